"""Owner lifetimes, gc integration and leak reports (Pool(track_sites=True))."""

import gc
import inspect
import subprocess
import sys
import tracemalloc
import weakref

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cupool
from cupool.core import sites as tracking

MiB = 1 << 20
HERE = __file__


def here() -> int:
    """The line number of the caller's line."""
    return inspect.currentframe().f_back.f_lineno


@pytest.fixture
def tpool():
    return cupool.Pool("sim", capacity="64MiB", track_sites=True)


# ------------------------------------------------------------------ sites
def test_site_is_the_users_line_for_malloc_and_empty(tpool):
    a = tpool.malloc(1000); line_a = here()  # noqa: E702
    x = tpool.empty((16, 16), "float64"); line_x = here()  # noqa: E702
    leaks = {leak.ptr: leak for leak in tpool.leaks()}
    assert leaks[a.ptr].site == f"{HERE}:{line_a}"
    assert leaks[a.ptr].size == 1000 and leaks[a.ptr].nbytes == 1024
    assert leaks[x.ctypes.data].site == f"{HERE}:{line_x}"
    assert leaks[x.ctypes.data].size == 16 * 16 * 8
    # the stack starts at the site, in this test function
    assert leaks[a.ptr].stack[0] == f"{HERE}:{line_a} in test_site_is_the_users_line_for_malloc_and_empty"


def _helper(pool, n):
    return pool.malloc(n)


def test_stack_walks_out_through_helpers(tpool):
    a = _helper(tpool, 10); line = here()  # noqa: E702
    (leak,) = tpool.leaks()
    assert leak.site.endswith(f"{HERE}:{inspect.getsourcelines(_helper)[1] + 1}")
    assert any(frame == f"{HERE}:{line} in test_stack_walks_out_through_helpers" for frame in leak.stack)
    assert len(leak.stack) <= tracking.STACK_DEPTH
    assert a.ptr == leak.ptr


def test_tracking_never_keeps_an_allocation_alive(tpool):
    a = tpool.malloc(4096)
    ref = weakref.ref(a)
    del a
    assert ref() is None
    assert tpool.leaks() == []
    assert tpool.stats()["allocated_bytes.all.current"] == 0


def test_freed_but_referenced_allocations_are_not_leaks_and_reused_pointers_report_the_new_site(tpool):
    a = tpool.malloc(4096)
    a.free()
    assert tpool.leaks() == []
    b = tpool.malloc(4096); line = here()  # noqa: E702
    assert b.ptr == a.ptr  # best fit hands the same block back
    (leak,) = tpool.leaks()
    assert leak.ptr == b.ptr and leak.site == f"{HERE}:{line}"
    del a  # the old allocation dying must not drop the new one's record
    assert [leak.ptr for leak in tpool.leaks()] == [b.ptr]


def test_leaks_older_than_uses_age(tpool, monkeypatch):
    now = [100.0]

    class Clock:
        @staticmethod
        def monotonic():
            return now[0]

    monkeypatch.setattr(tracking, "time", Clock)
    old = tpool.malloc(1 << 10)
    now[0] += 30
    young = tpool.malloc(1 << 10)
    now[0] += 1
    assert [leak.ptr for leak in tpool.leaks()] == [old.ptr, young.ptr]  # oldest first
    assert [leak.ptr for leak in tpool.leaks(older_than=10)] == [old.ptr]
    assert tpool.leaks(older_than=10)[0].age == pytest.approx(31)
    assert len(tpool.leaks(older_than=0)) == 2
    assert tpool.leaks(older_than=60) == []


def test_largest_allocations_groups_live_bytes_by_site(tpool):
    small = [tpool.malloc(1000) for _ in range(3)]; line_small = here()  # noqa: E702
    big = tpool.malloc(5 * MiB); line_big = here()  # noqa: E702
    rows = tpool.largest_allocations(5)
    assert [r.site for r in rows] == [f"{HERE}:{line_big}", f"{HERE}:{line_small}"]
    assert rows[0].count == 1 and rows[0].size == 5 * MiB
    assert rows[1].count == 3 and rows[1].size == 3000 and rows[1].nbytes == 3 * 1024
    assert tpool.largest_allocations(1) == rows[:1]
    del small, big


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), ("1", TypeError), (True, TypeError)])
def test_bad_older_than(tpool, bad, exc):
    with pytest.raises(exc, match="older_than"):
        tpool.leaks(older_than=bad)


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (2.0, TypeError), (None, TypeError)])
def test_bad_n(tpool, bad, exc):
    with pytest.raises(exc, match="n must"):
        tpool.largest_allocations(bad)


def test_reports_need_tracking_and_tracking_needs_a_bool():
    p = cupool.Pool("sim", capacity="64MiB")
    with pytest.raises(RuntimeError, match="track_sites=True"):
        p.leaks()
    with pytest.raises(RuntimeError, match="track_sites=True"):
        p.largest_allocations()
    with pytest.raises(TypeError, match="track_sites"):
        cupool.Pool("sim", capacity="64MiB", track_sites="yes")


# -------------------------------------------------------------------- gc
def test_collect_reports_bytes_of_owners_freed_from_cycles(pool):
    gc.collect()
    gc.disable()
    try:
        x = pool.empty((1 << 18,), "uint8")  # 256 KiB
        cycle = [x]
        cycle.append(cycle)
        del x, cycle
        assert pool.stats()["allocated_bytes.all.current"] == 1 << 18  # the cycle keeps it
        assert pool.collect() == 1 << 18
        assert pool.stats()["allocated_bytes.all.current"] == 0
        assert pool.collect() == 0
    finally:
        gc.enable()


