"""Event recording, HDF5 traces (including a killed writer), importers and snapshot export."""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import h5py
import numpy as np
import pytest

import cupool
from cupool.core.events import KINDS
from cupool.replay import replay
from cupool.trace import Trace, TraceError, active_recorder, load_rmm_log, load_torch_snapshot, load_trace
from cupool.trace.format import Hdf5Writer


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


def _subscribers(pool, monkeypatch):
    """The callbacks subscribed to ``pool`` through ``pool.subscribe`` and not yet unsubscribed."""
    live = []
    subscribe = pool.subscribe

    def counted(callback, *args, **kwargs):
        unsubscribe = subscribe(callback, *args, **kwargs)
        live.append(callback)

        def counted_unsubscribe():
            live.remove(callback)
            unsubscribe()

        return counted_unsubscribe

    monkeypatch.setattr(pool, "subscribe", counted)
    return live


def _detached(pool, rec):
    """Whether ``rec`` no longer hears ``pool``, and ``pool`` no longer names it its recorder."""
    n = rec.n_events
    pool.malloc(100).free()
    return rec.n_events == n and active_recorder(pool) is not rec


def test_recording_is_off_by_default_and_detaches(pool, monkeypatch):
    subscribers = _subscribers(pool, monkeypatch)
    rec = pool.record()
    assert subscribers == []
    with rec:
        assert len(subscribers) == 1 and active_recorder(pool) is rec
        pool.malloc(100).free()
    assert subscribers == [] and active_recorder(pool) is None
    kinds = [e[1] for e in rec.events()]
    assert kinds == ["segment_map", "alloc", "free"]  # the default pool maps a granule of expandable segment
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


def test_hdf5_trace_round_trip_with_compaction_and_stacks(tmp_path):
    pool = cupool.Pool("sim", capacity="256MiB", defrag_threshold=None)
    path = tmp_path / "run.h5"
    with pool.record(path, stacks=True, batch=16) as rec:
        live = _churn(pool, 120)
        bufs = [pool.movable(3 << 20) for _ in range(8)]
        for m in bufs[::2]:
            m.free()
        assert pool.compact().moves > 0
    tr = load_trace(path)
    mem = rec.events()
    assert len(tr) == len(mem) == rec.n_events
    assert [tr.kinds[k] for k in tr.kind] == [e[1] for e in mem]
    assert tr.size.tolist() == [e[3] for e in mem]
    assert tr.addr.tolist() == [e[2] for e in mem]
    assert tr.t_ns.tolist() == [e[0] for e in mem]
    assert tr.config["capacity"] == pool.config["capacity"]
    assert tr.kinds == KINDS  # a file's kinds start as the pool's one list
    assert tr.counts()["compact"] == 1 and tr.counts()["move_in"] > 0
    assert tr.stacks is not None and len(tr.stacks) == len(tr)
    assert "test_trace.py" in tr.stacks[0] and "_churn" in tr.stacks[5]
    del live, bufs


def test_kinds_outside_the_known_list_are_appended(tmp_path):
    path = tmp_path / "custom.h5"
    events = [(0, "alloc", 512, 512, 0), (1, "my_custom_kind", 1, 2, 0), (2, "reclaim:gc", 0, 0, 0),
              (3, "another_kind", 0, 0, 0), (4, "my_custom_kind", 3, 4, 0)]
    writer = Hdf5Writer(path, stacks=False)
    writer.open({})
    writer.append(events[:2])
    writer.append(events[2:])
    writer.close()
    tr = load_trace(path)
    assert tr.kinds == (*KINDS, "my_custom_kind", "another_kind")
    assert [tr.kinds[k] for k in tr.kind] == [e[1] for e in events]
    mem = Trace.from_events(events)
    assert mem.kinds == tr.kinds and mem.kind.tolist() == tr.kind.tolist()


def test_files_written_before_a_kind_was_added_read_back_under_their_own_names(pool, tmp_path):
    # Before the reclaim kinds joined the list, a file appended them as it met them, after "oom".
    path = tmp_path / "old.h5"
    with pool.record(path):
        pool.malloc(100).free()
    old = (*KINDS[:KINDS.index("oom") + 1], "reclaim:gc")
    with h5py.File(path, "r+") as f:
        names = np.zeros(f["kind_names"].shape, f["kind_names"].dtype)
        names[: len(old)] = [k.encode() for k in old]
        f["kind_names"][:] = names
        f["kind"][-1] = len(old) - 1
    tr = load_trace(path)
    assert tr.kinds == old
    assert [tr.kinds[k] for k in tr.kind] == ["segment_map", "alloc", "reclaim:gc"]
    assert tr.code("reclaim:gc") == len(old) - 1 and tr.code("reclaim:streams") == -1
    assert replay(tr).peak_allocated == 512


