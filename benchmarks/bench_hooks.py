"""Hook overhead: ``cupy.empty((256,), float32)`` + drop through cupool, against a do-nothing allocator.

The floor is the cheapest possible Python allocator (it returns a fixed pointer
over ``UnownedMemory``), so a ratio to it is the cost of pooling as CuPy code
sees it.  cupool runs both of its memory paths on one sim pool each:

- ``PoolMemory``: ``cupy_allocator(pool)`` with cupool's compiled memory object
  (``cupool.hooks.cupy_memory``; the row is absent where it does not run, and
  ``memory path`` says why);
- ``UnownedMemory``: ``cupy_allocator(pool, path="unowned")``, the fallback.

Time is CPU time of this thread (``time.thread_time``: other processes on a
shared machine disturb it less than wall time), in rounds that interleave the
variants in a rotating order, so drift hits all alike.  Per variant the median
of the rounds is printed, and each ratio twice: of the medians, and the median
of the per-round ratios (paired: the steadier of the two).  Target: PoolMemory
<= 1.25x the floor.

Objects per allocation are counted, not assumed: with ``tracemalloc`` on, the
allocator is called ``--hold`` times and the results kept alive; the new memory
blocks Python traced, divided by that count, are the objects each allocation
keeps alive (CuPy's ``MemoryPointer`` is one of them).  The pool's own objects
are kept out of the count: the blocks were allocated and freed once before, so
they come off the pool's stacks, and its accounting log is folded (an int per
call, until the next fold) before each snapshot.  So are ``PoolMemory``'s
reusable shells (at most 64 emptied ``Allocation`` objects, Note [One memory
object]): 64 allocations made first fill them.  No int is made per
allocation: sizes are shared with CuPy's, pointers are C fields or the block's.

On a GPU the ``UnownedMemory`` path asks CuPy for the current device and stream
in Python on every allocation (``cupy.cuda.runtime.getDevice()``,
``cupy.cuda.get_current_stream().ptr``); ``PoolMemory`` calls CuPy's own C
functions instead (``cupy.cuda.device.get_device_id``,
``cupy.cuda.stream.get_current_stream_ptr``, found in their modules'
``__pyx_capi__``): two indirect C calls, no Python call and no object made, the
same CUDA work behind them.  Without a GPU those functions raise, so the Python
side is measured with stand-ins of the same shape: a no-argument builtin that
returns an int for each call, and CuPy's own ``Stream.null.ptr`` read for the
stream (``lookups``).

The same allocations counted in instructions (valgrind; steady where CPU time is
not): ``benchmarks/bench_hook_instructions.py``.

    python benchmarks/bench_hooks.py [--number 20000] [--rounds 15] [--hold 2000]
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import cupy
import numpy as np

import cupool
from cupool.hooks.cupy import memory_path
from rounds import interleaved, print_medians  # benchmarks/rounds.py, beside this script

FLOOR = "floor (fixed pointer)"


def floor_allocator() -> Callable[[int], Any]:
    arena = np.zeros(1 << 20, np.uint8)
    fixed, owner = arena.ctypes.data, arena
    pointer, unowned = cupy.cuda.MemoryPointer, cupy.cuda.UnownedMemory

    def floor(nbytes: int) -> Any:
        return pointer(unowned(fixed, nbytes, owner, 0), 0)

    return floor


def variants() -> dict[str, Callable[[int], Any]]:
    out = {FLOOR: floor_allocator()}
    if memory_path()[0] == "PoolMemory":
        out["cupool PoolMemory"] = cupool.cupy_allocator(cupool.Pool("sim", capacity="256MiB"))
    out["cupool UnownedMemory"] = cupool.cupy_allocator(cupool.Pool("sim", capacity="256MiB"), path="unowned")
    return out


def cpu_per_call(alloc: Callable[[int], Any], number: int) -> float:
    """Microseconds of this thread's CPU per ``cupy.empty((256,), float32)`` + drop."""
    empty, f32 = cupy.empty, np.float32
    cupy.cuda.set_allocator(alloc)
    try:
        t0 = time.thread_time()
        for _ in range(number):
            empty((256,), f32)
        return (time.thread_time() - t0) / number * 1e6
    finally:
        cupy.cuda.set_allocator()


def objects_per_allocation(alloc: Callable[[int], Any], hold: int) -> float:
    """Memory blocks Python traced per allocation kept alive (each object is one block)."""
    pool = getattr(alloc, "pool", None)
    fold = pool._arena.books.fold if pool is not None else (lambda: None)  # the fast path's log: the pool's ints
    held = [alloc(1024) for _ in range(hold + 64)]
    del held  # the blocks wait on the pool's stacks: taking them again makes no pool objects
    first = [alloc(1024) for _ in range(64)]  # fills PoolMemory's 64 reusable shells: a constant
    gc.collect()
    fold()  # not stats(): that would give the parked blocks back to the heap
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        kept = [alloc(1024) for _ in range(hold)]
        fold()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    mine = [tracemalloc.Filter(False, tracemalloc.__file__)]  # not the first snapshot's own blocks
    blocks = sum(s.count_diff for s in after.filter_traces(mine).compare_to(before.filter_traces(mine), "filename"))
    del kept, first
    return (blocks - 2) / hold  # less the list ``kept`` and its array of items


def lookups(number: int) -> float:
    """Nanoseconds of CPU for the Python lookups of the UnownedMemory path on a GPU, with stand-ins.

    ``get_device()`` and ``get_stream()`` are no-argument builtins as CuPy's
    ``getDevice`` and ``get_current_stream`` are; the stream is CuPy's, whose
    ``ptr`` is read as the hook reads it.  What the stand-ins leave out (the CUDA
    runtime's own look-up) is the same on both paths.
    """
    import itertools
    import sys

    get_device = sys.getrecursionlimit
    get_stream = itertools.repeat(cupy.cuda.Stream.null).__next__
    index = get_device()
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(number):
            if get_device() != index:
                raise AssertionError
            get_stream().ptr
        best = min(best, (time.thread_time() - t0) / number * 1e9)
    t0 = time.thread_time()
    for _ in range(number):
        pass
    return best - (time.thread_time() - t0) / number * 1e9  # less the loop itself


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000, help="calls per sample")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    ap.add_argument("--hold", type=int, default=2000, help="allocations kept alive to count objects")
    args = ap.parse_args()

    path, why = memory_path()
    print(f"memory path: {path} ({why})")
    print(f"fast path:   {cupool.core.build_info()['fast_path']}")
    allocs = variants()
    names = list(allocs)
    samples = interleaved({k: functools.partial(cpu_per_call, a) for k, a in allocs.items()}, args.rounds, args.number)
    print(f"CPU time per cupy.empty((256,), float32) + drop, {args.rounds} rounds of {args.number:,} calls:")
    print_medians(samples, FLOOR, "floor", 22)
    print("objects kept alive per allocation (tracemalloc, CuPy's MemoryPointer included):")
    for name in names:
        print(f"  {name:22s} {objects_per_allocation(allocs[name], args.hold):.2f}")
    print("target: PoolMemory <= 1.25x the floor; 2 objects (the MemoryPointer and one of cupool's)")
    print(f"GPU lookups through Python (UnownedMemory path, stand-ins): {lookups(args.number):.0f} ns per allocation; "
          "PoolMemory: two C calls, no Python call, no object")


if __name__ == "__main__":
    main()
