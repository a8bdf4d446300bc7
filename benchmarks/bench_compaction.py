"""Compaction bandwidth against a plain copy, and utilization with compaction on and off.

Bandwidth: N movable buffers in one segment, every other one freed, then ``pool.compact()``;
bytes moved per second against numpy copying the same number of bytes within the
host memory (the sim device's memory is host memory), same run, median of 5.  Target: >= 0.8x.

With ``expandable_segments=True`` (same run) the buffers are whole granules, so
compaction remaps them instead of copying (issue 12): the same figures, bytes
"moved" per second of compaction.

Utilization: the smallest sim capacity (2 MiB steps), as a multiple of the peak of
live bytes, on which the 200-layer mixed weight-streaming run completes.
Target with compaction: 1.00 to 1.05.

On a GPU (``--device cuda``, issue 18): the moves of compacting every other slot,
through ``CudaDevice.execute_moves``, against one CuPy device-to-device copy of the
same bytes, for 128 MiB in 32 moves (target >= 0.8x the copy), 1 GiB in 32 moves
(>= 0.9x) and 4,096 moves of 4 KiB (<= 0.5 ms); medians of 9 calls, bytes checked
(``cupool.validate.moves``, which ``python -m cupool.validate`` runs too).

    python benchmarks/bench_compaction.py [--device sim|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import cupool
from cupool import workloads

MiB = 1 << 20


def bandwidth(buf_mib: int = 4, n: int = 64, repeats: int = 5, expandable: bool = False) -> dict[str, float]:
    compact_bw, move_bw, copy_bw = [], [], []
    for r in range(repeats + 1):  # the first round compiles the kernel
        pool = cupool.Pool("sim", capacity=f"{2 * n * buf_mib + 64}MiB", defrag_threshold=None,
                           expandable_segments=expandable)
        pool.movable(n * buf_mib * MiB)  # dropped at once: one cached segment the buffers then share
        bufs = [pool.movable(buf_mib * MiB) for _ in range(n)]
        for i, m in enumerate(bufs):
            m.array()[:] = i % 251
        for m in bufs[::2]:
            m.free()
        rep = pool.compact()
        if r == 0:
            continue
        moved = rep.bytes_moved
        src = np.full(moved, 7, dtype=np.uint8)  # touched, like the arena's live bytes
        dst = np.ones(moved, dtype=np.uint8)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t_copy = time.perf_counter() - t0
        compact_bw.append(moved / rep.seconds)
        move_bw.append(moved / rep.move_seconds)
        copy_bw.append(moved / t_copy)
        for i, m in enumerate(bufs[1::2]):
            assert (m.array() == (2 * i + 1) % 251).all()
    return {k: statistics.median(v) for k, v in (("compact", compact_bw), ("move", move_bw), ("copy", copy_bw))}


def utilization(steps: int = 200, seed: int = 0) -> dict[str, float]:
    shapes = workloads.mixed_shapes(steps, seed=seed)
    peak = workloads.peak_live_bytes(shapes)
    out = {}
    for name, movable in (("off", False), ("on", True)):
        cap = workloads.smallest_capacity(
            lambda c: cupool.Pool("sim", capacity=c), shapes, peak, 4 * peak, 2 * MiB, movable=movable
        )
        out[name] = cap / peak
    return out


def gpu_moves(repeats: int = 9) -> None:
    """The issue's three move patterns on ``cuda:0`` (see the module's doc)."""
    from cupool.device import CudaDevice
    from cupool.validate.moves import PATTERNS, time_pattern

    try:
        device = CudaDevice(0)
    except Exception as e:  # noqa: BLE001 - no CuPy, driver or device: say so instead of a traceback
        raise SystemExit(f"bench_compaction.py --device cuda needs a CUDA GPU: {type(e).__name__}: {e}") from None
    print(f"{'pattern':<24} {'moves':>10} {'CuPy copy':>10} {'copy/moves':>10}  target")
    for p in PATTERNS:
        t = time_pattern(device, p, repeats)
        assert t["intact"], f"{p.label}: the moves left wrong bytes"
        ratio = t["copy"] / t["moves"]
        target = f">= {p.min_ratio}x" if p.min_ratio is not None else f"<= {p.max_ms} ms"
        met = ratio >= p.min_ratio if p.min_ratio is not None else t["moves"] * 1e3 <= (p.max_ms or 0.0)
        print(f"{p.label:<24} {t['moves'] * 1e3:>7.3f} ms {t['copy'] * 1e3:>7.3f} ms {ratio:>9.2f}x  "
              f"{target}: {'met' if met else 'not met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("sim", "cuda"), default="sim",
                    help="sim (default): bandwidth and utilization on the simulated device; cuda: the GPU's moves")
    if ap.parse_args().device == "cuda":
        gpu_moves()
        return
    bw = bandwidth()
    print(f"numpy copy of the same bytes     {bw['copy'] / 1e9:6.2f} GB/s")
    print(f"compaction, moves only           {bw['move'] / 1e9:6.2f} GB/s  ({bw['move'] / bw['copy']:.2f}x)")
    print(f"compaction, end to end           {bw['compact'] / 1e9:6.2f} GB/s  ({bw['compact'] / bw['copy']:.2f}x)"
          "  (includes planning and returning emptied segments)")
    vm = bandwidth(expandable=True)
    print(f"expandable segments, remapped    {vm['move'] / 1e9:6.2f} GB/s  ({vm['move'] / bw['move']:.2f}x the "
          f"copying moves; end to end {vm['compact'] / 1e9:.2f} GB/s, {vm['compact'] / bw['compact']:.2f}x)")
    u = utilization()
    print(f"smallest device / live peak: compaction off {u['off']:.2f}x, on {u['on']:.2f}x")


if __name__ == "__main__":
    main()
