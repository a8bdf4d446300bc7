"""A recording killed at any moment leaves a trace that plain HDF5 readers open, with every flushed event.

Thirty recording processes are killed with SIGKILL at random moments (seeded),
twenty a few hundred events in and ten about a hundred thousand in (past three of
the file's growths), flushes included; each file must open with ``h5py.File(path, "r")`` (no
``swmr``), with ``h5dump -H`` where that is installed, and load every event up to
the last flush, with the right values.  Separately, kills inside a growth of the
file, and a quiet program killed a second and a half after its last event.
"""

from __future__ import annotations

import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np
import pytest

from cupool.trace import load_trace

BATCH = 256
LONG = 10
#: (seed, events flushed before the kill): the first LONG about 100k events in, the others a few hundred in.
TRIALS = [(seed, random.Random(seed).randint(*((90_000, 110_000) if seed < LONG else (300, 800)))) for seed in range(30)]

# Pair i allocates and frees 512 * (1 + i % 97) bytes; the child prints rec.flushed whenever it changes.
_CHILD = textwrap.dedent(
    """
    def trial(path, batch):
        pool = cupool.Pool("sim", capacity="64MiB")
        rec = pool.record(path, batch=batch, flush_interval=3600)
        rec.start()
        reported = -1
        for i in range(10**9):
            pool.malloc(512 * (1 + i % 97)).free()
            if rec.flushed != reported:
                reported = rec.flushed
                print(reported, flush=True)
    """
)
#: Starts each recording process: a fork of one interpreter that has imported cupool, so that the thirty
#: recordings do not each pay for starting Python and importing cupool (most of their time).  For each line
#: "path batch" it forks a recording, says "pid N", relays what the recording prints, and once the recording
#: is dead (its output closed) says "exit CODE" (negative: the signal that ended it).
_FORKER = _CHILD + textwrap.dedent(
    """
    import os, sys
    import cupool
    for line in sys.stdin:
        path, batch = line.split()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.dup2(w, 1)
            sys.stdout = os.fdopen(1, "w")
            try:
                trial(path, int(batch))
            finally:
                os._exit(1)
        os.close(w)
        print("pid", pid, flush=True)
        with os.fdopen(r, "rb") as out:
            for chunk in iter(lambda: out.read1(65536), b""):
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
        print("exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    """
)


