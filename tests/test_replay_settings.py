"""Which settings a replay runs with, and what ``cupool replay`` says before it runs (issues 25, 28).

"recorded" means the recorded allocator's settings: a cupool trace's own, a
PyTorch snapshot's kind of segments; a derived setting (``stitch``) follows what
it derives from; every row names the settings it ran with; and the command
refuses, compiles and explains before it prints its table.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

import cupool
from cupool.cli import main
from cupool.replay import replay
from cupool.trace import load_trace

MiB = 1 << 20
A, B = 1 << 32, 1 << 34


def _recorded_on_the_defaults(tmp_path: Path) -> Path:
    """A cupool trace recorded on a pool with the defaults (expandable segments, stitched)."""
    pool = cupool.Pool("sim", capacity="128MiB")
    assert (pool.config["expandable_segments"], pool.config["stitch"]) == (True, True)
    path = tmp_path / "run.h5"
    with pool.record(path):
        held = [pool.malloc(n * MiB) for n in (30, 12, 30, 3)]
        for i in (0, 2):
            held[i].free()
        pool.malloc(50 * MiB).free()
    return path


def _event(action: str, addr: int, size: int, t: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}


def _plain_snapshot(path: Path) -> None:
    """A PyTorch snapshot on plain segments: three 30 MiB segments, freed blocks, then a 50 MiB one.
    Plain segments need a fourth segment (140 MiB); expandable ones reuse the freed range (90 MiB)."""
    events = []
    for j in range(3):
        events += [_event("segment_alloc", A + j * 30 * MiB, 30 * MiB, 10 * j),
                   _event("alloc", A + j * 30 * MiB, 30 * MiB, 10 * j + 1)]
    events += [_event("free_completed", A + j * 30 * MiB, 30 * MiB, 40 + j) for j in range(3)]
    events += [_event("segment_alloc", B, 50 * MiB, 59), _event("alloc", B, 50 * MiB, 60)]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events],
                                   "allocator_settings": {"expandable_segments": False}}))


def _still(path: Path, expandable: bool | None) -> None:
    """A snapshot with no history: two segments, one live block each (``is_expandable`` as given)."""
    segments = []
    for base in (A, B):
        seg = {"device": 0, "address": base, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
               "blocks": [{"address": base, "size": 12 * MiB, "requested_size": 12 * MiB,
                           "state": "active_allocated"},
                          {"address": base + 12 * MiB, "size": 8 * MiB, "state": "inactive"}]}
        if expandable is not None:
            seg["is_expandable"] = expandable
        segments.append(seg)
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [[]]}))


# ------------------------------------------------------------ the settings
def test_the_readme_command_replays_a_defaults_recording_on_plain_segments(tmp_path, capsys):
    """Before: the recorded stitch=True did not follow expandable_segments=false, and the pool refused it."""
    path = _recorded_on_the_defaults(tmp_path)
    assert main(["replay", str(path), "--compare", "recorded", "expandable_segments=false"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith(("recorded ", "expandable_segments=false "))]
    assert len(rows) == 2
    assert "expandable_segments=True, stitch=True" in rows[0]
    assert "expandable_segments=False, stitch=False" in rows[1]
    trace = load_trace(path)
    for engine in ("numba", "pool"):
        r = replay(trace, {"expandable_segments": False}, engine=engine)
        assert (r.config["expandable_segments"], r.config["stitch"]) == (False, False)
    # What is given explicitly stays given: stitching without expandable segments is still refused.
    assert main(["replay", str(path), "--config", "expandable_segments=false,stitch=true"]) == 2
    assert "stitch=True" in capsys.readouterr().err


def test_a_cupool_trace_replays_under_exactly_its_recorded_settings(tmp_path):
    pool = cupool.Pool("sim", capacity="128MiB", expandable_segments=True, stitch=False, release_threshold="16MiB")
    path = tmp_path / "t.h5"
    with pool.record(path):
        for n in (30, 12, 30):
            pool.malloc(n * MiB).free()
    s = pool.stats()
    for engine in ("numba", "pool"):
        r = replay(load_trace(path), engine=engine)
        assert {k: r.config[k] for k in ("expandable_segments", "stitch", "release_threshold")} == \
            {"expandable_segments": True, "stitch": False, "release_threshold": 16 * MiB}
        assert (r.peak_reserved, r.device_allocs, r.device_frees) == \
            (s["reserved_bytes.all.peak"], s["num_device_alloc"], s["num_device_free"])


def test_a_plain_pytorch_snapshot_replays_on_plain_segments_and_report_agrees(tmp_path, capsys):
    """Before: "recorded" meant cupool's defaults for a PyTorch snapshot (90 MiB on expandable segments),
    while ``cupool report`` replayed its plain segments (140 MiB): two answers for one file."""
    from cupool.replay.report import report_data

    path = tmp_path / "plain.pickle"
    _plain_snapshot(path)
    trace = load_trace(path)
    r = replay(trace)
    assert (r.config["expandable_segments"], r.config["stitch"]) == (False, False)
    assert r.peak_reserved == 140 * MiB == report_data(trace).summary["peak_reserved"]
    assert main(["replay", str(path), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["settings"]["expandable_segments"] is False and row["settings"]["stitch"] is False
    assert row["peak_reserved"] == 140 * MiB
    # The report command says the same, and names the settings.
    assert main(["report", str(path), "-o", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "peak reserved 140 MiB" in out and "expandable_segments=False, stitch=False" in out
    # Expandable segments, given, stitch as the pool's default has it.
    r = replay(trace, {"expandable_segments": True})
    assert (r.config["stitch"], r.peak_reserved) == (True, 90 * MiB)


@pytest.mark.parametrize(("flag", "segments"), [(False, 2), (True, 1), (None, 2)])
def test_a_still_snapshot_keeps_its_kind_of_segments(tmp_path, flag, segments):
    """A still snapshot has no map events: its segments' ``is_expandable`` says what they were; PyTorch's
    expandable segments never stitch.  Before: every still snapshot replayed on cupool's defaults."""
    path = tmp_path / "still.pickle"
    _still(path, flag)
    r = replay(load_trace(path), {"capacity": "1GiB"})
    assert (r.config["expandable_segments"], r.config["stitch"]) == (bool(flag), False)
    assert r.peak_segments == segments


