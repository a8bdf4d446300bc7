"""Hook overhead: ``cupy.empty((256,), float32)`` + drop, cupool on a sim pool vs the floor.

The floor is the cheapest possible Python allocator (it returns a fixed pointer),
so the ratio is the cost of pooling as seen by CuPy code.  Both run in the same
process, interleaved, and medians are compared.  Target: <= 1.5x.

    python3 benchmarks/bench_hooks.py [--number 20000] [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import cupy
import numpy as np

import cupool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000, help="loop iterations per sample")
    ap.add_argument("--repeat", type=int, default=15, help="samples per variant")
    args = ap.parse_args()

    arena = np.zeros(1 << 20, np.uint8)
    fixed = arena.ctypes.data
    owner = object()
    pointer, unowned = cupy.cuda.MemoryPointer, cupy.cuda.UnownedMemory

    def floor(nbytes: int) -> cupy.cuda.MemoryPointer:
        return pointer(unowned(fixed, nbytes, owner, 0), 0)

    pool = cupool.Pool("sim", capacity="256MiB")
    variants = {"floor (fixed pointer)": floor, "cupool (sim pool)": cupool.cupy_allocator(pool)}
    empty, f32 = cupy.empty, np.float32

    def loop() -> None:
        empty((256,), f32)

    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeat):
        for name, alloc in variants.items():  # interleaved, so drift hits both alike
            cupy.cuda.set_allocator(alloc)
            samples[name].append(timeit.timeit(loop, number=args.number) / args.number * 1e6)
    cupy.cuda.set_allocator()
    med = {k: statistics.median(v) for k, v in samples.items()}
    for name, m in med.items():
        print(f"{name:24s} median {m:6.3f} us   (min {min(samples[name]):.3f})")
    ratio = med["cupool (sim pool)"] / med["floor (fixed pointer)"]
    print(f"ratio cupool/floor: {ratio:.2f}x   (target <= 1.5x)")
    s = pool.stats()
    print(f"pool: {s['allocation.all.allocated']} allocations, cache hit rate {s['cache_hit_rate']:.6f}")


if __name__ == "__main__":
    main()