def _kill_at(forker: subprocess.Popen, path: Path, events: int, seed: int) -> int:
    """Kill a recording once it has flushed ``events`` events (plus up to a flush's time); the last flush it reported."""
    forker.stdin.write(f"{path} {BATCH}\n")
    forker.stdin.flush()
    pid = int(forker.stdout.readline().removeprefix("pid "))
    try:
        reported = 0
        for line in forker.stdout:
            assert not line.startswith("exit"), f"the recording ended by itself: {line}"
            reported = int(line)
            if reported >= events:
                break
        time.sleep(random.Random(seed).uniform(0, 0.002))  # anywhere in the next flush or so, flushes included
        os.kill(pid, signal.SIGKILL)
        rest = []
        for line in forker.stdout:
            if line.startswith("exit"):
                break
            rest.append(line)
        reported = int(rest[-1]) if rest else reported
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    assert int(line.split()[1]) == -signal.SIGKILL
    return reported


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> list[tuple[Path, int]]:
    folder = tmp_path_factory.mktemp("killed")
    forkers: queue.Queue[subprocess.Popen] = queue.Queue()
    for _ in range(2):  # two at a time: the processes wait on each other's kills
        forkers.put(subprocess.Popen([sys.executable, "-c", _FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True))

    def kill_at(path: Path, events: int, seed: int) -> int:
        forker = forkers.get()
        try:
            return _kill_at(forker, path, events, seed)
        finally:
            forkers.put(forker)

    paths = [folder / f"killed-{seed}.h5" for seed, _ in TRIALS]
    try:
        with ThreadPoolExecutor(2) as workers:
            flushed = workers.map(kill_at, paths, [events for _, events in TRIALS], [seed for seed, _ in TRIALS])
            return list(zip(paths, flushed))
    finally:
        while not forkers.empty():
            forker = forkers.get()
            forker.stdin.close()
            forker.wait(timeout=60)


def test_killed_traces_open_with_plain_h5py(killed):
    for path, _ in killed:
        with h5py.File(path, "r") as f:  # no swmr=True, no h5clear
            assert int(f["count"][()]) <= f["t_ns"].shape[0]


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="h5dump is not installed (apt-get install hdf5-tools)")
def test_killed_traces_open_with_h5dump(killed):
    for path, _ in killed:
        proc = subprocess.run(["h5dump", "-H", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{path}: {proc.stderr}"


def _check_events(path: Path, lengths: tuple[int, ...]) -> None:
    tr = load_trace(path)
    assert len(tr) in lengths
    kinds = [tr.kinds[k] for k in tr.kind]
    assert kinds[0] == "segment_map"  # the default pool's expandable small segment maps its first granule
    pairs = (len(tr) - 1) // 2
    assert kinds[1:] == ["alloc", "free"] * pairs + ["alloc"] * ((len(tr) - 1) % 2)
    sizes = 512 * (1 + np.arange(pairs) % 97)
    assert (tr.size[1 : 1 + 2 * pairs : 2] == sizes).all() and (tr.size[2 : 2 + 2 * pairs : 2] == sizes).all()
    assert (np.diff(tr.t_ns) >= 0).all() and (tr.addr[1::2] == tr.addr[1]).all()


def test_killed_traces_hold_every_flushed_event(killed):
    for path, flushed in killed:
        # The last reported flush, or the one after it when the kill came between a flush and its report.
        _check_events(path, (flushed, flushed + BATCH))
    assert sum(flushed >= 80_000 for _, flushed in killed) == LONG


_GROWING = textwrap.dedent(
    """
    import os, signal, sys
    import cupool
    pool = cupool.Pool("sim", capacity="64MiB")
    rec = pool.record(sys.argv[1], batch=int(sys.argv[2]), flush_interval=3600)
    rec.start()
    for i in range(20_000):  # past the first generation's 16384 rows
        pool.malloc(512 * (1 + i % 97)).free()
    def killing(*args):  # the writer reads the old file, and renames, only while the file grows
        print(rec.flushed, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    setattr(os, sys.argv[3], killing)
    for i in range(20_000, 40_000):  # past the second generation's 32768 rows
        pool.malloc(512 * (1 + i % 97)).free()
    """
)


@pytest.mark.parametrize("where", ["pread", "replace"])
def test_a_kill_while_the_file_grows_leaves_the_previous_file(tmp_path, where):
    path = tmp_path / "growing.h5"
    proc = subprocess.run([sys.executable, "-c", _GROWING, str(path), str(BATCH), where],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    flushed = int(proc.stdout)
    assert flushed > 1 << 14
    _check_events(path, (flushed,))
    with h5py.File(path, "r"):
        pass


_QUIET = textwrap.dedent(
    """
    import os, signal, sys, time
    import cupool
    pool = cupool.Pool("sim", capacity="64MiB")
    rec = pool.record(sys.argv[1])  # the defaults: batch=4096, flush_interval=1.0
    rec.start()
    while rec.n_events < 500:
        pool.malloc(1000).free()
    print(rec.n_events, flush=True)
    time.sleep(1.5)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_quiet_recording_loses_at_most_the_last_second(tmp_path):
    path = tmp_path / "quiet.h5"
    proc = subprocess.run([sys.executable, "-c", _QUIET, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert len(load_trace(path)) == int(proc.stdout) == 501  # the segment, then 250 allocs and frees
    with h5py.File(path, "r"):
        pass
    assert os.listdir(tmp_path) == ["quiet.h5"]
