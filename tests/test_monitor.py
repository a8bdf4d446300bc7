"""Threshold alerts: crossings, re-arming, callbacks, logging and severity bands."""

import gc
import logging
import threading
import weakref

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cupool
from cupool.observe.monitor import Alert, Monitor, severity

MiB = 1 << 20


@pytest.fixture
def pool():
    # Requests above 10 MiB get a segment of their own size: reserved bytes are exact.
    return cupool.Pool("sim", capacity="100MiB")


def collect_alerts(mon):
    got = []
    mon.add_callback(got.append)
    return got


def test_usage_alerts_fire_on_crossing_only_and_rearm(pool):
    with Monitor(pool) as mon:
        got = collect_alerts(mon)
        a = pool.malloc(70 * MiB)  # usage 0.70
        b = pool.malloc(12 * MiB)  # 0.82: warning
        mon.flush()
        assert [(x.metric, x.level) for x in got] == [("usage", "warning")]
        assert got[0].value == pytest.approx(0.82) and got[0].threshold == 0.8
        # churn inside the cached segment: still above, no new alert
        b.free()
        b = pool.malloc(12 * MiB)
        c = pool.malloc(12 * MiB)  # 0.94: critical
        mon.flush()
        assert [x.level for x in got] == ["warning", "critical"]
        assert mon.usage_level == "critical"
        c.free()
        b.free()
        pool.empty_cache()  # 0.70: back below 0.8 - 0.05
        mon.flush()
        assert [x.level for x in got] == ["warning", "critical", "ok"]
        b = pool.malloc(12 * MiB)  # re-armed: fires again
        mon.flush()
        assert [x.level for x in got] == ["warning", "critical", "ok", "warning"]
        del a, b


def test_hysteresis_keeps_a_hovering_pool_quiet(pool):
    with Monitor(pool, hysteresis=0.05) as mon:
        got = collect_alerts(mon)
        a = pool.malloc(76 * MiB)
        for _ in range(3):
            b = pool.malloc(12 * MiB)  # 0.88
            b.free()
            pool.empty_cache()  # 0.76
        mon.flush()
        # 0.76 is within the hysteresis of 0.8, so the gauge never re-armed
        assert [x.level for x in got] == ["warning"]
        assert mon.usage_level == "warning"
        del a


def test_fragmentation_alert_reports_severity_and_rearms():
    pool = cupool.Pool("sim", capacity="40MiB")  # 24 MiB reserved is usage 0.6: under pressure
    with Monitor(pool, usage_warning=1.0, usage_critical=1.0) as mon:
        got = collect_alerts(mon)
        a = pool.malloc(12 * MiB)
        b = pool.malloc(12 * MiB)
        mon.flush()
        assert got == []  # two full segments: no fragmentation
        a.free()  # (24 - 12) / 24 = 0.5
        mon.flush()
        assert [(x.metric, x.level, x.severity) for x in got] == [("fragmentation", "warning", "severe")]
        assert got[0].value == pytest.approx(0.5) and got[0].fragmentation == pytest.approx(0.5)
        assert "severe, at usage 0.60" in got[0].message
        a = pool.malloc(12 * MiB)  # reuses the cached segment: 0
        a.free()  # 0.5 again: re-armed, fires again
        mon.flush()
        assert [x.level for x in got] == ["warning", "ok", "warning"]
        del b


@pytest.mark.parametrize("expandable, ratio", [(False, 0.8), (None, 0.0)])
def test_a_fresh_segments_free_tail_raises_no_alert(expandable, ratio):
    """Issue 20 #5: one 4 MiB block in a fresh 20 MiB segment is 0.8 "severe" by the ratio alone.

    That segment is a plain one (device malloc); an expandable segment (the default) maps just
    the block's two granules, so it has no free tail at all."""
    pool = cupool.Pool("sim", capacity="100MiB", expandable_segments=expandable)
    with Monitor(pool) as mon:
        got = collect_alerts(mon)
        a = pool.malloc(4 * MiB)
        mon.flush()
        assert pool.stats()["fragmentation"] == pytest.approx(ratio)  # still the stat
        assert got == [], [x.message for x in got]
        assert mon.fragmentation_level == "ok"
        del a


