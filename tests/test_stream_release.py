"""Memory given back to the device is never still in use by queued work (found by cupool.testing's machine).

``empty_cache()`` waited for the streams before giving segments back, but ``spill()``
with nothing to spill, the ladder's release step and frees above
``release_threshold`` did not; the sim device then handed the segment out again
while a stream still had work on it.  cudaFree waits for the device, so the sim
device now does too, and unmapping granules (which does not wait on a GPU) waits first.
"""

from __future__ import annotations

import cupool
from cupool.device.sim import SimDevice

MiB = 1 << 20


def _busy_free(pool, dev):
    a = pool.malloc(12 * MiB, stream=1)
    dev.enqueue(1)  # a kernel on stream 1 still uses a
    a.free()
    return dev.record_event(1)


def test_a_segment_released_by_spill_is_not_in_use_by_queued_work():
    dev = SimDevice("64MiB")
    pool = cupool.Pool(dev, defrag_threshold=None, spill="host")
    work = _busy_free(pool, dev)
    assert not dev.event_done(work)
    pool.spill()  # nothing to spill: it only releases free segments
    assert pool.stats()["reserved_bytes.all.current"] == 0
    assert dev.event_done(work)  # the device waited before it took the segment back


def test_a_segment_released_above_the_release_threshold_is_not_in_use():
    dev = SimDevice("64MiB")
    pool = cupool.Pool(dev, defrag_threshold=None, release_threshold=0)
    work = _busy_free(pool, dev)
    pool.malloc(1000).free()  # settles what it can and releases above the threshold
    if pool.stats()["reserved_bytes.all.current"] < 12 * MiB:
        assert dev.event_done(work)


def test_granules_are_unmapped_only_once_queued_work_is_done():
    dev = SimDevice("64MiB")
    pool = cupool.Pool(dev, defrag_threshold=None, expandable_segments=True, spill="host")
    work = _busy_free(pool, dev)
    pool.spill()
    assert pool.stats()["reserved_bytes.all.current"] < 12 * MiB
    assert dev.event_done(work)
