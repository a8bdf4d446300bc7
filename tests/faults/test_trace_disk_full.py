"""A trace that cannot be written stops; the process and the pool carry on.

h5py segfaults when it closes a file whose flush failed, so each recording runs
in a child process: a crash shows as the child's exit status, not as a dead
test run.  The disk fills up through a file-size limit (RLIMIT_FSIZE, with
SIGXFSZ ignored, as a batch job's limit would be) and through a 1 MiB tmpfs
(where a user namespace lets this machine mount one).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_CHILD = textwrap.dedent(
    """
    import json, resource, signal, sys
    path, limit, batch, interval, pairs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    import cupool
    from cupool.trace import load_trace
    # Under a file-size limit, plain segments: the sim device's virtual memory is a memfd, which
    # RLIMIT_FSIZE limits too (a 2 MiB granule fails with EFBIG).  A full tmpfs keeps the defaults.
    pool = cupool.Pool("sim", capacity="64MiB", expandable_segments=False if limit else None)
    rec = pool.record(path, batch=batch, capacity=max(batch, 1 << 16), flush_interval=interval)
    error = None
    try:
        with rec:
            for i in range(pairs):
                pool.malloc(1000).free()
    except cupool.TraceError as e:
        error = str(e)
    pool.check()
    live = [pool.malloc(1000 * (1 + i % 7)) for i in range(100)]  # the pool still hands out memory
    for a in live:
        a.free()
    pool.check()
    print(json.dumps({"error": error, "flushed": rec.flushed, "n_events": rec.n_events,
                      "allocated": pool.stats()["allocated_bytes.all.current"], "loaded": len(load_trace(path))}))
    """
)


def _record(path: Path, limit: int = 0, batch: int = 256, interval: float = 1.0, wrap: tuple[str, ...] = ()) -> dict:
    args = [*wrap, sys.executable, "-c", _CHILD, str(path), str(limit), str(batch), str(interval), "20000"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"the recording process died (exit status {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.splitlines()[-1])


def _check_stopped_cleanly(path: Path, out: dict) -> None:
    assert out["error"] is not None, "the disk filled up, but leaving the with block raised nothing"
    assert re.search(re.escape(str(path)) + rf": writing the trace failed after {out['flushed']} events", out["error"])
    assert 0 < out["flushed"] < out["n_events"] == 1 + 2 * 20_000  # writing stopped, the recording went on
    assert out["allocated"] == 0
    assert out["loaded"] == out["flushed"]  # the file holds what the error says, and reads back


@pytest.mark.parametrize("limit", [200_000, 1_000_000])
def test_a_file_size_limit_stops_the_recording_not_the_process(tmp_path, limit):
    path = tmp_path / "limited.h5"
    out = _record(path, limit)
    _check_stopped_cleanly(path, out)
    assert "file-size limit" in out["error"] and path.stat().st_size <= limit


def test_a_failed_write_on_the_timer_thread_stops_the_recording_too(tmp_path):
    # Batches never fill (batch = 64k events), so every write, the failing one included, is the timer's.
    path = tmp_path / "timer.h5"
    out = _record(path, 1_000_000, batch=1 << 16, interval=0.005)
    _check_stopped_cleanly(path, out)


def _unshare() -> list[str]:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("a 1 MiB tmpfs needs unshare(1) and mount(8), which this machine lacks")
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here ({probe.stderr.strip()})")
    return ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$1" && shift && exec "$@"', "sh"]


def test_a_full_tmpfs_stops_the_recording_not_the_process(tmp_path):
    wrap = _unshare()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    path = mnt / "full.h5"
    out = _record(path, wrap=(*wrap, str(mnt)))  # the tmpfs goes with the child's namespace: it loads the file
    _check_stopped_cleanly(path, out)
    assert "No space left on device" in out["error"]
