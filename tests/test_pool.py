"""The pool on the sim device: errors, growth, limits, streams, threads, stats."""

import gc
import logging
import pickle
import subprocess
import sys
import threading

import numpy as np
import pytest

import cupool
from cupool.core import heap as heap_module
from cupool.device import SimDevice

MiB = 1 << 20


def books(p):
    """Everything a rejected call must leave as it was."""
    s = p.stats()
    return {k: v for k, v in s.items() if "peak" not in k}


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (1.5, TypeError), ("1MB", TypeError), (True, TypeError)])
def test_bad_sizes_are_refused_and_change_nothing(pool, bad, exc):
    keep = pool.malloc(1000)
    pool.device.bytes_at(keep.ptr, 1000)[:] = 42
    before = books(pool)
    with pytest.raises(exc, match="nbytes"):
        pool.malloc(bad)
    assert books(pool) == before
    assert (pool.device.bytes_at(keep.ptr, 1000) == 42).all()


def test_zero_bytes_is_a_valid_unique_allocation(pool):
    a, b = pool.malloc(0), pool.malloc(0)
    assert a.size == b.size == 0 and a.ptr != b.ptr
    assert pool.stats()["allocation.all.current"] == 2
    a.free()
    b.free()
    assert pool.stats()["allocation.all.current"] == 0


def test_too_big_raises_oom_with_the_figures(pool):
    keep = pool.malloc(3 * MiB)
    before = books(pool)
    with pytest.raises(cupool.OutOfMemoryError) as ei:
        pool.malloc(65 * MiB)
    e = ei.value
    assert isinstance(e, MemoryError)
    msg = str(e)
    for piece in ("65 MiB", "reserved", "allocated", "limit 64 MiB", "largest free block"):
        assert piece in msg
    # Fragmentation has nothing to do with a request above the limit: the error does not
    # blame it (it said "fragmentation 1.000" for a fresh pool before issue 20).
    assert "fragmentation" not in msg and e.fragmentation is None
    assert e.requested == 65 * MiB and e.limit == 64 * MiB
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is cupool.OutOfMemoryError and str(e2) == msg
    after = books(pool)
    assert after.pop("num_ooms") == before.pop("num_ooms") + 1
    assert after == before  # larger than the limit: refused at once, no ladder, no retry
    assert "larger than the pool's limit" in msg
    assert keep.ptr in [b["address"] for s in pool.snapshot()["segments"] for b in s["blocks"]]


def test_an_oom_within_the_limit_names_the_fragmentation():
    pool = cupool.Pool("sim", capacity="64MiB", max_size="40MiB", defrag_threshold=None)
    keep = [pool.malloc(12 * MiB) for _ in range(3)]
    with pytest.raises(cupool.OutOfMemoryError) as ei:
        pool.malloc(8 * MiB)
    assert "fragmentation 0." in str(ei.value) and ei.value.fragmentation is not None
    del keep


def test_double_free_names_the_pointer_and_changes_nothing(pool):
    a = pool.malloc(4096)
    b = pool.malloc(4096)
    pool.device.bytes_at(b.ptr, 4096)[:] = 7
    a.free()
    before = books(pool)
    with pytest.raises(cupool.DoubleFreeError, match=hex(a.ptr)) as ei:
        pool.free(a)
    assert isinstance(ei.value, ValueError)
    assert books(pool) == before
    assert (pool.device.bytes_at(b.ptr, 4096) == 7).all()
    assert pickle.loads(pickle.dumps(ei.value)).ptr == a.ptr


