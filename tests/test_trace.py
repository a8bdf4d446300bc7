"""Event recording, HDF5 traces (including a killed writer), importers and snapshot export."""

from __future__ import annotations

import base64
import json
import pickle
import re
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

import cupool
from cupool.importers import load_rmm_log, load_torch_snapshot
from cupool.replay import replay
from cupool.trace import TraceError, load_trace


def _churn(pool, n=200, seed=0, streams=1):
    rng = np.random.default_rng(seed)
    live = []
    for _ in range(n):
        if live and rng.random() < 0.45:
            live.pop(int(rng.integers(len(live)))).free()
        else:
            try:
                live.append(pool.malloc(int(rng.integers(0, 12 << 20)), stream=int(rng.integers(streams))))
            except cupool.OutOfMemoryError:
                pass
    return live


def test_recording_is_off_by_default_and_detaches(pool):
    assert pool._observers == []
    with pool.record() as rec:
        assert len(pool._observers) == 1
        pool.malloc(100).free()
    assert pool._observers == []
    kinds = [e[1] for e in rec.events()]
    assert kinds == ["segment_alloc", "alloc", "free"]
    pool.malloc(100).free()
    assert rec.n_events == 3  # nothing recorded after stop


def test_ring_buffer_keeps_the_newest_events(pool):
    with pool.record(capacity=8, batch=8) as rec:
        allocs = [pool.malloc(1024 * (i + 1)) for i in range(10)]
    evs = rec.events()
    assert len(evs) == 8 and rec.dropped == 10 + 1 - 8
    assert [e[3] for e in evs if e[1] == "alloc"] == [1024 * (i + 1) for i in range(2, 10)]
    assert [e[0] for e in evs] == sorted(e[0] for e in evs)
    del allocs


def test_hdf5_trace_round_trip_with_custom_kinds_and_stacks(pool, tmp_path):
    path = tmp_path / "run.h5"
    with pool.record(path, stacks=True, batch=16) as rec:
        live = _churn(pool, 120)
        with pool._lock:  # how compaction / spilling emit their own kinds
            pool._emit("compact", 0, 4096, 0)
            pool._emit("my_custom_kind", 1, 2, 0)
    tr = load_trace(path)
    mem = rec.events()
    assert len(tr) == len(mem) == rec.n_events
    assert [tr.kinds[k] for k in tr.kind] == [e[1] for e in mem]
    assert tr.size.tolist() == [e[3] for e in mem]
    assert tr.addr.tolist() == [e[2] for e in mem]
    assert tr.t_ns.tolist() == [e[0] for e in mem]
    assert tr.config["capacity"] == pool.config["capacity"]
    assert tr.counts()["compact"] == 1 and tr.counts()["my_custom_kind"] == 1
    assert tr.stacks is not None and len(tr.stacks) == len(tr)
    assert "test_trace.py" in tr.stacks[0] and "_churn" in tr.stacks[5]
    del live


def test_recording_starts_from_the_live_state(tmp_path):
    pool = cupool.Pool("sim", capacity="64MiB")
    before = [pool.malloc(s) for s in (3 << 20, 100, 700 << 10)]
    with pool.record(tmp_path / "t.h5"):
        after = _churn(pool, 60, seed=3)
    tr = load_trace(tmp_path / "t.h5")
    assert tr.counts()["alloc"] >= 3
    r = replay(tr)
    assert r.peak_allocated == pool.stats()["allocated_bytes.all.peak"]
    del before, after


