"""The ``cupool`` command: ``info``, ``demo``, ``replay``, ``report`` and ``export``.

Every failure the user can fix (bad input, a missing GPU, an unwritable path)
is one line on stderr, ``cupool: error: ...``, and exit status 2, never a
traceback.  A command line argparse cannot read gets that same line, under the
usage of the command it was meant for (``cupool demo --bogus``: demo's).  A
reader that leaves early (``cupool info | head``) ends the command quietly.
Ctrl-C (SIGINT) ends it with one line, ``cupool: interrupted``, and exit status
130 as a shell reports one killed by SIGINT; what was printed before stays
(rows are flushed as they are printed), and a file being written is left as it
was (``cupool._files.atomic_output``).

``--device`` names a device everywhere, as ``parse_device`` reads it: ``auto``, or a
kind of ``cupool.device.kinds`` with an optional index (``sim``, ``cuda:1``); its help
lists the kinds there are.  ``cupool info`` shows the pool that ``default_pool()``
would make, from ``CUPOOL_CONF`` read by the same code, and the kinds of device.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, NoReturn

from . import demo
from ._files import output_name, output_path, refuse_overwriting_input, status_stream
from ._units import format_bytes, parse_size
from ._words import count
from .config import ENV_VAR, env_conf
from .core import build_info
from .hooks.cupy import memory_path
from .hooks.torch import shim_status, torch_status
from .device import KINDS, CudaDevice, cuda_available, kinds, parse_device
from .errors import AddressSpaceExhausted
from .observe.snapshot import export_trace
from .pool import Pool
from .replay.commands import add_commands as add_replay_commands
from .trace import load_trace
from .trace.rmm_log import write_rmm_log

#: What ``cupool --help`` says above the list of commands.
DESCRIPTION = ("One GPU device-memory pool for CuPy, Numba and PyTorch.  Show the device and configuration (info), "
               "run the weight-streaming demo (demo), replay a trace of pool events under other settings (replay), "
               "plot it (report), or write it as a PyTorch memory snapshot (export).  'cupool COMMAND --help' says "
               "more.")
#: A value that argparse would take for an option: a minus sign, then a digit or a point (``-1GiB``, ``-.5``).
_NEGATIVE = re.compile(r"-\.?\d")
#: The exit status of a command whose reader went away, as a shell reports one killed by SIGPIPE.
EXIT_BROKEN_PIPE = 128 + 13
#: The exit status of a command stopped by Ctrl-C, as a shell reports one killed by SIGINT.
EXIT_INTERRUPTED = 128 + 2
#: The one line a command stopped by Ctrl-C prints on stderr.
INTERRUPTED = "cupool: interrupted"


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("cupool", "numpy", "numba", "numba-cuda", "h5py", "cupy-cuda12x", "cupy-cuda13x"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    if cuda_available():
        import cupy

        rt = cupy.cuda.runtime
        out["cuda driver"] = str(rt.driverGetVersion())
        out["cuda runtime"] = str(rt.runtimeGetVersion())
    return out


def _own_version() -> str:
    try:
        return version("cupool")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with its errors in cupool's one style (see the module's docstring), and an option's
    value that starts with a minus sign read as its value (``--capacity -1GiB``), so that the setting refuses it
    in its own words: argparse would take ``-1GiB`` for an option and say "expected one argument"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.value_options: set[str] = set()  # the options that take exactly one value

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.nargs is None:
            self.value_options.update(action.option_strings)
        return action

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        if args is not None:  # a command's parser is given its arguments; the top level reads sys.argv in main
            args = list(args)
            for i in range(len(args) - 2, -1, -1):
                if args[i] in self.value_options and _NEGATIVE.match(args[i + 1]):
                    args[i:i + 2] = [f"{args[i]}={args[i + 1]}"]
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"cupool: error: {message}\n")


def _check_device(device: str, capacity: int | str | None, given: str | None = None) -> str:
    """The device ``device`` names, as ``kind:index`` (``auto`` resolved without its notice: ``info`` shows
    which device it picked); one that is not there is refused before any work, as a user error rather than
    a traceback.  ``given`` says where the name came from (default: ``--device NAME``)."""
    try:
        kind, index = parse_device(device, capacity, note_fallback=False)
    except (ValueError, RuntimeError) as e:  # RuntimeError: "cuda" without a usable GPU
        raise ValueError(f"{given or f'--device {device}'}: {e}") from None
    return f"{kind}:{index}"


def _info_pool(args: argparse.Namespace) -> Pool:
    """The pool ``default_pool()`` would make, from ``CUPOOL_CONF`` read by its own code (``env_conf``), so that
    a misspelt key is refused here in the same words; ``--device`` and ``--capacity`` override it."""
    conf = env_conf()
    given = f"{ENV_VAR}: device={conf['device']}" if args.device is None and "device" in conf else None
    device = conf.pop("device", kinds.AUTO) if args.device is None else args.device
    conf.pop("device", None)
    from_env = bool(conf)
    if args.capacity is not None:
        conf["capacity"] = args.capacity
    device = _check_device(device, conf.get("capacity"), given)
    try:
        return Pool(device, **conf)
    except (TypeError, ValueError) as e:
        if not from_env:
            raise
        raise ValueError(f"{ENV_VAR}: cannot make the default pool: {e}") from None


def _cmd_info(args: argparse.Namespace) -> int:
    pool = _info_pool(args)
    free, total = pool.mem_info()
    print(f"device          {pool.device.name} ({pool.device!r})")
    if isinstance(pool.device, CudaDevice):
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(pool.device.index)
        print(f"name            {props['name'].decode()}")
    print(f"memory          {format_bytes(free)} free of {format_bytes(total)}")
    print("fast path       {fast_path} ({reason})".format(**build_info()))
    print(f"{ENV_VAR:<16}{os.environ.get(ENV_VAR) or '(not set: the defaults)'}")
    print("cupy memory     {} ({})".format(*memory_path()))
    print("torch           {} ({})".format(*torch_status()))
    print("torch shim      {} ({})".format(*shim_status()))
    print("device kinds")
    _print_table(_kind_rows())
    print("configuration")
    _print_table(pool.config.items(), ("capacity", "initial_size", "limit", "max_size", "release_threshold"))
    print("versions")
    _print_table(_versions().items())
    return 0


def _kind_rows() -> list[tuple[str, str]]:
    """``cupool info``'s list of device kinds, from ``cupool.device.kinds``: what each is, and what ``auto``
    picks on this machine."""
    gpu = cuda_available()
    rows = [(kinds.AUTO, f"{kinds.auto_help()}: {kinds.auto_kind(gpu).name} here")]
    for kind in KINDS.values():
        said = kind.help
        if kind.sized:
            said += f"; --capacity sizes it (default {format_bytes(parse_size(kind.capacity))})"
        if kind.needs_gpu and not gpu:
            said += "; no usable GPU here"
        rows.append((kind.name, said))
    return rows


def _print_table(rows: Iterable[tuple[str, Any]], sizes: tuple[str, ...] = ()) -> None:
    """Indented ``key  value`` lines, the values aligned past the longest key (sizes in bytes shown as sizes)."""
    rows = list(rows)
    width = max((len(k) for k, _ in rows), default=0) + 2
    for k, v in rows:
        shown = format_bytes(v) if k in sizes and isinstance(v, int) and not isinstance(v, bool) else v
        print(f"  {k:<{width}}{shown}")


def _cmd_demo(args: argparse.Namespace) -> int:
    demo.check_args(args.steps, args.seed)
    _check_device(args.device, args.capacity)
    print(demo.format_result(demo.run(args.device, args.capacity, args.steps, args.seed)))
    return 0


#: ``cupool export --format``: what each writes, and the file it writes by default.
EXPORT_FORMATS = {"torch": "snapshot.pickle", "rmm-csv": "rmm_log.csv"}


def _cmd_export(args: argparse.Namespace) -> int:
    fmt = args.format or ("rmm-csv" if args.output and args.output.lower().endswith(".csv") else "torch")
    if args.index is not None and fmt == "rmm-csv":
        raise ValueError("--index names the device of a PyTorch snapshot; an RMM log has no device field "
                         "(leave out --index with --format rmm-csv)")
    if args.index is not None and args.index < 0:
        raise ValueError(f"--index must be a device index >= 0, got {args.index}")
    what = "RMM log" if fmt == "rmm-csv" else "snapshot"
    out = output_path(args.output or EXPORT_FORMATS[fmt], EXPORT_FORMATS[fmt], what)
    refuse_overwriting_input(out, args.trace, what)
    trace = load_trace(args.trace)
    said = status_stream(out)  # not into the output, when that is standard output
    shown = output_name(out)
    if fmt == "rmm-csv":
        n = write_rmm_log(trace, out)
        print(f"wrote {shown}: {count(n, 'RMM log row')} from {count(len(trace), 'event')} ({trace.format}) "
              f"of {args.trace}", file=said)
        return 0
    n = export_trace(trace, out, args.index or 0)
    if n:
        print(f"wrote {shown}: {count(n, 'PyTorch trace entry', 'PyTorch trace entries')} from "
              f"{count(len(trace), 'event')} ({trace.format}) of {args.trace}", file=said)
    else:
        print(f"wrote {shown} with no events: {args.trace} has no alloc, free or segment events to export", file=said)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``cupool`` command line: every command and option, with its help."""
    parser = _Parser(prog="cupool", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"cupool {_own_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    sized = kinds.one_of((k.name for k in KINDS.values() if k.sized), quoted=False)
    auto = f"{kinds.AUTO}: {kinds.auto_help()}"

    def device_args(p: argparse.ArgumentParser, default: str | None, said: str) -> None:
        p.add_argument("--device", default=default,
                       help=f"the device: {kinds.one_of(kinds.forms(), quoted=False)} (default: {said})")
        p.add_argument("--capacity", default=None, metavar="SIZE",
                       help=f"the {sized} device's size, e.g. 1GiB ({sized} only; default: "
                            + ("CUPOOL_CONF's, else " if default is None else "") + f"the {sized} device's own)")

    p = sub.add_parser("info", help="device, configuration and versions",
                       description="Show the device, its free memory, whether the compiled fast path runs, the "
                                   "kinds of device there are, the configuration of the pool cupool.default_pool() "
                                   "would make (from CUPOOL_CONF, which is refused here as it is there) and the "
                                   "versions in use.")
    device_args(p, None, f"CUPOOL_CONF's device, else {auto}")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("demo", help="the weight-streaming workload, step by step",
                       description="Run the weight-streaming workload on a pool: the source's ten steps beside "
                                   "cupool with compaction off and on, a longer run of mixed layer shapes with the "
                                   "smallest device each setting needs, and a synthetic model streamed from HDF5.")
    device_args(p, kinds.AUTO, auto)
    p.add_argument("--steps", type=int, default=200, help="layers in the longer mixed run (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the longer run's random layer shapes (default 0)")
    p.set_defaults(func=_cmd_demo)
    add_replay_commands(sub.add_parser)
    p = sub.add_parser("export", help="write a trace as a PyTorch memory snapshot (for torch.cuda._memory_viz) "
                                      "or an RMM log (for RMM's replay benchmark)",
                       description="Convert a trace: write it as a PyTorch memory snapshot pickle, which "
                                   "torch.cuda._memory_viz and pytorch.org/memory_viz draw, or as an RMM log CSV, "
                                   "which RMM's replay benchmark reads.")
    p.add_argument("trace", help="cupool HDF5 trace, PyTorch memory snapshot pickle, or RMM log CSV")
    p.add_argument("-o", "--output", default=None,
                   help="file to write (default snapshot.pickle, or rmm_log.csv with --format rmm-csv; a folder, "
                        "one that exists or a name ending in '/', gets that file in it), '-' for standard output; "
                        "a file is written whole or not at all, and never over the input; a device or FIFO is "
                        "written into")
    p.add_argument("--format", choices=tuple(EXPORT_FORMATS), default=None,
                   help="torch: a PyTorch memory snapshot pickle; rmm-csv: an RMM logging_resource_adaptor CSV, "
                        "times as RMM's HH:MM:SS.ffffff clock and every thread 0 (traces record no thread) "
                        "(default: rmm-csv for an output ending in .csv, else torch)")
    p.add_argument("--index", type=int, default=None,
                   help="the device index the snapshot names (default 0; torch only: an RMM log has no device)")
    p.set_defaults(func=_cmd_export)
    for p in sub.choices.values():
        p.set_defaults(command_parser=p)  # for main: a command refuses what it does not know itself
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse leaves what a command does not know to the top level, which would show cupool's usage:
        # read the command's own arguments again, so that it refuses them under its own usage.
        start = next(i for i, a in enumerate(argv) if a == args.cmd) + 1
        args.command_parser.parse_args(argv[start:])
        parser.error(f"unrecognized arguments: {' '.join(extra)}")  # they came before the command
    try:
        status = args.func(args)
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's last flush
        return status
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return _interrupted()
    except (ValueError, TypeError, OSError, AddressSpaceExhausted) as e:
        # TraceError is a ValueError; OSError: a report or trace path that cannot be written or read;
        # AddressSpaceExhausted: a sim device this process has no addresses for (ulimit -v).
        print(f"cupool: error: {e}", file=sys.stderr)
        return 2


def _interrupted() -> int:
    """Say once that Ctrl-C stopped the command, after what it printed, instead of Python's traceback."""
    try:
        sys.stdout.flush()  # the rows printed so far come before the word, and stay
    except (BrokenPipeError, OSError, ValueError):
        _drop_stdout()
    # On a terminal, first clear the line a progress bar may have been drawing when the interrupt came.
    print(("\r\x1b[K" if sys.stderr.isatty() else "") + INTERRUPTED, file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush finds no closed pipe to complain of."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): nothing will flush
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
