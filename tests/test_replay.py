"""Replay: record -> replay reproduces the run, and the compiled engine equals the real Pool."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import cupool
from cupool import workloads
from cupool.cli import main
from cupool.core.events import KINDS
from cupool.replay import parse_config, replay
from cupool.trace import Trace, load_trace
from engines import COUNTS, engines_agree, synthetic, synthetic_events

MiB = 1 << 20


def _recorded(pool_stats, r):
    assert r.peak_reserved == pool_stats["reserved_bytes.all.peak"]
    assert r.peak_allocated == pool_stats["allocated_bytes.all.peak"]
    assert r.peak_segments == pool_stats["segment.all.peak"]
    assert (r.segment_allocs, r.segment_frees) == (pool_stats["segment.all.allocated"], pool_stats["segment.all.freed"])
    assert (r.device_allocs, r.device_frees) == (pool_stats["num_device_alloc"], pool_stats["num_device_free"])
    assert r.ooms == pool_stats["num_ooms"]


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
    r = engines_agree(trace)  # the recorded configuration, by default
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
        expandable=st.sampled_from([None, False]),  # Pool's defaults (expandable segments here) and plain ones
    )
    def setup(self, capacity, threshold, initial, expandable):
        self.pool = cupool.Pool("sim", capacity=capacity, release_threshold=threshold, initial_size=initial,
                                expandable_segments=expandable)
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
        r = engines_agree(self.rec.trace())
        _recorded(self.pool.stats(), r)


TestRecordedPool = RecordedPool.TestCase
TestRecordedPool.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30 << 20), st.integers(0, 3), st.integers(0, 99)),
                max_size=120),
       st.sampled_from([{"capacity": "64MiB"}, {"capacity": "64MiB", "release_threshold": "10MiB"},
                        {"capacity": "128MiB", "max_size": "50MiB", "initial_size": "6MiB"},
                        {"capacity": "64MiB", "expandable_segments": False}]))  # plain segments too
def test_engines_agree_on_generated_traces(ops, config):
    engines_agree(synthetic(ops), config)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30 << 20), st.integers(0, 3), st.integers(0, 99)),
                max_size=120),
       st.sets(st.integers(0, 119), max_size=6),
       st.sampled_from([{"capacity": "64MiB"}, {"capacity": "128MiB", "initial_size": "6MiB"},
                        {"capacity": "64MiB", "expandable_segments": False}]))  # plain segments too
def test_engines_agree_on_a_programs_own_empty_cache(ops, empties, config):
    """A PyTorch program's empty_cache() (a burst of segment frees) is replayed alike by both engines."""
    events = []
    for t, ev in enumerate(synthetic_events(ops)):
        events.append(ev)
        if t in empties:
            events.append((ev[0], "segment_free", 1 << 40, 2 << 20, 0))
    engines_agree(Trace.from_events(events, format="torch"), config)


def test_foreign_quirks_unmatched_frees_and_reused_addresses():
    events = [(0, "free", 99, 512, 0), (1, "alloc", 5, 4096, 0), (2, "alloc", 5, 8192, 0), (3, "free", 5, 8192, 0)]
    r = engines_agree(Trace.from_events(events), {"capacity": "64MiB"})
    assert r.unmatched_frees == 1 and r.peak_allocated == 8192


def test_timeline_matches_the_summary():
    ops = [(True, (i % 7 + 1) << 19, 0, 0) if i % 3 else (False, 0, 0, i) for i in range(300)]
    trace = synthetic(ops)
    r = replay(trace, {"capacity": "1GiB"}, timeline=True)
    assert r.timeline["reserved"].max() == r.peak_reserved
    assert r.timeline["allocated"].max() == r.peak_allocated
    assert replay(trace, {"capacity": "1GiB"}, stop=10).events == 10


