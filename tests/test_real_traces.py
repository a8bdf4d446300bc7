"""PyTorch memory snapshots as they really are: windows that start mid-run, snapshots without
history, the old list form, expandable segments; and the CLI's single, compare and JSON output.

Synthetic snapshots are written here, where every figure is known; the two real ones in the
repository's sibling ``shared/traces/`` are read when that folder is present.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

import cupool
from cupool.cli import main
from cupool.replay import layout, replay
from cupool.trace import load_trace
from cupool.trace.importers import recorded_peak_allocated, recorded_peak_reserved

MiB = 1 << 20
A = 1 << 32  # a large segment that was there before recording started
B = 1 << 33  # a small one, freed during the window
SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
GiB = 1 << 30
#: The capacity source of the mid-run snapshot, whose segments A and B reserve 22 MiB.
_SIZED_22 = "1.25x the recorded peak reserved 22 MiB; the snapshot does not record the device's total"
_SAME = ("peak_allocated", "ooms", "unmatched_frees", "seeded_blocks", "history")


def _event(action: str, addr: int, size: int, t: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}


def _mid_run(path: Path) -> None:
    """A window switched on mid-run: W (6 MiB) and X (3 MiB) in segment A and b (1000 B) in small
    segment B were allocated before it.  The recorded allocated peak is W + Y + Z = 15 MiB + 512.
    """
    events = [
        _event("free_requested", A + 6 * MiB, 3 * MiB, 1),
        _event("free_completed", A + 6 * MiB, 3 * MiB, 2),  # X
        _event("free_completed", B, 1000, 3),  # b
        _event("segment_free", B, 2 * MiB, 4),
        _event("alloc", A + 6 * MiB, 4 * MiB, 5),  # Y
        _event("alloc", A + 10 * MiB, 5 * MiB + 100, 6),  # Z
        _event("free_completed", A + 6 * MiB, 4 * MiB, 7),
    ]
    segment = {"device": 0, "address": A, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
               "blocks": [{"address": A, "size": 6 * MiB, "requested_size": 6 * MiB, "state": "active_allocated"},
                          {"address": A + 6 * MiB, "size": 4 * MiB, "requested_size": 0, "state": "inactive"},
                          {"address": A + 10 * MiB, "size": 5 * MiB + 512, "requested_size": 5 * MiB + 100,
                           "state": "active_allocated"},
                          {"address": A + 15 * MiB + 512, "size": 5 * MiB - 512, "requested_size": 0,
                           "state": "inactive"}]}
    path.write_bytes(pickle.dumps({"segments": [segment], "device_traces": [events]}))


@pytest.mark.parametrize("engine", ["numba", "pool"])
def test_blocks_from_before_the_window_are_seeded(tmp_path, engine):
    _mid_run(tmp_path / "mid.pickle")
    trace = load_trace(tmp_path / "mid.pickle")
    assert recorded_peak_allocated(trace) == 15 * MiB + 512
    r = replay(trace, {"capacity": "1GiB"}, engine=engine)
    assert r.peak_allocated == 15 * MiB + 512  # 9 MiB + 512 without the seed
    assert (r.seeded_blocks, r.unmatched_frees, r.ooms, r.history) == (3, 0, 0, True)


def test_both_engines_agree_on_a_seeded_snapshot(tmp_path):
    _mid_run(tmp_path / "mid.pickle")
    trace = load_trace(tmp_path / "mid.pickle")
    fast, exact = (replay(trace, {"capacity": "1GiB"}, engine=e) for e in ("numba", "pool"))
    assert {k: getattr(fast, k) for k in _SAME} == {k: getattr(exact, k) for k in _SAME}


def test_a_snapshot_without_history_is_a_still_picture(tmp_path, capsys):
    # The old list form of torch.cuda.memory_snapshot(): blocks have no address, they lie end to end.
    segments = [{"device": 0, "address": A, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
                 "blocks": [{"size": 8 * MiB, "requested_size": 8 * MiB - 10, "state": "active_allocated"},
                            {"size": 4 * MiB, "state": "inactive"},
                            {"size": 8 * MiB, "requested_size": 8 * MiB, "state": "active_allocated"}]},
                {"device": 0, "address": B, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
                 "blocks": [{"size": 512, "requested_size": 300, "state": "active_allocated"},
                            {"size": 2 * MiB - 512, "state": "inactive"}]}]
    old, new = tmp_path / "list.pickle", tmp_path / "nohistory.pickle"
    old.write_bytes(pickle.dumps(segments))
    new.write_bytes(pickle.dumps({"segments": segments, "device_traces": [[_event("snapshot", 0, 0, 1)]]}))
    for path in (old, new):
        trace = load_trace(path)
        r = replay(trace, {"capacity": "1GiB"})
        assert (r.history, r.seeded_blocks, r.unmatched_frees) == (False, 3, 0)
        assert r.peak_allocated == recorded_peak_allocated(trace) == 16 * MiB + 512
        assert r.peak_reserved == 22 * MiB
        segs = layout(trace, {"capacity": "1GiB"})
        assert [(s["size"], s["kind"]) for s in segs] == [(20 * MiB, "large"), (2 * MiB, "small")]
        assert segs[0]["blocks"] == [(0, 8 * MiB, True), (8 * MiB, 4 * MiB, False), (12 * MiB, 8 * MiB, True)]
        assert main(["replay", str(path), "--config", "capacity=1GiB"]) == 0
        out = capsys.readouterr().out
        assert "no history to replay" in out
        assert "2 segments, 3 live blocks, 2 free blocks (6 MiB, the largest 4 MiB)" in out


@pytest.mark.parametrize("case", ["whole", "grown", "unmapped"])
def test_expandable_segments_replay(tmp_path, case):
    """Maps and unmaps of an expandable segment at A.  "whole": the window maps it all.
    "grown": its first 20 MiB, and a live 8 MiB block in them, predate the window, which then
    grows it by 20 MiB: only those first 20 MiB are seeded.  "unmapped": as "whole", but the
    second 20 MiB are unmapped again before the end."""
    events = [] if case == "grown" else [_event("segment_map", A, 20 * MiB, 1), _event("alloc", A, 8 * MiB, 2)]
    events += [
        _event("alloc", A + 8 * MiB, 8 * MiB, 3),
        _event("segment_map", A + 20 * MiB, 20 * MiB, 4),
        _event("alloc", A + 16 * MiB, 16 * MiB, 5),  # across the two mappings
        _event("free_completed", A + 8 * MiB, 8 * MiB, 6),
        _event("free_completed", A + 16 * MiB, 16 * MiB, 7),
    ]
    total = 40 * MiB
    if case == "unmapped":
        events.append(_event("segment_unmap", A + 20 * MiB, 20 * MiB, 8))
        total = 20 * MiB
    segment = {"device": 0, "address": A, "total_size": total, "stream": 0, "segment_type": "large",
               "is_expandable": True,
               "blocks": [{"address": A, "size": 8 * MiB, "requested_size": 8 * MiB, "state": "active_allocated"},
                          {"address": A + 8 * MiB, "size": total - 8 * MiB, "state": "inactive"}]}
    path = tmp_path / "expandable.pickle"
    path.write_bytes(pickle.dumps({"segments": [segment], "device_traces": [events]}))
    trace = load_trace(path)
    grown = case == "grown"
    assert trace.config["seed"]["events"] == (2 if grown else 0)
    if grown:
        assert (trace.kinds[trace.kind[0]], int(trace.size[0])) == ("segment_alloc", 20 * MiB)
    for engine in ("numba", "pool"):
        r = replay(trace, {"capacity": "1GiB"}, engine=engine)
        assert r.peak_allocated == recorded_peak_allocated(trace) == 32 * MiB
        assert (r.seeded_blocks, r.unmatched_frees, r.ooms) == (int(grown), 0, 0)


def test_single_run_output_counts_seeded_blocks(tmp_path, capsys):
    _mid_run(tmp_path / "mid.pickle")
    assert main(["replay", str(tmp_path / "mid.pickle"), "--config", "capacity=1GiB"]) == 0
    out = capsys.readouterr().out
    assert "seeded blocks      3 (alive before the recording started" in out
    assert "unmatched frees    0" in out and "(recorded: 15 MiB)" in out
    assert "capacity           1 GiB (from --config)" in out and "no history" not in out


def test_compare_shows_seeded_blocks_and_unmatched_frees_and_whole_labels(tmp_path, capsys):
    _mid_run(tmp_path / "mid.pickle")
    label = "capacity=1GiB,release_threshold=0,initial_size=0,max_size=900MiB"
    assert main(["replay", str(tmp_path / "mid.pickle"), "--compare", "capacity=1GiB", label]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.startswith("configuration"))
    assert "seeded" in header and "unmatched" in header
    row = next(line for line in out if line.startswith(label + " "))
    ran_with = header.index("ran with")
    assert row[:ran_with].split()[-3:-1] == ["3", "0"]
    # Each row names the settings it ran with, those left to the pool resolved (issue 25).
    assert row[ran_with:].startswith("initial_size=0 B, max_size=900MiB, release_threshold=0 B, "
                                     "release_before_split=True, expandable_segments=False, stitch=False")
    assert "peak allocated 15 MiB" in next(line for line in out if line.startswith("recorded: "))


def test_json_prints_one_object_per_configuration(tmp_path, capsys):
    _mid_run(tmp_path / "mid.pickle")
    assert main(["replay", str(tmp_path / "mid.pickle"), "--json",
                 "--compare", "capacity=1GiB", "recorded"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["configuration"] for r in rows] == ["capacity=1GiB", "recorded"]
    first = rows[0]
    assert first["peak_allocated"] == first["recorded_peak_allocated"] == 15 * MiB + 512
    assert (first["seeded_blocks"], first["unmatched_frees"], first["ooms"]) == (3, 0, 0)
    assert (first["capacity"], first["capacity_source"]) == (1 << 30, "from --config")
    assert (rows[1]["capacity"], rows[1]["capacity_source"]) == (28 * MiB, _SIZED_22)
    for key in ("peak_reserved", "max_fragmentation", "mean_fragmentation", "fragmentation_at_peak",
                "peak_segments", "events_per_second", "history"):
        assert key in first


@pytest.mark.parametrize("engine", ["numba", "pool"])
def test_the_device_is_sized_from_the_recorded_peak_reserved(tmp_path, engine):
    """A 6 GiB program on the 4 GiB default device ran out of memory at every step; sized from
    its trace (a 6 GiB segment, then a 1 GiB one while it is still held), it runs."""
    events = [_event("segment_alloc", A, 6 * GiB, 1), _event("alloc", A, 6 * GiB, 2),
              _event("segment_alloc", B, GiB, 3), _event("alloc", B, GiB, 4),
              _event("free_completed", A, 6 * GiB, 5), _event("segment_free", A, 6 * GiB, 6)]
    path = tmp_path / "big.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))
    trace = load_trace(path)
    assert recorded_peak_reserved(trace) == 7 * GiB
    r = replay(trace, engine=engine)
    assert (r.capacity, r.ooms, r.peak_reserved, r.peak_allocated) == (8960 * MiB, 0, 7 * GiB, 7 * GiB)
    old = replay(trace, {"capacity": "4GiB"}, engine=engine)  # the old default device
    assert (old.ooms, old.peak_allocated) == (1, GiB)


def test_sized_capacity_rounds_up_to_a_page_and_is_said(tmp_path, capsys):
    _mid_run(tmp_path / "mid.pickle")
    path = str(tmp_path / "mid.pickle")
    trace = load_trace(path)
    assert recorded_peak_reserved(trace) == 22 * MiB  # seeded A (20 MiB) and B (2 MiB)
    assert replay(trace).capacity == 28 * MiB  # 27.5 MiB, rounded up to 2 MiB
    assert main(["replay", path]) == 0
    assert f"capacity           28 MiB ({_SIZED_22})" in capsys.readouterr().out
    assert main(["replay", path, "--capacity", "1GiB"]) == 0
    assert "capacity           1 GiB (from --capacity)" in capsys.readouterr().out
    assert main(["replay", path, "--json", "--capacity", "64MiB", "--compare", "recorded", "release_threshold=0"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(r["capacity"], r["capacity_source"]) for r in rows} == {(64 * MiB, "from --capacity")}
    assert main(["replay", path, "--capacity", "1GiB", "--config", "capacity=2GiB"]) == 2
    assert "give the capacity once" in capsys.readouterr().err


def test_report_says_the_capacity_and_the_ooms(tmp_path, capsys):
    _mid_run(tmp_path / "mid.pickle")
    path, out = str(tmp_path / "mid.pickle"), str(tmp_path / "r.png")
    plain = ["--config", "expandable_segments=false"]  # plain segments: 16 MiB is too small for them
    assert main(["report", path, "-o", out, *plain]) == 0
    assert f"capacity 28 MiB ({_SIZED_22}); 0 OOMs" in capsys.readouterr().out
    assert main(["report", path, "-o", out, "--capacity", "16MiB", *plain]) == 0
    said = capsys.readouterr().out
    assert "capacity 16 MiB (from --capacity); " in said and "; 0 OOMs" not in said


def test_a_snapshot_without_segments_keeps_the_default_device(tmp_path):
    path = tmp_path / "bare.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_event("alloc", A, MiB, 1)]]}))
    trace = load_trace(path)
    assert recorded_peak_reserved(trace) is None
    assert replay(trace).capacity == 4 * GiB


def _phases(path: Path, between: str) -> None:
    """Three 30 MiB blocks, each in its own segment, freed; then ``between``; then a 50 MiB block.

    "empty_cache": the program gave the three segments back (a burst of segment frees);
    "retry": PyTorch freed one to retry a device allocation that failed, then mapped the new
    segment (the replay's own ladder decides that); "nothing": the cache was kept.
    """
    events = []
    for j in range(3):
        events += [_event("segment_alloc", A + j * 30 * MiB, 30 * MiB, 10 * j),
                   _event("alloc", A + j * 30 * MiB, 30 * MiB, 10 * j + 1)]
    events += [_event("free_completed", A + j * 30 * MiB, 30 * MiB, 40 + j) for j in range(3)]
    if between == "empty_cache":
        events += [_event("segment_free", A + j * 30 * MiB, 30 * MiB, 50 + j) for j in range(3)]
    elif between == "retry":
        events += [_event("segment_free", A, 30 * MiB, 50), _event("segment_alloc", B, 50 * MiB, 51)]
    events.append(_event("alloc", B, 50 * MiB, 60))
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))


@pytest.mark.parametrize(("between", "peak", "segment_frees"),
                         [("empty_cache", 90 * MiB, 3), ("retry", 140 * MiB, 0), ("nothing", 140 * MiB, 0)])
def test_the_programs_own_empty_cache_is_followed(tmp_path, between, peak, segment_frees):
    _phases(tmp_path / "phases.pickle", between)
    trace = load_trace(tmp_path / "phases.pickle")
    plain = {"capacity": "1GiB", "expandable_segments": False}  # the figures are plain segments
    fast, exact = (replay(trace, plain, engine=e) for e in ("numba", "pool"))
    for r in (fast, exact):
        assert (r.peak_reserved, r.segment_frees, r.peak_allocated, r.ooms) == (peak, segment_frees, 90 * MiB, 0)
    assert fast.fragmentation_at_peak == exact.fragmentation_at_peak
    timeline = replay(trace, plain, timeline=True).timeline
    assert timeline is not None and int(timeline["reserved"][-1]) == (50 if between == "empty_cache" else 140) * MiB


@pytest.mark.parametrize(("between", "segment_frees", "final"),
                         [("empty_cache", 1, 50 * MiB), ("retry", 0, 90 * MiB), ("nothing", 0, 90 * MiB)])
def test_the_programs_own_empty_cache_is_followed_on_the_defaults(tmp_path, between, segment_frees, final):
    """Pool's defaults: the three 30 MiB blocks share one growing segment, so once freed they are one 90 MiB
    hole that holds the 50 MiB block (peak 90 MiB either way); the program's empty_cache unmaps that one
    segment whole, and only then does the 50 MiB block map its own."""
    _phases(tmp_path / "phases.pickle", between)
    trace = load_trace(tmp_path / "phases.pickle")
    defaults = {"capacity": "1GiB", "expandable_segments": None}  # not the recorded (plain) segments
    fast, exact = (replay(trace, defaults, engine=e) for e in ("numba", "pool"))
    for r in (fast, exact):
        assert (r.peak_reserved, r.segment_frees, r.peak_allocated, r.ooms) == (90 * MiB, segment_frees, 90 * MiB, 0)
    timeline = replay(trace, defaults, timeline=True).timeline
    assert timeline is not None and int(timeline["reserved"][-1]) == final


def test_a_cupool_trace_is_not_given_extra_empty_caches(tmp_path):
    """cupool's recorded settings reproduce its own segment frees: a replay adds none."""
    pool = cupool.Pool("sim", capacity="256MiB", release_threshold=0)
    with pool.record(tmp_path / "t.h5"):
        for _ in range(3):
            pool.malloc(30 * MiB).free()
    trace = load_trace(tmp_path / "t.h5")
    for engine in ("numba", "pool"):
        assert replay(trace, engine=engine).device_frees == pool.stats()["num_device_free"] == 3


def _shared(name: str) -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"the real snapshots are not here ({SHARED} is absent; it is not part of the repository)")
    return SHARED / name