@pytest.mark.parametrize("initial", [None, "8MiB"])
def test_recording_starts_from_the_live_state(tmp_path, initial):
    pool = cupool.Pool("sim", capacity="96MiB", initial_size=initial)
    before = [pool.malloc(s) for s in (3 << 20, 100, 700 << 10, 5 << 20, 300, 2 << 20, 12 << 20)]
    for i in (0, 4, 5):  # holes in the middle of segments, which the replay must keep
        before[i].free()
    pool.reset_peak_stats()
    segments = len(pool.snapshot()["segments"])
    with pool.record(tmp_path / "t.h5"):
        after = _churn(pool, 80, seed=3)
    tr = load_trace(tmp_path / "t.h5")
    seed = tr.config["seed"]
    assert seed["events"] == segments + 4 and len(seed["small_segments"]) == 1
    assert len(seed["kept_segments"]) == (initial is not None)
    stats = pool.stats()
    r = replay(tr)
    assert r.peak_allocated == stats["allocated_bytes.all.peak"]
    assert r.peak_reserved == stats["reserved_bytes.all.peak"]
    assert r.peak_segments == stats["segment.all.peak"]
    del before, after


def test_recorder_reads_the_live_state_and_subscribes_under_one_lock(pool, monkeypatch):
    # An allocation slipped in between reading the state and subscribing would be in neither,
    # so start() must subscribe while it still holds the pool: another thread's allocation
    # waits until then, and is recorded.
    monkeypatch.setattr(pool, "snapshot", lambda: pytest.fail("start() must not snapshot separately"))
    racer = threading.Thread(target=lambda: pool.malloc(100).free())
    subscribe = pool.subscribe

    def racing_subscribe(callback, *args, **kwargs):
        racer.start()
        racer.join(0.2)
        assert racer.is_alive(), "another thread allocated between reading the live state and subscribing"
        return subscribe(callback, *args, **kwargs)

    monkeypatch.setattr(pool, "subscribe", racing_subscribe)
    keep = pool.malloc(300)
    with pool.record() as rec:
        racer.join()
    assert [e[1] for e in rec.events()] == ["segment_map", "alloc", "alloc", "free"]  # the seed: keep's granule
    keep.free()


def test_a_failing_disk_never_corrupts_the_pool(pool, tmp_path, monkeypatch):
    path = tmp_path / "full.h5"
    calls = []

    def append(self, events):
        calls.append(len(events))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Hdf5Writer, "append", append)
    rec = pool.record(path, batch=4)
    with pytest.raises(TraceError, match=re.escape(str(path)) + ".*No space left on device"):
        with rec:
            live = [pool.malloc(1000 * (i + 1)) for i in range(20)]  # the 4th event hits the disk
            for a in live[::2]:
                a.free()
            pool.check()
    assert calls == [4]  # writing stopped at the first failure
    assert rec.n_events == 1 + 20 + 10  # the ring went on: segment, allocs, frees
    for a in live[1::2]:
        a.free()  # no DoubleFreeError: every operation completed
    pool.check()
    assert pool.stats()["allocated_bytes.all.current"] == 0 and _detached(pool, rec)


def test_a_failing_disk_does_not_hide_the_error_of_the_block(pool, tmp_path, monkeypatch):
    monkeypatch.setattr(Hdf5Writer, "append", lambda self, ev: 1 / 0)
    with pytest.raises(KeyError) as info:
        with pool.record(tmp_path / "x.h5", batch=1):
            pool.malloc(10).free()
            raise KeyError("the user's own error")
    assert any("the trace was not fully written" in n for n in info.value.__notes__)