_GC_IN_THE_TRACKERS_LOCK = """
import gc, cupool
p = cupool.Pool("sim", capacity="64MiB", track_sites=True)
keep = [p.malloc(512) for _ in range(20)]
# Small gen-0 thresholds move the collections around, so that some fire on an
# allocation made while the tracker holds its lock, with a dead tracked owner
# waiting in a cycle: its weak reference's callback then runs on this thread.
for threshold in (3, 5, 7, 11, 13, 17, 23):
    gc.set_threshold(threshold, 1000, 1000)
    for _ in range(300):
        a = p.malloc(512)
        cycle = [a]
        cycle.append(cycle)
        del a, cycle
        p.leaks()
        p.largest_allocations(2)
gc.collect()
assert len(p.leaks()) == 20, p.leaks()
print("done")
"""


def test_a_collection_inside_the_trackers_lock_does_not_hang():
    # In a subprocess with a timeout, so that a regression fails instead of hanging the suite.
    try:
        out = subprocess.run(
            [sys.executable, "-c", _GC_IN_THE_TRACKERS_LOCK], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("leaks() deadlocked: a weakref callback run by the cycle collector took the tracker's lock")
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr


def test_records_of_dead_owners_are_dropped_and_a_reused_identity_keeps_its_record(tpool):
    a = tpool.malloc(4096)
    del a
    b = tpool.malloc(4096)
    tpool.malloc(100)  # dies at once; its record goes on the next add or report
    (leak,) = tpool.leaks()
    assert leak.ptr == b.ptr


def test_the_records_of_dead_owners_do_not_pile_up(tpool):
    """A long run of short-lived allocations keeps the tracker's memory flat.

    Measured with tracemalloc on the tracker's module: each record (weak reference,
    frames, dict entry) costs a few hundred bytes, so records of dead owners that
    were never dropped would show up as hundreds of KiB here.
    """
    path = tracking.__file__

    def tracker_bytes(snap):
        return sum(st.size for st in snap.filter_traces([tracemalloc.Filter(True, path)]).statistics("filename"))

    tracemalloc.start(1)
    try:
        for _ in range(50):  # warm up: the dict reaches its working size
            tpool.malloc(100)
        before = tracker_bytes(tracemalloc.take_snapshot())
        for _ in range(2000):
            tpool.malloc(100)  # dies at once
        after = tracker_bytes(tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()
    assert tpool.leaks() == []
    assert after - before < 16 << 10, f"the tracker grew by {after - before} bytes over 2000 dead allocations"


# -------------------------------------------------- leak report vs. a model
def _site_a(pool, n):
    return pool.malloc(n)


def _site_b(pool, n):
    return pool.empty((n,), "uint8")


SITE_A = f"{HERE}:{inspect.getsourcelines(_site_a)[1] + 1}"
SITE_B = f"{HERE}:{inspect.getsourcelines(_site_b)[1] + 1}"


class LeakReportMachine(RuleBasedStateMachine):
    """The leak report always lists exactly the live, unfreed allocations, each at its site."""

    def __init__(self):
        super().__init__()
        self.pool = cupool.Pool("sim", capacity="64MiB", track_sites=True)
        self.held = []  # (object, ptr, size, site, freed)

    @rule(n=st.integers(0, 3 * MiB))
    def malloc(self, n):
        a = _site_a(self.pool, n)
        self.held.append([a, a.ptr, n, SITE_A, False])

    @rule(n=st.integers(0, 3 * MiB))
    def empty(self, n):
        x = _site_b(self.pool, n)
        self.held.append([x, x.ctypes.data, n, SITE_B, False])

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 10**6))
    def drop(self, i):
        self.held.pop(i % len(self.held))

    @precondition(lambda self: any(isinstance(h[0], cupool.Allocation) and not h[4] for h in self.held))
    @rule(i=st.integers(0, 10**6))
    def free_but_keep(self, i):
        cands = [h for h in self.held if isinstance(h[0], cupool.Allocation) and not h[4]]
        h = cands[i % len(cands)]
        h[0].free()
        h[4] = True

    @invariant()
    def report_matches_model(self):
        want = sorted((ptr, size, site) for _, ptr, size, site, freed in self.held if not freed)
        got = sorted((leak.ptr, leak.size, leak.site) for leak in self.pool.leaks())
        assert got == want
        live = sum(leak.nbytes for leak in self.pool.leaks())
        assert live == self.pool.stats()["allocated_bytes.all.current"]


TestLeakReport = LeakReportMachine.TestCase


def test_nbytes_is_the_device_block_for_raw_and_movable_alike():
    p = cupool.Pool("sim", capacity="64MiB", track_sites=True, spill="host")
    a = p.malloc(3000)
    m = p.movable(3000)
    by_kind = {leak.movable: leak for leak in p.leaks()}
    assert by_kind[False].size == by_kind[True].size == 3000
    assert by_kind[False].nbytes == by_kind[True].nbytes == 3072
    assert sum(r.nbytes for r in p.largest_allocations(5)) == p.stats()["allocated_bytes.all.current"]
    p.spill()
    assert {leak.movable: leak.nbytes for leak in p.leaks()} == {False: 3072, True: 0}
    del a, m


def test_movable_buffers_are_tracked_and_reported_while_spilled():
    p = cupool.Pool("sim", capacity="64MiB", track_sites=True, spill="host")
    m = p.movable(3000); line = here()  # noqa: E702
    p.spill()
    (leak,) = p.leaks()
    assert leak.movable and leak.ptr is None and leak.size == 3000 and leak.nbytes == 0
    assert leak.site == f"{HERE}:{line}" and "spilled" in str(leak)
    m.free()
    assert p.leaks() == []