def test_config_parsing_and_bad_keys():
    assert parse_config("max_size=1GiB, release_threshold=none,memory_fraction=0.5,capacity=1024") == {
        "max_size": "1GiB", "release_threshold": None, "memory_fraction": 0.5, "capacity": 1024}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_config("max_size")
    trace = synthetic([(True, 100, 0, 0)])
    with pytest.raises(ValueError, match="unknown configuration key 'max_sise'"):
        replay(trace, {"max_sise": "1GiB"})
    with pytest.raises(ValueError, match="--engine pool"):
        replay(trace, {"track_sites": True}, engine="numba")
    assert replay(trace, {"track_sites": True}).engine == "pool"  # no engine named: the one that models it
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
    assert "(after each alloc/free while anything is allocated)" in out and "frag. at peak" in out
    assert main(["replay", str(path), "--compare", "recorded", "max_size=80MiB", "release_threshold=0",
                 "--engine", "pool"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"recorded: peak reserved {peak}" in lines[1]  # the recorded allocator's, to compare with
    rows = lines[3:]
    assert lines[2].split()[:3] == ["configuration", "capacity", "peak"]
    assert rows.pop().startswith("max/mean frag: after each alloc/free while anything is allocated")
    assert [r.split()[0] for r in rows] == ["recorded", "max_size=80MiB", "release_threshold=0"]
    assert rows[0].split()[3:5] == peak.split()
    ran_with = lines[2].index("ran with")  # each row ends with the settings it ran with
    assert int(rows[1][:ran_with].split()[-2]) > 0  # 80 MiB is too small for these layers: unmatched frees
    assert "max_size=80MiB" in rows[1][ran_with:] and "expandable_segments=True, stitch=True" in rows[1][ran_with:]


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


def test_annotations_and_segment_events_do_not_drive_a_replay():
    events = [(0, "alloc", 1, 4096, 0), (1, "compact", 0, 0, 0), (2, "reclaim:release", 0, 1 << 21, 0),
              (3, "segment_free", 7, 1 << 21, 0), (4, "free", 1, 4096, 0)]
    trace = Trace.from_events(events)
    assert trace.kinds == KINDS  # the reclaim kinds are known ones, not appended
    r = engines_agree(trace, {"capacity": "64MiB"})
    assert r.peak_allocated == 4096 and r.unmatched_frees == 0


_MOVED = [
    (0, "alloc_movable", 100, 4 << 20, 0),
    (1, "alloc_movable", 200, 3 << 20, 1),
    (2, "move_out", 100, 4 << 20, 0), (3, "move_in", 50, 4 << 20, 0),   # 100 -> 50
    (4, "move_out", 50, 4 << 20, 0), (5, "move_in", 10, 4 << 20, 0),    # moved twice in one plan
    (6, "compact", 0, 8 << 20, 0),
    (7, "free_movable", 200, 3 << 20, 1), (8, "spill", 200, 3 << 20, 1),  # spilled
    (9, "alloc", 300, 1 << 20, 0),
    (10, "alloc_movable", 400, 3 << 20, 1), (11, "restore", 400, 3 << 20, 1),  # and back
    (12, "free_movable", 10, 4 << 20, 0),  # later events name the block where it moved
    (13, "free_movable", 400, 3 << 20, 1),
    (14, "free", 300, 1 << 20, 0),
]


@pytest.mark.parametrize("engine", ["numba", "pool"])
def test_moves_and_spills_carry_a_blocks_identity(engine):
    r = replay(Trace.from_events(_MOVED), {"capacity": "64MiB"}, engine=engine)
    assert r.unmatched_frees == 0 and r.ooms == 0
    assert r.peak_allocated == (4 << 20) + (3 << 20) + (1 << 20)
    # Movable buffers grow the pool by exactly their size (rounded to 2 MiB pages), not by a 20 MiB
    # segment; the 1 MiB raw block gets a 2 MiB small segment; the restore reuses the spilled one's.
    assert r.peak_reserved == (4 << 20) + (4 << 20) + (2 << 20) and r.peak_segments == 3
    # A move that lost its block (src never allocated) is not a free of anything.
    stray = Trace.from_events([(0, "move_out", 5, 512, 0), (1, "move_in", 6, 512, 0), (2, "free_movable", 6, 512, 0)])
    assert replay(stray, {"capacity": "64MiB"}, engine=engine).unmatched_frees == 1


def test_engines_agree_on_movables_without_compaction():
    events = [e for e in _MOVED if e[1] not in ("compact",)]
    # The numba engine follows the recorded moves and the pool engine does not move (no compact
    # event), so their layouts, and fragmentation, differ; peaks and counts do not.  (This compared
    # the pool engine with itself once: the default engine of a trace with movables is the pool's.)
    engines_agree(Trace.from_events(events), {"capacity": "64MiB"}, on=COUNTS)
    fast = replay(Trace.from_events(events), {"capacity": "64MiB"}, engine="numba")
    assert fast.warnings and "does not compact" in fast.warnings[0]


def test_a_compacting_pool_replays_exactly_on_the_pool_engine(tmp_path, capsys):
    pool = cupool.Pool("sim", capacity="512MiB")
    path = tmp_path / "movable.h5"
    with pool.record(path):
        workloads.weight_streaming(pool, workloads.mixed_shapes(40, seed=0), movable=True)
    stats = pool.stats()
    trace = load_trace(path)
    counts = trace.counts()
    assert counts["compact"] == stats["num_compactions"] > 0 and counts["move_in"] > 0
    assert trace.config["defrag_threshold"] == 0.3
    r = replay(trace)  # the default engine for a trace with movables is the pool
    assert r.engine == "pool" and r.config["defrag_threshold"] == 0.3 and not r.warnings
    _recorded(stats, r)
    # The numba engine cannot compact, and says so.
    fast = replay(trace, engine="numba")
    assert fast.peak_allocated == stats["allocated_bytes.all.peak"]
    assert fast.warnings and "--engine pool" in fast.warnings[0]
    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pool engine)" in out and "warning" not in out
    assert f"peak reserved      {cupool.format_bytes(stats['reserved_bytes.all.peak'])}" in out
    assert main(["replay", str(path), "--engine", "numba"]) == 0
    assert "warning: this trace has movable buffers" in capsys.readouterr().out


def test_a_gpu_trace_applies_the_limit_once():
    # A pool on an 80 GiB GPU with max_size=50% recorded limit=40 GiB; the sim device gets 40 GiB,
    # and max_size must not halve it again.  Scaled down: limit 64 MiB, a 40 MiB request.
    config = {"device": "cuda:0", "capacity": None, "max_size": "50%", "memory_fraction": 0.9,
              "limit": 64 << 20, "initial_size": 0, "release_threshold": None}
    trace = Trace.from_events([(0, "alloc", 1, 40 << 20, 0), (1, "free", 1, 40 << 20, 0)], config=config)
    for engine in ("numba", "pool"):
        r = replay(trace, engine=engine)
        assert r.ooms == 0 and r.peak_allocated == 40 << 20
        assert r.config["capacity"] == 64 << 20 and "max_size" not in r.config
        assert "memory_fraction" not in r.config
    # An explicit override still applies, to the recorded limit.
    assert replay(trace, {"max_size": "50%"}).ooms == 1


def test_fragmentation_is_sampled_while_something_is_allocated():
    mib = 1 << 20
    events = [(0, "alloc", 1, 3 * mib, 0), (1, "alloc", 2, 8 * mib, 0), (2, "free", 1, 3 * mib, 0),
              (3, "free", 2, 8 * mib, 0)]  # the last free is teardown: all cache, nothing allocated
    # Plain segments: one 20 MiB segment (the samples' denominator).
    r = engines_agree(Trace.from_events(events), {"capacity": "64MiB", "expandable_segments": False})
    samples = [17 / 20, 9 / 20, 12 / 20]
    assert r.max_fragmentation == pytest.approx(17 / 20)  # not 1.0 from the teardown
    assert r.mean_fragmentation == pytest.approx(sum(samples) / 3)
    assert r.fragmentation_at_peak == pytest.approx(17 / 20)  # the 20 MiB segment came with the first alloc


def test_a_spilling_pool_replays_exactly_with_its_recorded_spill_settings(tmp_path):
    pool = cupool.Pool("sim", capacity="64MiB", spill="host")
    path = tmp_path / "spill.h5"
    with pool.record(path):
        bufs = []
        for i in range(30):  # 150 MiB of buffers through a 64 MiB device
            bufs.append(pool.movable(5 << 20))
            if i % 3 == 0:
                bufs.pop(0).free()
        for b in bufs[:4]:
            b.array()  # brought back from the host
        for b in bufs:
            b.free()
    trace = load_trace(path)
    assert trace.config["spill"] == "host" and trace.config["spill_policy"] == "lru"
    assert trace.counts()["spill"] > 0 and trace.counts()["restore"] == 4
    r = replay(trace)
    assert r.engine == "pool" and r.unmatched_frees == 0 and r.config["spill"] == "host"
    _recorded(pool.stats(), r)
    # Without spilling the same run cannot fit: the buffers that could not be made are OOMs.
    tight = replay(trace, {"spill": None})
    assert tight.ooms > 0 and tight.unmatched_frees == tight.ooms


def test_a_recorded_capacity_no_machine_maps_names_the_trace_and_the_setting():
    trace = Trace.from_events([(0, "alloc", 1, 4096, 0)], config={"capacity": 1000 << 40}, source="big.h5")
    for engine in ("numba", "pool"):
        with pytest.raises(ValueError, match=r"big\.h5: cannot make a sim pool .* capacity: a sim device of 1000 TiB"):
            replay(trace, engine=engine)


def test_a_capacity_whose_addresses_the_process_is_refused_names_the_trace(monkeypatch):
    """Before: since issue 34 a sim device the process has no address space for (``ulimit -v``) raises
    ``AddressSpaceExhausted``, which ``sim_pool`` let through without the trace and the settings, and
    which is no ``ValueError`` as the refusal was before."""
    from cupool.device import sim

    def refused(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    trace = Trace.from_events([(0, "alloc", 1, 4096, 0)], config={"capacity": 16 << 30}, source="big.h5")
    monkeypatch.setattr(sim.mmap, "mmap", refused)
    for engine in ("numba", "pool"):
        with pytest.raises(ValueError, match=r"big\.h5: cannot make a sim pool .* 16 GiB needs 32 GiB of address"):
            replay(trace, engine=engine)


@pytest.mark.parametrize("engine", ["numba", "pool"])
def test_a_malformed_seed_names_the_trace_and_the_field(engine):
    events = [(0, "segment_alloc", 1 << 21, 2 << 20, 0), (0, "alloc", 1 << 21, 4096, 0), (1, "free", 1 << 21, 4096, 0)]
    for seed, field in (({"events": 2, "small_segments": 5}, "'small_segments'"),
                        ({"events": 2, "kept_segments": [True]}, "'kept_segments'"),
                        ({"events": True}, "'events'")):
        trace = Trace.from_events(events, config={"seed": seed}, source="seeded.h5")
        with pytest.raises(ValueError, match=f"seeded.h5: the trace's seed configuration is corrupted: {field}"):
            replay(trace, {"capacity": "64MiB"}, engine=engine)
    good = Trace.from_events(events, config={"seed": {"events": 2, "small_segments": [1 << 21]}}, source="ok")
    assert replay(good, {"capacity": "64MiB"}, engine=engine).unmatched_frees == 0


def test_a_cupool_trace_keeps_its_recorded_capacity():
    from cupool.replay.driver import trace_capacity

    trace = Trace.from_events([(0, "alloc", 1, 4096, 0)], config={"capacity": 64 << 20})
    assert trace_capacity(trace) == (64 << 20, "recorded")
    assert replay(trace).capacity == 64 << 20
    assert trace_capacity(Trace.from_events([(0, "alloc", 1, 4096, 0)])) is None


def test_the_replay_time_leaves_out_compiling_the_engine(monkeypatch):
    """The engine's first call in a process compiles it or loads it from the cache: a stand-in
    that takes 0.5 s on its first call only must not show in the replay's time."""
    from cupool.replay import engine as eng

    run, calls = eng.run, []

    def slow_first(*args):
        if not calls:
            time.sleep(0.5)
        calls.append(args[5:7])
        return run(*args)

    monkeypatch.setattr(eng, "run", slow_first)
    r = replay(Trace.from_events([(i, "alloc" if i % 2 == 0 else "free", 1, 4096, 0) for i in range(100)]))
    assert calls[0] == (0, 0) and calls[1:] == [(0, 100)]
    assert r.seconds < 0.25 and r.ooms == 0


def test_compiling_is_announced_once_and_only_for_the_engine(capsys):
    import numba

    from cupool.replay import engine as eng

    def double(x):
        return 2 * x

    def triple(x):
        return 3 * x

    double.__module__ = eng.__name__  # compiled afresh, as the engine's own functions are on a cold cache
    with eng.compile_notice() as quiet:
        assert numba.njit(triple)(2) == 6  # someone else's function: not the replay engine
    assert not quiet.compiled and capsys.readouterr().err == ""
    with eng.compile_notice() as notice:
        compiled = numba.njit(double)
        assert (compiled(2), compiled(2.5)) == (4, 5.0)  # two signatures, two compilations
    assert notice.compiled and capsys.readouterr().err == eng.COMPILE_NOTICE + "\n"
    with eng.compile_notice() as again:
        assert compiled(3) == 6  # compiled already
    assert not again.compiled and capsys.readouterr().err == ""


# ------------------------------------------------------------------ issue 28
def test_replay_and_layout_take_a_trace_files_path(tmp_path):
    """``replay("file.h5")`` raised AttributeError from deep inside; a path is what users have at hand."""
    from pathlib import Path

    from cupool.replay import layout

    path, stats = _write_trace(tmp_path)
    by_trace = replay(load_trace(path))
    for given in (str(path), Path(path)):
        r = replay(given)
        assert (r.peak_reserved, r.peak_allocated, r.replayed) == (
            by_trace.peak_reserved, by_trace.peak_allocated, by_trace.replayed)
        assert layout(given) == layout(load_trace(path))
    assert by_trace.peak_allocated == stats["allocated_bytes.all.peak"]
    for bad in (b"t.h5", 3, None, [path]):
        with pytest.raises(TypeError, match=rf"replay\(\) takes a Trace .* or a trace file's path, got "
                                            rf"{type(bad).__name__}"):
            replay(bad)
    with pytest.raises(cupool.TraceError, match="missing.h5"):
        replay(tmp_path / "missing.h5")


@pytest.mark.parametrize("busy", [False, True], ids=["fresh", "started-on-a-busy-pool"])
@pytest.mark.parametrize("movable", [False, True], ids=["raw", "movable"])
def test_a_cupool_trace_carries_the_recorded_peak_allocated(tmp_path, capsys, busy, movable):
    """``cupool replay --compare`` printed "peak allocated unknown" for cupool's own traces, which record
    every block: the peak is read from their events, the seed's blocks included."""
    from cupool.trace.importers import recorded_peak_allocated

    pool = cupool.Pool("sim", capacity="512MiB", spill="host" if movable else None)
    before = pool.malloc(40 * MiB) if busy else None  # alive before the recording: in its seed
    if busy:
        pool.reset_peak_stats()  # the pool's peak over the recording window, as the trace can know it
    path = tmp_path / "t.h5"
    with pool.record(path):
        workloads.weight_streaming(pool, workloads.mixed_shapes(12, seed=0), movable=movable)
        if movable:
            pool.spill()
        extra = pool.malloc(3 * MiB)
        extra.free()
    peak = pool.stats()["allocated_bytes.all.peak"]
    trace = load_trace(path)
    assert recorded_peak_allocated(trace) == peak > (40 * MiB if busy else 0)
    assert main(["replay", str(path), "--compare", "recorded", "max_size=500MiB"]) == 0
    out = capsys.readouterr().out
    assert f"peak allocated {cupool.format_bytes(peak)}" in out and "unknown" not in out
    assert main(["replay", str(path)]) == 0
    assert f"(recorded: {cupool.format_bytes(peak)})" in capsys.readouterr().out
    del before


def test_a_ring_buffer_that_dropped_its_start_does_not_claim_a_peak():
    """Without its start (and so its seed), a trace's frees of blocks it never saw would understate the peak."""
    from cupool.trace.importers import recorded_peak_allocated

    pool = cupool.Pool("sim", capacity="64MiB")
    with pool.record(capacity=4) as rec:
        blocks = [pool.malloc(MiB) for _ in range(4)]
        del blocks
    assert rec.dropped and recorded_peak_allocated(rec.trace()) is None
    with pool.record(capacity=64) as rec:
        blocks = [pool.malloc(MiB) for _ in range(4)]
        del blocks
    assert recorded_peak_allocated(rec.trace()) == 4 * MiB
