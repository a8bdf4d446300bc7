"""benchmarks/bench_real_traces.py: the smallest-device search (bisection, then a scan) and one trace's row."""

from __future__ import annotations

import importlib.util
import pickle
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

MiB = 1 << 20
PAGE = 2 * MiB
_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_real_traces.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_real_traces", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def _event(action: str, addr: int, size: int, t: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}


def _snapshot(path: Path) -> None:
    """Two large blocks live at once (64 MiB + 32 MiB), then freed; a recorded peak reserved of 96 MiB."""
    a, b = 1 << 32, 1 << 33
    events = [
        _event("segment_alloc", a, 64 * MiB, 1), _event("alloc", a, 64 * MiB, 2),
        _event("segment_alloc", b, 32 * MiB, 3), _event("alloc", b, 32 * MiB, 4),
        _event("free_completed", a, 64 * MiB, 5), _event("free_completed", b, 32 * MiB, 6),
    ]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))


def test_a_monotone_search_finds_the_threshold(bench):
    s = bench.smallest_device(lambda cap: int(cap < 100 * PAGE), 10 * PAGE, 40 * PAGE, window=8)
    assert s.smallest == 100 * PAGE and s.bisected == 100 * PAGE and not s.non_monotone


def test_the_scan_finds_a_smaller_working_capacity_than_bisection(bench):
    # Zero OOMs at 50-59 pages, OOMs at 60-64, zero from 65 on (the issue's 20.67 / 20.86 / 21.375 GiB pattern):
    # bisection between 1 and 128 pages lands at 65; only the scan finds 50 and the failing band above it.
    def ooms(cap: int) -> int:
        p = cap // PAGE
        return 0 if 50 <= p < 60 or p >= 65 else 1

    s = bench.smallest_device(ooms, PAGE, 128 * PAGE, window=16)
    assert s.bisected == 65 * PAGE
    assert s.smallest == 50 * PAGE
    assert s.non_monotone and s.failing_above == [p * PAGE for p in range(60, 65)]
    assert s.window == (2 * PAGE, 81 * PAGE)


def test_the_scan_goes_down_to_the_floor_past_any_window(bench):
    # The issue's trace: 0 OOMs at 21,200 MiB, 1 at 21,866, 0 at 21,868; the working band lies
    # 333 steps below the bisection's answer, far outside any window around it.
    def ooms(cap: int) -> int:
        mib = cap // MiB
        return 0 if 21_200 <= mib <= 21_210 or mib >= 21_868 else 1

    s = bench.smallest_device(ooms, 21_000 * MiB, 40_000 * MiB, window=4)
    assert s.bisected == 21_868 * MiB
    assert s.smallest == 21_200 * MiB
    assert s.non_monotone and 21_866 * MiB in s.failing_above
    # Nothing at or below the floor (a capacity known to fail) is replayed, and no capacity twice:
    # the scanned steps, and a dozen bisection steps above the window.
    assert s.window == (21_002 * MiB, 21_876 * MiB)
    assert len(range(21_002, 21_876 + 1, 2)) < s.replays <= len(range(21_002, 21_876 + 1, 2)) + 12


def test_the_first_guess_is_doubled_until_it_works(bench):
    s = bench.smallest_device(lambda cap: int(cap < 300 * PAGE), PAGE, 16 * PAGE, window=4)
    assert s.smallest == 300 * PAGE


def test_a_synthetic_snapshot_row(bench, tmp_path):
    _snapshot(tmp_path / "two.pickle")
    row = bench.trace_row(tmp_path / "two.pickle", window=8)
    assert row["events"] == 6 and row["history"]
    assert row["peak_allocated"] == 96 * MiB and row["recorded_peak_reserved"] == 96 * MiB
    for label in ("plain", "plain, release_threshold=0", "expandable+stitch"):
        assert row[label]["peak_reserved"] == 96 * MiB and row[label]["ooms"] == 0
        s = row[label]["smallest_device"]
        assert s["smallest"] == 96 * MiB and not s["non_monotone"]
    assert "two.pickle" in bench.table([row])


def test_the_issues_synthetic_case_a_split_cache_needs_virtual_memory_or_release_before_split(bench, tmp_path):
    """benchmarks/synthetic_snapshots.py's split_before_big: the table's figures for it, and its verdicts."""
    spec = importlib.util.spec_from_file_location("synthetic_snapshots", _PATH.parent / "synthetic_snapshots.py")
    syn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(syn)
    assert syn.main([str(tmp_path)]) == 0
    row = bench.trace_row(tmp_path / "split_before_big.pickle", window=4)
    assert row["peak_allocated"] == 1036 * MiB and row["recorded_peak_reserved"] == 2048 * MiB
    # Split, the 12 MiB block pins the cache; released before the split, it does not (Note [Release before split]).
    assert row["plain, release_before_split=False"]["smallest_device"]["smallest"] == 2048 * MiB
    assert not bench.meets(row, "plain, release_before_split=False")["device"]
    for label in ("plain", "plain, release_threshold=0", "expandable", "expandable+stitch"):
        assert row[label]["smallest_device"]["smallest"] == 1036 * MiB
        assert bench.meets(row, label) == {"reserved": True, "device": True, "monotone": True}
    assert "split_before_big.pickle | 8 | 1,036.0 MiB | 2,048.0 MiB | expandable+stitch" in bench.table([row])


def test_the_scan_above_reaches_the_first_guess_and_counts_every_failing_capacity(bench):
    # Zero OOMs from 50 pages on, but OOMs at 70-79 and at 120: far above the answer, past any small window.
    def ooms(cap: int) -> int:
        p = cap // PAGE
        return 0 if p >= 50 and not 70 <= p < 80 and p != 120 else 1

    s = bench.smallest_device(ooms, 10 * PAGE, 128 * PAGE)
    assert s.smallest == 50 * PAGE and s.window == (11 * PAGE, 128 * PAGE)
    assert s.failing_above == [p * PAGE for p in [*range(70, 80), 120]]
    assert bench.failing_summary(asdict(s)) == "11 of 78 (140.0 MiB–240.0 MiB)"


def test_a_row_replays_each_setting_on_a_device_of_the_recorded_peak_reserved(bench, tmp_path):
    _snapshot(tmp_path / "two.pickle")
    row = bench.trace_row(tmp_path / "two.pickle", window=8)
    assert row["recorded_capacity"] == 96 * MiB
    for label in bench.SETTINGS:
        assert row[label]["at_recorded"] == {"peak_reserved": 96 * MiB, "ooms": 0}
        assert bench.meets(row, label)["reserved"]
    row["plain"]["at_recorded"]["ooms"] = 1  # a replay that runs out on the recorded device misses the target
    assert not bench.meets(row, "plain")["reserved"]
