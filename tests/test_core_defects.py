"""Regression tests for defects of the pool core found before the redesign.

One test (or a small group) per defect; each asserts the correct behaviour and
failed, or hung, on the code before the redesign (commit 48e7ccd).  Only public
API is used: the names in ``cupool.__all__``, ``Pool``'s arguments, methods and
attributes, plus ``Pool.close()`` / ``with Pool(...)`` and
``Pool.subscribe(callback, kinds=...)``, which the redesign adds.

The BatchSizer deadlock test (c) is the last one in the file on purpose: on code
that has the defect, the thread it starts stays stuck inside a garbage
collection, and CPython runs no other collection while one is in progress, so any
test after it that relies on ``gc.collect()`` would fail for that reason instead
of its own.
"""

from __future__ import annotations

import gc
import logging
import re
import threading
import weakref

import numpy as np
import pytest

import cupool

MiB = 1 << 20


# ----------------------------------------------------------------- helpers
def _stat(pool: cupool.Pool, name: str) -> int:
    return pool.stats()[name]


def _allocated(pool: cupool.Pool) -> int:
    return _stat(pool, "allocated_bytes.all.current")


def _names_bytes(msg: str, n: int) -> bool:
    """Whether ``msg`` states ``n`` bytes in one of the usual spellings."""
    return any(s in msg for s in (str(n), f"{n:,}", f"{n:_}", cupool.format_bytes(n)))


def _error_logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    """Whether an ERROR (or worse) record on the "cupool" logger mentions ``text``.

    The text may be in the message or in the logged exception (``log.exception``).
    """
    fmt = logging.Formatter()
    for r in caplog.records:
        if r.name != "cupool" and not r.name.startswith("cupool."):
            continue
        if r.levelno < logging.ERROR:
            continue
        full = r.getMessage()
        if r.exc_info:
            full += "\n" + fmt.formatException(r.exc_info)
        if text in full:
            return True
    return False


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


# ------------------------------------------- a. closing and dropping a pool
def _in_use(d: cupool.SimDevice) -> int:
    """The device's bytes held: ``mem_info`` counts plain segments and mapped granules alike."""
    free, total = d.mem_info()
    return total - free


# Both segment sources: plain (device-malloc) segments, and the default, expandable ones.
SOURCES = pytest.mark.parametrize("expandable", [False, None], ids=["plain", "default"])


@SOURCES
def test_a_dropped_pool_gives_its_segments_back(expandable):
    d = cupool.SimDevice("64MiB")
    p = cupool.Pool(d, expandable_segments=expandable)
    p.malloc(1 << 20).free()
    assert _in_use(d) > 0
    del p
    gc.collect()
    assert _in_use(d) == 0, f"a dropped pool still holds {_in_use(d)} bytes of its device"


# Device bytes held before the close, and after it while live1 and live2 hold their memory. Plain:
# a 20 MiB medium segment (live1, live2), a 24 MiB one and a 2 MiB small one; the close gives back
# the two wholly free ones. Expandable: the large region maps 4 MiB for live1 (3 MiB), grows to
# 6 MiB for live2 (2 MiB, from the 1 MiB free tail and one granule), to 30 MiB for the 24 MiB
# block, plus a 2 MiB small region; the close unmaps the small region and the large region's free
# granules past live2's end (5 MiB), keeping 6 MiB.
@pytest.mark.parametrize("expandable,before,after", [(False, 46, 20), (None, 32, 6)], ids=["plain", "default"])
def test_a_close_with_live_allocations_drains(expandable, before, after):
    d = cupool.SimDevice("64MiB")
    p = cupool.Pool(d, expandable_segments=expandable)
    live1 = p.malloc(3 * MiB)
    live2 = p.malloc(2 * MiB)  # the same segment
    p.malloc(24 * MiB).free()  # plain: a wholly free segment of its own
    p.malloc(1000).free()  # a wholly free small segment
    assert _in_use(d) == before * MiB

    with pytest.warns(ResourceWarning) as record:
        p.close()
    msgs = [str(w.message) for w in record if issubclass(w.category, ResourceWarning)]
    assert any(
        re.search(r"\b2\b", m) and _names_bytes(m, 5 * MiB) for m in msgs
    ), f"the ResourceWarning should name 2 live allocations and {5 * MiB} bytes: {msgs}"

    # The wholly free segments (and free tails) went back at once; the memory holding live blocks stays.
    assert _in_use(d) == after * MiB

    with pytest.raises(ValueError, match="(?i)closed"):
        p.malloc(100)

    live1.free()
    assert _in_use(d) == after * MiB  # live2 still holds the segment
    live2.free()
    assert _in_use(d) == 0, "the last free of a closed pool's segment should give it back"