def test_freeing_another_pools_allocation_is_refused(pool):
    other = cupool.Pool("sim", capacity="8MiB")
    a = other.malloc(100)
    mine = pool.malloc(100)
    before, before_other = books(pool), books(other)
    with pytest.raises(cupool.ForeignAllocationError, match=hex(a.ptr)) as ei:
        pool.free(a)
    assert isinstance(ei.value, ValueError)
    assert books(pool) == before and books(other) == before_other
    assert not a.freed and not mine.freed
    with pytest.raises(TypeError, match="Allocation"):
        pool.free(a.ptr)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(device="tpu"), ValueError, "device must be"),
        (dict(device=3), TypeError, "device must be"),
        (dict(memory_fraction=1.5), ValueError, "memory_fraction"),
        (dict(memory_fraction="half"), TypeError, "memory_fraction"),
        (dict(max_size="lots"), ValueError, "max_size"),
        (dict(initial_size="128MiB"), ValueError, "initial_size"),
        (dict(capacity=-1), ValueError, "capacity"),
    ],
)
def test_bad_configuration(kwargs, exc, match):
    kwargs.setdefault("device", "sim")
    kwargs.setdefault("capacity", "64MiB")
    with pytest.raises(exc, match=match):
        cupool.Pool(**kwargs)


def test_bad_shapes_and_dtypes(pool):
    before = books(pool)
    for shape, exc in [((-1, 2), ValueError), ((2.0,), TypeError), ("ab", TypeError), (None, TypeError)]:
        with pytest.raises(exc, match="shape"):
            pool.empty(shape, np.float32)
    with pytest.raises(TypeError, match="objects"):
        pool.empty(4, object)
    with pytest.raises(TypeError):
        pool.empty(4, "not-a-dtype")
    assert books(pool) == before


def test_bad_stream(pool):
    with pytest.raises(TypeError, match="stream"):
        pool.malloc(10, stream="s1")
    with pytest.raises(TypeError, match="stream"):
        pool.malloc(10, stream=-3)


# ----------------------------------------------------------- size classes
def test_size_classes_and_alignment():
    # The size classes' segment sizes are plain (device-malloc) segments': expandable ones grow by granules.
    pool = cupool.Pool("sim", capacity="64MiB", expandable_segments=False)
    small = pool.malloc(1000)
    large = pool.malloc(11 * MiB + 5)
    medium = pool.malloc(3 * MiB)
    s = pool.stats()
    assert s["segment.small_pool.current"] == 1
    assert s["reserved_bytes.small_pool.current"] == 2 * MiB
    # medium (<=10 MiB) gets a 20 MiB segment; large gets its own, rounded to 2 MiB
    assert s["reserved_bytes.large_pool.current"] == 20 * MiB + 12 * MiB
    assert all(a.ptr % 512 == 0 for a in (small, medium, large))
    assert small.nbytes == 1024 and large.nbytes == 11 * MiB + 512
    assert s["requested_bytes.all.current"] == 1000 + 3 * MiB + 11 * MiB + 5
    # a second small request shares the small segment: no new segment
    pool.malloc(1000)
    assert pool.stats()["segment.small_pool.current"] == 1


def test_limit_leaves_room_for_an_exact_segment():
    # Plain segments: the 20 MiB medium segment and the exact one are what this is about.
    p = cupool.Pool("sim", capacity="64MiB", max_size="32MiB", expandable_segments=False)
    a = p.malloc(9 * MiB)  # preferred 20 MiB segment fits
    b = p.malloc(9 * MiB)  # fits in the rest of it
    c = p.malloc(9 * MiB)  # 20 MiB won't fit under 32 MiB, but the 12 MiB left will
    assert p.stats()["reserved_bytes.all.current"] == 32 * MiB
    assert p.stats()["segment.large_pool.current"] == 2
    with pytest.raises(cupool.OutOfMemoryError, match="limit 32 MiB"):
        p.malloc(9 * MiB)
    del a, b, c


def test_memory_fraction_and_percent():
    p = cupool.Pool("sim", capacity="100MiB", memory_fraction=0.5)
    assert p.limit == 50 * MiB
    q = cupool.Pool("sim", capacity="100MiB", max_size="25%", memory_fraction=0.5)
    assert q.limit == 25 * MiB


def test_initial_size_is_preallocated_and_kept():
    p = cupool.Pool("sim", capacity="64MiB", initial_size="32MiB")
    s = p.stats()
    assert s["reserved_bytes.large_pool.current"] == 32 * MiB and s["num_device_alloc"] == 1
    a = p.malloc(5 * MiB)
    assert p.stats()["num_device_alloc"] == 1  # served from the preallocated segment
    a.free()
    assert p.empty_cache() == 0
    assert p.stats()["reserved_bytes.all.current"] == 32 * MiB