def test_stacks_keep_user_frames_in_folders_named_cupool(pool, tmp_path):
    folder = tmp_path / "cupool"
    folder.mkdir()
    script = folder / "user_script.py"
    script.write_text("def work(pool):\n    return pool.malloc(4096)\n")
    ns: dict = {}
    exec(compile(script.read_text(), str(script), "exec"), ns)
    with pool.record(stacks=True) as rec:
        a = ns["work"](pool)
    stack = rec.events()[-1][5]
    assert str(script) in stack and "in work" in stack
    assert f'"{os.path.dirname(cupool.__file__)}{os.sep}' not in stack  # the package's own frames are gone
    a.free()


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
        if rec.flushed >= 640 and rec.n_events % 64 == 17:
            print(rec.flushed, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_killed_recorder_leaves_a_readable_trace(tmp_path):
    path = tmp_path / "killed.h5"
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    flushed = int(proc.stdout.split()[-1])
    with h5py.File(path, "r") as f:  # plain h5py: no swmr=True, no h5clear
        assert f["count"][()] == flushed
    tr = load_trace(path)
    assert len(tr) == flushed  # everything up to the last flush, nothing half-written
    kinds = [tr.kinds[k] for k in tr.kind]
    assert kinds[0] == "segment_map" and set(kinds) <= {"alloc", "free", "segment_map"}  # expandable segments
    assert (tr.size > 0).all() and (np.diff(tr.t_ns) >= 0).all()
    r = replay(tr)
    signed = np.where(tr.kind == tr.code("alloc"), tr.size, np.where(tr.kind == tr.code("free"), -tr.size, 0))
    assert r.unmatched_frees == 0 and r.peak_allocated == signed.cumsum().max()


_OLD_SWMR_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import h5py, numpy as np
    from cupool.core.events import KINDS
    # What cupool wrote before its traces were written for crashes: chunked columns, SWMR mode.
    f = h5py.File(sys.argv[1], "w", libver="latest")
    f.attrs.update(format="cupool-trace", version=1, config="{}")
    for name in ("t_ns", "kind", "addr", "size", "stream"):
        f.create_dataset(name, data=np.arange(3, dtype=np.uint8 if name == "kind" else np.int64), maxshape=(None,))
    names = np.zeros(64, "S32")
    names[: len(KINDS)] = [k.encode() for k in KINDS]
    f["kind_names"] = names
    f["count"] = np.int64(3)
    f.swmr_mode = True
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_killed_swmr_trace_from_an_earlier_cupool_still_loads(tmp_path):
    path = tmp_path / "old.h5"
    proc = subprocess.run([sys.executable, "-c", _OLD_SWMR_WRITER, str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with pytest.raises(OSError, match="already open for write"):
        h5py.File(path, "r")  # what the SWMR reader in load_trace is there for
    tr = load_trace(path)
    assert tr.t_ns.tolist() == [0, 1, 2] and tr.kinds[: len(KINDS)] == KINDS


def _timers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "cupool-trace-flush"}


def test_the_timer_writes_out_a_quiet_recording(pool, tmp_path):
    path = tmp_path / "quiet.h5"
    before = _timers()
    with pool.record(path, flush_interval=0.05) as rec:
        live = [pool.malloc(1000) for _ in range(10)]
        deadline = time.monotonic() + 5
        while rec.flushed < rec.n_events and time.monotonic() < deadline:
            time.sleep(0.01)  # no event arrives: only the timer can write them out
        assert rec.flushed == rec.n_events == 11
        assert len(load_trace(path)) == 11  # readable while it is being written
        assert len(_timers() - before) == 1
    assert _timers() <= before  # stop() ended its timer
    del live


def _pairs(pool, n, seed):
    for size in np.random.default_rng(seed).integers(1, 64 << 10, n):
        pool.malloc(int(size), stream=int(size) % 2).free()


def test_timer_flushes_do_not_race_the_events(pool, tmp_path):
    path = tmp_path / "race.h5"
    with pool.record(path, capacity=1 << 17, batch=1 << 17, flush_interval=0.001) as rec:  # only the timer writes
        threads = [threading.Thread(target=_pairs, args=(pool, 15_000, seed)) for seed in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    tr, mem = load_trace(path), rec.events()
    assert len(tr) == len(mem) == rec.n_events and rec.dropped == 0
    assert [tr.kinds[k] for k in tr.kind] == [e[1] for e in mem]
    assert tr.t_ns.tolist() == [e[0] for e in mem] and tr.addr.tolist() == [e[2] for e in mem]


def test_a_finished_trace_has_no_unused_rows_and_nothing_beside_it(pool, tmp_path):
    path = tmp_path / "t.h5"
    with pool.record(path, stacks=True, batch=7):
        _churn(pool, 40)
    with h5py.File(path, "r") as f:
        n = int(f["count"][()])
        assert {f[c].shape[0] for c in ("t_ns", "kind", "addr", "size", "stream", "stack_end")} == {n}
        assert f["stack_bytes"].shape[0] == f["stack_end"][-1]
    assert os.listdir(tmp_path) == ["t.h5"]
    empty = tmp_path / "empty.h5"
    with cupool.Pool("sim", capacity="64MiB").record(empty) as rec:
        pass
    assert rec.n_events == len(load_trace(empty)) == 0


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


def _rewrite(src, dst, edit):
    dst.write_bytes(src.read_bytes())
    with h5py.File(dst, "r+") as f:
        edit(f)
    return dst


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda f: (f.__delitem__("size"), f.create_dataset("size", data=np.full(f["t_ns"].shape, 1.5))),
         "dataset 'size' holds float64, not integers"),
        (lambda f: (f.__delitem__("kind_names"), f.create_dataset("kind_names", data=np.arange(64))),
         "'kind_names' holds int64, not byte strings"),
        (lambda f: f.attrs.__setitem__("config", "{not json"), "'config' attribute is not JSON"),
        (lambda f: f.attrs.__setitem__("config", "[1, 2]"), "'config' attribute is not a JSON object"),
        (lambda f: f["size"].__setitem__(0, -5), "event 0 has a negative size"),
        (lambda f: f["kind"].__setitem__(0, 200), "an event kind has no name"),
    ],
)
def test_corrupted_columns_and_attributes_get_clear_errors(pool, tmp_path, edit, problem):
    good = tmp_path / "good.h5"
    with pool.record(good):
        _churn(pool, 20)
    bad = _rewrite(good, tmp_path / "bad.h5", edit)
    with pytest.raises(TraceError, match=re.escape(str(bad)) + ".*" + re.escape(problem)):
        load_trace(bad)