_KILLED = textwrap.dedent(
    """
    import os, signal, sys
    import cupool
    pool = cupool.Pool("sim", capacity="256MiB")
    rec = pool.record(sys.argv[1], batch=64, flush_interval=3600)
    rec.start()
    live = []
    for i in range(100000):
        live.append(pool.malloc(1024 * (1 + i % 50)))
        if len(live) > 20:
            live.pop(0).free()
        if rec._flushed >= 640 and rec.n_events % 64 == 17:
            print(rec._flushed, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_killed_recorder_leaves_a_readable_trace(tmp_path):
    path = tmp_path / "killed.h5"
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    flushed = int(proc.stdout.split()[-1])
    tr = load_trace(path)
    assert len(tr) == flushed  # everything up to the last flush, nothing half-written
    kinds = [tr.kinds[k] for k in tr.kind]
    assert kinds[0] == "segment_alloc" and set(kinds) <= {"alloc", "free", "segment_alloc"}
    assert (tr.size > 0).all() and (np.diff(tr.t_ns) >= 0).all()
    r = replay(tr)
    signed = np.where(tr.kind == tr.code("alloc"), tr.size, np.where(tr.kind == tr.code("free"), -tr.size, 0))
    assert r.unmatched_frees == 0 and r.peak_allocated == signed.cumsum().max()


# ------------------------------------------------------------------ bad input
def test_bad_trace_files_get_clear_errors(tmp_path, pool):
    good = tmp_path / "good.h5"
    with pool.record(good):
        _churn(pool, 50)
    data = good.read_bytes()
    cases = {
        "truncated.h5": (data[: len(data) // 2], "truncated or corrupted"),
        "empty.h5": (b"", "empty"),
        "notes.txt": (b"hello, world\n", "not a trace cupool can read"),
    }
    for name, (content, problem) in cases.items():
        p = tmp_path / name
        p.write_bytes(content)
        with pytest.raises(TraceError, match=re.escape(str(p)) + ".*" + problem):
            load_trace(p)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(TraceError, match="not a cupool trace"):
        load_trace(other)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.h5")
    wrong = tmp_path / "wrong_version.h5"
    wrong.write_bytes(data)
    with h5py.File(wrong, "r+") as f:
        f.attrs["version"] = 99
    with pytest.raises(TraceError, match="version 99"):
        load_trace(wrong)


def test_recorder_rejects_bad_options(pool, tmp_path):
    with pytest.raises(ValueError, match="capacity"):
        pool.record(capacity=0)
    with pytest.raises(ValueError, match="batch"):
        pool.record(capacity=4, batch=8)
    with pytest.raises(TraceError, match="cannot create"):
        pool.record(tmp_path / "no" / "such" / "dir.h5").start()
    assert pool._observers == []


# ------------------------------------------------------------------ importers
def _torch_fixture(path, extra=()):
    ev = [
        {"action": "segment_alloc", "addr": 1 << 30, "size": 20 << 20, "stream": 0, "time_us": 10, "frames": []},
        {"action": "alloc", "addr": 1 << 30, "size": 4 << 20, "stream": 0, "time_us": 11, "frames": []},
        {"action": "alloc", "addr": (1 << 30) + (4 << 20), "size": 512, "stream": 7, "time_us": 12, "frames": []},
        {"action": "free_requested", "addr": 1 << 30, "size": 4 << 20, "stream": 0, "time_us": 13, "frames": []},
        {"action": "free_completed", "addr": 1 << 30, "size": 4 << 20, "stream": 0, "time_us": 14, "frames": []},
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": 15, "frames": []},
        {"action": "oom", "addr": 0, "size": 1 << 40, "stream": 0, "time_us": 16, "frames": []},
        *extra,
    ]
    snap = {"segments": [], "device_traces": [[], ev]}
    path.write_bytes(pickle.dumps(snap))
    return ev


def test_torch_snapshot_import(tmp_path):
    p = tmp_path / "snap.pickle"
    _torch_fixture(p)
    tr = load_trace(p)
    assert tr.format == "torch"
    assert [tr.kinds[k] for k in tr.kind] == ["segment_alloc", "alloc", "alloc", "free", "oom"]
    assert tr.t_ns.tolist() == [10_000, 11_000, 12_000, 14_000, 16_000]
    assert tr.stream.tolist() == [0, 0, 1, 0, 0]  # streams renumbered densely
    r = replay(tr, {"capacity": "1GiB"})
    assert r.peak_allocated == (4 << 20) + 512 and r.ooms == 1 and r.unmatched_frees == 0
    with pytest.raises(TraceError, match="no device 5"):
        load_torch_snapshot(p, device=5)


def test_torch_snapshot_rejects_objects_and_other_pickles(tmp_path):
    p = tmp_path / "evil.pickle"
    p.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": np.int64(1)}]]}))
    with pytest.raises(TraceError, match="Python object numpy"):
        load_trace(p)
    p.write_bytes(pickle.dumps({"hello": 1}))
    with pytest.raises(TraceError, match="not a PyTorch memory snapshot"):
        load_trace(p)
    p.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc"}]]})[:-5])
    with pytest.raises(TraceError, match="not a readable PyTorch memory snapshot"):
        load_trace(p)


def test_rmm_log_import(tmp_path):
    p = tmp_path / "rmm.csv"
    p.write_text(
        "Thread,Time,Action,Pointer,Size,Stream\n"
        "140573312345856,1634567890.000001,allocate,0x7f8a40000000,1024,0x0\n"
        "140573312345856,1634567890.000002,allocate,0x7f8a40000400,3145728,0x7f8a38001020\n"
        "140573312345856,1634567890.000003,free,0x7f8a40000000,1024,0x0\n"
        "140573312345857,1634567890.000004,allocate failure,0x0,99999999999,0x0\n"
        "\n"
    )
    tr = load_trace(p)
    assert tr.format == "rmm"
    assert [tr.kinds[k] for k in tr.kind] == ["alloc", "alloc", "free", "oom"]
    assert tr.addr[1] == 0x7F8A40000400 and tr.size[1] == 3145728
    assert tr.stream.tolist() == [0, 1, 0, 0]
    assert tr.t_ns[1] - tr.t_ns[0] == 1000
    r = replay(tr, {"capacity": "1GiB"})
    assert r.peak_allocated == 1024 + 3145728 and r.ooms == 1
    old = tmp_path / "old.csv"
    old.write_text("Thread,Time,Action,Pointer,Size,Stream\n1,08:00:01:000250,allocate,0x10,512,0x0\n")
    assert load_rmm_log(old).t_ns[0] == (8 * 3600 + 1) * 10**9 + 250_000


@pytest.mark.parametrize(
    "body, problem",
    [
        ("1,1.0,allocate,0x10\n", "line 2: expected 6 fields"),
        ("1,1.0,reallocate,0x10,5,0x0\n", "line 2: unknown action 'reallocate'"),
        ("1,1.0,allocate,zz,5,0x0\n", "line 2: cannot parse"),
    ],
)
def test_rmm_log_errors_name_the_line(tmp_path, body, problem):
    p = tmp_path / "bad.csv"
    p.write_text("Thread,Time,Action,Pointer,Size,Stream\n" + body)
    with pytest.raises(TraceError, match=re.escape(problem)):
        load_trace(p)


# ------------------------------------------------------------- snapshot export
def _exported(pool, tmp_path):
    with pool.record(stacks=True):
        keep = [pool.malloc(s) for s in (1000, 5 << 20, 30 << 20)]
        keep.pop(0).free()
        path = tmp_path / "snap.pickle"
        pool.export_snapshot(path)
    return pickle.loads(path.read_bytes()), keep, path


def test_export_snapshot_shape(pool, tmp_path):
    data, keep, path = _exported(pool, tmp_path)
    segs = pool.snapshot()["segments"]
    assert [s["address"] for s in data["segments"]] == [s["address"] for s in segs]
    assert all("blocks" in s and "total_size" in s for s in data["segments"])
    actions = [e["action"] for e in data["device_traces"][0]]
    assert actions.count("segment_alloc") == 3 and actions.count("alloc") == 3
    i = actions.index("free_requested")
    assert actions[i + 1] == "free_completed"
    assert any(f["filename"].endswith("test_trace.py") for f in data["device_traces"][0][1]["frames"])
    # and it comes back through the PyTorch importer with the same live bytes
    r = replay(load_trace(path), {"capacity": "64MiB"})
    assert r.peak_allocated == pool.stats()["allocated_bytes.all.peak"]
    del keep


def test_export_snapshot_renders_with_torch_memory_viz(pool, tmp_path):
    mv = pytest.importorskip("torch.cuda._memory_viz", reason="torch is not installed (pip install cupool[viz])")
    data, keep, _ = _exported(pool, tmp_path)
    summary = mv.segsum(data)
    assert "segments: 3" in summary and "total_reserved: 52.0MiB" in summary
    text = mv.trace(data)
    assert "cudaMalloc" in text and "free completed" in text
    for html in (mv.trace_plot(data), mv.segment_plot(data)):
        payload = json.loads(re.search(r"(\[\{\"name\": \"snapshot.pickle\".*?\}\])", html).group(1))
        assert pickle.loads(base64.b64decode(payload[0]["base64"])) == data
    del keep
