"""CuPy's memory object made by cupool (Note [One memory object]), and its fallback to UnownedMemory.

The tests of the object itself run where it runs (compiled, a CuPy laid out as it
declares); ``tests/test_both_paths.py`` runs this file on the other path too, where
the fallback tests run.  CuPy builds ndarrays on this memory without a GPU as long
as no kernel runs.
"""

from __future__ import annotations

import gc
import threading
import tracemalloc
import warnings

import cupy
import numpy as np
import pytest

import cupool
from conftest import needs_gpu
from cupool.core import PURE_ENV, build_info, compiled_module
from cupool.core import fast
from cupool.core.fast import Allocation
from cupool.hooks import cupy as hook

runs = hook.memory_path()[0] == "PoolMemory"
needs_object = pytest.mark.skipif(not runs, reason=f"cupool's memory object does not run: {hook.memory_path()[1]}")


def live(pool):
    return pool.stats()["allocation.all.current"]


@pytest.fixture
def pool():
    return cupool.Pool("sim", capacity="64MiB")


def test_the_memory_object_runs_exactly_when_the_compiled_fast_path_does():
    """With the fast path compiled and this CuPy, the object runs; uncompiled it cannot (it cimports the fast path)."""
    path, why = hook.memory_path()
    if build_info()["fast_path"] == "compiled":
        assert path == "PoolMemory", why
    else:
        assert path == "UnownedMemory" and (PURE_ENV in why or "needs cupool.core.fast compiled" in why), why


@needs_object
def test_cupy_gets_pool_memory_and_nothing_else_of_cupools(pool):
    module, _ = compiled_module(hook.MEMORY_MODULE)
    with cupool.using(pool):
        x = cupy.empty((256,), np.float32)
    mem = x.data.mem
    assert type(mem) is module.PoolMemory and isinstance(mem, cupy.cuda.memory.BaseMemory)
    assert (mem.ptr, mem.size, mem.device_id, mem.nbytes) == (x.data.ptr, 1024, 0, 1024)
    refs = gc.get_referents(mem)  # the pool's arena and block, the size and stream: no Allocation behind it
    assert not any(isinstance(r, Allocation) for r in refs) and pool._arena in refs
    assert live(pool) == 1
    del x, mem
    assert live(pool) == 0
    pool.check()


@pytest.mark.parametrize("path", ["pointer", "unowned"])
def test_objects_kept_alive_per_allocation(pool, path):
    """Counted by tracemalloc: the pointer and one object of cupool's (two with UnownedMemory).

    The fraction over a whole number is the pool's: a list growing now and then.
    """
    if path == "pointer" and not runs:
        pytest.skip("cupool's memory object does not run")
    alloc = cupool.cupy_allocator(pool, path=path)
    held = [alloc(1024) for _ in range(600)]
    del held  # the blocks now wait on the pool's stacks: taking them again makes no pool objects
    first = [alloc(1024) for _ in range(64)]  # fills PoolMemory's reusable shells: a constant, not per allocation
    fold = pool._arena.books.fold  # the fast path's log (an int per call) is the pool's, not the allocation's;
    fold()  # folded without stats(), which would give the parked blocks back to the heap
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        kept = [alloc(1024) for _ in range(500)]
        fold()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    mine = [tracemalloc.Filter(False, tracemalloc.__file__)]
    blocks = sum(s.count_diff for s in after.filter_traces(mine).compare_to(before.filter_traces(mine), "filename"))
    per = (blocks - 2) / len(kept)  # less the list and its items
    # UnownedMemory keeps the Allocation alive, which uncompiled is a Python object with a dict
    expected = 2 if path == "pointer" else 3 if fast.COMPILED else 4
    assert abs(per - expected) < 0.1, per
    del kept, first
    assert live(pool) == 0


@needs_object
def test_the_pointer_cupool_writes_in_c_is_cupys_own_memory_pointer(pool):
    """``pointer_to`` fills CuPy's ``MemoryPointer`` without calling it: CuPy reads it as one it built."""
    alloc = cupool.cupy_allocator(pool)
    p = alloc(1000)
    assert type(p) is cupy.cuda.MemoryPointer
    assert (p.ptr, p.device_id, int(p)) == (p.mem.ptr, 0, p.mem.ptr) and p.mem.size == 1000
    q = p + 256  # CuPy's own arithmetic makes the next pointer over the same memory
    assert (q.ptr, q.mem) == (p.ptr + 256, p.mem)
    del p
    assert live(pool) == 1  # q keeps the memory, and so the block
    with cupool.using(pool):
        x = cupy.empty((256,), np.float32)
    view = x[10:]
    assert (view.data.ptr, view.data.mem) == (x.data.ptr + 40, x.data.mem)
    del q, x
    assert live(pool) == 1  # the view keeps the array's memory
    del view
    assert live(pool) == 0
    pool.check()


@needs_object
def test_shells_are_reused_and_never_leak(pool):
    """200 memories dying at once fill the 64 shells and let the rest go; a churn after reuses them, keeping none."""
    alloc = cupool.cupy_allocator(pool)
    held = [alloc(512) for _ in range(200)]
    del held
    for _ in range(1000):
        p = alloc(512)
        del p
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(2000):
            p = alloc(512)
            del p
        pool._arena.books.fold()  # the fast path's log: the pool's ints, not the hook's
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert grown < 2048, grown  # a shell or a memory kept per allocation would be 2000 objects
    assert live(pool) == 0
    pool.check()


