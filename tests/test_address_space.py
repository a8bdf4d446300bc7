"""Address space: one virtual memory per device, each pool's addresses its own and sized by its limit (issue 34).

On an H200 each ``Pool("cuda")`` made its own virtual memory, whose first reservation was an
arena of 2 x capacity x 64 (17.5 TiB), never freed: a handful of pools used up the GPU's 128 TiB
of addresses and the suite's GPU tests failed with ``cuMemAddressReserve failed``.  On the sim
device 284 default-size pools were the most one process could hold, and the 285th raised a raw
``OSError``.  Note [Address arena] in ``cupool.device.vmm`` says what replaced it.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

import cupool
from cupool.device import SimDevice
from cupool.device import cuda as cuda_module
from cupool.device.cuda import CudaDevice
from cupool.device.cuda_vmm import CudaVirtualMemory
from cupool.core.rules import REGION_LIMITS
from cupool.device.vmm import ARENA_SPANS, GRANULE, address_arena
from cupool.errors import AddressSpaceExhausted, DeviceOutOfMemory
from cupool.testing.cuda_double import CudaDouble

MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40


def vm_size() -> int:
    """The process's address space now (VmSize), in bytes: read, never written."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def space_of(pool: cupool.Pool):
    return pool._arena.segments.space


# ---------------------------------------------------------------- the sim device's targets
def test_a_thousand_limited_pools_of_one_sim_device_are_alive_at_once():
    device = SimDevice("4GiB")
    before = vm_size()
    pools = []
    for _ in range(1000):
        pool = cupool.Pool(device, max_size="64MiB", expandable_segments=True)
        pools.append((pool, pool.malloc(MiB)))
    vm = device.virtual_memory()
    assert vm.in_use == 1000 * GRANULE  # one granule each, all of them mapped at once
    # each pool reserved one arena of 4 x its limit, nothing sized by the device
    assert {space_of(p).address_bytes for p, _ in pools} == {ARENA_SPANS * 64 * MiB}
    assert vm.address_bytes == 1000 * ARENA_SPANS * 64 * MiB
    assert vm_size() - before <= 1000 * ARENA_SPANS * 64 * MiB + 256 * MiB
    for pool, a in pools[::97]:  # and every one of them still serves
        b = pool.malloc(3 * MiB)
        a.free()
        b.free()
        pool.check()


def test_a_thousand_pools_of_their_own_sim_devices_are_alive_at_once():
    """The case that stopped at 284: each ``Pool("sim")`` makes a 4 GiB device of its own."""
    pools = []
    for _ in range(1000):
        pool = cupool.Pool("sim", max_size="64MiB", expandable_segments=True)
        pools.append((pool, pool.malloc(MiB)))
    assert all(space_of(p).address_bytes == ARENA_SPANS * 64 * MiB for p, _ in pools)


def test_a_pool_without_a_limit_holds_a_few_times_the_device_in_addresses():
    """Four growing regions, two limits long each (``rules.REGION_LIMITS``: a region retires on the pool's
    history, issue 35), take two arenas of four limits: eight times the device, where it was four."""
    device = SimDevice("256MiB")
    pool = cupool.Pool(device, expandable_segments=True, stitch=True, defrag_threshold=None)
    live = [pool.malloc(n, stream=s) for s in (0, 1) for n in (1000, 300 * 1024)]  # both size classes, two streams
    live += [pool.malloc(30 * MiB) for _ in range(8)]  # 240 of the device's 256 MiB
    for a in live[5::2]:
        a.free()
    live.append(pool.malloc(60 * MiB))  # no room to grow: stitched from the holes
    pool.check()
    assert pool.stats()["num_stitches"] >= 1
    vm = device.virtual_memory()
    most = REGION_LIMITS * ARENA_SPANS * device.capacity
    assert 0 < space_of(pool).address_bytes <= most
    assert vm.address_bytes <= most


def test_three_thousand_pools_made_and_dropped_leave_the_address_space_where_it_was():
    device = SimDevice("4GiB")
    vm = device.virtual_memory()

    def churn(n: int) -> None:
        for i in range(n):
            pool = cupool.Pool(device, expandable_segments=True, max_size=None if i % 2 else "64MiB")
            pool.malloc(MiB + i)  # alive when the pool is dropped: the pool goes when it does

    churn(10)  # Python's own first allocations out of the way
    gc.collect()
    before = vm_size()
    churn(3000)
    gc.collect()
    assert vm.address_bytes == 0 and vm.in_use == 0 and not vm.ranges()
    assert abs(vm_size() - before) <= 64 * MiB


def test_a_closed_pool_gives_its_addresses_back_before_it_is_collected():
    device = SimDevice("1GiB")
    pool = cupool.Pool(device, expandable_segments=True)
    a = pool.malloc(5 * MiB)
    space = space_of(pool)
    assert space.address_bytes == address_arena(device.capacity)
    a.free()
    pool.close()
    assert space.address_bytes == 0 and device.virtual_memory().address_bytes == 0