def test_real_snapshot_with_history_replays_at_its_recorded_peak():
    trace = load_trace(_shared("zidongliu_decomfl_memory.pickle"))
    r = replay(trace, {"capacity": "8GiB"})
    assert r.peak_allocated == recorded_peak_allocated(trace) == 1_783_665_152
    assert (r.history, r.seeded_blocks, r.unmatched_frees, r.ooms) == (True, 0, 0, 0)
    # Plain segments: 61 of them, 1,897,922,560 bytes, all allocated in the window and kept.
    sized = replay(trace, {"expandable_segments": False})
    assert recorded_peak_reserved(trace) == 1_897_922_560
    assert (sized.capacity, sized.ooms, sized.peak_reserved) == (2_373_976_064, 0, 1_897_922_560)
    # The recorded settings are the recorded allocator's: plain segments (the snapshot says
    # expandable_segments False), so the replay reproduces its reserved peak.  Before (issue 25): cupool's
    # defaults, 1.69 GiB, while ``cupool report`` on the same file said 1.77 GiB.
    recorded = replay(trace)
    assert (recorded.config["expandable_segments"], recorded.config["stitch"]) == (False, False)
    assert recorded.peak_reserved == sized.peak_reserved
    # Pool's defaults (expandable segments, stitched) on the same device: issue 19's target, no more reserved
    # than the recorded allocator's, and both engines agree on it.
    fast, exact = (replay(trace, {"expandable_segments": None}, engine=e) for e in ("numba", "pool"))
    assert fast.config["stitch"] is True  # stitch follows expandable_segments, not the recorded False
    assert fast.peak_reserved == exact.peak_reserved and fast.ooms == exact.ooms == 0
    assert fast.capacity == 2_373_976_064 and r.peak_allocated <= fast.peak_reserved < 1_897_922_560