def test_bad_recorded_settings_name_the_file(pool, tmp_path, capsys):
    from cupool.cli import main

    good = tmp_path / "good.h5"
    with pool.record(good):
        _churn(pool, 20)
    bad = _rewrite(good, tmp_path / "bad.h5", lambda f: f.attrs.__setitem__(
        "config", json.dumps({"capacity": "lots", "limit": 1 << 30})))
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "capacity" in err and "Traceback" not in err


def test_events_must_be_int64_integers():
    with pytest.raises(ValueError, match="event 1: the size must be an integer, got 1.5"):
        Trace.from_events([(0, "alloc", 1, 5, 0), (1, "alloc", 2, 1.5, 0)])
    with pytest.raises(ValueError, match="event 0: the kind must be a string, got 7"):
        Trace.from_events([(0, 7, 1, 5, 0)])
    with pytest.raises(ValueError, match="event 0: the size -1 is out of range"):
        Trace.from_events([(0, "alloc", 1, -1, 0)])
    with pytest.raises(ValueError, match="event 0: the address .* out of range"):
        Trace.from_events([(0, "alloc", 1 << 64, 5, 0)])


def test_recorder_rejects_bad_options(pool, tmp_path):
    with pytest.raises(ValueError, match="capacity"):
        pool.record(capacity=0)
    with pytest.raises(ValueError, match="batch"):
        pool.record(capacity=4, batch=8)
    with pytest.raises(ValueError, match="flush_interval"):
        pool.record(flush_interval=float("inf"))
    with pool.record(capacity=4) as rec:  # the default batch fits a small ring
        pool.malloc(100).free()
    assert len(rec.events()) == 3
    rec = pool.record(tmp_path / "no" / "such" / "dir.h5")
    with pytest.raises(TraceError, match="cannot create"):
        rec.start()
    assert rec.n_events == 0 and _detached(pool, rec)


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
    with pytest.raises(TraceError, match="device 5 holds nothing"):
        load_torch_snapshot(p, device=5)


