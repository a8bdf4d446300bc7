"""One behaviour suite for every device, in the manner of RMM's ``mr_ref_test``.

A ``Device`` is what the pool stands on, so each backend must behave alike where
the pool relies on it: disjoint aligned segments, exact capacity accounting,
faithful copies, memmove semantics for move lists, events that complete, and
capabilities that say what the device really does.  The same tests then run the
public pool API over each device.  The CUDA flavours skip (with a reason) on a
machine without a usable GPU.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupool
from cupool.device import (
    PAGE,
    Capabilities,
    CudaDevice,
    CudaPinnedDevice,
    Device,
    SimDevice,
    SimPinnedDevice,
    cuda_available,
    pinned_device_beside,
)
from cupool.device.sim import SimWholeHandles
from cupool.device.vmm import VirtualMemoryUnsupported
from cupool.errors import DeviceOutOfMemory

MiB = 1 << 20

_no_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a usable CUDA GPU and CuPy (none here)")


@dataclass(frozen=True)
class _Kind:
    name: str
    make: Callable[[], Device]
    capabilities: Capabilities
    #: The alignment ``malloc`` guarantees: a 2 MiB page on the sim devices (they
    #: charge whole pages, as cudaMalloc maps them); 256 bytes is all CUDA documents.
    align: int
    #: Whether ``mem_info`` accounts for this device's segments alone.  Pinned CUDA
    #: memory reports the host's RAM, which every process on the machine moves.
    accounted: bool = True
    marks: tuple = ()


KINDS = [
    _Kind("sim", lambda: SimDevice("64MiB"), Capabilities(True, True, True, sys.platform.startswith("linux")), PAGE),
    _Kind("pinned-sim", lambda: SimPinnedDevice("64MiB"), Capabilities(True, True, False, False), PAGE),
    _Kind("sim-whole-handles", lambda: SimWholeHandles("64MiB"),
          Capabilities(True, True, True, sys.platform.startswith("linux"), whole_handles=True), PAGE),
    _Kind("cuda", lambda: CudaDevice(0), Capabilities(True, False, True, True, whole_handles=True), 256,
          marks=(_no_gpu,)),
    _Kind(
        "pinned-cuda",
        lambda: CudaPinnedDevice(0),
        Capabilities(True, True, False, False),
        256,
        accounted=False,
        marks=(_no_gpu,),
    ),
]


@pytest.fixture(params=[pytest.param(k, id=k.name, marks=k.marks) for k in KINDS])
def kind(request: pytest.FixtureRequest) -> _Kind:
    return request.param


@pytest.fixture
def device(kind: _Kind) -> Device:
    return kind.make()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def _needs_accounting(kind: _Kind) -> None:
    if not kind.accounted:
        pytest.skip(f"{kind.name}: mem_info reports the host's RAM, shared with every process on the machine")


def _to_numpy(device: Device, arr: Any) -> np.ndarray:
    return np.array(arr) if device.capabilities.host_accessible else arr.get()


def _write(device: Device, arr: Any, values: np.ndarray) -> None:
    if device.capabilities.host_accessible:
        arr[...] = values
    else:
        arr.set(values)


class _Owner:
    """Stands for the ``Allocation`` an array must keep alive."""


# ----------------------------------------------------------------------------- device level
def test_malloc_gives_aligned_disjoint_segments(kind, device):
    sizes = [1, 4096, PAGE, PAGE + 1, 3 * PAGE]
    ptrs = [device.malloc(n) for n in sizes]
    try:
        assert all(p % kind.align == 0 for p in ptrs)
        spans = sorted(zip(ptrs, sizes))
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
        # Disjoint in fact, not only in address arithmetic: no segment's bytes alias another's.
        for i, (p, n) in enumerate(zip(ptrs, sizes)):
            device.from_host(p, np.full(n, i + 1, np.uint8))
        for i, (p, n) in enumerate(zip(ptrs, sizes)):
            assert (device.to_host(p, n) == i + 1).all()
    finally:
        for p, n in zip(ptrs, sizes):
            device.free(p, n)


def test_free_gives_the_capacity_back(kind, device):
    _needs_accounting(kind)
    free0, total = device.mem_info()
    assert 0 < free0 <= total
    sizes = [PAGE, 4 * PAGE, PAGE + 1]
    ptrs = [device.malloc(n) for n in sizes]
    assert device.mem_info()[0] <= free0 - sum(sizes)
    for p, n in zip(ptrs, sizes):
        device.free(p, n)
    assert device.mem_info() == (free0, total)


def test_the_sim_devices_charge_whole_pages(device):
    if not isinstance(device, SimDevice):
        pytest.skip("only the sim devices promise page-exact accounting")
    free0 = device.mem_info()[0]
    p = device.malloc(1)
    assert device.mem_info()[0] == free0 - PAGE
    device.free(p, 1)


def test_malloc_past_capacity_raises_and_changes_nothing(kind, device):
    _needs_accounting(kind)
    held = device.malloc(PAGE)
    before = device.mem_info()
    free, total = before
    for n in (free + PAGE, total + PAGE):
        with pytest.raises(DeviceOutOfMemory):
            device.malloc(n)
        assert device.mem_info() == before
    p = device.malloc(PAGE)  # a refusal leaves the device serving
    device.free(p, PAGE)
    device.free(held, PAGE)


def test_bytes_written_read_back(device, rng):
    ptr = device.malloc(PAGE)
    data = rng.integers(0, 256, PAGE, dtype=np.uint8)
    device.from_host(ptr, data)
    np.testing.assert_array_equal(device.to_host(ptr, PAGE), data)
    # Another dtype at an odd offset: only its bytes change.
    f = np.arange(100, dtype=np.float32)
    device.from_host(ptr + 3, f)
    np.testing.assert_array_equal(device.to_host(ptr + 3, f.nbytes).view(np.float32), f)
    np.testing.assert_array_equal(device.to_host(ptr, 3), data[:3])
    np.testing.assert_array_equal(device.to_host(ptr + 3 + f.nbytes, 64), data[3 + f.nbytes : 67 + f.nbytes])
    device.free(ptr, PAGE)


def test_as_array_sees_and_writes_the_same_bytes(device, rng):
    ptr = device.malloc(PAGE)
    ref = rng.standard_normal(1000).astype(np.float32)
    device.from_host(ptr + 512, ref)
    arr = device.as_array(ptr + 512, (10, 100), np.dtype(np.float32), _Owner())
    assert arr.shape == (10, 100) and arr.dtype == np.float32
    np.testing.assert_array_equal(_to_numpy(device, arr), ref.reshape(10, 100))
    arr[3] = 0
    device.synchronize()
    expect = ref.reshape(10, 100).copy()
    expect[3] = 0
    np.testing.assert_array_equal(device.to_host(ptr + 512, ref.nbytes).view(np.float32).reshape(10, 100), expect)
    del arr
    device.free(ptr, PAGE)


def test_as_array_keeps_its_owner_alive(device):
    ptr = device.malloc(PAGE)
    owner = _Owner()
    alive = weakref.ref(owner)
    arr = device.as_array(ptr, (16,), np.dtype(np.float64), owner)
    del owner
    gc.collect()
    assert alive() is not None
    del arr
    gc.collect()
    assert alive() is None
    device.free(ptr, PAGE)


SPAN = 1024  # bytes a move list works over; small, so that moves overlap often

HAND_PICKED = {
    "slide up by a byte": [(0, 1, 1000)],
    "slide down by three bytes": [(3, 0, 1000)],
    "slide up by a word": [(0, 8, 1008)],
    "slide down by words, no overlap": [(512, 0, 512)],
    "in place": [(100, 100, 200)],
    "a later move reads what an earlier one wrote": [(0, 500, 100), (500, 10, 100), (10, 11, 300)],
    "word moves in a chain": [(8, 0, 256), (0, 16, 512), (16, 8, 1000)],
    "zero length": [(5, 9, 0)],
    "empty list": [],
}


def _check_moves(device: Device, ptr: int, moves: list[tuple[int, int, int]], init: np.ndarray) -> None:
    device.from_host(ptr, init)
    ref = init.copy()
    for s, d, n in moves:
        ref[d : d + n] = ref[s : s + n].copy()
    src, dst, nbytes = (np.array([m[i] for m in moves], dtype=np.int64) for i in range(3))
    device.execute_moves(src + ptr, dst + ptr, nbytes)
    np.testing.assert_array_equal(device.to_host(ptr, SPAN), ref)


@pytest.mark.parametrize("moves", HAND_PICKED.values(), ids=HAND_PICKED.keys())
def test_execute_moves_has_memmove_semantics(device, rng, moves):
    ptr = device.malloc(PAGE)
    _check_moves(device, ptr, moves, rng.integers(0, 256, SPAN, dtype=np.uint8))
    device.free(ptr, PAGE)


@st.composite
def _move_lists(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    unit = draw(st.sampled_from([1, 8]))  # 8: every move in words, the kernels' fast path
    slots = SPAN // unit
    moves = []
    for _ in range(draw(st.integers(0, 6))):
        n = draw(st.integers(0, slots))
        s, d = draw(st.integers(0, slots - n)), draw(st.integers(0, slots - n))
        moves.append((s * unit, d * unit, n * unit))
    return moves


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(moves=_move_lists(), seed=st.integers(0, 2**32 - 1))
def test_execute_moves_matches_a_reference_on_drawn_lists(device, moves, seed):
    ptr = device.malloc(PAGE)
    try:
        init = np.random.default_rng(seed).integers(0, 256, SPAN, dtype=np.uint8)
        _check_moves(device, ptr, moves, init)
    finally:
        device.free(ptr, PAGE)


def test_moves_cross_from_one_segment_to_another(device, rng):
    a, b = device.malloc(PAGE), device.malloc(PAGE)
    da = rng.integers(0, 256, 4096, dtype=np.uint8)
    device.from_host(a, da)
    device.from_host(b, np.zeros(4096, np.uint8))
    device.execute_moves(np.array([a + 8]), np.array([b + 16]), np.array([4000]))
    expect = np.zeros(4096, np.uint8)
    expect[16:4016] = da[8:4008]
    np.testing.assert_array_equal(device.to_host(b, 4096), expect)
    np.testing.assert_array_equal(device.to_host(a, 4096), da)
    device.free(a, PAGE)
    device.free(b, PAGE)


def test_an_event_completes_once_the_device_is_synchronized(device):
    key = device.stream_key(None)
    assert device.stream_key(None) == key and hash(key) == hash(device.stream_key(None))
    event = device.record_event(key)
    device.synchronize()
    assert device.event_done(event)


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def _work_in_flight(device: Device) -> tuple[Any, Any]:
    """(stream key, handle to keep alive) of a stream that is busy for a while."""
    if isinstance(device, SimDevice):
        device.enqueue(3)
        return 3, None
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.Device(device.index), stream:
        cupy.RawKernel(_SPIN, "spin")((1,), (1,), (np.int64(500_000_000),))  # a few hundred ms
    return device.stream_key(stream), stream


def test_work_in_flight_keeps_its_event_pending_until_synchronize(device):
    assert device.capabilities.streams
    key, keep = _work_in_flight(device)
    event = device.record_event(key)
    assert not device.event_done(event)
    device.synchronize()
    assert device.event_done(event)
    del keep


def test_capabilities_are_the_documented_ones(kind, device):
    assert device.capabilities == kind.capabilities
    assert type(device).capabilities is device.capabilities  # a property of the kind, not of one device
    with pytest.raises(dataclasses.FrozenInstanceError):
        device.capabilities.streams = False  # type: ignore[misc]


def test_grow_in_place_means_the_device_lends_virtual_memory(device):
    if not device.capabilities.grow_in_place:
        with pytest.raises(VirtualMemoryUnsupported, match="no virtual memory"):
            device.virtual_memory()
        return
    vm = device.virtual_memory()
    assert vm is device.virtual_memory()  # one per device
    free0 = device.mem_info()[0]
    chunk = vm.create(vm.granularity)
    assert device.mem_info()[0] == free0 - vm.granularity  # granules come out of the device's capacity
    vm.release(chunk)


def test_host_accessible_means_numpy_reads_the_memory_in_place(device):
    ptr = device.malloc(PAGE)
    arr = device.as_array(ptr, (256,), np.dtype(np.uint8), _Owner())
    if device.capabilities.host_accessible:
        host = np.asarray(arr)
        assert host.__array_interface__["data"][0] == ptr  # a view, not a copy
        host[:] = 7
        assert (device.to_host(ptr, 256) == 7).all()
    else:
        with pytest.raises(TypeError):
            np.asarray(arr)  # device memory must be copied out explicitly
        arr.fill(5)
        assert (arr.get() == 5).all()
    del arr
    device.free(ptr, PAGE)


def test_device_memory_decides_which_pool_may_hold_the_device(device):
    if device.capabilities.device_memory:
        with pytest.raises(ValueError, match="pinned host-memory device"):
            cupool.PinnedPool(device)
    else:
        assert cupool.PinnedPool(device).device is device
    if isinstance(device, CudaDevice):
        import cupy

        rt = cupy.cuda.runtime
        ptr = device.malloc(PAGE)
        expected = rt.memoryTypeDevice if device.capabilities.device_memory else rt.memoryTypeHost
        assert rt.pointerGetAttributes(ptr).type == expected
        device.free(ptr, PAGE)


def test_pinned_device_beside_is_pinned_host_memory(device):
    pinned = pinned_device_beside(device)
    assert not pinned.capabilities.device_memory and pinned.capabilities.host_accessible
    if isinstance(device, CudaDevice):
        assert isinstance(pinned, CudaPinnedDevice) and pinned.index == device.index
    else:
        assert isinstance(pinned, SimPinnedDevice) and pinned.total == device.total
    data = (np.arange(4096) % 251).astype(np.uint8)
    p = pinned.malloc(data.nbytes)
    pinned.from_host(p, data)
    np.testing.assert_array_equal(pinned.to_host(p, data.nbytes), data)
    pinned.free(p, data.nbytes)


# ----------------------------------------------------------------------------- pool level
def _pool(device: Device) -> cupool.Pool:
    return cupool.Pool(device) if device.capabilities.device_memory else cupool.PinnedPool(device)


_BOOKS = (
    "allocation.all.current",
    "allocated_bytes.all.current",
    "requested_bytes.all.current",
    "reserved_bytes.all.current",
    "segment.all.current",
)


def _books(pool: cupool.Pool) -> dict[str, Any]:
    s = pool.stats()
    return {k: s[k] for k in _BOOKS}


def test_pool_malloc_free_round_trip(device):
    pool = _pool(device)
    a = pool.malloc(1000)
    assert a.size == 1000 and a.nbytes >= 1000 and a.ptr % 256 == 0
    s = pool.stats()
    assert s["allocation.all.current"] == 1 and s["allocated_bytes.all.current"] == a.nbytes
    assert s["reserved_bytes.all.current"] >= a.nbytes
    pool.check()
    ptr, reserved, segments_made = a.ptr, s["reserved_bytes.all.current"], s["num_device_alloc"]
    a.free()
    assert a.freed
    s = pool.stats()
    assert s["allocation.all.current"] == 0 and s["allocated_bytes.all.current"] == 0
    assert s["reserved_bytes.all.current"] == reserved  # cached, not given back
    b = pool.malloc(1000)
    assert b.ptr == ptr and pool.stats()["num_device_alloc"] == segments_made  # reused from the cache
    pool.check()
    b.free()


def test_pool_empty_keeps_its_bytes_through_other_traffic(device, rng):
    pool = _pool(device)
    x = pool.empty((4096,), np.float64)
    ref = rng.standard_normal(4096)
    _write(device, x, ref)
    others = [pool.empty((n,), np.uint8) for n in (1, 1000, 3 * MiB, 600_000)]
    for o in others:
        _write(device, o, np.full(o.shape, 0xAB, np.uint8))
    del others[::2]
    more = [pool.empty((n,), np.uint8) for n in (512, 5 * MiB)]
    for o in more:
        _write(device, o, np.full(o.shape, 0xCD, np.uint8))
    device.synchronize()
    np.testing.assert_array_equal(_to_numpy(device, x), ref)
    assert all((_to_numpy(device, o) == 0xAB).all() for o in others)
    pool.check()


def test_pool_empty_cache_gives_memory_back_to_the_device(kind, device):
    pool = _pool(device)
    free0 = device.mem_info()[0]
    a, b = pool.malloc(3 * MiB), pool.malloc(100)
    s = pool.stats()
    reserved = s["reserved_bytes.all.current"]
    assert s["allocated_bytes.all.current"] == a.nbytes + b.nbytes and reserved >= 4 * MiB
    if kind.accounted:
        assert device.mem_info()[0] <= free0 - reserved
    a.free()
    b.free()
    assert pool.stats()["reserved_bytes.all.current"] == reserved
    assert pool.empty_cache() == reserved
    assert pool.stats()["reserved_bytes.all.current"] == 0 and pool.stats()["allocated_bytes.all.current"] == 0
    if kind.accounted:
        assert device.mem_info()[0] == free0
    pool.check()


def test_pool_out_of_memory_at_its_limit_changes_nothing(kind, device):
    pool = _pool(device)
    keep = pool.malloc(MiB)
    before, mem = _books(pool), device.mem_info()
    with pytest.raises(cupool.OutOfMemoryError):
        pool.malloc(pool.limit + PAGE)
    assert _books(pool) == before
    if kind.accounted:
        assert device.mem_info() == mem
    assert not keep.freed
    pool.check()


def test_pool_out_of_memory_when_the_device_refuses_changes_nothing(kind, device):
    _needs_accounting(kind)
    pool = _pool(device)
    keep = pool.malloc(1000)
    free = device.mem_info()[0]
    headroom = min(64 * MiB, free // 4 // PAGE * PAGE)
    hog = device.malloc(free - headroom)  # someone else takes the device, below the pool's limit
    try:
        before, mem = _books(pool), device.mem_info()
        with pytest.raises(cupool.OutOfMemoryError):
            pool.malloc(2 * headroom)
        assert _books(pool) == before
        assert device.mem_info() == mem
    finally:
        device.free(hog, free - headroom)
    assert not keep.freed
    pool.check()
