"""``cupool export TRACE --format rmm-csv``: RMM's log format written, read back the same (issues 20, 28).

RMM writes the time of day to the microsecond (``HH:MM:SS.ffffff``), so times
come back as the same intervals, to the microsecond, from another midnight.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np
import pytest

import cupool
from cupool.cli import main
from cupool.replay import replay
from cupool.trace import Trace, load_trace
from cupool.trace.rmm_log import ACTIONS, write_rmm_log

MiB = 1 << 20
_PLAIN = {"alloc_movable": "alloc", "move_in": "alloc", "free_movable": "free", "move_out": "free"}


def _expected(trace: Trace) -> list[tuple]:
    """The block events an RMM log keeps, movable kinds as plain ones."""
    out = []
    for t, k, a, n, s in zip(trace.t_ns.tolist(), trace.kind.tolist(), trace.addr.tolist(), trace.size.tolist(),
                             trace.stream.tolist()):
        kind = trace.kinds[k]
        if kind in ACTIONS:
            out.append((t, _PLAIN.get(kind, kind), a, n, s))
    return out


def _events(trace: Trace) -> list[tuple]:
    return list(zip(trace.t_ns.tolist(), [trace.kinds[k] for k in trace.kind.tolist()], trace.addr.tolist(),
                    trace.size.tolist(), trace.stream.tolist()))


def _same(back: list[tuple], expected: list[tuple]) -> None:
    """The same events, at the same intervals to the microsecond (RMM's clock), from any first time."""
    assert [e[1:] for e in back] == [e[1:] for e in expected]
    us = [e[0] // 1000 for e in expected]
    assert [e[0] - back[0][0] for e in back] == [(u - us[0]) * 1000 for u in us]


def _recorded(tmp_path: Path) -> Path:
    """Raw allocations on two streams, a refused request, and blocks alive at the end."""
    pool = cupool.Pool("sim", capacity="256MiB", max_size="64MiB")
    path = tmp_path / "run.h5"
    with pool.record(path):
        keep = [pool.malloc((i % 7 + 1) * 300_000, stream=i % 2) for i in range(40)]
        for a in keep[::3]:
            a.free()
        with pytest.raises(cupool.OutOfMemoryError):
            pool.malloc(100 * MiB)
        keep.append(pool.malloc(5 * MiB))
    return path


def _rmm_parse(path: Path) -> list[tuple]:
    """The log as RMM's own parser (benchmarks/utilities/log_parser.hpp) reads it: decimal thread, size and
    stream, a hexadecimal pointer, and only its three actions."""
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["Thread", "Time", "Action", "Pointer", "Size", "Stream"]
    out = []
    for thread, time, action, ptr, size, stream in rows[1:]:
        assert action in ("allocate", "free", "allocate failure")
        assert re.fullmatch(r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d\.\d{6}", time), time  # spdlog's %H:%M:%S.%f
        out.append((int(thread, 10), action, int(ptr, 16), int(size, 10), int(stream, 10)))
    return out


def test_a_recorded_trace_round_trips_through_an_rmm_log(tmp_path, capsys):
    src = _recorded(tmp_path)
    out = tmp_path / "run.csv"
    assert main(["export", str(src), "-o", str(out)]) == 0  # .csv: the RMM format without being told
    assert capsys.readouterr().out.startswith(f"wrote {out}: ")
    original, back = load_trace(src), load_trace(out)
    assert back.format == "rmm"
    _same(_events(back), _expected(original))
    assert len(back) > 40
    rows = _rmm_parse(out)
    assert len(rows) == len(back) and {r[1] for r in rows} == {"allocate", "free", "allocate failure"}
    assert {r[4] for r in rows} == {0, 1} and {r[0] for r in rows} == {0}  # a trace records no thread
    config = {"capacity": "256MiB", "max_size": "64MiB"}
    a, b = replay(original, config), replay(back, config)
    for key in ("peak_allocated", "peak_reserved", "ooms", "unmatched_frees", "peak_segments"):
        assert getattr(a, key) == getattr(b, key), key


def test_moves_and_movable_buffers_become_frees_and_allocations(tmp_path):
    pool = cupool.Pool("sim", capacity="512MiB", initial_size="36MiB", defrag_threshold=None)
    path = tmp_path / "moved.h5"
    with pool.record(path):
        bufs = [pool.movable(3 * MiB) for _ in range(12)]
        for m in bufs[::2]:
            m.free()
        assert pool.compact().moves > 0
    trace = load_trace(path)
    out = tmp_path / "moved.log"
    assert main(["export", str(path), "-o", str(out), "--format", "rmm-csv"]) == 0
    back = load_trace(out)
    _same(_events(back), _expected(trace))
    # Following the log ends with the pool's live blocks, where the moves put them.
    live: dict[int, int] = {}
    for _, kind, addr, size, _ in _events(back):
        if kind == "alloc":
            live[addr] = size
        elif kind == "free":
            assert live.pop(addr) == size
    held = {b["address"] for s in pool.snapshot()["segments"] for b in s["blocks"] if b["state"] != "inactive"}
    assert set(live) == held and len(held) == 6
    assert replay(back, {"capacity": "512MiB"}).peak_allocated == replay(trace).peak_allocated == 12 * 3 * MiB
    del bufs


def test_times_are_rmms_clock_to_the_microsecond(tmp_path):
    t0 = 1_732_480_000_123_456_789  # an epoch clock in ns: 20:26:40.123456789 UTC
    events = [(t0, "segment_alloc", 1 << 30, 2 * MiB, 0), (t0 + 1, "alloc", 1 << 30, 512, 0),
              (t0 + 1_000_000_007, "free", 1 << 30, 512, 0), (t0 + 2_000_000_000, "oom", 0, 1 << 40, 0)]
    out = tmp_path / "t.csv"
    assert write_rmm_log(Trace.from_events(events), out) == 3
    assert [r.split(",")[1] for r in out.read_text().splitlines()[1:]] == \
        ["20:26:40.123456", "20:26:41.123456", "20:26:42.123456"]
    back = load_trace(out)
    assert (back.t_ns - back.t_ns[0]).tolist() == [0, 1_000_000_000, 2_000_000_000]
    assert [back.kinds[k] for k in back.kind] == ["alloc", "free", "oom"]
    assert np.array_equal(back.size, [512, 512, 1 << 40])


def test_a_clock_before_zero_counts_back_from_midnight(tmp_path):
    """A negative clock (a seed placed before the first event) keeps its intervals across midnight."""
    events = [(-1_500, "alloc", 16, 512, 0), (-1, "free", 16, 512, 0), (2_000, "alloc", 16, 512, 0)]
    out = tmp_path / "t.csv"
    write_rmm_log(Trace.from_events(events), out)
    assert [r.split(",")[1] for r in out.read_text().splitlines()[1:]] == \
        ["23:59:59.999998", "23:59:59.999999", "00:00:00.000002"]
    assert (load_trace(out).t_ns - load_trace(out).t_ns[0]).tolist() == [0, 1_000, 4_000]


def test_index_is_refused_with_an_rmm_log(tmp_path, capsys):
    src = _recorded(tmp_path)
    out = tmp_path / "run.csv"
    assert main(["export", str(src), "-o", str(out), "--index", "1"]) == 2
    assert capsys.readouterr().err == ("cupool: error: --index names the device of a PyTorch snapshot; an RMM log "
                                       "has no device field (leave out --index with --format rmm-csv)\n")
    assert not out.exists()
    assert main(["export", str(src), "-o", str(tmp_path / "s.pickle"), "--index", "1"]) == 0
