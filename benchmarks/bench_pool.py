"""malloc+free cost on the sim device with 1k, 100k and 1M live blocks.

Two loops per size: "pair" allocates and frees at once (the cache's best case);
"churn" frees a random live block and allocates a random small size, so the heap
keeps splitting and coalescing among N live blocks.  Medians of 5 repeats.
The target (issue 2): cost flat in N, at most 1.5x from 1k to 100k.

"observed" is the pair again with a ``Monitor`` and a ``BatchSizer`` attached to
the pool, in the same run: observers must not switch the fast path off (target:
at most 1.3x the bare pair).

"expandable" runs pair and churn again, in the same run, on a pool with
``expandable_segments=True`` (issue 12's target: at most 1.3x the plain pool).

    python benchmarks/bench_pool.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import cupool


def pair_loop(pool: cupool.Pool, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        pool.malloc(1000).free()
    return (time.perf_counter() - t0) / iters


def run(live: int, iters: int, repeats: int, expandable: bool = False) -> tuple[float, float, float]:
    pool = cupool.Pool("sim", capacity=max(64 << 20, live * 32768), defrag_threshold=None,
                       expandable_segments=expandable)
    rng = np.random.default_rng(0)
    sizes = rng.choice([256, 512, 1000, 4096, 20_000], size=live)
    blocks = [pool.malloc(int(n)) for n in sizes]
    pair, churn, observed = [], [], []
    for _ in range(repeats):
        pair.append(pair_loop(pool, iters))
        victims = rng.integers(0, live, size=iters)
        new_sizes = rng.choice([256, 512, 1000, 4096, 20_000], size=iters)
        t0 = time.perf_counter()
        for v, n in zip(victims.tolist(), new_sizes.tolist()):
            blocks[v].free()
            blocks[v] = pool.malloc(n)
        churn.append((time.perf_counter() - t0) / iters)
    monitor = cupool.Monitor(pool, min_reserved="1TiB")  # no fragmentation alerts from the benchmark
    sizer = cupool.BatchSizer(pool, 8, 1, 64)
    for _ in range(repeats):
        observed.append(pair_loop(pool, iters))
    sizer.update()
    monitor.close()
    pool.check()
    return statistics.median(pair), statistics.median(churn), statistics.median(observed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1k and 100k only")
    args = ap.parse_args()
    sizes = [1_000, 100_000] if args.quick else [1_000, 100_000, 1_000_000]
    results, expandable = {}, {}
    print(f"{'live blocks':>12} {'pair (us)':>10} {'churn (us)':>11} {'observed (us)':>14} "
          f"{'expandable pair':>16} {'expandable churn':>17}")
    for n in sizes:
        results[n] = run(n, iters=20_000, repeats=5)
        expandable[n] = run(n, iters=20_000, repeats=5, expandable=True)
        pair, churn, observed = results[n]
        xpair, xchurn, _ = expandable[n]
        print(f"{n:>12,} {pair * 1e6:>10.2f} {churn * 1e6:>11.2f} {observed * 1e6:>14.2f} "
              f"{xpair * 1e6:>16.2f} {xchurn * 1e6:>17.2f}")
    for n in sizes:
        print(f"expandable/plain at {n:,}: pair {expandable[n][0] / results[n][0]:.2f}x, "
              f"churn {expandable[n][1] / results[n][1]:.2f}x (target <= 1.3x)")
    for n in sizes:
        print(f"observed/pair at {n:,}: {results[n][2] / results[n][0]:.2f}x (target <= 1.3x)")
    base = results[1_000]
    for n in sizes[1:]:
        print(f"ratio {n:,}/1,000: pair {results[n][0] / base[0]:.2f}x, churn {results[n][1] / base[1]:.2f}x")


if __name__ == "__main__":
    main()
