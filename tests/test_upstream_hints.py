"""The upstreams' driver settings (issue 27), proven on the sim device: managed memory's advice and prefetch
(prefetched while a segment fits in the device's free memory, never past it) and the stream-ordered pool's
release threshold (kept up to it at a synchronization, the rest given back, and no device synchronization).

The CUDA calls themselves run only on a GPU; here ``ManagedHints`` is shown to call CuPy's functions in the
form the installed CuPy declares (CUDA 12's device ordinal, or a CUDA 13 build's added ``flags``).
"""

from __future__ import annotations

import pytest

import cupool
from cupool.device.cuda import ManagedHints
from cupool.errors import DeviceOutOfMemory
from cupool.device.sim import SimDevice
from cupool.device.upstream import AsyncUpstream, DeviceUpstream, ManagedUpstream, make_upstream

MiB = 1 << 20


def test_managed_segments_are_prefetched_while_they_fit_and_only_mapped_past_that():
    """A 64 MiB device, three 40 MiB segments: the first fits in the free memory and is advised and
    prefetched; the others, handed out past it, are advised accessed-by only and never prefetched."""
    device = SimDevice("64MiB")
    up = make_upstream("managed", device)
    stream = 3
    ptrs = [up.allocate(40 * MiB, stream) for _ in range(3)]
    assert (device.prefetches, device.prefetched) == (1, 40 * MiB)
    assert device.advised == {"preferred_location": 40 * MiB, "accessed_by": 120 * MiB}
    assert up.stats() == {
        "managed.reserved_bytes": 120 * MiB, "managed.prefetched_bytes": 40 * MiB,
        "managed.unprefetched_bytes": 80 * MiB, "managed.oversubscribed_bytes": 56 * MiB,
        "num_prefetches": 1, "num_prefetches_skipped": 2,
    }
    up.deallocate(ptrs[1], 40 * MiB, stream)  # back below the capacity: the next one fits again
    up.deallocate(ptrs[2], 40 * MiB, stream)
    up.allocate(16 * MiB, stream)
    assert (device.prefetches, device.prefetched) == (2, 56 * MiB)
    assert up.stats()["managed.unprefetched_bytes"] == 0 and up.stats()["managed.oversubscribed_bytes"] == 0


def test_a_pool_on_managed_memory_prefetches_what_fits():
    pool = cupool.Pool("sim", capacity="64MiB", upstream="managed")
    blocks = [pool.malloc(40 * MiB) for _ in range(3)]
    assert pool.device.prefetched == 40 * MiB and pool.device.oversubscribed == 56 * MiB
    del blocks
    pool.empty_cache()
    pool.check()


def test_a_device_without_managed_hints_gets_none():
    class NoHints(SimDevice):
        managed_hints = False

    device = NoHints("64MiB")
    up = make_upstream("managed", device)
    up.allocate(8 * MiB, None)
    assert (device.prefetches, device.advised) == (0, {})
    assert up.stats()["num_prefetches"] == up.stats()["num_prefetches_skipped"] == 0


def test_a_refused_hint_gives_the_managed_memory_back():
    class Refusing(SimDevice):
        def prefetch(self, ptr: int, nbytes: int, stream: int) -> None:
            raise RuntimeError("prefetch refused")

    device = Refusing("64MiB")
    up = make_upstream("managed", device)
    with pytest.raises(RuntimeError, match="prefetch refused"):
        up.allocate(8 * MiB, 0)
    assert device.managed == 0 and up.stats()["managed.reserved_bytes"] == 0


def test_the_sim_device_refuses_hints_for_memory_that_is_not_managed():
    device = SimDevice("64MiB")
    ptr = device.malloc(4 * MiB)
    with pytest.raises(ValueError, match="is not managed memory"):
        device.prefetch(ptr, 4 * MiB, 0)
    managed = device.malloc_managed(4 * MiB)
    with pytest.raises(ValueError, match="advice must be one of preferred_location, accessed_by, got 'read_mostly'"):
        device.advise(managed, 4 * MiB, "read_mostly")


def test_the_stream_ordered_pool_keeps_up_to_its_threshold_at_a_synchronization():
    device = SimDevice("64MiB")
    up = AsyncUpstream(device, release_threshold=16 * MiB)
    assert device.release_threshold == 16 * MiB
    ptrs = [up.allocate(8 * MiB, 1) for _ in range(4)]
    for p in ptrs:
        up.deallocate(p, 8 * MiB, 1)
    assert device.used == 32 * MiB  # freed in stream order: held until a synchronization
    assert up.stats() == {"async.release_threshold": 16 * MiB, "async.driver_reserved_bytes": 32 * MiB,
                          "async.driver_idle_bytes": 32 * MiB}
    again = up.allocate(8 * MiB, 1)  # taken back from what the pool keeps, without a synchronization
    assert again in ptrs and device.used == 32 * MiB
    up.deallocate(again, 8 * MiB, 1)
    device.synchronize(1)
    assert device.used == 16 * MiB and device.syncs == 0  # the rest went back; the device never synchronized
    up.set_release_threshold(None)  # no pool threshold: the driver keeps nothing past a synchronization
    device.synchronize(1)
    assert device.used == 0 and up.stats()["async.driver_reserved_bytes"] == 0


