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

from cupool.cli import main
from cupool.replay import layout, replay
from cupool.trace import load_trace
from cupool.trace.importers import recorded_peak_allocated

MiB = 1 << 20
A = 1 << 32  # a large segment that was there before recording started
B = 1 << 33  # a small one, freed during the window
SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
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
    assert "seeded blocks      3 (alive before the recording started)" in out
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
    assert row.split()[-3:-1] == ["3", "0"]
    assert "recorded allocated peak: 15 MiB" in out[-1]


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
    assert rows[1]["capacity_source"] == "the sim device's default"
    for key in ("peak_reserved", "max_fragmentation", "mean_fragmentation", "fragmentation_at_peak",
                "peak_segments", "events_per_second", "history"):
        assert key in first


def _shared(name: str) -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"the real snapshots are not here ({SHARED} is absent; it is not part of the repository)")
    return SHARED / name


def test_real_snapshot_with_history_replays_at_its_recorded_peak():
    trace = load_trace(_shared("zidongliu_decomfl_memory.pickle"))
    r = replay(trace, {"capacity": "8GiB"})
    assert r.peak_allocated == recorded_peak_allocated(trace) == 1_783_665_152
    assert (r.history, r.seeded_blocks, r.unmatched_frees, r.ooms) == (True, 0, 0, 0)


def test_real_snapshot_without_history_is_a_still_picture():
    trace = load_trace(_shared("yiyi_6a8eab0_oom_snapshot.pickle"))
    r = replay(trace, {"capacity": "16GiB"})
    # The snapshot's own marker event carries the allocated total: 11,840,159,744 bytes.
    assert r.peak_allocated == recorded_peak_allocated(trace) == 11_840_159_744
    assert (r.history, r.seeded_blocks, r.unmatched_frees, r.ooms, r.peak_segments) == (False, 460, 0, 0, 176)