def test_real_snapshot_without_history_is_a_still_picture():
    trace = load_trace(_shared("yiyi_6a8eab0_oom_snapshot.pickle"))
    r = replay(trace, {"capacity": "16GiB", "expandable_segments": False})  # plain: its recorded segments
    # The snapshot's own marker event carries the allocated total: 11,840,159,744 bytes.
    assert r.peak_allocated == recorded_peak_allocated(trace) == 11_840_159_744
    assert (r.history, r.seeded_blocks, r.unmatched_frees, r.ooms, r.peak_segments) == (False, 460, 0, 0, 176)
    sized = replay(trace)  # its 176 segments hold 11,844,714,496 bytes: 11 GiB, past the 4 GiB default
    assert recorded_peak_reserved(trace) == 11_844_714_496
    assert (sized.capacity, sized.ooms, sized.peak_allocated) == (14_805_893_120, 0, 11_840_159_744)
    # The recorded settings are its allocator's plain segments: its 176, not 2 expandable ones (issue 25).
    assert (sized.peak_segments, sized.peak_reserved) == (176, 11_844_714_496)


def test_a_device_smaller_than_the_seeded_segments_replays_on_both_engines(tmp_path):
    """Seeded segments that do not all fit: the rest are allocated the ordinary way, whose reclaim
    ladder must not give back seeded segments still waiting for their blocks (the numba engine
    used to corrupt its state there and never return)."""
    import threading

    segments = []
    for i in range(6):  # big and small alternate, so that small ones still fit after big ones stop fitting
        base = A + i * 16 * MiB
        segments.append({"device": 0, "address": base, "total_size": 10 * MiB, "stream": 0, "segment_type": "large",
                         "blocks": [{"address": base, "size": 9 * MiB, "requested_size": 9 * MiB,
                                     "state": "active_allocated"},
                                    {"address": base + 9 * MiB, "size": MiB, "state": "inactive"}]})
        segments.append({"device": 0, "address": base + 12 * MiB, "total_size": 2 * MiB, "stream": 0,
                         "segment_type": "large",
                         "blocks": [{"address": base + 12 * MiB, "size": MiB + 512 * 1024,
                                     "requested_size": MiB + 512 * 1024, "state": "active_allocated"},
                                    {"address": base + 13 * MiB + 512 * 1024, "size": 512 * 1024,
                                     "state": "inactive"}]})
    path = tmp_path / "seeded.pickle"
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [[_event("snapshot", 0, 0, 1)]]}))
    trace = load_trace(path)
    out = {}

    def run():
        out["numba"] = replay(trace, {"capacity": "40MiB"})
        out["pool"] = replay(trace, {"capacity": "40MiB"}, engine="pool")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(180)  # a cold cache compiles the engine first
    assert not t.is_alive(), "the replay never returned"
    # The pool engine rebuilds the seed by ordinary allocation (it warns so): on a seed that does
    # not fit, its placement may differ by a block, so the engines are held to the device, not each other.
    for r in out.values():
        assert r.seeded_blocks == 12 and r.ooms > 0
        assert r.peak_allocated <= r.peak_reserved <= 40 * MiB


def test_a_real_snapshot_on_a_device_smaller_than_its_seeded_segments_returns():
    """The no-history snapshot on 11 GB (its live blocks need 11.04 GB): the numba engine used to
    corrupt its state while seeding and never return; both engines now report the same OOMs."""
    import threading

    trace = load_trace(_shared("yiyi_6a8eab0_oom_snapshot.pickle"))
    out = {}

    def run():
        out["numba"] = replay(trace, {"capacity": 11_000_000_000})
        out["pool"] = replay(trace, {"capacity": 11_000_000_000}, engine="pool")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(180)  # a cold cache compiles the engine first
    assert not t.is_alive(), "the replay never returned"
    assert out["numba"].ooms == out["pool"].ooms > 0
    assert out["numba"].peak_reserved == out["pool"].peak_reserved <= 11_000_000_000