def test_the_same_ratio_warns_once_the_pool_is_under_pressure(pool):
    """Free bytes matter when the pool nears its limit: the ratio warns from min_usage on."""
    with Monitor(pool, usage_warning=1.0, usage_critical=1.0, min_usage=0.5) as mon:
        got = collect_alerts(mon)
        held = [pool.malloc(12 * MiB) for _ in range(4)]  # 48 MiB reserved: usage 0.48
        held[0].free()
        held[2].free()  # fragmentation 0.5, but usage 0.48
        mon.flush()
        assert got == []
        held[0] = pool.malloc(12 * MiB)
        held[2] = pool.malloc(12 * MiB)  # the cached segments serve them: 0
        held.append(pool.malloc(12 * MiB))  # 60 MiB reserved: usage 0.60
        held[0].free()
        held[2].free()  # 0.4 at usage 0.6
        mon.flush()
        assert [(x.metric, x.level) for x in got] == [("fragmentation", "warning")]
        assert got[0].value == pytest.approx(0.4) and got[0].reserved == 60 * MiB
        del held


def fragmented_pool():
    """60 MiB, full: three 20 MiB segments of 4 MiB blocks, every other block freed (32 MiB free in 4 MiB holes).

    Plain segments: stitching (on by default with expandable segments) would serve 8 MiB from two holes."""
    pool = cupool.Pool("sim", capacity="60MiB", defrag_threshold=None, expandable_segments=False)
    blocks = [pool.malloc(4 * MiB) for _ in range(15)]
    for b in blocks[::2]:
        b.free()
    assert pool.stats()["reserved_bytes.all.current"] == 60 * MiB
    return pool, blocks[1::2]


def test_a_request_refused_for_fragmentation_is_a_critical_alert():
    pool, held = fragmented_pool()
    with Monitor(pool) as mon:
        got = collect_alerts(mon)
        with pytest.raises(cupool.OutOfMemoryError):
            pool.malloc(8 * MiB)  # 32 MiB free, but in 4 MiB holes
        mon.flush()
    refused = [x for x in got if x.request]
    assert [(x.metric, x.level, x.request, x.largest_free) for x in refused] == [
        ("fragmentation", "critical", 8 * MiB, 4 * MiB)
    ]
    assert refused[0].value == pytest.approx(32 / 60)
    assert "fragmentation refused a request of 8 MiB: 32 MiB free" in refused[0].message
    assert "largest free block is 4 MiB" in refused[0].message
    del held


def test_with_stitching_the_same_holes_serve_the_request_and_no_fragmentation_alert_fires():
    pool = cupool.Pool("sim", capacity="60MiB", defrag_threshold=None)  # the default: expandable, stitching
    held = [pool.malloc(4 * MiB) for _ in range(15)]
    for b in held[::2]:
        b.free()
    with Monitor(pool) as mon:
        got = collect_alerts(mon)
        big = pool.malloc(8 * MiB)  # two 4 MiB holes' granules, mapped side by side
        mon.flush()
    assert pool.stats()["num_stitches"] == 1
    assert [x for x in got if x.request] == []
    pool.check()
    del held, big


@pytest.mark.parametrize("request_mib", [40, 200])
def test_a_request_the_free_bytes_could_not_serve_is_no_fragmentation_alert(request_mib):
    pool, held = fragmented_pool()  # 28 MiB live of a 60 MiB limit: 32 MiB could be had
    with Monitor(pool) as mon:
        got = collect_alerts(mon)
        with pytest.raises(cupool.OutOfMemoryError):
            pool.malloc(request_mib * MiB)  # more than the live data leaves, or than the limit
        mon.flush()
    assert [x for x in got if x.request] == []
    del held


def test_an_injected_refusal_that_a_free_block_could_serve_is_no_fragmentation_alert():
    from cupool.testing.faults import fail_nth_allocation

    pool, held = fragmented_pool()
    with Monitor(pool) as mon, fail_nth_allocation(pool, 1):
        got = collect_alerts(mon)
        with pytest.raises(cupool.OutOfMemoryError):
            pool.malloc(4 * MiB)  # a 4 MiB hole was there: the refusal was not fragmentation's
        mon.flush()
    assert [x for x in got if x.request] == []
    del held


def test_min_reserved_keeps_small_pools_quiet(pool):
    with Monitor(pool, min_reserved="64MiB") as mon:
        got = collect_alerts(mon)
        a = pool.malloc(1000)  # one 2 MiB segment, almost all of it "fragmentation"
        mon.flush()
        assert got == []
        del a


def test_alerts_are_logged_to_the_cupool_logger(pool, caplog):
    with caplog.at_level(logging.INFO, logger="cupool"), Monitor(pool) as mon:
        a = pool.malloc(92 * MiB)
        mon.flush()
    recs = [r for r in caplog.records if r.name == "cupool"]
    assert [r.levelno for r in recs] == [logging.CRITICAL]
    assert "critical: usage 0.920 passed 0.90" in recs[0].getMessage()
    del a