@pytest.mark.parametrize(
    "event, problem",
    [
        ({"action": "alloc", "addr": 1 << 64, "size": 5}, "device_traces[1][7]: addr 18446744073709551616 is out of range"),
        ({"action": "alloc", "addr": 16, "size": -5}, "device_traces[1][7]: size -5 is out of range"),
        ({"action": "alloc", "addr": 16, "size": 5, "time_us": 1 << 62}, "device_traces[1][7]: time_us"),
        ({"action": "alloc", "addr": 16, "size": "5"}, "device_traces[1][7] (alloc): size must be an integer"),
        ({"action": 3, "addr": 16, "size": 5}, "device_traces[1][7]: the action must be a string, got 3"),
    ],
)
def test_torch_snapshot_bad_values_name_the_file_and_event(tmp_path, event, problem):
    p = tmp_path / "bad.pickle"
    _torch_fixture(p, extra=[event])
    with pytest.raises(TraceError, match=re.escape(str(p)) + ".*" + re.escape(problem)):
        load_trace(p)


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


def test_rmm_wall_clock_times_and_midnight(tmp_path):
    p = tmp_path / "clock.csv"
    p.write_text("Thread,Time,Action,Pointer,Size,Stream\n"
                 "1,23:59:59.999500,allocate,0x10,512,0x0\n"
                 "1,00:00:00.000250,free,0x10,512,0x0\n"
                 "1,00:00:01.5,allocate,0x10,512,0x0\n")
    t = load_rmm_log(p).t_ns
    assert t[0] == (23 * 3600 + 59 * 60 + 59) * 10**9 + 999_500_000
    assert t[1] - t[0] == 750_000 and t[2] - t[1] == 1_499_750_000  # across midnight, not a day back


@pytest.mark.parametrize(
    "body, problem",
    [
        ("1,1.0,allocate,0x10\n", "line 2: expected 6 fields"),
        ("1,1.0,reallocate,0x10,5,0x0\n", "line 2: unknown action 'reallocate'"),
        ("1,1.0,allocate,zz,5,0x0\n", "line 2: cannot parse the pointer 'zz'"),
        ("1,1.0,allocate,0x10,5.5,0x0\n", "line 2: cannot parse the size '5.5'"),
        ("1,1.0,allocate,0x10,5,0x0q\n", "line 2: cannot parse the stream '0x0q'"),
        ("1,1.0,allocate,0x10,-5,0x0\n", "line 2: size -5 is out of range"),
        ("1,1.0,allocate,0xffffffffffffffffff,5,0x0\n", "line 2: pointer 4722366482869645213695 is out of range"),
        ("1,1.0,allocate,0x10,99999999999999999999,0x0\n", "line 2: size 99999999999999999999 is out of range"),
        ("1,1e12,allocate,0x10,5,0x0\n", "line 2: time 1000000000000000000000 is out of range"),
        ("1,inf,allocate,0x10,5,0x0\n", "line 2: cannot parse the time 'inf'"),
    ],
)
def test_rmm_log_errors_name_the_line(tmp_path, body, problem):
    p = tmp_path / "bad.csv"
    p.write_text("Thread,Time,Action,Pointer,Size,Stream\n" + body)
    with pytest.raises(TraceError, match=re.escape(problem)):
        load_trace(p)


def test_rmm_failure_rows_as_rmm_writes_them(tmp_path):
    """RMM prints pointers with %p, which writes the null pointer of every failed allocation as (nil); some
    versions print %llx, hexadecimal without 0x, pointers and streams alike (issue 28)."""
    p = tmp_path / "failed.csv"
    p.write_text("Thread,Time,Action,Pointer,Size,Stream\n"
                 "140573312345856,08:00:01.000250,allocate,0x7f8a40000000,1024,0x7f8a38001020\n"
                 "140573312345856,08:00:01.000300,allocate failure,(nil),1099511627776,0x7f8a38001020\n"
                 "140573312345856,08:00:01.000400,allocate,7f8a40000400,2048,7f8a38001020\n"
                 "140573312345856,08:00:01.000500,free,0x7f8a40000000,1024,0\n")
    tr = load_trace(p)
    assert [tr.kinds[k] for k in tr.kind] == ["alloc", "oom", "alloc", "free"]
    assert tr.addr.tolist() == [0x7F8A40000000, 0, 0x7F8A40000400, 0x7F8A40000000]
    assert tr.stream.tolist() == [1, 1, 1, 0]  # 0x7f8a38001020 both ways (numbered after the null stream)
    assert replay(tr, {"capacity": "64MiB"}).ooms == 1


