"""What reading the pool once a pass costs the allocations of a loop (Note [Reads park nothing]).

A training-like loop allocates ``--sizes`` recurring small sizes and frees them, pass after
pass, on ``Pool("sim")``; once a pass it reads the pool, as a user logging memory would:

- ``none``: no read;
- ``allocated``: ``cupool.torch.memory_allocated`` (one figure, under the lock);
- ``stats``: ``pool.stats()`` (every figure);
- ``snapshot``: ``pool.snapshot()``.

Printed per variant: CPU time per allocation + free, the read's own time left out (the read
is timed apart and reported beside), medians of interleaved rounds (``rounds.py``).  Before
that Note each read gave every parked block to the heap, so the next pass missed every size.

    python benchmarks/bench_reads.py [--sizes 100] [--passes 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from rounds import interleaved

import cupool
from cupool import torch as ctorch


def measure(read: str, sizes: list[int], passes: int) -> Callable[[int], tuple[float, float]]:
    pool = cupool.Pool("sim", capacity="4GiB")
    if read == "allocated":  # the one pool cupool.torch serves
        ctorch.use(pool)
    reads: dict[str, Callable[[], object]] = {
        "none": lambda: None,
        "allocated": ctorch.memory_allocated,
        "stats": pool.stats,
        "snapshot": pool.snapshot,
    }
    do_read = reads[read]
    clock = time.process_time

    def run(n_passes: int) -> tuple[float, float]:
        loop = reading = 0.0
        for _ in range(n_passes):
            t0 = clock()
            live = [pool.malloc(n) for n in sizes]
            for a in live:
                a.free()
            t1 = clock()
            do_read()
            reading += clock() - t1
            loop += t1 - t0
        return loop / (n_passes * len(sizes)) * 1e9, reading / n_passes * 1e6

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, default=100, help="recurring sizes a pass allocates (default 100)")
    ap.add_argument("--passes", type=int, default=2000, help="passes per round (default 2000)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    sizes = [512 * (3 + 7 * k) + 100 for k in range(args.sizes)]  # distinct small sizes, 1.6 KiB to ~360 KiB
    runs = {name: measure(name, sizes, args.passes) for name in ("none", "allocated", "stats", "snapshot")}
    reads: dict[str, list[float]] = {name: [] for name in runs}
    samples = interleaved({name: (lambda n, name=name: _keep(runs[name](n), reads[name])) for name in runs},
                          args.rounds, args.passes)
    base = statistics.median(samples["none"])
    print(f"{args.sizes} recurring sizes, {args.passes} passes a round, {args.rounds} rounds "
          f"(compiled: {cupool.core.build_info()['fast_path']})")
    for name, values in samples.items():
        med = statistics.median(values)
        read = statistics.median(reads[name])
        print(f"  read {name:9s}  {med:7.0f} ns per allocation + free ({med / base:5.2f}x no read);"
              f"  the read itself {read:8.1f} us")


def _keep(result: tuple[float, float], reads: list[float]) -> float:
    per_alloc, per_read = result
    reads.append(per_read)
    return per_alloc


if __name__ == "__main__":
    main()