def test_empty_cache_reports_released_bytes(pool):
    a = pool.malloc(100)
    b = pool.malloc(12 * MiB)
    b.free()
    assert pool.empty_cache() == 12 * MiB
    assert pool.stats()["reserved_bytes.all.current"] == 2 * MiB
    assert pool.device.mem_info()[0] == 62 * MiB
    a.free()
    assert pool.empty_cache() == 2 * MiB
    assert pool.device.mem_info()[0] == 64 * MiB


def test_release_threshold_returns_free_segments_at_once():
    # Plain segments, each released whole; an expandable region gives back only its free tail.
    p = cupool.Pool("sim", capacity="64MiB", release_threshold="16MiB", expandable_segments=False)
    a = p.malloc(12 * MiB)
    b = p.malloc(12 * MiB)
    a.free()  # reserved 24 MiB > 16 MiB: a's segment goes back
    assert p.stats()["reserved_bytes.all.current"] == 12 * MiB
    b.free()  # reserved 12 MiB <= 16 MiB: kept as cache
    assert p.stats()["reserved_bytes.all.current"] == 12 * MiB


# ------------------------------------------------------------- OOM ladder
def test_ladder_releases_cached_segments_of_the_other_size_class():
    p = cupool.Pool("sim", capacity="16MiB")
    small = [p.malloc(MiB) for _ in range(8)]  # 4 small segments = 8 MiB
    del small
    # 8 MiB cached in the small pool; a 12 MiB request needs them back
    a = p.malloc(12 * MiB)
    s = p.stats()
    assert s["num_alloc_retries"] == 1 and s["segment.small_pool.current"] == 0
    assert a.nbytes == 12 * MiB


def test_ladder_collects_garbage_cycles():
    p = cupool.Pool("sim", capacity="16MiB")

    class Node:
        pass

    n = Node()
    n.self = n
    n.buf = p.empty((12 * MiB,), np.uint8)
    del n  # only a reference cycle keeps the 12 MiB alive now
    gc.disable()
    try:
        b = p.malloc(12 * MiB)
    finally:
        gc.enable()
    assert b.nbytes == 12 * MiB
    assert p.stats()["num_ooms"] == 0


