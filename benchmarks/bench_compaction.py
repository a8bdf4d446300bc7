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

    python benchmarks/bench_compaction.py
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args()  # no options: --help describes the run instead of starting it
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
