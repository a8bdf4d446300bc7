"""PinnedPool: the pool over pinned host memory (sim flavour here; the CUDA flavour needs a GPU)."""

import cupy
import cupyx
import numpy as np
import pytest

import cupool
from cupool.device import CudaPinnedDevice, SimPinnedDevice

from conftest import needs_gpu

MiB = 1 << 20


@pytest.fixture
def pinned():
    return cupool.PinnedPool("sim", capacity="16MiB")


def test_pinned_pool_serves_host_arrays_with_stats(pinned):
    assert pinned.device.name == "pinned:sim" and pinned.device.kind == "pinned"
    assert not pinned.device.capabilities.device_memory and pinned.device.capabilities.host_accessible
    x = pinned.empty((1000,), np.float64)
    assert isinstance(x, np.ndarray) and x.ctypes.data % 4096 == 0  # first block of a page-aligned segment
    x[:] = np.arange(1000)
    s = pinned.stats()
    assert s["allocation.all.current"] == 1 and s["requested_bytes.all.current"] == 8000
    assert s["reserved_bytes.all.current"] == 2 * MiB
    assert x[999] == 999
    del x
    assert pinned.stats()["allocation.all.current"] == 0
    assert pinned.empty_cache() == 2 * MiB


def test_pinned_pool_enforces_its_capacity(pinned):
    with pytest.raises(cupool.OutOfMemoryError):
        pinned.malloc(17 * MiB)


def test_cupy_pinned_allocator_draws_from_the_pool(pinned):
    cupy.cuda.set_pinned_memory_allocator(pinned.cupy_allocator())
    try:
        h = cupyx.empty_pinned((256,), np.float32)
        assert pinned.stats()["allocation.all.current"] == 1
        h[:] = 1.5
        assert (pinned.device.bytes_at(h.ctypes.data, 1024).view(np.float32) == 1.5).all()
        del h
        assert pinned.stats()["allocation.all.current"] == 0
    finally:
        cupy.cuda.set_pinned_memory_allocator()


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(device=cupool.SimDevice("4MiB")), ValueError, "pinned host-memory device"),
        (dict(device="tpu"), ValueError, "device must be"),
        (dict(device=SimPinnedDevice("4MiB"), capacity="1MiB"), ValueError, "capacity"),
        (dict(device=7), TypeError, "device must be"),
    ],
)
def test_bad_pinned_configuration(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cupool.PinnedPool(**kwargs)


def test_cupy_allocator_refuses_a_pinned_pool(pinned):
    with pytest.raises(ValueError, match="pinned host memory"):
        cupool.cupy_allocator(pinned)


@needs_gpu
def test_cuda_pinned_pool_is_page_locked_and_async_copies_work():
    p = cupool.PinnedPool("cuda")
    assert isinstance(p.device, CudaPinnedDevice)
    h = p.empty((1 << 20,), np.float32)
    h[:] = np.arange(1 << 20, dtype=np.float32)
    attrs = cupy.cuda.runtime.pointerGetAttributes(h.ctypes.data)
    assert attrs.type == cupy.cuda.runtime.memoryTypeHost
    s = cupy.cuda.Stream(non_blocking=True)
    d = cupy.empty_like(cupy.asarray(h[:1]), shape=h.shape)
    d.set(h, stream=s)
    s.synchronize()
    assert float(d[12345]) == 12345.0
