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
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from . import streaming, workloads
from ._units import format_bytes
from .device import CudaDevice, SimDevice, VirtualMemoryUnsupported, cuda_available, parse_device
from .observe.snapshot import export_trace
from .pool import Pool
from .replay.commands import add_commands as add_replay_commands
from .trace import load_trace

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
    print("configuration")
    for k, v in pool.config.items():
        shown = format_bytes(v) if isinstance(v, int) and k in ("capacity", "initial_size", "limit") else v
        print(f"  {k:<18}{shown}")
    print("versions")
    for k, v in _versions().items():
        print(f"  {k:<18}{v}")
    return 0


def _print_steps(off: list[workloads.Step], on: list[workloads.Step]) -> None:
    print(f"  {'step':>4}  {'action':<13} {'shape':<12} {'source':>12} {'compaction off':>15} {'compaction on':>14}")
    print(f"  {'':>4}  {'':<13} {'':<12} {'frag segs':>12} {'frag segs':>15} {'frag segs':>14}")
    for a, b in zip(off, on):
        _, _, sfrag, ssegs = workloads.SOURCE_STEPS[a.step - 1]
        print(
            f"  {a.step:>4}  {a.action:<13} {str(a.shape):<12} {sfrag:>7.3f} {ssegs:>4} "
            f"{a.fragmentation:>10.3f} {a.segments:>4} {b.fragmentation:>9.3f} {b.segments:>4}"
        )


def _summary(steps: list[workloads.Step]) -> tuple[float, float, int]:
    fr = [s.fragmentation for s in steps]
    return max(fr), sum(fr) / len(fr), max(s.reserved for s in steps)


def _cmd_demo(args: argparse.Namespace) -> int:
    # "off": plain arrays, nothing may move.  "on": the layers live in movable buffers
    # and the pool compacts when fragmentation passes its defrag_threshold (0.3).
    modes = {"off": dict(movable=False), "on": dict(movable=True)}
    _check_device(args)

    def make(cap: int | str | None = None, **pool_kw: Any) -> Pool:
        return Pool(args.device, capacity=cap if cap is not None else args.capacity, **pool_kw)

    first = make()
    print(f"cupool demo: weight streaming on {first.device.name} (4 cached layers, 2 evicted at a time, float32)")
    print("Layers are written when loaded and checked when evicted, so a corrupting move would fail the run.\n")
    runs = {k: workloads.weight_streaming(first if k == "off" else make(), workloads.source_shapes(), fill=True, **kw)
            for k, kw in modes.items()}
    print("The source's ten steps (PyTorch's caching allocator) beside cupool:")
    _print_steps(runs["off"], runs["on"])
    print()
    print(f"  {'':<20} {'source':>8} {'off':>8} {'on':>8}")
    mx = {k: _summary(v)[0] for k, v in runs.items()}
    mean = {k: _summary(v)[1] for k, v in runs.items()}
    print(f"  {'max fragmentation':<20} {workloads.SOURCE_MAX:>8.3f} {mx['off']:>8.3f} {mx['on']:>8.3f}")
    print(f"  {'mean fragmentation':<20} {workloads.SOURCE_MEAN:>8.3f} {mean['off']:>8.3f} {mean['on']:>8.3f}\n")

    shapes = workloads.mixed_shapes(args.steps, seed=args.seed)
    peak_live = workloads.peak_live_bytes(shapes)
    print(f"A longer run: {args.steps} layers of {len(set(shapes))} mixed shapes (seed {args.seed}), "
          f"peak of live bytes {format_bytes(peak_live)}:")
    print(f"  {'compaction':<16} {'max frag':>9} {'mean frag':>10} {'peak reserved':>15} {'device allocs':>14} "
          f"{'smallest device':>22}")
    vmm = {"expandable_segments": True, "stitch": True}
    rows: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
        ("off", {}, modes["off"]), ("on", {}, modes["on"]), ("off, expandable", vmm, modes["off"])
    )
    for name, pool_kw, kw in rows:
        try:
            pool = make(**pool_kw)
        except VirtualMemoryUnsupported as e:
            print(f"  {name:<16} n/a: {e}")
            continue
        mx_, mean_, peak_res = _summary(workloads.weight_streaming(pool, shapes, fill=True, **kw))
        smallest = "n/a on a GPU"
        if isinstance(pool.device, SimDevice):
            cap = workloads.smallest_capacity(
                lambda c: Pool("sim", capacity=c, **pool_kw), shapes, peak_live, 4 * peak_live, 2 << 20, **kw
            )
            smallest = "> 4x" if cap is None else f"{format_bytes(cap)} ({cap / peak_live:.2f}x)"
        print(f"  {name:<16} {mx_:>9.3f} {mean_:>10.3f} {format_bytes(peak_res):>9} "
              f"({peak_res / peak_live:.2f}x) {pool.stats()['num_device_alloc']:>14} {smallest:>22}")
    print("\n'smallest device': the least sim capacity (2 MiB steps) on which the run completes without running "
          "out of memory, as a multiple of the live peak; 1.00x is what a perfect allocator needs.\n"
          "'device allocs': segments taken from the device; compaction gives emptied segments back, "
          "so it trades some device allocations for memory.\n"
          "'off, expandable': plain arrays on expandable segments with stitching (virtual memory: granules "
          "mapped at a segment's end,\nfree granules of holes remapped side by side for a request no free range "
          "fits); 'device allocs' counts mappings.")

    print("\nStreaming a synthetic HDF5 model (the ten layer shapes, three passes) through cupool.streaming.LayerCache")
    print("under the source's four cache settings, cupool's figures beside the source's:")
    print(streaming.format_table(streaming.settings_table(device=args.device, capacity=args.capacity)))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    if args.index < 0:
        raise ValueError(f"--index must be a device index >= 0, got {args.index}")
    out = Path(args.output)
    if not out.resolve().parent.is_dir():
        raise OSError(f"cannot write the snapshot {out}: the folder {out.resolve().parent} does not exist")
    trace = load_trace(args.trace)
    n = export_trace(trace, out, args.index)
    if n:
        print(f"wrote {out}: {n} PyTorch trace entries from {len(trace)} events ({trace.format}) of {args.trace}")
    else:
        print(f"wrote {out} with no events: {args.trace} has no alloc, free or segment events to export")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cupool", description=DESCRIPTION)
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
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_demo)
    add_replay_commands(sub.add_parser)
    p = sub.add_parser("export", help="write a trace as a PyTorch memory snapshot, for torch.cuda._memory_viz")
    p.add_argument("trace", help="cupool HDF5 trace, PyTorch memory snapshot pickle, or RMM log CSV")
    p.add_argument("-o", "--output", default="snapshot.pickle", help="pickle to write (default snapshot.pickle)")
    p.add_argument("--index", type=int, default=0, help="the device index the snapshot names (default 0)")
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