@SOURCES
def test_a_with_block_closes_the_pool(expandable):
    d = cupool.SimDevice("64MiB")
    with cupool.Pool(d, expandable_segments=expandable) as p:
        p.malloc(1 << 20).free()
        assert _in_use(d) > 0
    assert _in_use(d) == 0
    with pytest.raises(ValueError, match="(?i)closed"):
        p.malloc(100)


# --------------------------------- b. the scheduler kept dropped buffers alive
def _spill_then_drop(p: cupool.Pool) -> None:
    ms = [p.movable(8 << 20) for _ in range(6)]  # 48 of 64 MiB
    p.malloc(30 << 20).free()  # spills two of them
    assert sum(not m.on_device for m in ms) >= 1, "precondition: the malloc spilled"
    del ms
    gc.collect()


def test_b_scheduler_does_not_keep_dropped_movables_alive():
    p = cupool.Pool("sim", capacity="64MiB", spill="host")
    dev = p.device
    _spill_then_drop(p)
    assert _allocated(p) == 0, "dropped movable buffers are still allocated"
    p.check()

    ref = weakref.ref(p)
    del p  # no gc.collect(): a reference cycle would keep the pool alive
    assert ref() is None, "a dropped pool should die at once, not wait for the cycle collector"
    gc.collect()
    assert dev.used == 0


def test_b_spill_tier_dies_with_its_pool():
    pinned = cupool.PinnedPool("sim", capacity="64MiB")
    pinned_dev = pinned.device
    tier = cupool.HostTier(pinned)
    tier_ref, pinned_ref = weakref.ref(tier), weakref.ref(pinned)
    p = cupool.Pool("sim", capacity="64MiB", spill=tier)
    del tier, pinned
    _spill_then_drop(p)
    assert _allocated(p) == 0

    ref = weakref.ref(p)
    del p  # no gc.collect()
    assert ref() is None
    assert tier_ref() is None, "the spill tier outlived its pool"
    assert pinned_ref() is None, "the spill tier's pinned pool outlived it"
    gc.collect()
    assert pinned_dev.used == 0, "the spill tier's pinned memory was not given back"


# ------------------------------------------------ d. a subscriber that raises
def test_d_raising_subscriber_is_detached_and_logged(caplog):
    caplog.set_level(logging.ERROR, logger="cupool")
    pool = cupool.Pool("sim", capacity="64MiB")
    calls = []

    def bad(ev):
        calls.append(ev)
        1 / 0

    a = pool.malloc(100)
    pool.subscribe(bad)
    a.free()  # must not raise
    assert a.freed
    assert len(calls) == 1
    pool.check()
    assert _allocated(pool) == 0
    pool.empty_cache()
    assert _stat(pool, "reserved_bytes.all.current") == 0, "the freed block leaked in the heap"

    pool.malloc(100).free()  # more events: the detached subscriber is not called
    assert len(calls) == 1, "a subscriber that raised was called again"
    pool.check()
    assert _error_logged(caplog, "ZeroDivisionError")


# --------------------------------------------------- e. an on_move that raises
def _boom(calls):
    def on_move(m, old, new):
        calls.append((old, new))
        raise RuntimeError("on_move failed")

    return on_move


