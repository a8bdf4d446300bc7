"""The replay benchmarks' rows run what their names say (issue 25): ``{}`` is a trace's recorded settings,
so a row named "plain" that passed ``{}`` ran expandable segments with stitching on a made-up trace."""

from __future__ import annotations

import importlib.util
import pickle
import sys
from pathlib import Path

import pytest

from cupool.replay import replay
from cupool.trace import Trace, load_trace

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
MiB = 1 << 20


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def _claims(label: str) -> dict:
    """What a row's name says it runs."""
    vmm = "expandable" in label or label == "defaults"  # the pool's defaults, on the sim device
    return {"expandable_segments": vmm, "stitch": vmm and ("stitch" in label or label == "defaults"),
            **({"release_threshold": 0} if "release_threshold=0" in label or "rt=0" in label else {}),
            **({"release_before_split": False} if "release_before_split=False" in label else {})}


def _traces(tmp_path: Path) -> list[Trace]:
    """A made-up trace (no recorded settings) and a PyTorch snapshot recorded on plain segments."""
    made_up = Trace.from_events([(0, "alloc", 1, 3 * MiB, 0), (1, "free", 1, 3 * MiB, 0)])
    events = [{"action": "segment_alloc", "addr": 1 << 32, "size": 20 * MiB, "stream": 0, "time_us": 0},
              {"action": "alloc", "addr": 1 << 32, "size": 3 * MiB, "stream": 0, "time_us": 1},
              {"action": "free_completed", "addr": 1 << 32, "size": 3 * MiB, "stream": 0, "time_us": 2}]
    path = tmp_path / "plain.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))
    return [made_up, load_trace(path)]


@pytest.mark.parametrize("name", ["bench_replay", "bench_real_traces"])
def test_every_row_runs_what_its_name_says(name, tmp_path):
    settings = _module(name).SETTINGS
    for trace in _traces(tmp_path):
        for label, cfg in settings.items():
            ran = replay(trace, {"capacity": "64MiB", **cfg}).config
            assert {k: ran[k] for k in _claims(label)} == _claims(label), (name, label, trace.format)
