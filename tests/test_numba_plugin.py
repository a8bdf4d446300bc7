"""The Numba EMM plugin, instantiated as Numba does to read its version (context=None), over sim pools."""

import gc
import importlib
import logging
import weakref

import numpy as np
import pytest
from numba import cuda
from numba.cuda.cudadrv import driver

import cupool
from cupool import hooks
from cupool.hooks.numba import device_pointer
from cupool.numba import CupoolMemoryManager, _numba_memory_manager

MiB = 1 << 20


@pytest.fixture
def pinned():
    return cupool.PinnedPool("sim", capacity="8MiB")


@pytest.fixture
def mm(pool, pinned):
    return CupoolMemoryManager(context=None, pool=pool, pinned_pool=pinned)


def live(pool):
    return pool.stats()["allocation.all.current"]


def test_module_is_a_valid_numba_memory_manager_module():
    mod = importlib.import_module("cupool.numba")  # what NUMBA_CUDA_MEMORY_MANAGER=cupool.numba does
    assert mod._numba_memory_manager is CupoolMemoryManager is _numba_memory_manager
    assert issubclass(CupoolMemoryManager, cuda.HostOnlyCUDAMemoryManager)
    assert issubclass(CupoolMemoryManager, cuda.GetIpcHandleMixin)
    assert CupoolMemoryManager(context=None).interface_version == 1


def test_numba_accepts_it_and_it_can_be_taken_back():
    before = driver._memory_manager
    try:
        cuda.set_memory_manager(CupoolMemoryManager)  # instantiates it with context=None
        assert driver._memory_manager is CupoolMemoryManager
    finally:
        driver._memory_manager = before


def test_memalloc_comes_from_the_pool_and_the_finalizer_returns_it(mm, pool):
    ptrs = [mm.memalloc(n) for n in (1, 1000, 3 * MiB)]
    assert live(pool) == 3
    addrs = sorted((p.device_pointer_value, p.size) for p in ptrs)
    for (a0, n0), (a1, _) in zip(addrs, addrs[1:]):
        assert a0 + n0 <= a1
    assert [p.size for p in ptrs] == [1, 1000, 3 * MiB]
    assert pool.stats()["requested_bytes.all.current"] == 1 + 1000 + 3 * MiB
    pool.device.bytes_at(ptrs[1].device_pointer_value, 1000)[:] = 5  # real sim memory
    del ptrs
    gc.collect()
    assert live(pool) == 0
    pool.check()


def test_explicit_free_returns_at_once(mm, pool):
    p = mm.memalloc(4096)
    p.free()
    assert live(pool) == 0
    with pytest.raises(RuntimeError, match="dead memory"):
        p.free()
    assert live(pool) == 0


def test_get_memory_info_counts_device_free_plus_cached(mm, pool):
    info = mm.get_memory_info()
    assert info.total == 64 * MiB and info.free == 64 * MiB
    p = mm.memalloc(1000)
    info = mm.get_memory_info()
    # 2 MiB segment taken from the device, of which all but 1024 bytes are cached free in the pool
    assert info.free == 62 * MiB + (2 * MiB - 1024)
    del p
    assert mm.get_memory_info().free == 64 * MiB


def test_defer_cleanup_defers_frees_until_the_outermost_block_ends(mm, pool):
    with mm.defer_cleanup():
        p = mm.memalloc(1000)
        del p
        with mm.defer_cleanup():
            q = mm.memalloc(1000)
            q.free()
        assert live(pool) == 2  # both frees held back
    assert live(pool) == 0


def test_defer_cleanup_releases_even_when_the_block_raises(mm, pool):
    with pytest.raises(ZeroDivisionError):
        with mm.defer_cleanup():
            p = mm.memalloc(10)
            del p
            1 / 0
    assert live(pool) == 0