def test_e_raising_on_move_during_another_buffers_array(caplog):
    caplog.set_level(logging.ERROR, logger="cupool")
    # One 16 MiB segment the pool may not grow past, so that y's restore below
    # can only fit after compaction has moved x, whatever the compaction policy.
    p = cupool.Pool("sim", capacity="64MiB", initial_size="16MiB", max_size="16MiB", spill="host")
    calls = []
    y = p.movable(6 * MiB)  # [0, 6)
    x = p.movable(2 * MiB, on_move=_boom(calls))  # [6, 8)
    f = p.movable(2 * MiB)  # [8, 10)
    w = p.movable(4 * MiB)  # [10, 14), and [14, 16) free
    y.array()[:] = 7
    f.free()
    pins = [x.array(), w.array()]
    assert p.spill() == 6 * MiB  # only y may go
    z = p.malloc(3 * MiB)  # lands in y's old place: [0, 3)
    del pins
    assert not y.on_device and not x.leased and not w.leased
    assert calls == []

    # Free: [3, 6), [8, 10), [14, 16).  y needs 6 MiB: x and w must slide first.
    arr = y.array()
    assert calls, "precondition: y's restore moved x"
    assert y.on_device and y.leased
    assert (arr == 7).all()
    del arr
    assert not y.leased, "y stays leased with no array alive"

    before = _allocated(p)
    y.free()
    assert _allocated(p) == before - 6 * MiB, "y's bytes were not returned"
    z.free()
    x.free()
    w.free()
    p.check()
    assert _allocated(p) == 0
    assert _error_logged(caplog, "on_move failed")


def test_e_raising_on_move_during_malloc(caplog):
    caplog.set_level(logging.ERROR, logger="cupool")
    p = cupool.Pool("sim", capacity="64MiB", initial_size="16MiB", max_size="16MiB")
    calls = []
    f = p.movable(4 * MiB)  # [0, 4)
    x = p.movable(4 * MiB, on_move=_boom(calls))  # [4, 8), and [8, 16) free
    f.free()
    a = p.malloc(10 * MiB)  # fits only once x has slid to 0
    assert calls, "precondition: the malloc moved x"
    assert isinstance(a, cupool.Allocation) and not a.freed
    assert _allocated(p) == 14 * MiB
    a.free()
    x.free()
    p.check()
    assert _allocated(p) == 0
    assert _error_logged(caplog, "on_move failed")


# -------------------------------------- f. requests that can never succeed
_LADDER_KINDS = {"spill", "segment_alloc", "segment_free", "move_out", "move_in", "free_movable", "compact"}


def test_f_impossible_request_fails_at_once_without_side_effects():
    p = cupool.Pool("sim", capacity="64MiB", spill="host")
    ms = [p.movable(4 << 20) for _ in range(8)]
    kinds = []
    p.subscribe(lambda ev: kinds.append(ev[1]))
    s0 = p.stats()

    with pytest.raises(cupool.OutOfMemoryError) as info:
        p.malloc(p.limit + 1)
    assert info.value.requested >= p.limit + 1

    with pytest.raises((cupool.OutOfMemoryError, ValueError, OverflowError)) as info:
        p.malloc(2**63)
    err = info.value
    if isinstance(err, cupool.OutOfMemoryError):
        assert err.requested >= 2**63
    else:
        assert _names_bytes(str(err), 2**63), f"the error should name the size: {err}"

    assert all(m.on_device for m in ms), "an impossible request spilled movable buffers"
    s1 = p.stats()
    for k in ("reserved_bytes.all.current", "num_device_alloc", "num_device_free", "allocated_bytes.all.current"):
        assert s1[k] == s0[k], k
    assert not _LADDER_KINDS.intersection(kinds), f"the reclaim ladder ran: {sorted(set(kinds))}"
    assert not [k for k in kinds if k.startswith("reclaim:")], f"the reclaim ladder ran: {sorted(set(kinds))}"
    p.check()


