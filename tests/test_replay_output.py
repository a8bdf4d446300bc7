"""What a replay says: its starting state, its rate, its device, its settings and its errors (issues 19, 20)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupool.cli import main
from cupool.replay import check_config, replay
from cupool.trace import TraceError, load_trace

MiB = 1 << 20
A, C = 1 << 32, 1 << 34


def _event(action: str, addr: int, size: int, t: int, stream: int = 0) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t, "frames": []}


def _cached_mid_run(path: Path) -> None:
    """A window opened mid-run on a cache: segment A (40 MiB) holds one old 20 MiB block, segment C
    (60 MiB) is wholly free; the window allocates and frees 30 MiB twice."""
    events = [_event("alloc", A + 20 * MiB, 12 * MiB, 1), _event("free_completed", A + 20 * MiB, 12 * MiB, 2),
              _event("alloc", C, 50 * MiB, 3), _event("free_completed", C, 50 * MiB, 4)]
    segments = [
        {"device": 0, "address": A, "total_size": 40 * MiB, "stream": 0, "segment_type": "large",
         "blocks": [{"address": A, "size": 20 * MiB, "requested_size": 20 * MiB, "state": "active_allocated"},
                    {"address": A + 20 * MiB, "size": 20 * MiB, "state": "inactive"}]},
        {"device": 0, "address": C, "total_size": 60 * MiB, "stream": 0, "segment_type": "large",
         "blocks": [{"address": C, "size": 60 * MiB, "state": "inactive"}]},
    ]
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [events]}))


def test_both_engines_start_a_mid_run_window_from_the_recorded_cache(tmp_path):
    """Before: the pool engine started fresh (6.20 against 3.64 GiB on a real trace)."""
    _cached_mid_run(tmp_path / "mid.pickle")
    trace = load_trace(tmp_path / "mid.pickle")
    fields = ("peak_reserved", "peak_allocated", "peak_segments", "segment_allocs", "segment_frees", "device_allocs",
              "device_frees", "ooms", "fragmentation_at_peak", "max_fragmentation", "mean_fragmentation")
    for cfg in ({"capacity": "1GiB"}, {"capacity": "1GiB", "release_threshold": 0}):
        fast, exact = replay(trace, cfg), replay(trace, cfg, engine="pool")
        assert {k: getattr(fast, k) for k in fields} == {k: getattr(exact, k) for k in fields}, cfg
        assert not exact.warnings
    kept = replay(trace, {"capacity": "1GiB"})
    assert kept.peak_reserved == 100 * MiB  # the recorded cache: A and C, and the window fits in them
    # release_threshold=0 would never have kept C: it goes back at the start, and the window's
    # 50 MiB block then needs a segment of its own.  On the recorded (plain) segments A stays whole
    # (40 MiB); on expandable ones its free tail goes back too, and its old 20 MiB block is left.
    eager = replay(trace, {"capacity": "1GiB", "release_threshold": 0})
    assert eager.peak_reserved == (40 + 50) * MiB and eager.device_frees >= 1
    eager = replay(trace, {"capacity": "1GiB", "release_threshold": 0, "expandable_segments": True})
    assert eager.peak_reserved == (20 + 50) * MiB and eager.device_frees >= 1


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1, max_size=8),
       st.lists(st.tuples(st.booleans(), st.integers(1, 30 << 20), st.integers(0, 99)), max_size=30),
       st.sampled_from([{}, {"release_threshold": 0}, {"initial_size": "8MiB"}, {"max_size": "100MiB"},
                        {"expandable_segments": True, "stitch": True},
                        {"expandable_segments": True, "stitch": True, "max_size": "100MiB", "initial_size": "8MiB"}]))
def test_engines_agree_on_generated_mid_run_windows(tmp_path_factory, segs, ops, cfg):
    """Random old segments (some holding an old block at their start, of half their size) and a random window."""
    segments, addr, old = [], 1 << 32, []
    for pages, used in segs:
        size = pages * 2 * MiB
        blocks = [{"address": addr, "size": size // 2, "requested_size": size // 2, "state": "active_allocated"}]
        segments.append({"device": 0, "address": addr, "total_size": size, "stream": 0, "segment_type": "large",
                         "blocks": blocks if used and size // 2 > MiB else []})
        if used and size // 2 > MiB:
            old.append(addr)
        addr += 1 << 30
    events, live, t = [], list(old), 0
    for is_alloc, size, which in ops:
        t += 1
        if is_alloc or not live:
            live.append((1 << 40) + t * (1 << 30))
            events.append(_event("alloc", live[-1], size, t))
        else:
            events.append(_event("free_completed", live.pop(which % len(live)), 0, t))
    path = tmp_path_factory.mktemp("gen") / "gen.pickle"
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [events]}))
    trace = load_trace(path)
    config = {"capacity": "512MiB", **cfg}
    fast, exact = replay(trace, config), replay(trace, config, engine="pool")
    fields = ("peak_reserved", "peak_allocated", "segment_allocs", "segment_frees", "device_allocs", "device_frees",
              "ooms", "peak_segments")
    assert {k: getattr(fast, k) for k in fields} == {k: getattr(exact, k) for k in fields}


def test_the_rate_counts_only_replayed_events_and_a_still_picture_has_none(tmp_path, capsys):
    _cached_mid_run(tmp_path / "mid.pickle")
    trace = load_trace(tmp_path / "mid.pickle")
    seeds = trace.config["seed"]["events"]
    for engine in ("numba", "pool"):
        r = replay(trace, {"capacity": "1GiB"}, engine=engine)
        assert (r.events, r.replayed) == (len(trace), len(trace) - seeds) and r.replayed == 4
        assert r.events_per_second == pytest.approx(4 / r.seconds)
    still = tmp_path / "still.pickle"
    still.write_bytes(pickle.dumps({"segments": [
        {"device": 0, "address": A, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
         "blocks": [{"address": A, "size": 20 * MiB, "requested_size": 20 * MiB, "state": "active_allocated"}]}]}))
    r = replay(load_trace(still))
    assert r.replayed == 0 and r.events_per_second is None
    assert main(["replay", str(still)]) == 0
    out = capsys.readouterr().out
    assert "a still picture: no events replayed" in out and "events/s" not in out


def _vmm_snapshot(folder: Path) -> Path:
    """A PyTorch snapshot recorded on expandable segments: one mapped range, a block made and freed in it."""
    events = [_event("segment_map", A, 20 * MiB, 1), _event("alloc", A, 12 * MiB, 2),
              _event("free_completed", A, 12 * MiB, 3)]
    path = folder / "vmm.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))
    return path


def test_a_recording_on_expandable_segments_says_so(tmp_path, capsys):
    path = _vmm_snapshot(tmp_path)
    assert main(["replay", str(path), "--config", "upstream=managed"]) == 0
    assert "warning: the recording ran on expandable segments; this replay uses plain segments from the managed" \
        in capsys.readouterr().out
    assert not replay(load_trace(path), {"expandable_segments": True}, engine="pool").warnings


def test_plain_segments_asked_for_are_not_warned_of(tmp_path, capsys):
    """Before: ``--compare recorded expandable_segments=false`` warned, on its second row, that the replay
    used plain segments, which is what that row asked for (issue 36, item 18)."""
    path = _vmm_snapshot(tmp_path)
    for engine in ("numba", "pool"):
        r = replay(load_trace(path), {"expandable_segments": False}, engine=engine)
        assert r.config["expandable_segments"] is False and not r.warnings
    for args in (["--config", "expandable_segments=false"], ["--compare", "recorded", "expandable_segments=false"]):
        assert main(["replay", str(path), *args]) == 0
        out = capsys.readouterr().out
        assert "expandable_segments=False" in out and "warning" not in out, out


def test_the_plain_segments_warning_reads_the_settings_the_pool_resolved(tmp_path, capsys):
    """Before: expandable_segments=None (the default: on wherever the device has virtual memory) was read
    as plain, and the replay warned that it used plain segments while it ran on expandable ones."""
    path = _vmm_snapshot(tmp_path)
    for engine in ("numba", "pool"):
        r = replay(load_trace(path), {"expandable_segments": None}, engine=engine)
        assert r.config["expandable_segments"] is True and not r.warnings
    assert main(["replay", str(path), "--config", "expandable_segments=none"]) == 0
    out = capsys.readouterr().out
    assert "warning" not in out and "expandable_segments=True, stitch=True" in out


def _two_devices(path: Path) -> None:
    """Device 0 holds only a marker; device 1 the program; device 2 nothing at all."""
    busy = [_event("alloc", A, 30 * MiB, 1), _event("free_completed", A, 30 * MiB, 2)]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_event("snapshot", 0, 0, 0)], busy, []]}))


def test_a_multi_device_snapshot_picks_the_program_and_takes_device(tmp_path, capsys):
    path = tmp_path / "multi.pickle"
    _two_devices(path)
    assert load_trace(path).config["snapshot"]["device"] == 1  # not device 0's lone marker
    assert len(load_trace(path, device=1)) == 2
    for d in (0, 2):
        with pytest.raises(TraceError, match=f"device {d} holds nothing in this snapshot.*devices that do: 1"):
            load_trace(path, device=d)
    assert main(["replay", str(path), "--device", "cuda:1"]) == 0
    assert "peak allocated     30 MiB" in capsys.readouterr().out
    assert main(["replay", str(path), "--device", "cuda:0"]) == 2
    assert "device 0 holds nothing" in capsys.readouterr().err


def test_the_configuration_line_and_the_result_agree_on_the_capacity(tmp_path, capsys):
    _two_devices(tmp_path / "multi.pickle")
    assert main(["replay", str(tmp_path / "multi.pickle"), "--capacity", "33MiB"]) == 0
    out = capsys.readouterr().out
    assert "configuration      capacity=34 MiB" in out and "capacity           34 MiB" in out


def test_the_help_lists_exactly_the_keys_each_engine_takes(capsys):
    from cupool.replay.config import POOL_ENGINE_KEYS

    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    numba_part, pool_part = text.split("the numba engine takes ")[1].split("; the pool engine takes ")
    numba_keys = numba_part.split(")")[0].split(";")[0].replace(",", " ").split()
    pool_keys = pool_part.split(")")[0].replace(",", " ").split()
    for key in numba_keys:
        check_config({key: 1}, "numba")
    assert tuple(pool_keys[:len(POOL_ENGINE_KEYS)]) == POOL_ENGINE_KEYS
    for key in POOL_ENGINE_KEYS:
        check_config({key: 1}, "pool")
        if key not in numba_keys:
            with pytest.raises(ValueError, match="only modelled by the pool engine"):
                check_config({key: 1}, "numba")


def test_an_error_names_what_was_given_not_the_whole_configuration(tmp_path):
    _two_devices(tmp_path / "multi.pickle")
    trace = load_trace(tmp_path / "multi.pickle")
    for engine in ("numba", "pool"):
        with pytest.raises(ValueError) as e:
            replay(trace, {"capacity": "64MiB", "initial_size": "128MiB"}, engine=engine)
        msg = str(e.value)
        assert "initial_size" in msg and "given: capacity=64MiB, initial_size=128MiB" in msg
        assert "defrag_threshold" not in msg and "{" not in msg


def test_compare_rows_stream_as_each_replay_finishes(tmp_path, capsys, monkeypatch):
    import cupool.replay.commands as commands

    _two_devices(tmp_path / "multi.pickle")
    seen = []
    real = commands.replay

    def spy(*a, **k):
        seen.append(capsys.readouterr().out)  # what was printed before this replay started
        return real(*a, **k)

    monkeypatch.setattr(commands, "replay", spy)
    assert main(["replay", str(tmp_path / "multi.pickle"), "--compare", "recorded", "release_threshold=0",
                 "--progress"]) == 0
    assert "recorded " not in seen[0] and any(line.startswith("recorded ") for line in seen[1].splitlines())
    assert "replay (numba engine)" in capsys.readouterr().err  # the bar, on stderr


def test_fragmentation_at_peak_is_never_above_the_maximum(tmp_path):
    """Before: the preallocated segment set the peak with nothing allocated, and its 1.000 was printed
    as the fragmentation at peak, above a maximum of 0.5; a seeded start state was not a sample either."""
    from cupool.trace import Trace

    trace = Trace.from_events([(0, "alloc", 1, 16 << 20, 0), (1, "free", 1, 16 << 20, 0)])
    for engine in ("numba", "pool"):
        r = replay(trace, {"capacity": "256MiB", "initial_size": "32MiB"}, engine=engine)
        assert r.peak_reserved == 32 << 20 and r.max_fragmentation == pytest.approx(0.5)
        assert r.fragmentation_at_peak == pytest.approx(0.5)
    _cached_mid_run(tmp_path / "mid.pickle")
    for engine in ("numba", "pool"):
        r = replay(load_trace(tmp_path / "mid.pickle"), {"capacity": "1GiB"}, engine=engine)
        assert 0 < r.fragmentation_at_peak <= r.max_fragmentation