def test_rmm_negative_decimal_times_keep_their_nanoseconds(tmp_path):
    p = tmp_path / "negative.csv"
    p.write_text("Thread,Time,Action,Pointer,Size,Stream\n"
                 "0,-1234567890.123456789,allocate,0x10,512,0\n"
                 "0,-0.000000001,free,0x10,512,0\n"
                 "0,-0.5,allocate,0x10,512,0\n")
    assert load_rmm_log(p).t_ns.tolist() == [-1_234_567_890_123_456_789, -1, -500_000_000]


# ------------------------------------------------------------- snapshot export
def _exported(pool, tmp_path):
    with pool.record(stacks=True):
        keep = [pool.malloc(s) for s in (1000, 5 << 20, 30 << 20)]
        keep.pop(0).free()
        path = tmp_path / "snap.pickle"
        pool.export_snapshot(path)
    return pickle.loads(path.read_bytes()), keep, path


@pytest.mark.parametrize("expandable, grows, segments", [(False, "segment_alloc", 3), (True, "segment_map", 2)])
def test_export_snapshot_shape(tmp_path, expandable, grows, segments):
    # Three requests of three sizes: three plain segments, or three mappings into expandable ones
    # (a small segment, and one large segment grown twice), as PyTorch writes each.
    pool = cupool.Pool("sim", capacity="64MiB", expandable_segments=expandable)
    data, keep, path = _exported(pool, tmp_path)
    segs = pool.snapshot()["segments"]
    assert [s["address"] for s in data["segments"]] == [s["address"] for s in segs] and len(segs) == segments
    assert all("blocks" in s and "total_size" in s for s in data["segments"])
    actions = [e["action"] for e in data["device_traces"][0]]
    assert actions.count(grows) == 3 and actions.count("alloc") == 3
    assert sum(e["size"] for e in data["device_traces"][0] if e["action"] == grows) == \
        sum(s["total_size"] for s in data["segments"])
    i = actions.index("free_requested")
    assert actions[i + 1] == "free_completed"
    assert any(f["filename"].endswith("test_trace.py") for f in data["device_traces"][0][1]["frames"])
    # and it comes back through the PyTorch importer with the same live bytes
    r = replay(load_trace(path), {"capacity": "64MiB"})
    assert r.peak_allocated == pool.stats()["allocated_bytes.all.peak"]
    del keep


def test_export_snapshot_renders_with_torch_memory_viz(tmp_path):
    mv = pytest.importorskip("torch.cuda._memory_viz", reason="torch is not installed (pip install torch, or '.[viz]' in cupool's checkout)")
    pool = cupool.Pool("sim", capacity="64MiB", expandable_segments=False)  # its figures are plain segments'
    data, keep, _ = _exported(pool, tmp_path)
    summary = mv.segsum(data)
    assert "segments: 3" in summary and "total_reserved: 52.0MiB" in summary
    text = mv.trace(data)
    assert "cudaMalloc" in text and "free completed" in text
    for html in (mv.trace_plot(data), mv.segment_plot(data)):
        payload = json.loads(re.search(r"(\[\{\"name\": \"snapshot.pickle\".*?\}\])", html).group(1))
        assert pickle.loads(base64.b64decode(payload[0]["base64"])) == data
    del keep


def test_export_follows_compaction_moves(tmp_path):
    pool = cupool.Pool("sim", capacity="512MiB", initial_size="36MiB", defrag_threshold=None)
    with pool.record():
        bufs = [pool.movable(3 << 20) for _ in range(12)]  # all in the preallocated segment
        for m in bufs[::2]:
            m.free()
        report = pool.compact()
        path = tmp_path / "moved.pickle"
        pool.export_snapshot(path)
    assert report.moves > 0
    entries = pickle.loads(path.read_bytes())["device_traces"][0]
    live = {}
    for e in entries:
        if e["action"] == "alloc":
            assert e["addr"] not in live
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            assert live.pop(e["addr"]) == e["size"]  # every free names a block that is live there
    snap_live = {b["address"]: b["size"] for s in pool.snapshot()["segments"] for b in s["blocks"]
                 if b["state"] != "inactive"}
    assert len(snap_live) == 6 and live == snap_live  # following the moves ends where the pool is
    assert {m.ptr for m in bufs[1::2]} == set(live)
    r = replay(load_trace(path), {"capacity": "512MiB"})
    assert r.unmatched_frees == 0 and r.peak_allocated == 12 * (3 << 20)
