"""The GPU's mechanisms priced without a GPU: driver calls counted on the CUDA double, timed with the H200's costs.

    python benchmarks/bench_driver_calls.py [--large] [--json]

Each operation runs on ``cupool.testing.cuda_double`` (``CudaDevice`` on the CPU,
every runtime and driver call recorded); its calls are priced with the per-call
costs measured on an H200 (``cupool.device.costs``, Note [Per-call costs]) and
printed beside issue 34's target, which the H200 run states against the same
baseline (``cudaMalloc`` of the same bytes, one device copy of the same bytes).
An estimate is only as good as its table: the calls it priced without a
measurement of their own are listed.  ``--large`` adds the 1 GiB pattern (2 GiB
of host memory); ``--json`` prints the rows as JSON.  The budgets in calls are
tests (``tests/test_cuda_double.py``); this prints what they cost.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

import cupool
from cupool.device.costs import H200, copy_seconds
from cupool.device.vmm import GRANULE
from cupool.testing.cuda_double import CallLog, CudaDouble

MiB = 1 << 20


def row(what: str, log: CallLog, mark: int, target: str, bound_us: float | None, baseline_us: float | None = None,
        ratio_at_least: float | None = None, max_calls: int | None = None) -> dict[str, Any]:
    """One operation: its calls, their estimated time, and the target (a time bound, a ratio to a baseline, or
    a number of calls: those the table prices at 0, a synchronization or a context push, count there too)."""
    est = log.estimate(mark) * 1e6
    calls = log.counts(mark)
    met = None
    if bound_us is not None:
        met = est <= bound_us
    if ratio_at_least is not None and baseline_us is not None:
        met = baseline_us / est >= ratio_at_least if est else True
    if max_calls is not None:
        met = sum(calls.values()) <= max_calls
    return {"operation": what, "calls": dict(sorted(calls.items())), "estimate_us": round(est, 1),
            "baseline_us": None if baseline_us is None else round(baseline_us, 1),
            "target": target, "met": met, "assumed": log.assumed(mark)}


def grow_and_trim(rows: list[dict[str, Any]]) -> None:
    d = CudaDouble("4GiB")
    pool = cupool.Pool(d.device(), expandable_segments=True)
    pool.free(pool.malloc(GRANULE))
    keep = pool.malloc(GRANULE)
    mark = d.log.mark()
    a = pool.malloc(64 * GRANULE)
    bound = 3 * 61.1  # cudaMalloc of 128 MiB took 61.1 us on the H200 (costs.md)
    rows.append(row("grow by 64 granules (128 MiB)", d.log, mark, "<= 3x cudaMalloc of the bytes (183 us)", bound))
    mark = d.log.mark()
    pool.free(a)
    pool.free(pool.malloc(64 * GRANULE))
    rows.append(row("warm malloc + free of 128 MiB, twice", d.log, mark, "no driver call", None, max_calls=0))
    mark = d.log.mark()
    pool.empty_cache()
    rows.append(row("empty_cache() of a 64-granule tail", d.log, mark, "", None))
    pool.free(keep)


def compaction(rows: list[dict[str, Any]]) -> None:
    d = CudaDouble("4GiB")
    dev = d.device()
    pool = cupool.Pool(dev, expandable_segments=True, defrag_threshold=None)
    bufs = [pool.movable(4 * MiB) for _ in range(64)]
    for b in bufs[::2]:
        b.free()
    dev.prepare_moves()
    marks: list[tuple[int, int]] = []
    execute = dev.execute_moves

    def timed(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        mark = d.log.mark()
        execute(src, dst, nbytes)
        marks.append((mark, d.log.mark()))

    dev.execute_moves = timed  # type: ignore[method-assign]  # the moves' own calls, apart from the trim's
    mark = d.log.mark()
    report = pool.compact()
    moves = CallLog()
    for a, b in marks:
        moves.calls += d.log.calls[a:b]
    base = copy_seconds(H200, report.bytes_moved) * 1e6
    rows.append(row(f"pool.compact(), moves only ({report.moves} moves, {report.bytes_moved >> 20} MiB)", moves, 0,
                    ">= 0.8x one device copy", None, base, 0.8))
    rows.append(row("pool.compact(), end to end", d.log, mark, "", None))


def mover(rows: list[dict[str, Any]], count: int, size: int, target: str, ratio: float | None,
          bound_us: float | None) -> None:
    """Every other of ``2 * count`` slots of ``size`` compacted in order, through the mover alone."""
    d = CudaDouble(f"{4 * count * size + (64 << 20)}")
    dev = d.device()
    dev.prepare_moves()
    base = d.runtime.malloc(2 * count * size)
    k = np.arange(count, dtype=np.int64)
    mark = d.log.mark()
    dev.execute_moves(base + (2 * k + 1) * size, base + k * size, np.full(count, size, np.int64))
    label = f"{count:,} moves of {size // 1024:,} KiB" if size < MiB else f"{count * size // MiB:,} MiB in {count} moves"
    rows.append(row(label, d.log, mark, target, bound_us, copy_seconds(H200, count * size) * 1e6, ratio))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--large", action="store_true", help="add 1 GiB in 32 moves (2 GiB of host memory)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    grow_and_trim(rows)
    compaction(rows)
    mover(rows, 32, 4 * MiB, ">= 0.8x one device copy", 0.8, None)
    if args.large:
        mover(rows, 32, 32 * MiB, ">= 0.9x one device copy", 0.9, None)
    mover(rows, 4096, 4096, "<= 0.5 ms", None, 500.0)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("Estimated on an H200 from counted calls (cupool.device.costs; Note [Per-call costs])\n")
    for r in rows:
        met = {True: "met", False: "NOT met", None: ""}[r["met"]]
        vs = f", baseline {r['baseline_us']} us ({r['baseline_us'] / r['estimate_us']:.2f}x)" if r["baseline_us"] and r["estimate_us"] else ""
        print(f"{r['operation']}: {r['estimate_us']} us{vs}  target {r['target'] or '-'}  {met}")
        print(f"    calls: {', '.join(f'{k} {v}' for k, v in r['calls'].items()) or 'none'}")
        if r["assumed"]:
            print(f"    priced without a measurement of their own: {', '.join(r['assumed'])}")


if __name__ == "__main__":
    main()
