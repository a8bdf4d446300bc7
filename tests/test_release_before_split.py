"""Note [Release before split]: without virtual memory, a request under pressure does not pin a cached segment.

And the seed of a mid-run replay is built with the pool's giving back switched
off, so every setting starts from the recorded state (``cupool.replay.seed``).
"""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cupool
from cupool.config import parse_conf
from cupool.replay import replay
from cupool.trace import Trace, load_trace
from engines import engines_agree, synthetic

MiB = 1 << 20
_SYNTHETIC = Path(__file__).resolve().parents[1] / "benchmarks" / "synthetic_snapshots.py"


def _plain(capacity_mib: int, **kw) -> cupool.Pool:
    return cupool.Pool("sim", capacity=capacity_mib * MiB, expandable_segments=False, **kw)


def _split_before_big(pool: cupool.Pool) -> tuple[object, object]:
    """A 1 GiB segment cached, a 12 MiB request, then a 1 GiB one (the issue's case)."""
    pool.malloc(1024 * MiB).free()
    small = pool.malloc(12 * MiB)
    return small, pool.malloc(1024 * MiB)


def test_under_pressure_a_small_request_gives_the_cached_segment_back_rather_than_pin_it():
    pool = _plain(1036)
    small, big = _split_before_big(pool)  # on a split, the 1 GiB request would need a 2 GiB device
    s = pool.stats()
    assert (s["num_releases_before_split"], s["num_ooms"]) == (1, 0)
    assert s["reserved_bytes.all.current"] == 1036 * MiB
    sizes = sorted(seg["total_size"] for seg in pool.snapshot()["segments"])
    assert sizes == [12 * MiB, 1024 * MiB]  # the small request grew by just its pages
    small.free(), big.free()
    pool.check()


def test_switched_off_the_split_pins_the_cache_as_before():
    pool = _plain(1036, release_before_split=False)
    with pytest.raises(cupool.OutOfMemoryError):
        _split_before_big(pool)
    assert pool.stats()["num_releases_before_split"] == 0


def test_with_room_to_spare_it_splits_and_keeps_its_cache():
    pool = _plain(4096)
    small, big = _split_before_big(pool)
    s = pool.stats()
    assert (s["num_releases_before_split"], s["num_device_free"], s["num_device_alloc"]) == (0, 0, 2)
    assert s["reserved_bytes.all.current"] == 2048 * MiB  # as PyTorch does, no device call on the way


@pytest.mark.parametrize("case", ["preallocated", "small", "movable", "same pages", "expandable"])
def test_what_is_never_given_back_this_way(case):
    if case == "expandable":
        pool = cupool.Pool("sim", capacity=1036 * MiB, expandable_segments=True, stitch=False)
        _split_before_big(pool)  # the free tail is unmapped instead
        assert pool.stats()["num_releases_before_split"] == 0
        return
    pool = _plain(1036, initial_size="1GiB" if case == "preallocated" else None)
    if case != "preallocated":
        pool.malloc(1024 * MiB).free()
    if case == "small":
        pool.malloc(MiB)  # a small block: its own 2 MiB segment, the cache untouched
        assert pool.stats()["num_device_alloc"] == 2
    elif case == "movable":
        pool.movable(12 * MiB)  # compaction can move it out of the way later
    elif case == "same pages":
        pool.malloc(1023 * MiB)  # its pages are the whole segment: nothing to gain
    else:
        pool.malloc(12 * MiB)  # the preallocated segment stays
    assert pool.stats()["num_releases_before_split"] == 0
    assert pool.stats()["num_device_free"] == 0


def test_the_setting_is_checked_read_and_set():
    with pytest.raises(TypeError, match="release_before_split must be True or False, got 'yes'"):
        cupool.Pool("sim", release_before_split="yes")
    pool = _plain(1036)
    assert pool.release_before_split is True and pool.config["release_before_split"] is True
    with pytest.raises(TypeError, match="release_before_split must be True or False, got 1"):
        pool.release_before_split = 1
    assert pool.release_before_split is True  # unchanged by the refusal
    pool.release_before_split = False
    with pytest.raises(cupool.OutOfMemoryError):
        _split_before_big(pool)
    assert parse_conf("release_before_split=false") == {"release_before_split": False}
    with pytest.raises(ValueError, match="release_before_split: must be true or false, got 'maybe'"):
        parse_conf("release_before_split=maybe")