def test_callbacks_run_outside_the_pool_lock_and_survive_a_broken_one(pool, caplog):
    seen = []

    def calls_back(alert):
        seen.append((alert.level, pool.stats()["reserved_bytes.all.current"]))  # would deadlock under the lock

    def broken(alert):
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="cupool"), Monitor(pool, callbacks=[broken, calls_back]) as mon:
        a = pool.malloc(85 * MiB)
        mon.flush(timeout=5)
    assert seen == [("warning", 86 * MiB)]
    assert any("callback" in r.getMessage() and r.exc_info for r in caplog.records)
    del a


def test_a_pool_already_above_a_threshold_alerts_at_once(pool):
    a = pool.malloc(95 * MiB)
    got = []
    with Monitor(pool, callbacks=got.append) as mon:
        mon.flush()
    assert [(x.metric, x.level) for x in got] == [("usage", "critical")]
    del a


def test_frees_still_in_the_fast_paths_log_are_seen(pool):
    small = [pool.malloc(MiB) for _ in range(40)]  # 20 small segments, full
    del small  # nobody subscribed: the fast path parks the blocks and only logs the frees
    got = []
    with Monitor(pool, callbacks=got.append, min_usage=0) as mon:  # any fragmentation warns
        mon.flush()
        # Read from the tables without the log, the pool would look full (allocated 40 MiB).
        assert [(x.metric, x.level, x.allocated) for x in got] == [("fragmentation", "warning", 0)]
        # The monitor leaves the fast path on: small blocks reach it through the books
        # at its next event, here a large allocation (20 MiB more reserved, 12 allocated).
        small = [pool.malloc(MiB) for _ in range(40)]
        mon.flush()
        assert len(got) == 1  # no event of its own for a small block
        big = pool.malloc(12 * MiB)
        mon.flush()
    assert [(x.metric, x.level, x.allocated) for x in got[1:]] == [("fragmentation", "ok", 52 * MiB)]
    del small, big


def test_a_small_allocation_that_grows_the_pool_is_evaluated(pool):
    big = pool.malloc(78 * MiB)  # usage 0.78
    with Monitor(pool) as mon:
        got = collect_alerts(mon)
        small = pool.malloc(MiB)  # a new 2 MiB small segment: usage 0.80
        mon.flush()
        assert [(x.metric, x.level) for x in got] == [("usage", "warning")]
    del big, small


