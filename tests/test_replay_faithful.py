"""Replays that say what happened: the ladder's costs, the program's own calls, the state a window starts from."""

from __future__ import annotations

import gc

import cupool
from hypothesis import given, settings
from hypothesis import strategies as st
from cupool.replay import replay
from cupool.testing.programs import run_calls
from cupool.trace import Trace


def _oom_trace(n: int = 40) -> Trace:
    """Every other request of 30 MiB is refused on a 64 MiB device: the ladder runs each time."""
    events = [(0, "alloc", 1, 30 << 20, 0), (1, "alloc", 2, 30 << 20, 0)]
    events += [(2 + i, "alloc", 10 + i, 30 << 20, 0) for i in range(n)]
    return Trace.from_events(events)


def test_the_replay_pools_ladder_does_not_collect_garbage(monkeypatch):
    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or real(*a))
    for cfg in ({"capacity": "64MiB"}, {"capacity": "64MiB", "expandable_segments": True, "stitch": True}):
        r = replay(_oom_trace(), cfg, engine="pool")
        assert r.ooms == 40
    assert calls == []
    # An ordinary pool still collects: the step is off only for replays.
    pool = cupool.Pool("sim", capacity="64MiB")
    keep = [pool.malloc(30 << 20), pool.malloc(30 << 20)]
    try:
        pool.malloc(30 << 20)
    except cupool.OutOfMemoryError:
        pass
    assert calls
    del keep


def _recorded_run(config, program):
    """Run ``program(pool)`` on a recorded sim pool; returns the trace and the pool's stats."""
    pool = cupool.Pool("sim", **config)
    rec = pool.record()
    rec.start()
    program(pool)
    rec.stop()
    return rec.trace(), pool.stats()


def _same_as_recorded(trace, stats, engines=("numba", "pool")):
    for engine in engines:
        r = replay(trace, engine=engine)
        got = (r.peak_reserved, r.device_allocs, r.device_frees, r.ooms)
        want = (stats["reserved_bytes.all.peak"], stats["num_device_alloc"], stats["num_device_free"],
                stats["num_ooms"])
        assert got == want, engine


def test_a_programs_own_empty_cache_is_replayed():
    """The issue's repro: recorded at 92 MiB, replayed at 182 MiB on both engines before."""

    def program(pool):
        for a in [pool.malloc(30 << 20) for _ in range(3)]:
            a.free()
        pool.empty_cache()
        keep = [pool.malloc(45 << 20) for _ in range(2)]
        del keep

    trace, stats = _recorded_run({"capacity": "1GiB", "expandable_segments": False}, program)
    assert stats["reserved_bytes.all.peak"] == 92 << 20
    _same_as_recorded(trace, stats)
    trace, stats = _recorded_run({"capacity": "1GiB", "expandable_segments": True}, program)
    _same_as_recorded(trace, stats)


# One stream: an empty_cache() that releases nothing leaves no event, yet it settles the streams, which
# changes what another stream may reuse; that needs the pool to record the call (see cupool.replay.calls).
_MALLOC = st.tuples(st.just(0), st.integers(0, 40 << 20), st.just(0))  # run_calls's calls, mallocs half of them
_OPS = st.lists(st.one_of(_MALLOC, _MALLOC, st.tuples(st.just(1), st.integers(0, 99), st.just(0)), st.just((2, 0, 0))),
                max_size=40)


@settings(max_examples=40, deadline=None)
@given(_OPS, st.sampled_from([{}, {"release_threshold": 0}, {"release_threshold": "30MiB"},
                              {"initial_size": "8MiB"}, {"expandable_segments": False}]))  # {} is expandable
def test_empty_cache_calls_replay_exactly_under_any_settings(ops, settings_):
    def program(pool):
        run_calls(pool, ops)  # what is still live is freed as it returns, recorded

    trace, stats = _recorded_run({"capacity": "128MiB", **settings_}, program)
    engines = ("pool",) if settings_.get("expandable_segments") else ("numba", "pool")
    _same_as_recorded(trace, stats, engines)


def test_a_programs_own_compact_calls_are_replayed():
    """Movable buffers, freed in a checkerboard, then compact(): the recorded segments are given back."""

    def program(pool):
        pool.malloc(64 << 20).free()  # one cached segment that the movable buffers share
        bufs = [pool.movable(8 << 20) for _ in range(8)]
        for m in bufs[::2]:
            m.free()
        pool.compact()
        big = pool.malloc(32 << 20)  # fits the compacted segment; the checkerboard would need a new one
        more = [pool.movable(8 << 20) for _ in range(4)]
        del more, big

    for defrag in (None, 0.3):
        trace, stats = _recorded_run({"capacity": "256MiB", "defrag_threshold": defrag}, program)
        assert trace.counts().get("compact") and trace.counts().get("move_in")
        _same_as_recorded(trace, stats, ("pool",))