# ----------------------------------------------------------------- arrays
def test_empty_returns_views_and_memory_returns_when_the_array_dies(pool):
    x = pool.empty((256, 4), np.float64)
    assert isinstance(x, np.ndarray) and x.shape == (256, 4) and x.dtype == np.float64
    x[:] = np.arange(1024).reshape(256, 4)
    ptr = x.ctypes.data
    assert (pool.device.bytes_at(ptr, 8).view(np.float64) == 0).all()
    view = x[10:20]
    del x
    assert pool.stats()["allocation.all.current"] == 1  # the view keeps it alive
    assert view[0, 1] == 41
    del view
    assert pool.stats()["allocation.all.current"] == 0
    y = pool.empty(8192 // 4, np.float32)
    assert y.ctypes.data == ptr  # reused at once on the same stream


def test_dropping_an_allocation_frees_it(pool):
    a = pool.malloc(1 << 16)
    assert pool.stats()["allocated_bytes.all.current"] == 1 << 16
    del a
    assert pool.stats()["allocated_bytes.all.current"] == 0


# ---------------------------------------------------------------- streams
def test_reuse_on_the_same_stream_is_immediate(pool):
    pool.device.enqueue(1)  # stream 1 is busy
    a = pool.malloc(4096, stream=1)
    ptr = a.ptr
    a.free()
    assert pool.malloc(4096, stream=1).ptr == ptr


def test_cross_stream_reuse_waits_for_the_event():
    dev = SimDevice("64MiB")
    p = cupool.Pool(dev)
    a = p.malloc(4096, stream=1)
    ptr = a.ptr
    dev.enqueue(1)  # a kernel using a is in flight on stream 1
    a.free()
    b = p.malloc(4096, stream=2)
    assert not (b.ptr <= ptr < b.ptr + b.nbytes)
    assert p.stats()["segment.small_pool.current"] == 2  # stream 2 had to grow
    dev.synchronize(1)
    # The event completed: stream 2 may now use a's segment.  Three 1 MiB blocks fit
    # only if it does (its own segment has room for one).
    cs = [p.malloc(MiB, stream=2) for _ in range(3)]
    s = p.stats()
    assert s["segment.small_pool.current"] == 2 and s["num_alloc_retries"] == 0
    assert ptr in [c.ptr for c in cs]
    p.check()
    del b


def test_sync_in_the_ladder_frees_other_streams_memory():
    dev = SimDevice("16MiB")
    p = cupool.Pool(dev)
    a = p.malloc(12 * MiB, stream=1)
    dev.enqueue(1)
    a.free()
    # stream 2 cannot take it while stream 1 is busy, and there is no room to grow:
    # the ladder synchronizes the device and then reuses it.
    b = p.malloc(12 * MiB, stream=2)
    assert b.ptr == a.ptr
    assert p.stats()["num_alloc_retries"] == 1


# ---------------------------------------------------------------- threads
def test_eight_threads_malloc_and_free_at_once():
    p = cupool.Pool("sim", capacity="1GiB")
    errors = []
    barrier = threading.Barrier(8)

    def work(tid):
        rng = np.random.default_rng(tid)
        mine = []
        try:
            barrier.wait()
            for i in range(400):
                if mine and rng.random() < 0.45:
                    a, tag = mine.pop(rng.integers(len(mine)))
                    if not (p.device.bytes_at(a.ptr, a.size) == tag).all():
                        errors.append(f"thread {tid}: block {a.ptr:#x} was overwritten")
                    p.free(a)
                else:
                    n = int(rng.choice([64, 1000, 70_000, 3 * MiB // 2]))
                    a = p.malloc(n)
                    tag = (tid * 31 + i) % 251
                    p.device.bytes_at(a.ptr, n)[:] = tag
                    mine.append((a, tag))
                    if rng.random() < 0.1:
                        arr = p.empty((128,), np.uint8)  # dies at once: finalizer path
                        arr[:] = 1
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))
        for a, tag in mine:
            if not (p.device.bytes_at(a.ptr, a.size) == tag).all():
                errors.append(f"thread {tid}: block {a.ptr:#x} was overwritten")
            p.free(a)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = p.stats()
    assert s["allocation.all.current"] == 0 and s["allocated_bytes.all.current"] == 0
    assert s["allocation.all.allocated"] == s["allocation.all.freed"] > 1500
    p.check()


# ------------------------------------------------------------------ stats
CONTRACT = [
    "allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
    "reserved_bytes.all.peak", "requested_bytes.all.current", "active_bytes.all.current",
    "inactive_split_bytes.all.current", "segment.all.current", "allocation.all.current",
    "allocation.all.allocated", "allocation.all.freed", "num_alloc_retries", "num_ooms",
    "allocated_bytes.small_pool.current", "allocated_bytes.large_pool.current",
    "reserved_bytes.small_pool.peak", "reserved_bytes.large_pool.peak",
    "fragmentation", "largest_free_block", "cache_hit_rate",
]


def test_stats_contract_and_values(pool):
    s = pool.stats()
    missing = [k for k in CONTRACT if k not in s]
    assert not missing
    a = pool.malloc(1000)
    b = pool.malloc(1000)
    a.free()
    s = pool.stats()
    assert s["allocated_bytes.all.current"] == 1024 and s["allocated_bytes.all.peak"] == 2048
    assert s["reserved_bytes.all.current"] == 2 * MiB
    assert s["inactive_split_bytes.all.current"] == 2 * MiB - 1024
    assert s["allocation.all.allocated"] == 2 and s["allocation.all.freed"] == 1
    assert s["fragmentation"] == pytest.approx((2 * MiB - 1024) / (2 * MiB))
    assert pool.fragmentation() == s["fragmentation"]
    assert s["largest_free_block"] == 2 * MiB - 2048
    assert s["cache_hit_rate"] == 0.5  # first malloc grew, second was served from the cache
    pool.reset_peak_stats()
    assert pool.stats()["allocated_bytes.all.peak"] == 1024
    del b


def test_snapshot_has_segments_and_blocks(pool):
    a = pool.malloc(3000)
    snap = pool.snapshot()
    (seg,) = snap["segments"]
    assert seg["total_size"] == 2 * MiB and seg["segment_type"] == "small"
    assert seg["allocated_size"] == 3072 and seg["requested_size"] == 3000
    first, rest = seg["blocks"]
    assert first == {"address": a.ptr, "size": 3072, "requested_size": 3000, "state": "active_allocated"}
    assert rest["state"] == "inactive" and rest["size"] == 2 * MiB - 3072


def test_subscribe_sees_events_in_order(pool):
    seen = []
    unsubscribe = pool.subscribe(seen.append)
    a = pool.malloc(100)
    a.free()
    pool.empty_cache()
    unsubscribe()
    pool.malloc(5)
    kinds = [e[1] for e in seen]
    # The default pool maps granules (segment_map / segment_unmap); the program's own empty_cache()
    # is an event of its own, after what it did, with the bytes it released.
    assert kinds == ["segment_map", "alloc", "free", "segment_unmap", "call:empty_cache"]
    assert seen[1][2] == a.ptr and seen[1][3] == 512
    assert seen[0][2:] == seen[3][2:] == (a.ptr, 2 * MiB, 0) and seen[4][3] == 2 * MiB
    with pytest.raises(TypeError, match="callable"):
        pool.subscribe(42)


def test_auto_device_falls_back_to_sim_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr(cupool.device, "_auto_note_given", False)
    monkeypatch.setattr(cupool.device, "cuda_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="cupool"):
        p = cupool.Pool(capacity="8MiB")
        cupool.Pool(capacity="8MiB")
    assert p.device.kind == "sim"
    notes = [r for r in caplog.records if "simulated device" in r.getMessage()]
    assert len(notes) == 1


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cupool.device, "cuda_available", lambda: False)
    with pytest.raises(RuntimeError, match="no usable CUDA GPU"):
        cupool.Pool("cuda")
    with pytest.raises(ValueError, match="capacity"):
        cupool.Pool("cuda", capacity="1GB")


def test_sim_device_enforces_capacity_like_cudamalloc():
    dev = SimDevice("8MiB")
    a = dev.malloc(6 * MiB)
    with pytest.raises(MemoryError):
        dev.malloc(4 * MiB)
    dev.free(a, 6 * MiB)
    b = dev.malloc(8 * MiB)
    assert dev.mem_info() == (0, 8 * MiB)
    with pytest.raises(ValueError, match="not a segment"):
        dev.free(b + 512, 0)
    dev.free(b, 8 * MiB)


def test_finalizer_during_malloc_is_deferred_not_reentrant(pool, monkeypatch):
    """A GC pass inside malloc runs finalizers; they must queue, not corrupt the heap."""
    victim = pool.malloc(1000)
    orig = heap_module.split_rest

    def split_and_finalize(block_size, size):  # inside Heap.take: the lock is held
        nonlocal victim
        if victim is not None:
            v, victim = victim, None
            del v  # Allocation.__del__ fires while malloc holds the lock
        return orig(block_size, size)

    # The heap is compiled (Note [One compiled core]): its methods cannot be patched, the rule it calls can.
    monkeypatch.setattr(heap_module, "split_rest", split_and_finalize)
    b = pool.malloc(1000)
    pool.check()
    assert pool.stats()["allocation.all.current"] == 1


_REENTRANT_FREE = """
import gc, sys, cupool
p = cupool.Pool("sim", capacity="16MiB")
raised = []
sys.unraisablehook = lambda u: raised.append(repr(u.exc_value))

class Holder:
    def __init__(self, a, m):
        self.a, self.m, self.me = a, m, self
    def __del__(self):
        self.a.free()          # explicit frees from a finalizer run by the ladder's gc.collect()
        self.m.free()

class Allocator:
    def __init__(self):
        self.me = self
    def __del__(self):
        p.malloc(10)           # allocating there cannot be served: a clear error, not a hang

for _ in range(3):
    Holder(p.malloc(12 << 20), p.movable(1 << 20))
Allocator()
gc.disable()
b = p.malloc(12 << 20)
gc.enable()
p.check()
assert p.stats()["allocation.all.current"] == 1, p.stats()["allocation.all.current"]
assert any("finalizer" in r for r in raised), raised
print("ok")
"""


def test_finalizers_that_free_during_a_collection_do_not_deadlock():
    """The reclaim ladder's gc.collect() runs user __del__ methods while the pool's lock is held."""
    r = subprocess.run([sys.executable, "-c", _REENTRANT_FREE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_a_subscriber_sees_allocations_served_from_blocks_parked_before_it_came(pool):
    """Blocks freed through the fast path before an exact subscriber arrived are still reported."""
    pool.malloc(1000).free()  # parked: the fast path's stack holds it
    seen = []
    pool.subscribe(seen.append, kinds={"alloc", "free"})
    a = pool.malloc(1000)  # same size and stream: the parked block would serve it unseen
    a.free()
    assert [e[1] for e in seen] == ["alloc", "free"]
    assert seen[0][2] == a.ptr


def test_a_figures_only_subscriber_keeps_the_fast_path_and_still_sees_the_figures(pool):
    got = []
    pool.subscribe(lambda e: got.append((e[1], pool.view.books.allocated)), small_blocks=False)
    for _ in range(100):
        pool.malloc(1000).free()
    # The first block grew the pool, which is news; the 99 reuses of it are not.
    assert got == [("segment_map", 0), ("alloc", 1024)]
    big = pool.malloc(12 * MiB)
    assert got[-1] == ("alloc", 12 * MiB)  # large blocks are reported, with current figures
    del big


def test_a_pool_call_inside_hold_is_refused_rather_than_deadlocking(pool):
    a = pool.malloc(100)
    with pool.hold() as view:
        with pytest.raises(RuntimeError, match="hold"):
            pool.malloc(10)
        with pytest.raises(RuntimeError, match="hold"):
            a.free()
        assert view.books.allocations == 1
    a.free()  # the lock was released, and the refused free changed nothing
    pool.check()
    assert pool.stats()["allocation.all.current"] == 0


def test_a_pool_collected_inside_its_own_arenas_malloc_closes_without_deadlock(monkeypatch):
    """A pool in a reference cycle may be collected while its arena holds the lock (a hook's
    bound malloc_key outlives the pool); its finalizer's close must queue, not wait."""
    import threading

    dev = SimDevice("16MiB")
    p = cupool.Pool(dev)
    malloc = p.malloc_key  # what a CuPy hook keeps
    p.cycle = p
    del p
    orig = heap_module.split_rest
    fired = []

    def split_and_collect(block_size, size):  # inside Heap.take: the lock is held
        if not fired:
            fired.append(1)
            gc.collect()  # collects the pool: its finalizer closes the arena
        return orig(block_size, size)

    monkeypatch.setattr(heap_module, "split_rest", split_and_collect)
    out = []
    t = threading.Thread(target=lambda: out.append(malloc(1000, 0)), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the finalizer's close waited for the lock its own thread held"
    (a,) = out
    with pytest.raises(ValueError, match="closed"):
        malloc(1000, 0)
    # The live allocation's granule stays mapped until it is freed (mem_info counts mapped granules).
    assert dev.mem_info()[0] == 14 * MiB
    a.free()
    assert dev.mem_info()[0] == 16 * MiB


def test_an_arena_dying_as_cyclic_garbage_frees_each_segment_once():
    """Its finalizer gives the segments back before the handles' __del__ run: they must not free again."""
    raised = []
    hook, sys.unraisablehook = sys.unraisablehook, lambda u: raised.append(u.exc_value)
    gc.disable()
    try:
        dev = SimDevice("64MiB")
        p = cupool.Pool(dev)
        m = p.movable(3 * MiB)
        box = [m]
        box.append(box)  # the buffer sits in some cyclic structure
        with pytest.warns(ResourceWarning):
            p.close()
        del p, m, box
        gc.collect()
    finally:
        gc.enable()
        sys.unraisablehook = hook
    assert raised == [] and dev.used == 0


def test_the_view_inside_a_subscriber_shows_parked_blocks_as_free(pool):
    small = [pool.malloc(1000) for _ in range(4)]
    del small  # parked on the fast path
    seen = []

    def look(event):
        segs = pool.view.segments()
        seen.append((sum(not b.free for s in segs for b in s.blocks), pool.view.books.allocations))

    pool.subscribe(look, kinds={"segment_map"})  # the large region's first granules, mapped before the alloc
    big = pool.malloc(12 * MiB)
    assert seen == [(0, 0)]
    del big


# ------------------------------------------------------ sizes past 64 bits, streams past int64
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(capacity=2**64), r"capacity must be at most 2\*\*63 - 1 bytes"),
        (dict(capacity="100TiB"), "capacity: a sim device of 100 TiB .* the largest sim device is 64 TiB"),
        (dict(capacity="9" * 400), "capacity: .* is more bytes than a 64-bit size holds"),
        (dict(max_size=2**64), "max_size"),
        (dict(initial_size="99999999999TiB"), "initial_size"),
    ],
)
def test_sizes_no_machine_holds_are_value_errors_naming_the_argument(kwargs, match):
    kwargs.setdefault("capacity", "64MiB")
    with pytest.raises(ValueError, match=match):
        cupool.Pool("sim", **kwargs)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda p: p.malloc(2**64), "nbytes must be at most"),
        (lambda p: p.movable(2**64), "nbytes must be at most"),
        (lambda p: p.empty(2**64), r"shape \(18446744073709551616,\) of float32 needs more than 2\*\*63 - 1 bytes"),
        (lambda p: p.empty((2**62, 3)), r"shape \(4611686018427387904, 3\) of float32"),
        (lambda p: p.empty((2**32, 2**32), np.uint8), r"shape \(4294967296, 4294967296\) of uint8"),
        (lambda p: p.empty((2**32, 2**32)), r"shape \(4294967296, 4294967296\)"),
    ],
)
def test_byte_counts_past_64_bits_are_refused_before_any_malloc(pool, call, match):
    keep = pool.malloc(1000)
    before = books(pool)
    with pytest.raises(ValueError, match=match):
        call(pool)
    assert books(pool) == before  # no malloc, no out-of-memory counted
    del keep


