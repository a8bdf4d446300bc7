"""Replay: record -> replay reproduces the run, and the compiled engine equals the real Pool."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import cupool
from cupool import workloads
from cupool.cli import main
from cupool.replay import parse_config, replay
from cupool.trace import KINDS, Trace, load_trace

_SAME = ("peak_reserved", "peak_allocated", "peak_segments", "segment_allocs", "segment_frees", "ooms",
         "unmatched_frees", "max_fragmentation", "mean_fragmentation")


def _recorded(pool_stats, r):
    assert r.peak_reserved == pool_stats["reserved_bytes.all.peak"]
    assert r.peak_allocated == pool_stats["allocated_bytes.all.peak"]
    assert r.peak_segments == pool_stats["segment.all.peak"]
    assert r.segment_allocs == pool_stats["num_device_alloc"]
    assert r.segment_frees == pool_stats["num_device_free"]
    assert r.ooms == pool_stats["num_ooms"]


def _agree(trace, config=None):
    fast = replay(trace, config)
    exact = replay(trace, config, engine="pool")
    assert {k: getattr(fast, k) for k in _SAME} == {k: getattr(exact, k) for k in _SAME}
    return fast


@pytest.mark.parametrize(
    "settings_",
    [
        {"capacity": "256MiB"},
        {"capacity": "160MiB", "max_size": "120MiB"},
        {"capacity": "256MiB", "release_threshold": "40MiB", "initial_size": "24MiB"},
    ],
)
def test_record_then_replay_reproduces_the_run(tmp_path, settings_):
    pool = cupool.Pool("sim", **settings_)
    rng = np.random.default_rng(1)
    with pool.record(tmp_path / "run.h5", batch=256):
        workloads.weight_streaming(pool, workloads.mixed_shapes(30, seed=2))
        live = []
        for _ in range(500):
            if live and rng.random() < 0.47:
                live.pop(int(rng.integers(len(live)))).free()
            else:
                small = rng.random() < 0.5
                n = int(rng.integers(0, 1 << 20)) if small else int(rng.integers(1 << 20, 24 << 20))
                try:
                    live.append(pool.malloc(n, stream=int(rng.integers(3))))
                except cupool.OutOfMemoryError:
                    pass
    stats = pool.stats()
    trace = load_trace(tmp_path / "run.h5")
    r = _agree(trace)  # the recorded configuration, by default
    _recorded(stats, r)
    if "max_size" in settings_:
        assert r.ooms > 0  # the case with a limit really exercises the reclaim ladder
    del live


class RecordedPool(RuleBasedStateMachine):
    """Drive a recorded pool at random; both replays must reproduce its books exactly."""

    @initialize(
        capacity=st.sampled_from([16 << 20, 48 << 20]),
        threshold=st.sampled_from([None, 0, 8 << 20]),
        initial=st.sampled_from([0, 4 << 20]),
    )
    def setup(self, capacity, threshold, initial):
        self.pool = cupool.Pool("sim", capacity=capacity, release_threshold=threshold, initial_size=initial)
        self.rec = self.pool.record(capacity=1 << 16)
        self.rec.start()
        self.live = []

    @rule(size=st.one_of(st.integers(0, 4096), st.integers(0, 1 << 20), st.integers(1 << 20, 24 << 20)),
          stream=st.integers(0, 2))
    def malloc(self, size, stream):
        try:
            self.live.append(self.pool.malloc(size, stream=stream))
        except cupool.OutOfMemoryError:
            pass

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1 << 30))
    def free(self, i):
        self.live.pop(i % len(self.live)).free()

    @invariant()
    def books_balance(self):
        if hasattr(self, "pool"):
            self.pool.check()

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        self.rec.stop()
        r = _agree(self.rec.trace())
        _recorded(self.pool.stats(), r)


TestRecordedPool = RecordedPool.TestCase
TestRecordedPool.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


def _synthetic(ops):
    """A trace from (is_alloc, size, stream, which) tuples, with made-up addresses."""
    events, live, nxt = [], [], 0
    for t, (is_alloc, size, stream, which) in enumerate(ops):
        if is_alloc or not live:
            nxt += 1
            live.append((nxt, size, stream))
            events.append((t, "alloc", nxt, size, stream))
        else:
            a, s, strm = live.pop(which % len(live))
            events.append((t, "free", a, s, strm))
    return Trace.from_events(events)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30 << 20), st.integers(0, 3), st.integers(0, 99)),
                max_size=120),
       st.sampled_from([{"capacity": "64MiB"}, {"capacity": "64MiB", "release_threshold": "10MiB"},
                        {"capacity": "128MiB", "max_size": "50MiB", "initial_size": "6MiB"}]))
def test_engines_agree_on_generated_traces(ops, config):
    _agree(_synthetic(ops), config)


def test_foreign_quirks_unmatched_frees_and_reused_addresses():
    events = [(0, "free", 99, 512, 0), (1, "alloc", 5, 4096, 0), (2, "alloc", 5, 8192, 0), (3, "free", 5, 8192, 0)]
    r = _agree(Trace.from_events(events), {"capacity": "64MiB"})
    assert r.unmatched_frees == 1 and r.peak_allocated == 8192


def test_timeline_matches_the_summary():
    ops = [(True, (i % 7 + 1) << 19, 0, 0) if i % 3 else (False, 0, 0, i) for i in range(300)]
    trace = _synthetic(ops)
    r = replay(trace, {"capacity": "1GiB"}, timeline=True)
    assert r.timeline["reserved"].max() == r.peak_reserved
    assert r.timeline["allocated"].max() == r.peak_allocated
    assert replay(trace, {"capacity": "1GiB"}, stop=10).events == 10


def test_config_parsing_and_bad_keys():
    assert parse_config("max_size=1GiB, release_threshold=none,memory_fraction=0.5,capacity=1024") == {
        "max_size": "1GiB", "release_threshold": None, "memory_fraction": 0.5, "capacity": 1024}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_config("max_size")
    trace = _synthetic([(True, 100, 0, 0)])
    with pytest.raises(ValueError, match="unknown configuration key 'max_sise'"):
        replay(trace, {"max_sise": "1GiB"})
    with pytest.raises(ValueError, match="--engine pool"):
        replay(trace, {"track_sites": True})
    assert replay(trace, {"track_sites": True, "capacity": "64MiB"}, engine="pool").peak_allocated == 512
    with pytest.raises(ValueError, match="max_size"):
        replay(trace, {"max_size": "lots"})
    with pytest.raises(ValueError, match="unknown replay engine"):
        replay(trace, engine="fast")


def _write_trace(tmp_path):
    pool = cupool.Pool("sim", capacity="512MiB")
    path = tmp_path / "t.h5"
    with pool.record(path):
        workloads.weight_streaming(pool, workloads.mixed_shapes(12, seed=0))
    return path, pool.stats()


def test_cli_replay_and_compare(tmp_path, capsys):
    path, stats = _write_trace(tmp_path)
    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    peak = cupool.format_bytes(stats["reserved_bytes.all.peak"])
    assert f"peak reserved      {peak}" in out and "OOMs               0" in out
    assert main(["replay", str(path), "--compare", "recorded", "max_size=80MiB", "release_threshold=0",
                 "--engine", "pool"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["recorded", "max_size=80MiB", "release_threshold=0"]
    assert rows[0].split()[1:3] == peak.split()
    assert int(rows[1].split()[-2]) > 0  # 80 MiB is too small for these layers: OOMs counted


def test_cli_bad_input_exits_2(tmp_path, capsys):
    path, _ = _write_trace(tmp_path)
    assert main(["replay", str(path), "--config", "colour=blue"]) == 2
    assert "unknown configuration key 'colour'" in capsys.readouterr().err
    bad = tmp_path / "bad.h5"
    bad.write_bytes(path.read_bytes()[:1000])
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "truncated" in err and "Traceback" not in err
    assert main(["replay", str(tmp_path / "nope.h5")]) == 2
    assert "nope.h5: cannot read" in capsys.readouterr().err


def test_kinds_we_do_not_replay_are_ignored():
    events = [(0, "alloc", 1, 4096, 0), (1, "move", 1, 4096, 0), (2, "spill", 1, 4096, 0),
              (3, "segment_free", 7, 1 << 21, 0), (4, "free", 1, 4096, 0)]
    trace = Trace.from_events(events)
    assert set(KINDS) <= set(trace.kinds)
    r = _agree(trace, {"capacity": "64MiB"})
    assert r.peak_allocated == 4096 and r.unmatched_frees == 0