def test_pools_on_one_device_reserve_alike_whatever_the_others_do():
    """Each pool's ranges come from its own arena, in its own order (Note [Address arena]): a pool whose
    neighbour made and freed ranges in between lays its ranges out as a pool alone does."""

    def layout(pool: cupool.Pool) -> list[int]:
        base = min(space_of(pool).arenas)
        return [r.base - base for r in pool._arena.segments.ranges.values()]

    def program(pool: cupool.Pool, other: cupool.Pool | None) -> list[int]:
        keep = [pool.malloc(3 * MiB, stream=0)]
        if other is not None:
            x = other.malloc(5 * MiB, stream=1)
            x.free()
            other.empty_cache()
        keep += [pool.malloc(3 * MiB, stream=1), pool.malloc(1000, stream=0)]
        return layout(pool)

    alone = program(cupool.Pool(SimDevice("256MiB"), expandable_segments=True), None)
    device = SimDevice("256MiB")
    beside = program(cupool.Pool(device, expandable_segments=True), cupool.Pool(device, expandable_segments=True))
    assert beside == alone and len(alone) == 3


# ---------------------------------------------------------------- running out is a cupool error
def test_running_out_of_address_space_is_an_out_of_memory_error_and_the_pools_made_keep_working():
    """A process without addresses left (here ``ulimit -v``) refuses the next pool's arena: that request
    fails with ``OutOfMemoryError`` naming the address space, never a raw ``OSError``, and the pools
    already made keep serving what they hold."""
    script = textwrap.dedent(
        """
        import resource
        import cupool
        from cupool.device import SimDevice

        def vm_size():
            for line in open("/proc/self/status"):
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024

        device = SimDevice("4GiB")
        device.virtual_memory()
        limit = vm_size() + (12 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        pools = []
        for i in range(100):
            pool = cupool.Pool(device, max_size="1GiB", expandable_segments=True)
            try:
                a = pool.malloc(1 << 20)
            except cupool.OutOfMemoryError as e:
                assert "address space" in str(e), str(e)
                pool.check()
                break
            pools.append((pool, a))
        else:
            raise AssertionError("100 arenas of 4 GiB fitted in 12 GiB")
        for pool, a in pools:
            a.free()
            b = pool.malloc(1 << 20)
            b.free()
            pool.check()
        try:
            cupool.Pool("sim", capacity="64GiB")  # its sim device alone needs 128 GiB of addresses
        except cupool.errors.AddressSpaceExhausted as e:
            assert "address space" in str(e) and isinstance(e, cupool.Error), str(e)
        else:
            raise AssertionError("a sim device found addresses the process does not have")
        print(len(pools))
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert 2 <= int(r.stdout.split()[-1]) < 100


def test_a_backend_without_addresses_is_address_space_exhausted():
    vm = CudaVirtualMemory(0, driver=CudaDouble("64MiB", address_space=8 * GRANULE).driver)
    r = vm.reserve(2 * GRANULE)  # the arena is refused, the range alone fits
    assert vm.arena_fallback is not None
    with pytest.raises(AddressSpaceExhausted, match="out of address space") as e:
        vm.reserve(8 * GRANULE)
    assert isinstance(e.value, DeviceOutOfMemory) and dict(vm.ranges()) == {r: 2 * GRANULE}
    vm.close()


# ---------------------------------------------------------------- one virtual memory per GPU
class GpuLike(SimDevice):
    """A sim device whose virtual memory is ``CudaDevice``'s, over a fake driver: what a pool on ``cuda:0``
    asks of the address space, without a GPU (its bytes are never touched here)."""

    virtual_memory = CudaDevice.virtual_memory
    _driver = None  # CudaDevice.virtual_memory reads it: None is the real driver's key, which the fixture fakes

    @property
    def name(self) -> str:
        return "cuda:0"


@pytest.fixture
def fake_gpu(monkeypatch):
    """The CUDA double's driver with an H200's 128 TiB of addresses: it refuses a reservation past them,
    as the driver did on the H200."""
    gpu = CudaDouble("4GiB", address_space=128 * TiB).driver
    monkeypatch.setattr(cuda_module, "CudaVirtualMemory", lambda index, driver=None: CudaVirtualMemory(index, driver=gpu))
    gc.collect()  # no virtual memory of cuda:0 left from elsewhere
    return gpu


def test_every_pool_on_a_gpu_shares_its_virtual_memory(fake_gpu):
    a, b = GpuLike("64MiB"), GpuLike("64MiB")
    assert a.virtual_memory() is b.virtual_memory()
    assert fake_gpu.retained == 1  # one retained context for the GPU


def test_pools_made_one_after_another_on_a_gpu_never_run_out_of_addresses(fake_gpu):
    """tests/test_kernels.py on the H200: one pool per example, limited to 64 or 256 MiB; after a few
    examples every reservation failed (``cuMemAddressReserve failed: CUDA_ERROR_OUT_OF_MEMORY``)."""
    for i in range(50):
        pool = cupool.Pool(GpuLike("1GiB"), max_size="256MiB" if i % 2 else "64MiB", expandable_segments=True)
        a = pool.malloc(64 * MiB if i % 2 else 512)
        assert sum(fake_gpu.reserved.values()) <= ARENA_SPANS * 256 * MiB * 2  # this pool's, and the last's
        a.free()
        del a, pool
    gc.collect()
    # every pool gone: the GPU's virtual memory went with them, and gave its addresses and context back
    assert fake_gpu.reserved == {} and fake_gpu.retained == 0


def test_a_pool_that_outgrows_its_arena_numbers_the_next_after_it_and_replays_to_itself():
    """Four streams growing both size classes hold eight regions: more than one arena of 4 x the limit.
    The next arenas follow the first in the space's lane (Note [Address arena]), so the ranges keep the
    order the replay engine gives them, and the recording replays to itself in both engines."""
    from cupool.replay import replay

    pool = cupool.Pool("sim", capacity="64MiB", expandable_segments=True, stitch=False)
    rec = pool.record()
    rec.start()
    live = [pool.malloc(n, stream=s) for s in range(4) for n in (1000, 3 * MiB)]
    live[0].free()
    live[3].free()
    live += [pool.malloc(5 * MiB, stream=2), pool.malloc(500, stream=3), pool.malloc(7 * MiB, stream=1)]
    rec.stop()
    space = space_of(pool)
    bases = sorted(space.arenas)
    assert len(bases) >= 2 and all(b - a == space.arena for a, b in zip(bases, bases[1:]))
    stats = pool.stats()
    want = (stats["reserved_bytes.all.peak"], stats["segment.all.peak"], stats["num_device_alloc"],
            stats["num_ooms"])
    for engine in ("numba", "pool"):
        r = replay(rec.trace(), engine=engine)
        assert (r.peak_reserved, r.peak_segments, r.device_allocs, r.ooms) == want, engine


def test_a_pool_whose_limit_is_raised_grows_past_the_limit_it_was_made_with():
    """Before: a region was one limit long, the limit the pool was made with, so after ``set_limit()``
    lifted a 64 MiB cap a 512 MiB request mapped past its new region's end: ``VirtualMemoryError``
    ("lies in no reserved range") out of ``malloc``, its chunks left created.  (A region was twice the
    device before issue 34, which any limit fits.)"""
    pool = cupool.Pool("sim", capacity="1GiB", max_size="64MiB", expandable_segments=True)
    small = pool.malloc(32 * MiB)  # a region of the first limit, grown
    pool.set_limit()  # CuPy's: no cap, the device's total
    big = pool.malloc(512 * MiB)  # past that region's end: a new one
    fresh = pool.malloc(300 * MiB, stream=1)  # a stream without a region yet
    pool.check()
    assert pool.stats()["reserved_bytes.all.current"] >= 844 * MiB
    for a in (small, big, fresh):
        a.free()
    pool.empty_cache()
    pool.check()
    assert pool.stats()["reserved_bytes.all.current"] == 0


def test_after_a_raised_limit_large_requests_grow_one_segment_in_arenas_of_the_new_size():
    """Before: regions and arenas stayed sized by the limit the pool was made with, so after
    ``set_limit()`` lifted a 64 MiB cap each 200 MiB request retired its region and reserved one of
    its own: three requests, three more segments, in three more 256 MiB arenas.  Now the segment
    source is told (``may_hold``): the next region is two raised limits long, so the three requests
    grow one segment, in an arena of 4 x the new limit that starts a lane of its own (numbered, so
    that arenas reserved after it still follow it)."""
    device = SimDevice("1GiB")
    pool = cupool.Pool(device, max_size="64MiB", expandable_segments=True)
    small = pool.malloc(32 * MiB)  # a region one 64 MiB limit long
    pool.set_limit()  # CuPy's: no cap, the device's total
    big = [pool.malloc(200 * MiB) for _ in range(3)]
    assert pool.stats()["segment.all.current"] == 2  # the first region's, and one grown for all three
    space = space_of(pool)
    assert space.arena == address_arena(GiB) and space.lane in space.arenas
    assert sorted(space.arenas.values()) == [address_arena(64 * MiB), address_arena(GiB)]
    pool.limit = "64MiB"  # a lower limit after a raise sizes nothing smaller
    assert space.arena == address_arena(GiB)
    pool.limit = "512MiB"
    pool.check()
    for a in (small, *big):
        a.free()
    pool.close()
    assert space.arenas == {} and space.lanes == {} and device.virtual_memory().address_bytes == 0