def _synthetic(tmp_path: Path, name: str) -> Trace:
    spec = importlib.util.spec_from_file_location("synthetic_snapshots", _SYNTHETIC)
    syn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(syn)
    (tmp_path / f"{name}.pickle").write_bytes(pickle.dumps(syn.SNAPSHOTS[name]()))
    return load_trace(tmp_path / f"{name}.pickle")


@pytest.mark.parametrize("engine", ["numba", "pool"])
def test_both_engines_replay_the_issues_case_on_the_live_peak(tmp_path, engine):
    trace = _synthetic(tmp_path, "split_before_big")
    plain = {"capacity": 1036 * MiB, "expandable_segments": False}
    assert replay(trace, plain, engine=engine).ooms == 0
    assert replay(trace, {**plain, "release_before_split": False}, engine=engine).ooms == 1


@pytest.mark.parametrize("engine", ["numba", "pool"])
def test_a_mid_run_window_starts_from_the_recorded_state_under_release_threshold(tmp_path, engine):
    """The inherited 400 MiB segment holding a live 200 MiB block is the program's, whatever the policy:
    release_threshold=0 gives back the wholly free 600 MiB one only (it used to rebuild the first
    around its live block, starting from a state the program never had)."""
    trace = _synthetic(tmp_path, "mid_run")
    for threshold in (None, 0):
        r = replay(trace, {"capacity": 1250 * MiB, "expandable_segments": False, "release_threshold": threshold},
                   engine=engine)
        assert r.peak_reserved == (1000 if threshold is None else 900) * MiB
        assert r.ooms == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 48 << 20), st.just(0), st.integers(0, 99)), max_size=80),
       st.sampled_from([40, 64, 96]), st.booleans())
def test_engines_agree_under_pressure_with_and_without_it(ops, capacity_mib, split):
    config = {"capacity": capacity_mib * MiB, "expandable_segments": False, "release_before_split": split}
    engines_agree(synthetic(ops), config)


@pytest.mark.parametrize("entry, says", [
    ("max_split_size_mb:512", "'max_split_size_mb' is a PYTORCH_CUDA_ALLOC_CONF key, not cupool's: .*release_before_split"),
    ("garbage_collection_threshold=0.6", "'garbage_collection_threshold' is a PYTORCH_CUDA_ALLOC_CONF key.*release_threshold=80%"),
    ("roundup_power2_divisions:4", "'roundup_power2_divisions' is a PYTORCH_CUDA_ALLOC_CONF key.*512 bytes"),
    ("expandable_segments:True", r"is not key=value \(PYTORCH_CUDA_ALLOC_CONF writes key:value; cupool writes key=value\)"),
])
def test_pytorch_habits_in_cupool_conf_say_what_cupool_does_instead(entry, says):
    with pytest.raises(ValueError, match=says):
        parse_conf(entry)


@pytest.mark.parametrize("capacity_mib, split, device_calls", [
    (1030, True, (20, 19)),  # the documented price: the big segment is exchanged on every turn
    (1030, False, (1, 0)),  # the switch for such a loop
    (1036, True, (3, 1)),  # room for both: one exchange, then both stay cached
])
def test_the_price_in_an_alternating_loop_is_the_one_the_note_states(capacity_mib, split, device_calls):
    pool = _plain(capacity_mib, release_before_split=split)
    for _ in range(10):
        pool.malloc(1024 * MiB).free()
        pool.malloc(12 * MiB).free()
    s = pool.stats()
    assert (s["num_device_alloc"], s["num_device_free"]) == device_calls
    assert s["num_ooms"] == 0