def test_reset_releases_cached_memory_and_pending_frees(mm, pool):
    keep = mm.memalloc(12 * MiB)
    with mm.defer_cleanup():
        p = mm.memalloc(1000)
        del p
        mm.reset()
        assert live(pool) == 1
    s = pool.stats()
    assert s["reserved_bytes.all.current"] == 12 * MiB  # the small segment went back; keep's stays
    assert keep.size == 12 * MiB


def test_memhostalloc_comes_from_the_pinned_pool(mm, pinned):
    h = mm.memhostalloc(4096)
    assert pinned.stats()["allocation.all.current"] == 1
    arr = np.ndarray(4096, np.uint8, buffer=h)
    arr[:] = 9
    assert (pinned.device.bytes_at(h.host_pointer.value, 4096) == 9).all()
    del arr, h
    gc.collect()
    assert pinned.stats()["allocation.all.current"] == 0


def test_without_an_explicit_pool_it_follows_using(pool):
    mm = CupoolMemoryManager(context=None)
    with cupool.using(pool):
        assert mm.pool is pool
        p = mm.memalloc(100)
    assert live(pool) == 1
    del p
    assert live(pool) == 0


def test_bad_pools_are_refused():
    with pytest.raises(TypeError, match="pool must be"):
        CupoolMemoryManager(context=None, pool="sim")
    with pytest.raises(TypeError, match="pinned_pool must be"):
        CupoolMemoryManager(context=None, pinned_pool=cupool.Pool("sim", capacity="4MiB"))


class _StandInMapped(driver.AutoFreePointer):
    """MappedMemory without the driver call its constructor makes (cuMemHostGetDevicePointer)."""

    __cuda_memory__ = True

    def __init__(self, context, pointer, size, owner=None, finalizer=None):
        self.host_pointer = pointer
        addr = pointer if isinstance(pointer, int) else pointer.value
        super().__init__(context, device_pointer(addr), size, finalizer=finalizer)

    def own(self):
        return driver.OwnedPointer(weakref.proxy(self))


def test_mapped_host_memory_leaves_numbas_books_when_it_dies(mm, pinned, monkeypatch):
    monkeypatch.setattr(cuda, "MappedMemory", _StandInMapped)  # the plugin reads numba.cuda per call
    h = mm.memhostalloc(4096, mapped=True)
    assert live(pinned) == 1 and len(mm.allocations) == 1
    del h
    gc.collect()
    assert live(pinned) == 0 and len(mm.allocations) == 0
    h2 = mm.memhostalloc(4096, mapped=True)  # the same address again: no collision
    assert live(pinned) == 1
    del h2


def test_get_memory_info_respects_the_pools_limit():
    pool = cupool.Pool("sim", capacity="64MiB", max_size="16MiB")
    mm = CupoolMemoryManager(context=None, pool=pool)
    info = mm.get_memory_info()
    assert info.free == 16 * MiB and info.total == 64 * MiB
    p = mm.memalloc(3 * MiB)  # a 20 MiB segment would pass the limit: the pool takes 4 MiB
    info = mm.get_memory_info()
    assert info.free == 16 * MiB - 3 * MiB
    with pytest.raises(cupool.OutOfMemoryError):
        mm.memalloc(info.free + 1)
    del p


def test_reset_creates_no_pool():
    hooks.reset_default_pools()
    CupoolMemoryManager(context=None).reset()
    assert hooks.existing_pool() is None


@pytest.fixture
def numba_logs(monkeypatch):
    """The logger Numba's pending deallocations write to; Numba makes it when the driver starts."""
    monkeypatch.setattr(driver, "_logger", logging.getLogger("numba.cuda.cudadrv.driver"), raising=False)


@pytest.fixture
def capped(numba_logs):
    """A pool that may hold 16 MiB, with 12 MiB of it in one allocation Numba is about to let go."""
    pool = cupool.Pool("sim", capacity="64MiB", max_size="16MiB")
    mm = CupoolMemoryManager(context=None, pool=pool)
    mm.initialize()  # sizes Numba's pending-deallocation batch, as Numba does for a new context
    keep = pool.malloc(12 * MiB)
    mm.deallocations.add_item(cupool.Allocation.free, keep, keep.size)
    return pool, mm, keep


