"""The ``cupool`` command: ``info``, ``demo``, ``replay``, ``report`` and ``export``.

Every failure the user can fix (bad input, a missing GPU, an unwritable path)
is one line on stderr and exit status 2, never a traceback; a reader that
leaves early (``cupool info | head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from . import demo
from ._files import refuse_overwriting_input
from ._units import format_bytes
from .core import build_info
from .hooks.cupy import memory_path
from .hooks.torch import shim_status
from .device import CudaDevice, cuda_available, parse_device
from .observe.snapshot import export_trace
from .pool import Pool
from .replay.commands import add_commands as add_replay_commands
from .trace import load_trace
from .trace.rmm_log import write_rmm_log

#: What ``cupool --help`` says above the list of commands.
DESCRIPTION = ("One GPU device-memory pool for CuPy and Numba.  Show the device and configuration (info), run the "
               "weight-streaming demo (demo), replay a trace of pool events under other settings (replay), plot it "
               "(report), or write it as a PyTorch memory snapshot (export).  'cupool COMMAND --help' says more.")
#: The exit status of a command whose reader went away, as a shell reports one killed by SIGPIPE.
EXIT_BROKEN_PIPE = 128 + 13


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


def _check_device(args: argparse.Namespace) -> None:
    """Refuse a device that is not there before any work, as a user error rather than a traceback."""
    try:
        parse_device(args.device, args.capacity, note_fallback=False)
    except RuntimeError as e:  # what Pool raises for "cuda" without a usable GPU
        raise ValueError(f"--device {args.device}: {e}") from None


def _cmd_info(args: argparse.Namespace) -> int:
    _check_device(args)
    pool = Pool(args.device, capacity=args.capacity)
    free, total = pool.device.mem_info()
    print(f"device          {pool.device.name} ({pool.device!r})")
    if isinstance(pool.device, CudaDevice):
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(pool.device.index)
        print(f"name            {props['name'].decode()}")
    print(f"memory          {format_bytes(free)} free of {format_bytes(total)}")
    print("fast path       {fast_path} ({reason})".format(**build_info()))
    print("cupy memory     {} ({})".format(*memory_path()))
    print("torch shim      {} ({})".format(*shim_status()))
    print("configuration")
    _print_table(pool.config.items(), ("capacity", "initial_size", "limit", "max_size", "release_threshold"))
    print("versions")
    _print_table(_versions().items())
    return 0


def _print_table(rows: Iterable[tuple[str, Any]], sizes: tuple[str, ...] = ()) -> None:
    """Indented ``key  value`` lines, the values aligned past the longest key (sizes in bytes shown as sizes)."""
    rows = list(rows)
    width = max((len(k) for k, _ in rows), default=0) + 2
    for k, v in rows:
        shown = format_bytes(v) if k in sizes and isinstance(v, int) and not isinstance(v, bool) else v
        print(f"  {k:<{width}}{shown}")


def _cmd_demo(args: argparse.Namespace) -> int:
    demo.check_args(args.steps, args.seed)
    _check_device(args)
    print(demo.format_result(demo.run(args.device, args.capacity, args.steps, args.seed)))
    return 0


#: ``cupool export --format``: what each writes, and the file it writes by default.
EXPORT_FORMATS = {"torch": "snapshot.pickle", "rmm-csv": "rmm_log.csv"}


def _cmd_export(args: argparse.Namespace) -> int:
    if args.index < 0:
        raise ValueError(f"--index must be a device index >= 0, got {args.index}")
    fmt = args.format or ("rmm-csv" if args.output and args.output.lower().endswith(".csv") else "torch")
    out = Path(args.output or EXPORT_FORMATS[fmt])
    what = "RMM log" if fmt == "rmm-csv" else "snapshot"
    if not out.resolve().parent.is_dir():
        raise OSError(f"cannot write the {what} {out}: the folder {out.resolve().parent} does not exist")
    refuse_overwriting_input(out, args.trace, what)
    trace = load_trace(args.trace)
    if fmt == "rmm-csv":
        n = write_rmm_log(trace, out)
        print(f"wrote {out}: {n} RMM log rows from {len(trace)} events ({trace.format}) of {args.trace}")
        return 0
    n = export_trace(trace, out, args.index)
    if n:
        print(f"wrote {out}: {n} PyTorch trace entries from {len(trace)} events ({trace.format}) of {args.trace}")
    else:
        print(f"wrote {out} with no events: {args.trace} has no alloc, free or segment events to export")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cupool", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"cupool {_own_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def device_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default="auto", help="auto (default), sim, cuda or cuda:N")
        p.add_argument("--capacity", default=None, help="sim device size, e.g. 1GiB (sim only)")

    p = sub.add_parser("info", help="device, configuration and versions")
    device_args(p)
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("demo", help="the weight-streaming workload, step by step")
    device_args(p)
    p.add_argument("--steps", type=int, default=200, help="layers in the longer mixed run (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the longer run's random layer shapes (default 0)")
    p.set_defaults(func=_cmd_demo)
    add_replay_commands(sub.add_parser)
    p = sub.add_parser("export", help="write a trace as a PyTorch memory snapshot (for torch.cuda._memory_viz) "
                                      "or an RMM log (for RMM's replay benchmark)")
    p.add_argument("trace", help="cupool HDF5 trace, PyTorch memory snapshot pickle, or RMM log CSV")
    p.add_argument("-o", "--output", default=None,
                   help="file to write (default snapshot.pickle, or rmm_log.csv with --format rmm-csv); written "
                        "whole or not at all, and never over the input")
    p.add_argument("--format", choices=tuple(EXPORT_FORMATS), default=None,
                   help="torch: a PyTorch memory snapshot pickle; rmm-csv: an RMM logging_resource_adaptor CSV "
                        "(default: rmm-csv for an output ending in .csv, else torch)")
    p.add_argument("--index", type=int, default=0, help="the device index the snapshot names (default 0; torch only)")
    p.set_defaults(func=_cmd_export)
    args = parser.parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's last flush
        return status
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except (ValueError, TypeError, OSError) as e:
        # TraceError is a ValueError; OSError: a report or trace path that cannot be written or read.
        print(f"cupool: error: {e}", file=sys.stderr)
        return 2


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