@needs_object
def test_frees_in_any_order_keep_the_books_exact(pool):
    rng = np.random.default_rng(5)
    alloc = cupool.cupy_allocator(pool)
    held, model = [], 0
    for step in range(3000):
        if held and rng.random() < 0.5:
            p = held.pop(int(rng.integers(len(held))))
            model -= p.mem.size
            del p
        else:
            n = int(rng.choice([1, 256, 1000, 4096, 70_000, 3 << 20]))
            held.append(alloc(n))
            model += n
        if step % 500 == 0:
            assert pool.stats()["requested_bytes.all.current"] == model
    spans = sorted((p.ptr, p.mem.size) for p in held)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    del held
    s = pool.stats()
    assert s["allocation.all.current"] == 0 and s["allocation.all.allocated"] == s["allocation.all.freed"]
    pool.check()


@needs_object
def test_a_free_while_the_pools_lock_is_held_is_queued_never_waited_for(pool):
    """As from a finalizer inside the pool's own malloc (Note [Finalizers]): queued, applied at unlock."""
    alloc = cupool.cupy_allocator(pool)
    ps = [alloc(1000) for _ in range(3)]
    with pool.hold():
        del ps  # three memories die with the lock held: their frees queue
    assert live(pool) == 0
    again = [alloc(1000) for _ in range(3)]  # the queued shells were not reused while queued
    assert len({p.ptr for p in again}) == 3 and live(pool) == 3
    del again
    pool.check()


@needs_object
def test_a_free_from_another_thread_holding_the_lock_is_queued(pool):
    alloc = cupool.cupy_allocator(pool)
    p = alloc(1000)
    held, release = threading.Event(), threading.Event()

    def holder():
        with pool.hold():
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    del p  # must not wait for the other thread
    release.set()
    t.join()
    assert live(pool) == 0
    pool.check()


@needs_object
def test_a_pool_that_records_sites_keeps_the_allocation_so_its_record_lives():
    pool = cupool.Pool("sim", capacity="64MiB", track_sites=True)
    alloc = cupool.cupy_allocator(pool)
    p = alloc(4096)
    (leak,) = pool.leaks()
    assert leak.size == 4096
    del p
    assert pool.leaks() == [] and live(pool) == 0


@needs_object
def test_an_admission_check_still_refuses(pool):
    alloc_before = cupool.cupy_allocator(pool)
    pool.set_admission(lambda n, what: "too big" if n > 1000 else None)
    alloc = cupool.cupy_allocator(pool)
    with pytest.raises(cupool.OutOfMemoryError, match="too big"):
        alloc(2000)
    assert live(pool) == 0
    p = alloc(10)
    q = alloc_before(2000)  # made before the check: keeps the malloc of its time, as the UnownedMemory path
    assert live(pool) == 2
    del p, q
    assert live(pool) == 0


@needs_object
def test_the_layout_matches_this_cupy_and_cupys_c_lookups_are_found():
    module, _ = compiled_module(hook.MEMORY_MODULE)
    assert module.layout_mismatch() is None
    assert module.c_lookups() == {"stream": True, "device": True}


def test_a_cupy_laid_out_otherwise_falls_back_with_one_warning(pool, monkeypatch):
    module, _ = compiled_module(hook.MEMORY_MODULE)
    if module is None:
        pytest.skip("the compiled memory object does not run here: the fallback is the only path")
    monkeypatch.setattr(module, "layout_mismatch", lambda: "BaseMemory is 48 bytes, cupool declares 40")
    hook.memory_path.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            allocs = [cupool.cupy_allocator(pool) for _ in range(3)]
        assert len(caught) == 1 and "48 bytes" in str(caught[0].message), [str(w.message) for w in caught]
        p = allocs[0](1000)
        assert type(p.mem) is cupy.cuda.memory.UnownedMemory
        assert hook.memory_path() == ("UnownedMemory", "the installed CuPy differs from what cupool was built for: "
                                                       "BaseMemory is 48 bytes, cupool declares 40")
        del p
    finally:
        hook.memory_path.cache_clear()
    assert live(pool) == 0


def test_cupool_info_says_which_memory_object_cupy_gets(capsys):
    from cupool.cli import main

    assert main(["info", "--device", "sim"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("cupy memory")]
    path, why = hook.memory_path()
    assert line.split(None, 2)[2] == f"{path} ({why})"


@needs_gpu
@needs_object
def test_on_a_gpu_the_block_is_taken_for_cupys_current_stream_looked_up_in_c():
    """CuPy's own C functions give the device and stream: the block (in a fresh pool, its segment) is the
    stream's it served.  (This read ``BlockInfo.tag``, a field that never existed: it would have failed on
    any GPU.)"""
    assert hook.memory_path()[1].endswith("stream in C and device in C")
    pool = cupool.Pool("cuda")
    with cupool.using(pool):
        with cupy.cuda.Stream() as s:
            x = cupy.arange(1000, dtype=cupy.float32)
            assert float(x.sum()) == 499500.0
            del x
            s.synchronize()
    with pool.hold() as view:
        streams = {b.stream for seg in view.segments() for b in seg.blocks if b.free}
    assert s.ptr in streams and live(pool) == 0
