"""Numba's path into cupool on sim: the EMM plugin's ``memalloc`` + drop against the pool's own ``malloc_key``.

``numba.cuda.device_array(n)`` asks its context's memory manager for ``memalloc(n)``
and wraps the ``MemoryPointer`` it returns; without a GPU there is no context, so
this measures the part cupool owns: ``CupoolMemoryManager(context=None,
pool=pool).memalloc(1024)`` and dropping the pointer (Numba's ``weakref.finalize``
calls cupool's finalizer), against ``pool.malloc_key(1024, 0)`` and dropping the
``Allocation``.  Their ratio is the plugin's cost over the pool's own.  (Against
Numba's default manager, and through ``device_array`` itself, needs a GPU: the
rows ``python -m cupool.validate`` leaves pending without one.)

CPU time of this thread (``time.thread_time``), rounds interleaving the variants
in a rotating order, medians and the median of per-round ratios, as
``bench_hooks.py``.  Objects kept alive per allocation are counted with
``tracemalloc`` as there: Numba's ``MemoryPointer`` (and its ``__dict__``), its
``weakref.finalize`` (and the bookkeeping behind it), its device pointer, and
cupool's, which by design are two: the ``Allocation`` and the finalizer Numba
holds (``cupool.hooks.numba._Release``).

    python benchmarks/bench_numba.py [--number 20000] [--rounds 15] [--hold 2000]
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import cupool
from cupool.numba import CupoolMemoryManager
from rounds import interleaved, print_medians  # benchmarks/rounds.py, beside this script


def cpu_per_call(call: Callable[[int], Any], number: int) -> float:
    """Microseconds of this thread's CPU per ``call(1024)`` whose result is dropped at once."""
    t0 = time.thread_time()
    for _ in range(number):
        call(1024)
    return (time.thread_time() - t0) / number * 1e6


def objects_per_allocation(call: Callable[[int], Any], pool: cupool.Pool, hold: int) -> float:
    """Memory blocks Python traced per allocation kept alive, the pool's own left out (see bench_hooks.py)."""
    fold = pool._arena.books.fold
    held = [call(1024) for _ in range(hold)]
    del held  # the blocks wait on the pool's stacks
    gc.collect()
    fold()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        kept = [call(1024) for _ in range(hold)]
        fold()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    mine = [tracemalloc.Filter(False, tracemalloc.__file__)]
    blocks = sum(s.count_diff for s in after.filter_traces(mine).compare_to(before.filter_traces(mine), "filename"))
    del kept
    return (blocks - 2) / hold  # less the list ``kept`` and its array of items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000, help="calls per sample")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    ap.add_argument("--hold", type=int, default=2000, help="allocations kept alive to count objects")
    args = ap.parse_args()

    pool = cupool.Pool("sim", capacity="256MiB")
    mm = CupoolMemoryManager(context=None, pool=pool)
    key = pool.malloc_key
    calls: dict[str, Callable[[int], Any]] = {
        "pool.malloc_key(n, 0)": lambda n: key(n, 0),
        "pool.malloc(n)": pool.malloc,
        "cupool.numba memalloc(n)": mm.memalloc,
    }
    names = list(calls)
    base = names[0]
    print(f"fast path: {cupool.core.build_info()['fast_path']}")
    samples = interleaved({k: functools.partial(cpu_per_call, c) for k, c in calls.items()}, args.rounds, args.number)
    print(f"CPU time per allocation of 1024 bytes + drop, {args.rounds} rounds of {args.number:,} calls:")
    print_medians(samples, base, "malloc_key", 26)
    print("objects kept alive per allocation (tracemalloc):")
    for name in names:
        print(f"  {name:26s} {objects_per_allocation(calls[name], pool, args.hold):.2f}")
    print(f"pool: {pool.stats()['allocation.all.allocated']:,} allocations, all freed: "
          f"{pool.stats()['allocation.all.current'] == 0}")


if __name__ == "__main__":
    main()
