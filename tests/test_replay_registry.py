"""The replay's settings come from the registry (issue 25), and the replay knows upstreams (issue 27).

``--config`` keys, a trace's recorded settings and the numba engine's
configuration slots are all read from ``cupool.settings``; a replay with
``upstream=managed`` runs both engines on managed memory, which may hold more
than the device, and says by how much.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

import cupool
from cupool import settings
from cupool.cli import main
from cupool.replay import check_config, recorded_config, replay
from cupool.replay.config import accepted_keys, sim_pool
from cupool.replay.engine_layout import CFG_SLOTS, SETTING_SLOTS, config_array
from cupool.trace import Trace, load_trace

MiB = 1 << 20


def _oversubscribing(n: int = 5) -> Trace:
    """``n`` live 20 MiB blocks on a 64 MiB device, recorded on plain segments: three fit the device, all
    five fit managed memory."""
    events = [(i, "alloc", (1 << 32) + i * 32 * MiB, 20 * MiB, 0) for i in range(n)]
    events += [(n + i, "free", (1 << 32) + i * 32 * MiB, 20 * MiB, 0) for i in range(n)]
    return Trace.from_events(events, {"capacity": 64 * MiB, "expandable_segments": False, "stitch": False})


def _sample(s: settings.Setting, resolved: object) -> object:
    """A value of ``s`` other than what a pool resolves it to by default."""
    if s.kind == "flag":
        return not resolved
    if s.choices:
        return next(c for c in s.choices if c != resolved)
    return {"size": "8MiB", "fraction": 0.5, "threshold": 0.1}[s.kind]


def test_every_engine_setting_has_a_slot_and_reaches_the_engine():
    trace = _oversubscribing()
    base = {"capacity": "128MiB"}
    probe = sim_pool(base, trace)
    default = config_array(probe.config)
    assert SETTING_SLOTS == CFG_SLOTS[-len(SETTING_SLOTS):] and len(set(CFG_SLOTS)) == len(CFG_SLOTS)
    for s in settings.SETTINGS:
        if not s.engine:
            continue
        assert s.engine_slot in SETTING_SLOTS, s.name
        given = {**base, s.name: _sample(s, probe.config.get(s.name))}
        cfg = config_array(sim_pool(given, trace).config)
        assert cfg[CFG_SLOTS.index(s.engine_slot)] != default[CFG_SLOTS.index(s.engine_slot)], s.name
    # Derived slots follow what they derive from: managed memory lets plain segments take the whole span.
    managed = config_array(sim_pool({**base, "upstream": "managed"}, trace).config)
    holds = CFG_SLOTS.index("holds")
    assert (default[holds], managed[holds]) == (128 * MiB, 256 * MiB)


def test_every_recorded_setting_is_read_back_from_a_trace(tmp_path):
    given = {"capacity": "64MiB", "initial_size": "4MiB", "max_size": "48MiB", "memory_fraction": 0.75,
             "release_threshold": "8MiB", "defrag_threshold": None, "release_before_split": False,
             "spill": "host", "spill_policy": "fifo", "expandable_segments": False, "stitch": False,
             "upstream": "managed"}
    assert set(settings.names(recorded=True)) <= set(given)  # a new recorded setting gets a value here
    pool = cupool.Pool("sim", **given)
    with pool.record(tmp_path / "t.h5"):
        pool.malloc(MiB).free()
    trace = load_trace(tmp_path / "t.h5")
    held = {**pool.config, "spill": "host", "spill_policy": "fifo"}
    for engine in ("numba", "pool"):
        rec = recorded_config(trace, engine)
        assert set(rec) == {k for k in settings.names(recorded=True) if k in accepted_keys(engine)}
        assert rec == {k: held[k] for k in rec}
        r = replay(trace, engine=engine)
        assert (r.config["upstream"], r.config["release_before_split"]) == ("managed", False)


def test_a_new_setting_in_the_registry_is_a_replay_key_without_replay_edits(monkeypatch, capsys):
    new = settings.Setting("frobnicate", "flag", False, "pool", conf=True, recorded=True, engine=False,
                           help="a setting added to the registry")
    monkeypatch.setattr(settings, "SETTINGS", settings.SETTINGS + (new,))
    monkeypatch.setattr(settings, "BY_NAME", {**settings.BY_NAME, new.name: new})
    check_config({"frobnicate": True}, "pool")
    with pytest.raises(ValueError, match="'frobnicate' is only modelled by the pool engine"):
        check_config({"frobnicate": True}, "numba")
    monkeypatch.setattr(settings, "SETTINGS", settings.SETTINGS[:-1] + (replace(new, engine=True),))
    check_config({"frobnicate": True}, "numba")
    trace = Trace.from_events([(0, "alloc", 1 << 32, MiB, 0)], {"capacity": 64 * MiB, "frobnicate": True})
    assert recorded_config(trace, "numba")["frobnicate"] is True  # recorded: "recorded" replays under it
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    assert "frobnicate" in " ".join(capsys.readouterr().out.split()).split("the numba engine takes ")[1]


def test_a_follower_chain_follows_a_new_upstream():
    recorded = {"expandable_segments": True, "stitch": True, "upstream": "device"}
    assert settings.resolve_derived({"upstream": "managed"}, recorded) == {
        "expandable_segments": None, "stitch": None, "upstream": "managed"}
    assert settings.resolve_derived({"upstream": "device"}, recorded) == recorded
    assert settings.resolve_derived({"expandable_segments": True}, recorded) == recorded


def test_a_trace_that_runs_out_on_the_device_fits_on_managed_memory_on_both_engines():
    trace = _oversubscribing()
    figures = {}
    for engine in ("numba", "pool"):
        for upstream in ("device", "async", "managed"):
            r = replay(trace, {"upstream": upstream}, engine=engine)
            assert r.upstream == r.config["upstream"] == upstream
            row = r.as_dict()
            figures[engine, upstream] = {k: v for k, v in row.items() if k not in ("engine", "seconds", "config")}
    device = figures["pool", "device"]
    assert (device["ooms"], device["peak_reserved"], device["peak_oversubscribed"]) == (2, 60 * MiB, 0)
    managed = figures["pool", "managed"]
    assert (managed["ooms"], managed["peak_reserved"], managed["peak_oversubscribed"]) == (0, 100 * MiB, 36 * MiB)
    assert figures["pool", "async"] == device  # stream-ordered memory places as the device does
    for upstream in ("device", "async", "managed"):
        assert figures["numba", upstream] == figures["pool", upstream], upstream


def test_a_defaults_recording_replays_on_managed_memory_from_the_command_line(tmp_path, capsys):
    pool = cupool.Pool("sim", capacity="64MiB")
    assert pool.config["expandable_segments"]  # recorded on the defaults: expandable segments, stitched
    path = tmp_path / "run.h5"
    with pool.record(path):
        held = []
        for _ in range(5):
            try:
                held.append(pool.malloc(20 * MiB))
            except cupool.OutOfMemoryError:
                pass
        for h in held:
            h.free()
    assert main(["replay", str(path), "--compare", "recorded", "upstream=managed"]) == 0
    out = capsys.readouterr().out
    assert "oversub" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("recorded", "upstream="))}
    assert "upstream=device" in rows["recorded"] and "expandable_segments=True" in rows["recorded"]
    assert "upstream=managed" in rows["upstream=managed"] and "expandable_segments=False" in rows["upstream=managed"]
    assert main(["replay", str(path), "--config", "upstream=managed", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["upstream"], row["ooms"], row["peak_oversubscribed"]) == ("managed", 0, 16 * MiB)
    assert main(["replay", str(path), "--config", "upstream=managed"]) == 0
    assert "upstream           managed (peak oversubscribed 16 MiB" in capsys.readouterr().out


def test_an_unknown_upstream_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="upstream must be one of device, managed, async, got 'host'"):
        replay(_oversubscribing(), {"upstream": "host"}, engine="pool")



def test_the_readme_lists_the_replay_settings():
    text = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    listed = text.split("Settings (`--config`, from the registry `cupool.settings`): ")[1].split(" (an unset")[0]
    assert re.findall(r"`([a-z_]+)`", listed) == list(accepted_keys("numba"))


def test_the_report_says_how_far_managed_memory_went_past_the_device(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="cupool report draws with matplotlib")
    path = tmp_path / "t.h5"
    pool = cupool.Pool("sim", capacity="64MiB", expandable_segments=False)
    with pool.record(path):
        held = [pool.malloc(20 * MiB) for _ in range(3)]
        for h in held:
            h.free()
    out = str(tmp_path / "r.png")
    assert main(["report", str(path), "-o", out, "--config", "upstream=managed,capacity=32MiB"]) == 0
    err = capsys.readouterr()
    assert "managed memory, peak oversubscribed 28 MiB" in err.out + err.err


def test_the_engine_slots_keep_their_numbers():
    """A tripwire: Numba's cache is keyed on each engine module's source, not on these numbers, so a
    change that renumbers the slots must also edit the engine modules that read them, or clear the
    Numba cache (docs/design.md, "Settings").  Then update this list."""
    assert CFG_SLOTS == ("span", "vspan", "arena", "holds", "capacity", "initial_size", "limit",
                         "release_threshold", "release_before_split", "expandable_segments", "stitch", "upstream")


def test_the_default_engine_honours_the_settings_to_be_replayed():
    """Before: ``default_engine(trace, *configs)`` ignored ``configs``, so ``replay(trace, {"spill": "host"})``
    picked the numba engine and then refused the key it had been given ("only modelled by the pool
    engine: use --engine pool").  A setting only the pool engine models now picks it."""
    from cupool.replay import default_engine

    trace = Trace.from_events([(0, "alloc", 1 << 32, MiB, 0), (1, "free", 1 << 32, MiB, 0)], {"capacity": 64 * MiB})
    assert default_engine(trace) == default_engine(trace, None, {"release_threshold": 0, "upstream": "managed"}) == "numba"
    for key, value in (("spill", "host"), ("defrag_threshold", None), ("track_sites", True)):
        assert default_engine(trace, {"capacity": 64 * MiB}, {key: value}) == "pool", key
    assert replay(trace, {"spill": "host"}).engine == "pool"
    assert default_engine(trace, {"frobnicate": 1}) == "numba"  # a key neither takes: check_config refuses it
    with pytest.raises(ValueError, match="unknown configuration key 'frobnicate'"):
        replay(trace, {"frobnicate": 1})