def test_out_of_memory_flushes_numbas_pending_deallocations_and_retries_once(capped):
    pool, mm, keep = capped
    assert len(mm.deallocations) == 1 and not keep.freed
    p = mm.memalloc(8 * MiB)  # fits only once keep's 12 MiB is back
    assert keep.freed and len(mm.deallocations) == 0
    assert p.size == 8 * MiB and live(pool) == 1
    s = pool.stats()
    assert s["num_ooms"] == 1  # the first try; the retry succeeded
    assert s["reserved_bytes.all.current"] == 12 * MiB  # keep's segment, reused
    del p
    pool.check()


def test_no_retry_while_numbas_deallocations_are_held_back(capped):
    pool, mm, keep = capped
    with mm.defer_cleanup():  # Numba's flush is a no-op in here
        with pytest.raises(cupool.OutOfMemoryError):
            mm.memalloc(8 * MiB)
        assert len(mm.deallocations) == 1 and not keep.freed
    assert pool.stats()["num_ooms"] == 1  # one ladder run, not two
    assert live(pool) == 1
    pool.check()


def test_no_retry_when_nothing_is_pending(capped):
    pool, mm, keep = capped
    mm.deallocations.clear()
    assert keep.freed
    hold = pool.malloc(12 * MiB)
    with pytest.raises(cupool.OutOfMemoryError):
        mm.memalloc(8 * MiB)
    assert pool.stats()["num_ooms"] == 1
    assert live(pool) == 1 and not hold.freed
    pool.check()


def test_a_retry_that_fails_too_raises_the_pools_error_alone(numba_logs):
    pool = cupool.Pool("sim", capacity="64MiB", max_size="16MiB")
    mm = CupoolMemoryManager(context=None, pool=pool)
    mm.initialize()
    keep, small = pool.malloc(12 * MiB), pool.malloc(1000)
    mm.deallocations.add_item(cupool.Allocation.free, small, small.size)  # lets go of too little
    with pytest.raises(cupool.OutOfMemoryError) as info:
        mm.memalloc(8 * MiB)
    assert info.value.__context__ is None
    assert small.freed and not keep.freed and len(mm.deallocations) == 0
    assert pool.stats()["num_ooms"] == 2  # both tries ran the ladder
    pool.check()


def test_mapped_host_memory_retries_after_the_flush_too(mm, pinned, monkeypatch, numba_logs):
    monkeypatch.setattr(cuda, "MappedMemory", _StandInMapped)
    mm.initialize()
    keep = pinned.malloc(6 * MiB)
    mm.deallocations.add_item(cupool.Allocation.free, keep, keep.size)
    h = mm.memhostalloc(4 * MiB, mapped=True)  # the pinned pool has 8 MiB
    assert keep.freed and live(pinned) == 1
    del h
    gc.collect()
    assert live(pinned) == 0


def test_an_allocation_costs_cupool_two_objects_the_allocation_and_the_finalizer(mm, pool):
    """What Numba's finalizer holds is one object with slots, holding the Allocation and nothing else of
    this allocation (before: a closure, three cells, a holder list and a tuple around the Allocation)."""
    import gc

    from cupool.core.fast import Allocation

    p = mm.memalloc(1024)
    pointer, release, args, kwargs = p._finalizer.peek()
    assert pointer is p and (args, kwargs) == ((), {}) and not hasattr(release, "__dict__")
    allocation = release.allocation
    assert type(allocation) is Allocation and allocation.ptr == p.device_pointer_value
    assert [r for r in gc.get_referents(release) if r not in (mm, None, type(release))] == [allocation]
    del p, pointer, release, allocation
    assert pool.stats()["allocation.all.current"] == 0