def test_streams_past_int64_are_refused_by_the_sim_device(pool, tmp_path):
    before = books(pool)
    for stream in (2**63, np.uint64(2**63), 2**200):
        with pytest.raises(TypeError, match=r"stream: .* from 0 to 2\*\*63 - 1"):
            pool.malloc(10, stream=stream)
    assert books(pool) == before
    with pool.record(tmp_path / "streams.h5") as rec:  # the largest stream still fits the trace's columns
        pool.malloc(10, stream=2**63 - 1).free()
    assert [e[4] for e in rec.events() if e[1] in ("alloc", "free")] == [2**63 - 1] * 2


def test_a_huge_capacity_in_cupool_conf_is_a_value_error_naming_it():
    env = {**__import__("os").environ, "CUPOOL_CONF": "capacity=" + "9" * 400}
    r = subprocess.run([sys.executable, "-c", "import cupool; cupool.default_pool()"], env=env,
                       capture_output=True, text=True, timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: CUPOOL_CONF: capacity: ") and "64-bit" in last, last


def test_a_small_ring_records_without_a_path():
    """Needs the recorder's default batch to be min(4096, capacity) (a change for the lead: see the report)."""
    p = cupool.Pool("sim", capacity="64MiB")
    with p.record(capacity=1024) as rec:
        for _ in range(600):
            p.malloc(1000).free()
    assert rec.n_events > 1200 and len(rec.events()) == 1024 and rec.events()[-1][1] == "free"


@pytest.mark.parametrize("n", [2**63 - 1, 2**63 - 100, 2**62])
def test_a_request_near_2_63_bytes_is_an_out_of_memory_not_an_overflow(n):
    """The parked stacks' C integers must not meet a size no stack holds (a stack lookup raised
    OverflowError for sizes near 2**63 once the stacks went to C)."""
    pool = cupool.Pool("sim", capacity="64MiB")
    pool.malloc(4096).free()  # a block parked: the stacks are looked at
    with pytest.raises(cupool.OutOfMemoryError):
        pool.malloc(n)
    pool.check()