def test_a_kept_range_is_reused_on_another_stream_only_after_its_streams_work():
    device = SimDevice("16MiB")
    up = AsyncUpstream(device, release_threshold=16 * MiB)
    p = up.allocate(8 * MiB, 1)
    device.enqueue(1)
    up.deallocate(p, 8 * MiB, 1)
    q = up.allocate(8 * MiB, 2)  # stream 1's kernel may still use p: a fresh range
    assert q != p
    up.deallocate(q, 8 * MiB, 2)
    with pytest.raises(DeviceOutOfMemory):
        up.allocate(12 * MiB, 2)  # p is kept for a stream still at work, q is idle: q goes, p cannot
    device.synchronize(1)
    assert device.syncs == 0
    assert up.allocate(8 * MiB, 2) in (p, q)


def test_growing_and_trimming_on_the_async_upstream_never_synchronize_the_device():
    """As ``upstream="device"`` (each cudaFree synchronizes), then async with the driver keeping nothing:
    the stream-ordered pool gives back at the stream synchronizations, and the device never synchronizes."""
    plain = cupool.Pool("sim", capacity="64MiB", expandable_segments=False, release_threshold=0)
    before = plain.device.syncs
    for _ in range(5):
        plain.malloc(8 * MiB).free()
    assert plain.device.syncs - before == 5
    pool = cupool.Pool("sim", capacity="64MiB", upstream="async", release_threshold=0)
    dev = pool.device
    for _ in range(5):
        pool.malloc(8 * MiB, stream=1).free()
        dev.synchronize(1)
        assert dev.used == 0
    assert dev.syncs == 0 and pool.stats()["num_device_free"] == 5


def test_the_release_threshold_must_be_bytes():
    with pytest.raises(ValueError, match="release_threshold: a number of bytes >= 0 or None, got -1"):
        AsyncUpstream(SimDevice("16MiB"), release_threshold=-1)
    with pytest.raises(ValueError, match="release threshold: a number of bytes >= 0, got 1.5"):
        SimDevice("16MiB").set_release_threshold(1.5)  # type: ignore[arg-type]


def test_the_plain_upstream_has_no_figures_and_ignores_the_threshold():
    up = DeviceUpstream(SimDevice("16MiB"))
    up.set_release_threshold(4 * MiB)
    assert up.stats() == {}
    assert isinstance(make_upstream("managed", SimDevice("16MiB")), ManagedUpstream)


class _Runtime:
    """CuPy's runtime functions as a build declares them (their docstring's first line), recording calls."""

    cudaMemAdviseSetPreferredLocation = 3
    cudaMemAdviseSetAccessedBy = 5

    def __init__(self, prefetch_signature: str, advise_signature: str) -> None:
        self.calls: list[tuple] = []

        def memPrefetchAsync(*args):  # noqa: N802 - CuPy's name
            self.calls.append(("prefetch", *args))

        def memAdvise(*args):  # noqa: N802 - CuPy's name
            self.calls.append(("advise", *args))

        memPrefetchAsync.__doc__ = prefetch_signature
        memAdvise.__doc__ = advise_signature
        self.memPrefetchAsync, self.memAdvise = memPrefetchAsync, memAdvise


def test_managed_hints_call_cupy_as_cuda_12_builds_declare():
    rt = _Runtime("memPrefetchAsync(intptr_t devPtr, size_t count, int dstDevice, intptr_t stream)",
                  "memAdvise(intptr_t devPtr, size_t count, int advice, int device)")
    hints = ManagedHints(rt)
    hints.prefetch(0x1000, 4096, 1, 77)
    hints.advise(0x1000, 4096, "preferred_location", 1)
    hints.advise(0x1000, 4096, "accessed_by", 1)
    assert hints.usable
    assert rt.calls == [("prefetch", 0x1000, 4096, 1, 77), ("advise", 0x1000, 4096, 3, 1),
                        ("advise", 0x1000, 4096, 5, 1)]


def test_managed_hints_pass_flags_where_a_build_asks_for_them_and_refuse_a_location_form():
    rt = _Runtime("memPrefetchAsync(intptr_t devPtr, size_t count, int dstDevice, unsigned int flags, "
                  "intptr_t stream)\n\nPrefetch.", "memAdvise(intptr_t devPtr, size_t count, int advice, int device)")
    ManagedHints(rt).prefetch(0x1000, 4096, 0, 9)
    assert rt.calls == [("prefetch", 0x1000, 4096, 0, 0, 9)]
    located = _Runtime("memPrefetchAsync(intptr_t devPtr, size_t count, MemLocation location, intptr_t stream)",
                       "memAdvise(intptr_t devPtr, size_t count, int advice, MemLocation location)")
    assert not ManagedHints(located).usable


def test_the_installed_cupy_declares_a_form_the_hints_know():
    runtime = pytest.importorskip("cupy.cuda.runtime", reason="CuPy is not installed")
    assert ManagedHints(runtime).usable


def test_the_sourcing_hands_the_pool_its_upstream_to_tell_the_release_threshold():
    from cupool.sourcing import sourcing

    device = SimDevice("64MiB")
    src = sourcing(device, None, None, "async")
    assert isinstance(src.upstream_object, AsyncUpstream) and device.release_threshold == 0
    src.upstream_object.set_release_threshold(8 * MiB)
    assert device.release_threshold == 8 * MiB and src.upstream_object.stats()["async.release_threshold"] == 8 * MiB
