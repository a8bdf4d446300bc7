"""The stress and leak harnesses of issue 21, bounded: benchmarks/stress.py and benchmarks/leak.py run for seconds.

The threaded part is a seeded schedule per thread (benchmarks/stress.py says what
each checkpoint holds the pool to).  The single-threaded part is hypothesis: a
program of movables made, freed, dropped and dropped in cycles, and a compaction
or spill during which the garbage collector runs at a chosen event, which is when
Python runs it: at any allocation, in the middle of a pool operation.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cupool

MiB = 1 << 20
_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"cupool_bench_{name}", _BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def stress() -> ModuleType:
    return _load("stress")


@pytest.fixture(scope="module")
def leak() -> ModuleType:
    return _load("leak")


# ------------------------------------------------------------ threaded stress
@pytest.mark.parametrize("config", ["plain", "expandable"])
def test_threaded_stress_holds_the_books(stress, config):
    """Four threads for 3 s: the books agree with the live handles at every checkpoint, and nothing is left."""
    r = stress.run(config, seconds=3.0, threads=4, seed=21, check_every=0.5, hang_s=20.0)
    assert not r.failures, "\n".join(r.lines())
    # The run did what it is for (else it would prove nothing).
    assert r.checks >= 2, r.lines()
    assert r.ops["drop_in_cycle"] and r.ops["drop"] and r.ops["free"], r.lines()
    assert r.compactions and r.bytes_moved, r.lines()
    assert r.spills, r.lines()
    assert r.handles_checked > r.checks, r.lines()


def test_stress_report_names_a_broken_book(stress):
    """The checker is not blind: a pool whose books disagree with its handles is reported."""
    s = stress.Stress("plain", 1, 0, "64MiB", 5.0, False)
    w = s.workers[0]
    w.movable()
    w.malloc()
    s.audit()
    assert not s.report.failures and s.report.checks == 1
    forgotten = w.live.pop()  # kept alive, but no longer among the handles the checker knows
    s.audit()
    assert any("allocations" in f for f in s.report.failures), s.report.failures
    forgotten.handle.free()


def test_stress_cli_rejects_bad_arguments(stress, capsys):
    with pytest.raises(SystemExit) as e:
        stress.main(["--threads", "0"])
    assert e.value.code == 2
    assert "--threads" in capsys.readouterr().err


# ------------------------------------------ hypothesis: gc at a chosen moment
#: Each buffer: its size (mostly a few sizes, so that buffers share segments and compaction slides
#: them) and its fate once all are made.
_BUFFERS = st.lists(
    st.tuples(
        st.one_of(st.sampled_from([64 << 10, 256 << 10, 512 << 10, 3 * MiB // 2]), st.integers(1, 3 * MiB)),
        st.sampled_from(["keep", "keep", "keep_leased", "free", "drop", "drop_in_cycle", "drop_in_cycle"]),
    ),
    min_size=3, max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(buffers=_BUFFERS, action=st.sampled_from(["compact", "spill"]), collect_at=st.integers(0, 4),
       expandable=st.booleans())
def test_gc_at_any_event_of_a_compaction_or_spill_keeps_the_books(buffers, action, collect_at, expandable):
    """Movables dropped in cycles die when the collector runs: here at the n-th event of a compaction or spill."""
    extra: dict[str, Any] = {"expandable_segments": True, "stitch": True} if expandable else {}
    p = cupool.Pool("sim", capacity="128MiB", spill="host", **extra)
    p.malloc(32 * MiB).free()  # a cached segment that the movables share, so compaction slides them
    rng = np.random.default_rng(len(buffers))
    made = []
    for n, _ in buffers:
        m = p.movable(n)
        data = np.frombuffer(rng.bytes(n), np.uint8)
        m.array()[:] = data
        made.append((m, zlib.crc32(data)))
    del m
    live: list[tuple[cupool.Movable, int]] = []
    leases: list[Any] = []
    gc.disable()  # the collector runs only where the test says
    try:
        for (m, crc), (_, fate) in zip(made, buffers):
            if fate.startswith("keep"):
                live.append((m, crc))
                if fate == "keep_leased":
                    leases.append(m.array())
            elif fate == "free":
                m.free()
            elif fate == "drop_in_cycle":
                cycle: list[Any] = [m]
                cycle.append(cycle)
                del cycle
        del made, m  # "drop": the last reference goes here
        events = [0]

        def collect(ev: tuple) -> None:
            if events[0] == collect_at:
                gc.collect()
            events[0] += 1

        p.subscribe(collect, kinds=["move_out", "move_in", "free_movable", "spill", "segment_free", "segment_unmap"])
        getattr(p, action)()
    finally:
        gc.enable()
    leases.clear()
    gc.collect()
    p.check()
    on_device = [m for m, _ in live if m.on_device]
    s = p.stats()
    assert s["allocation.all.current"] == len(on_device)
    assert s["requested_bytes.all.current"] == sum(m.size for m in on_device)
    for m, crc in live:
        assert zlib.crc32(np.asarray(m.array())) == crc, f"{m!r} lost its bytes"
    for m, _ in live:
        m.free()
    p.check()
    assert p.stats()["allocation.all.current"] == 0


# --------------------------------------------------------------------- leaks
def test_leak_loop_keeps_fds_threads_and_mappings_flat(leak):
    """50 pools of each kind made, used, recorded, monitored and dropped: nothing grows with their number."""
    r = leak.run(pools=50, warmup=10, every=10)
    assert r.pools == 100
    for what in ("fds", "threads", "maps"):
        first, last, top = r.first[what], r.last[what], r.max[what]
        assert last <= first + r.slack[what], f"{what} grew from {first} to {last} (max {top}) over {r.pools} pools"
    assert r.verdict == "flat", "\n".join(r.lines())