def test_f_oom_without_a_spill_tier_does_not_suggest_spilling():
    p = cupool.Pool("sim", capacity="64MiB")
    ms = [p.movable(4 << 20) for _ in range(8)]
    for n in (40 << 20, p.limit + 1):
        with pytest.raises(cupool.OutOfMemoryError) as info:
            p.malloc(n)
        assert "spill" not in str(info.value).lower(), str(info.value)
    assert all(m.on_device for m in ms)


# ----------------------------------- g. rehome events with stream None
def test_g_rehome_events_carry_a_stream(tmp_path):
    p = cupool.Pool("sim", capacity="64MiB")
    seen = []
    p.subscribe(seen.append)
    p.movable(7 << 20).free()
    keep = [p.movable(2 << 20) for _ in range(3)]
    path = tmp_path / "t.h5"
    with p.record(path) as rec:
        try:
            p.malloc(57 << 20).free()
        except cupool.OutOfMemoryError:
            pass
    events = rec.events()
    assert events
    bad = [(e[1], e[4]) for e in events if not _is_int(e[4])]
    assert not bad, f"recorded events without an int stream: {bad}"
    bad = [(e[1], e[4]) for e in seen if not _is_int(e[4])]
    assert not bad, f"subscriber events without an int stream: {bad}"
    trace = cupool.load_trace(path)
    assert len(trace) == rec.n_events
    assert np.issubdtype(trace.stream.dtype, np.integer)
    assert all(m.on_device for m in keep)
    p.check()


# ------------------------------ h. subscribers that do not need every event
def test_h_filtered_subscribers_get_no_block_events():
    pool = cupool.Pool("sim", capacity="64MiB")
    pool.malloc(1000).free()  # the one small segment, before anyone watches
    assert _stat(pool, "segment.all.current") == 1

    segment_events = []
    # The default pool maps granules: its segment events are segment_map / segment_unmap.
    pool.subscribe(segment_events.append, kinds={"segment_map", "segment_unmap"})
    with cupool.Monitor(pool, min_reserved="4MiB") as mon:
        sizer = cupool.BatchSizer(pool, 8, 1, 64)
        for _ in range(2000):
            pool.malloc(1000).free()
        assert segment_events == []
        assert _stat(pool, "segment.all.current") == 1

        every = []
        unsubscribe = pool.subscribe(every.append)
        for _ in range(2000):
            pool.malloc(1000).free()
        unsubscribe()
        assert len(every) == 4000, len(every)
        assert {e[1] for e in every} == {"alloc", "free"}
        assert segment_events == []
        assert _stat(pool, "segment.all.current") == 1
        mon.flush()
        assert list(mon.alerts) == []

        # The sizer still sees the peak of a step it was not sent block events for.
        pool.malloc(56 << 20).free()
        assert sizer.update() == 6
    assert [(e[1], e[3]) for e in segment_events] == [("segment_map", 56 << 20)]  # a large region's granules
    pool.check()


# ------------------------------------------------ c. BatchSizer deadlock (last)
def test_c_batch_sizer_collected_mid_malloc_does_not_deadlock():
    pool = cupool.Pool("sim", capacity="64MiB")
    errors: list[BaseException] = []
    done = threading.Event()

    def body() -> None:
        try:
            keep = []
            for _ in range(200):
                s = cupool.BatchSizer(pool, 8, 1, 64)
                s.cycle = s  # only the cycle collector frees it, at any allocation
                del s
                for _ in range(20):
                    keep.append(pool.malloc(512))
            for a in keep:
                a.free()
            done.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    old = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    try:
        t = threading.Thread(target=body, name="batch-sizer-deadlock", daemon=True)
        t.start()
        t.join(20)
    finally:
        gc.set_threshold(*old)
    assert not t.is_alive(), "malloc deadlocked while a BatchSizer was being collected"
    assert not errors, errors
    assert done.is_set()
    gc.collect()
    pool.check()
    assert _allocated(pool) == 0