# ------------------------------------------------------------- the command
def test_every_setting_is_checked_before_the_first_replay(tmp_path, capsys, monkeypatch):
    """Before: the rows before a bad configuration ran (and printed) first."""
    import cupool.replay.commands as commands

    path = _recorded_on_the_defaults(tmp_path)
    ran = []
    monkeypatch.setattr(commands, "replay", lambda *a, **k: ran.append(a))
    assert main(["replay", str(path), "--compare", "recorded", "release_threshold=banana"]) == 2
    assert "release_threshold" in capsys.readouterr().err and not ran
    assert main(["replay", str(path), "--compare", "recorded", "initial_size=1TiB"]) == 2
    assert "initial_size" in capsys.readouterr().err and not ran


def test_the_engine_is_compiled_before_the_table_starts(tmp_path, capsys, monkeypatch):
    """Before: the compile notice (stderr) landed between the header and the first row."""
    import cupool.replay.numba_engine as numba_engine

    path = _recorded_on_the_defaults(tmp_path)
    printed = []
    real = numba_engine.prepare
    monkeypatch.setattr(numba_engine, "prepare", lambda trace: (printed.append(capsys.readouterr().out),
                                                                real(trace)))
    assert main(["replay", str(path), "--compare", "recorded", "release_threshold=0"]) == 0
    assert printed == [""]  # nothing of the output yet
    assert "configuration" in capsys.readouterr().out


def test_a_still_picture_compared_says_so(tmp_path, capsys):
    path = tmp_path / "still.pickle"
    _still(path, None)
    assert main(["replay", str(path), "--compare", "recorded", "expandable_segments=true", "release_threshold=0"]) == 0
    out = capsys.readouterr().out
    assert "no history to replay: the events above are only the 2 blocks alive" in out
    assert out.index("no history") < out.index("configuration")


def test_device_takes_a_name_as_info_does(tmp_path, capsys):
    path = tmp_path / "multi.pickle"
    busy = [_event("alloc", A, 30 * MiB, 1), _event("free_completed", A, 30 * MiB, 2)]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_event("snapshot", 0, 0, 0)], busy]}))
    for name in ("cuda:1", "sim:1", "CUDA:1", "1"):  # or a bare index, as torch takes one (issue 35 #4)
        assert main(["replay", str(path), "--device", name]) == 0, name
        assert "peak allocated     30 MiB" in capsys.readouterr().out
    assert main(["replay", str(path), "--device", "cuda"]) == 2  # device 0: only a marker
    assert "device 0 holds nothing" in capsys.readouterr().err
    for bad in ("gpu:1", "cuda:x", "-1"):
        assert main(["replay", str(path), "--device", bad]) == 2
        assert capsys.readouterr().err.startswith(f"cupool: error: --device {bad}: device")


@pytest.mark.parametrize("command", ["replay", "report"])
def test_help_describes_the_command_and_every_option(command, capsys):
    from cupool.replay.commands import REPLAY_DESCRIPTION, REPORT_DESCRIPTION, add_commands
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_commands(sub.add_parser)
    p = sub.choices[command]
    assert p.description == (REPLAY_DESCRIPTION if command == "replay" else REPORT_DESCRIPTION)
    for action in p._actions:
        assert action.help, (command, action.dest)
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert p.description.split(".")[0] in text
    if command == "report":  # report has no --engine: its help names no engines
        assert "engine" not in text
