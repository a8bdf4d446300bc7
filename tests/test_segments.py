"""One meaning of "segment" (Note [Segments]): ``Pool.stats()``, the trace, and both replay engines count the
same segments, and count the device calls (map and unmap on expandable segments) apart from them.

Before (issue 36, item 22): on expandable segments the replays' ``segment_allocs`` / ``segment_frees`` were
the map and unmap calls, while ``stats()``'s ``segment.all.allocated`` / ``freed`` counted segments: the two
disagreed on 130 of 243 random programs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupool
from cupool.replay import layout, recorded_segments, replay
from cupool.testing.programs import Call, run_calls
from cupool.trace import Trace, load_trace

MiB = 1 << 20
SIZES = (512, 4096, 300_000, 1 * MiB, 3 * MiB, 7 * MiB, 21 * MiB, 40 * MiB)


def _run(ops: list[Call], **config) -> tuple[Trace, dict]:
    """Record ``ops`` (``run_calls``'s: malloc, free, empty_cache) on a 128 MiB sim pool; the trace and the
    pool's stats."""
    pool = cupool.Pool("sim", capacity="128MiB", **config)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.h5"
        with pool.record(path):
            _, live = run_calls(pool, ops)
        trace = load_trace(path)
    return trace, pool.stats()


def _calls(trace: Trace) -> tuple[int, int]:
    """The trace's device calls: its segment_alloc and segment_map events, and its segment_free and unmap ones."""
    def n(*kinds: str) -> int:
        return sum(int((trace.kind == trace.code(k)).sum()) for k in kinds if trace.code(k) >= 0)

    return n("segment_alloc", "segment_map"), n("segment_free", "segment_unmap")


def _counts_agree(trace: Trace, stats: dict) -> None:
    segments = (stats["segment.all.peak"], stats["segment.all.allocated"], stats["segment.all.freed"])
    calls = (stats["num_device_alloc"], stats["num_device_free"])
    assert (recorded_segments(trace) or (0, 0, 0)) == segments
    assert _calls(trace) == calls
    for engine in ("numba", "pool"):
        r = replay(trace, engine=engine)
        assert (r.peak_segments, r.segment_allocs, r.segment_frees) == segments, engine
        assert (r.device_allocs, r.device_frees) == calls, engine
        # The report's segment map (``layout``) draws the segments the pool holds at the end.
        assert len(layout(trace, engine=engine)) == stats["segment.all.current"], engine


# run_calls's calls: (0, size, stream) mallocs (half of them), (1, which, _) frees, (2, _, _) empties the cache.
_MALLOC = st.tuples(st.just(0), st.sampled_from(SIZES), st.sampled_from([0, 0, 1]))
OPS = st.lists(st.one_of(_MALLOC, _MALLOC, st.tuples(st.just(1), st.integers(0, 1 << 16), st.just(0)),
                         st.just((2, 0, 0))), max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, kind=st.sampled_from(["plain", "expandable", "stitched"]))
def test_stats_trace_and_both_engines_count_the_same_segments(ops, kind):
    config = {"plain": {"expandable_segments": False}, "expandable": {"expandable_segments": True, "stitch": False},
              "stitched": {"expandable_segments": True, "stitch": True}}[kind]
    trace, stats = _run(ops, **config)
    _counts_agree(trace, stats)


def test_a_growing_segment_is_one_segment_of_several_maps():
    """Three requests that each grow the stream's one segment: one segment, three map calls; empty_cache
    unmaps the hole between two live blocks and splits it in two (one more segment), then the last frees
    give both back."""
    ops = [(0, 7 * MiB, 0), (0, 21 * MiB, 0), (0, 7 * MiB, 0), (1, 1, 0), (2, 0, 0), (1, 0, 0), (1, 0, 0), (2, 0, 0)]
    trace, stats = _run(ops, expandable_segments=True, stitch=False)
    assert stats["num_device_alloc"] == 3 and stats["segment.all.allocated"] == 2
    assert stats["segment.all.peak"] == 2 and stats["segment.all.freed"] == 2
    _counts_agree(trace, stats)
    r = replay(trace)
    assert (r.segment_allocs, r.device_allocs) == (2, 3)  # before: segment_allocs was 3, the map calls


def test_a_pytorch_snapshots_maps_are_counted_as_its_segments():
    """A PyTorch snapshot on expandable segments records map and unmap calls, imported under the plain
    names (``segment_alloc`` / ``segment_free``): its segments are the runs of mapped addresses, as its own
    ``segments`` list shows them, not one per call."""
    A = 1 << 40
    events = [("segment_alloc", A, 20 * MiB), ("segment_alloc", A + 20 * MiB, 20 * MiB),  # one run, grown
              ("alloc", A, 10 * MiB), ("alloc", A + 30 * MiB, 10 * MiB),
              ("segment_free", A + 12 * MiB, 16 * MiB),  # a hole in the middle: two runs
              ("free", A, 10 * MiB), ("segment_free", A, 12 * MiB),  # the first goes whole: one
              ("segment_alloc", A + 12 * MiB, 16 * MiB),  # the hole mapped again, onto the second's start
              ("free", A + 30 * MiB, 10 * MiB), ("segment_free", A + 12 * MiB, 28 * MiB)]  # all gone
    snapshot = {"snapshot": {"expandable_segments": True}}
    trace = Trace.from_events([(t, k, a, n, 0) for t, (k, a, n) in enumerate(events)], snapshot, format="torch")
    assert _calls(trace) == (3, 3)
    assert recorded_segments(trace) == (2, 2, 2)  # peak 2; the split made one, two went whole
    plain = Trace.from_events([(t, k, a, n, 0) for t, (k, a, n) in enumerate(events)], {}, format="torch")
    assert recorded_segments(plain) == (2, 3, 3)  # on plain segments every call is a segment
    assert recorded_segments(Trace.from_events([(0, "alloc", A, 512, 0)], {})) is None  # no segment events


def test_cupool_replay_shows_segments_beside_the_recordings_and_the_calls_apart(tmp_path, capsys):
    from cupool.cli import main

    pool = cupool.Pool("sim", capacity="128MiB", expandable_segments=True, stitch=False)
    with pool.record(tmp_path / "t.h5"):
        held = [pool.malloc(n * MiB) for n in (7, 21, 7)]  # one segment, grown by three maps
    stats = pool.stats()
    assert (stats["segment.all.peak"], stats["num_device_alloc"]) == (1, 3)
    assert main(["replay", str(tmp_path / "t.h5")]) == 0
    out = capsys.readouterr().out
    assert "peak segments      1 (recorded: 1)\n" in out
    assert "device calls       3 to allocate or map, 0 to free or unmap\n" in out
    del held
