"""The ``cupool`` command: ``info`` and ``demo``."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from . import workloads
from ._units import format_bytes
from .device import cuda_available
from .pool import Pool


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


def _cmd_info(args: argparse.Namespace) -> int:
    pool = Pool(args.device, capacity=args.capacity)
    free, total = pool.device.mem_info()
    print(f"device          {pool.device.name} ({pool.device!r})")
    if pool.device.kind == "cuda":
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


def _print_steps(title: str, steps: list[workloads.Step], source: bool) -> None:
    print(title)
    head = f"  {'step':>4}  {'action':<13} {'shape':<12} {'frag':>6} {'segs':>4}"
    if source:
        head += f"   {'source frag':>11} {'segs':>4}"
    print(head)
    for st in steps:
        line = f"  {st.step:>4}  {st.action:<13} {str(st.shape):<12} {st.fragmentation:>6.3f} {st.segments:>4}"
        if source and st.step <= len(workloads.SOURCE_STEPS):
            _, _, sfrag, ssegs = workloads.SOURCE_STEPS[st.step - 1]
            line += f"   {sfrag:>11.3f} {ssegs:>4}"
        print(line)


def _summary(steps: list[workloads.Step]) -> tuple[float, float, int]:
    fr = [s.fragmentation for s in steps]
    return max(fr), sum(fr) / len(fr), max(s.reserved for s in steps)


def _cmd_demo(args: argparse.Namespace) -> int:
    def make(cap=None):
        return Pool(args.device, capacity=cap if cap is not None else args.capacity)

    pool = make()
    print(f"cupool demo: weight streaming on {pool.device.name} "
          f"(4 cached layers, 2 evicted at a time, float32)\n")
    steps = workloads.weight_streaming(pool, workloads.source_shapes(), fill=True)
    _print_steps("The source's ten steps, cupool beside PyTorch's caching allocator:", steps, source=True)
    mx, mean, _ = _summary(steps)
    print(f"\n  max fragmentation  {mx:.3f}   (source {workloads.SOURCE_MAX:.3f})")
    print(f"  mean fragmentation {mean:.3f}   (source {workloads.SOURCE_MEAN:.3f})\n")

    shapes = workloads.mixed_shapes(args.steps, seed=args.seed)
    pool = make()
    steps = workloads.weight_streaming(pool, shapes, fill=True)
    mx, mean, peak_res = _summary(steps)
    peak_live = workloads.peak_live_bytes(shapes)
    print(f"A longer run: {args.steps} layers of {len(set(shapes))} mixed shapes (seed {args.seed}):")
    print(f"  max fragmentation  {mx:.3f}")
    print(f"  mean fragmentation {mean:.3f}")
    print(f"  peak reserved      {format_bytes(peak_res)} for a peak of {format_bytes(peak_live)} live "
          f"({peak_res / peak_live:.2f}x)")
    if pool.device.kind == "sim":
        step = 2 << 20
        smallest = workloads.smallest_capacity(
            lambda cap: Pool("sim", capacity=cap), shapes, peak_live, 4 * peak_live, step
        )
        shown = "more than 4x the live peak" if smallest is None else (
            f"{format_bytes(smallest)} ({smallest / peak_live:.2f}x the live peak)")
        print(f"  smallest sim device that completes it: {shown}")
    print(f"\nstats: {pool}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cupool", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

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
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"cupool: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