def test_rehoming_raises_no_alert_for_its_passing_double_reservation():
    """The rehome step holds a segment and its exact-size copy at once, only while moving."""
    # Plain segments: expandable ones (the default) compact by remapping granules in place, with no re-home.
    p = cupool.Pool("sim", capacity="40MiB", defrag_threshold=None, expandable_segments=False)
    raw = p.malloc(4 * MiB)  # a 20 MiB medium segment...
    ms = [p.movable(2 * MiB) for _ in range(7)] + [p.movable(3 * MiB // 2)]  # ...15.5 MiB of movables join it
    del raw  # usage 0.5, fragmentation 0.225: both quiet
    events = []
    p.subscribe(events.append)
    with Monitor(p) as mon:
        got = collect_alerts(mon)
        with pytest.raises(cupool.OutOfMemoryError):
            p.malloc(30 * MiB)  # the ladder re-homes into 16 MiB (36 of 40 reserved, mid-move), then fails
        mon.flush()
        assert mon.usage_level == "ok" and mon.fragmentation_level == "ok"
    kinds = [e[1] for e in events]
    assert "move_out" in kinds and "segment_alloc" in kinds  # the re-home did happen
    assert got == [], [x.message for x in got]
    assert p.stats()["reserved_bytes.all.current"] == 16 * MiB
    del ms


def test_close_unsubscribes(pool):
    mon = Monitor(pool)
    got = collect_alerts(mon)
    mon.close()
    a = pool.malloc(95 * MiB)  # would be critical, were the monitor still listening
    assert got == [] and list(mon.alerts) == [] and mon.usage_level == "ok"
    mon.close()  # idempotent
    # Nothing in the pool holds on to it: its subscription is gone, not merely ignored.
    ref = weakref.ref(mon)
    del mon, got
    gc.collect()
    assert ref() is None
    del a


@pytest.mark.parametrize(
    "value,band",
    [(0.0, "good"), (0.1499, "good"), (0.15, "moderate"), (0.2999, "moderate"), (0.30, "serious"),
     (0.3999, "serious"), (0.40, "severe"), (1.0, "severe")],
)
def test_severity_bands(value, band):
    assert severity(value) == band


@pytest.mark.parametrize(
    "kw,exc,word",
    [
        ({"usage_warning": 0}, ValueError, "usage_warning"),
        ({"usage_warning": 1.5}, ValueError, "usage_warning"),
        ({"usage_critical": "0.9"}, TypeError, "usage_critical"),
        ({"usage_warning": 0.9, "usage_critical": 0.8}, ValueError, "usage_critical"),
        ({"fragmentation": -0.1}, ValueError, "fragmentation"),
        ({"hysteresis": 1}, ValueError, "hysteresis"),
        ({"history": 0}, ValueError, "history"),
        ({"min_usage": 1.5}, ValueError, "min_usage"),
        ({"min_usage": None}, TypeError, "min_usage"),
        ({"callbacks": [42]}, TypeError, "callbacks"),
        ({"min_reserved": "lots"}, ValueError, "min_reserved"),
    ],
)
def test_bad_arguments_are_refused_without_subscribing(pool, kw, exc, word):
    threads = threading.active_count()
    made = []

    class Probe(Monitor):
        def __init__(self, *args, **kwargs):
            made.append(weakref.ref(self))
            super().__init__(*args, **kwargs)

    with pytest.raises(exc, match=word):
        Probe(pool, **kw)
    # A subscription or a dispatcher thread left behind would keep the refused monitor alive.
    gc.collect()
    assert made and made[0]() is None and threading.active_count() == threads


def test_monitor_needs_a_pool():
    with pytest.raises(TypeError, match="Pool"):
        Monitor("sim")


class MonitorMachine(RuleBasedStateMachine):
    """Whatever the sequence of allocations, the gauges agree with the pool and alerts alternate."""

    def __init__(self):
        super().__init__()
        self.pool = cupool.Pool("sim", capacity="100MiB")
        self.mon = Monitor(self.pool)
        self.held = []

    @rule(mib=st.integers(6, 20).map(lambda k: 2 * k))
    def malloc(self, mib):
        # Only what fits under the limit: an OOM runs the reclaim ladder's (slow) gc step.
        if self.pool.stats()["allocated_bytes.all.current"] + mib * MiB <= self.pool.limit:
            try:
                self.held.append(self.pool.malloc(mib * MiB))
            except cupool.OutOfMemoryError:  # a cached segment was split: fragmentation
                pass

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.held.pop(i % len(self.held)).free()

    @rule()
    def empty_cache(self):
        self.pool.empty_cache()

    @invariant()
    def gauges_agree_with_the_pool(self):
        s = self.pool.stats()
        usage = s["reserved_bytes.all.current"] / self.pool.limit
        level = self.mon.usage_level
        if usage >= 0.9:
            assert level == "critical"
        elif usage >= 0.8:
            assert level in ("warning", "critical")
        elif usage < 0.75:
            assert level == "ok"
        frag_level = self.mon.fragmentation_level
        pressed = s["fragmentation"] if usage >= self.mon.min_usage else 0.0  # the ratio only under pressure
        if pressed >= 0.30:
            assert frag_level == "warning"
        elif pressed < 0.25:
            assert frag_level == "ok"

    @invariant()
    def alerts_alternate(self):
        last = {}
        for a in self.mon.alerts:
            assert isinstance(a, Alert)
            if a.request:  # a refused request: an alert of its own, not a crossing
                assert a.level == "critical" and a.largest_free < a.request
                continue
            # critical may repeat: a fall into the warning band re-arms it silently
            assert a.level == "critical" or last.get(a.metric) != a.level, "the same alert fired twice in a row"
            if a.level != "ok":
                assert a.value >= a.threshold
            last[a.metric] = a.level

    def teardown(self):
        self.mon.close()


TestMonitorMachine = MonitorMachine.TestCase


def test_a_monitor_never_closed_does_not_keep_its_pool_alive():
    """Issue 21 #1: the arena reaches its subscribers, and outlives a dropped pool; a Monitor that held
    its pool strongly kept it (and its dispatcher thread) alive for good."""
    import gc
    import threading
    import weakref

    before = {t for t in threading.enumerate() if t.name == "cupool-monitor"}
    p = cupool.Pool("sim", capacity="64MiB")
    mon = Monitor(p)
    (thread,) = {t for t in threading.enumerate() if t.name == "cupool-monitor"} - before
    p.malloc(3 << 20).free()
    w = weakref.ref(p)
    del p
    gc.collect()
    assert w() is None, "a monitor that was never closed keeps its pool alive"
    assert mon.pool is None
    thread.join(5)
    assert not thread.is_alive(), "the dispatcher outlives the pool"
