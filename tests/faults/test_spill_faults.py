"""Spill files under faults: full disks, two processes on one path, damaged files, symbolic links.

A full disk once crashed the process (h5py segfaults on a file whose write
failed), so those runs are child processes: a crash shows as the child's exit
status, not as a dead test run.  The disk fills through a file-size limit
(RLIMIT_FSIZE, SIGXFSZ ignored) and through a small tmpfs where a user
namespace lets this machine mount one.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

import cupool
from cupool.pressure import spill

MiB = 1 << 20

#: Fills six 2 MiB buffers, spills them into a disk with room for about two, three
#: times over, and checks every byte after each round; exits 0 only if all held.
_FULL_DISK = textwrap.dedent(
    """
    import gc, os, resource, signal, sys, zlib
    import numpy as np
    import cupool
    path, limit = sys.argv[1], int(sys.argv[2])
    pool = cupool.Pool("sim", capacity="64MiB", spill=path)
    bufs = [pool.movable(2 << 20) for _ in range(6)]
    want = []
    for i, m in enumerate(bufs):
        a = m.array(dtype=np.uint8)
        a[:] = np.random.default_rng(i).integers(0, 256, a.size, dtype=np.uint8)
        want.append(zlib.crc32(a))
        del a
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    for _ in range(3):  # the failure retires the file; the next round starts a fresh one
        try:
            pool.spill()
            sys.exit("the disk has room for two buffers, yet spilling six raised nothing")
        except cupool.SpillError as e:
            assert "failed" in str(e) and path in str(e), e
        spilled = sum(not m.on_device for m in bufs)
        assert 1 <= spilled < 6, spilled
        for i, m in enumerate(bufs):
            assert zlib.crc32(m.array(dtype=np.uint8)) == want[i], f"buffer {i} came back wrong"
        pool.check()
    del bufs, m, pool
    gc.collect()
    assert os.listdir(os.path.dirname(path)) == [], os.listdir(os.path.dirname(path))
    print("ok")
    """
)


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"the spilling process failed ({_status(proc.returncode)}):\n{proc.stderr[-3000:]}"
    return proc


def _status(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def _fill(m: cupool.Movable, seed: int) -> int:
    a = m.array(dtype=np.uint8)
    a[:] = np.random.default_rng(seed).integers(0, 256, m.size, dtype=np.uint8)
    return zlib.crc32(a)


def _crc(m: cupool.Movable) -> int:
    return zlib.crc32(m.array(dtype=np.uint8))


# ------------------------------------------------------------ full disks
@pytest.mark.skipif(not hasattr(__import__("resource"), "RLIMIT_FSIZE"), reason="no RLIMIT_FSIZE on this platform")
def test_a_file_size_limit_raises_spill_errors_and_every_buffer_comes_back(tmp_path):
    _run([sys.executable, "-c", _FULL_DISK, str(tmp_path / "spill.h5"), str(6 << 20)])


def _tmpfs_wrapper(mount: Path) -> tuple[str, ...]:
    """Run a command with a 6 MiB tmpfs at ``mount`` in a user and mount namespace; skip where that is refused."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1): cannot mount a small tmpfs without privileges")
    wrap = (unshare, "--user", "--map-root-user", "--mount", "sh", "-c",
            f'mount -t tmpfs -o size=6m tmpfs "{mount}" && exec "$@"', "sh")
    probe = subprocess.run([*wrap, "true"], check=False, capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()[-200:]}")
    return wrap


def test_a_full_tmpfs_raises_spill_errors_and_every_buffer_comes_back(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    _run([*_tmpfs_wrapper(mount), sys.executable, "-c", _FULL_DISK, str(mount / "spill.h5"), "0"])


# ------------------------------------------------------ two processes, one path
_HOLDER = textwrap.dedent(
    """
    import sys, zlib
    import numpy as np
    import cupool
    pool = cupool.Pool("sim", capacity="64MiB", spill=sys.argv[1])
    bufs = [pool.movable(1 << 20) for _ in range(4)]
    want = []
    for i, m in enumerate(bufs):
        a = m.array(dtype=np.uint8)
        a[:] = np.random.default_rng(i).integers(0, 256, a.size, dtype=np.uint8)
        want.append(zlib.crc32(a))
        del a
    assert pool.spill() == 4 << 20
    print("spilled", flush=True)
    sys.stdin.readline()  # the other process has had its go at the path
    got = [zlib.crc32(m.array(dtype=np.uint8)) for m in bufs]
    assert got == want, "restores returned wrong bytes"
    print("ok")
    """
)

_INTRUDER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import cupool
    pool = cupool.Pool("sim", capacity="64MiB", spill=sys.argv[1])
    m = pool.movable(1 << 20)
    m.array(dtype=np.uint8)[:] = 7
    try:
        pool.spill()
        sys.exit("spilled into another process's live spill file")
    except cupool.SpillError as e:
        assert "already exists" in str(e) and sys.argv[1] in str(e), e
    assert m.on_device and (m.array(dtype=np.uint8) == 7).all()
    print("ok")
    """
)


def test_a_second_process_never_touches_a_live_spill_file(tmp_path):
    path = str(tmp_path / "shared.h5")
    env = {**os.environ, "HDF5_USE_FILE_LOCKING": "FALSE"}  # as on NFS and Lustre
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert holder.stdout.readline().strip() == "spilled", holder.stderr.read()[-3000:]
        intruder = subprocess.run(
            [sys.executable, "-c", _INTRUDER, path], check=False, capture_output=True, text=True, timeout=120, env=env
        )
        out, err = holder.communicate("go\n", timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert holder.returncode == 0, f"the first process failed ({_status(holder.returncode)}):\n{err[-3000:]}"
    assert out.strip() == "ok"
    assert intruder.returncode == 0, (
        f"the second process failed ({_status(intruder.returncode)}):\n{intruder.stderr[-3000:]}"
    )


# ------------------------------------------------------------ damaged files
@pytest.fixture
def h5_pool(tmp_path):
    return cupool.Pool("sim", capacity="64MiB", spill=str(tmp_path / "s.h5")), tmp_path / "s.h5"


def _assert_unchanged_by_the_failed_restore(pool, m, before, gen):
    assert not m.on_device and m.generation == gen
    assert pool.stats() == before
    pool.check()
    m.free()  # the damaged copy can still be dropped
    pool.check()
    assert pool.stats()["allocated_bytes.all.current"] == 0


def test_a_truncated_spill_file_raises_naming_the_buffer_and_changes_nothing(h5_pool):
    pool, path = h5_pool
    keep, m = pool.movable(MiB), pool.movable(3 * MiB)
    want = _fill(keep, 0)
    _fill(m, 1)
    pool.spill(1)  # keep
    pool.spill()  # m, written after keep
    os.truncate(path, path.stat().st_size - 2 * MiB)
    before, gen = pool.stats(), m.generation
    damaged = rf"spilled buffer b1 \(3 MiB\) in {re.escape(str(path))} is damaged: .*truncated"
    with pytest.raises(cupool.SpillError, match=damaged) as ei:
        m.array()
    assert isinstance(ei.value, spill.CorruptSpillError)
    _assert_unchanged_by_the_failed_restore(pool, m, before, gen)
    assert _crc(keep) == want  # a buffer whose bytes are intact still comes back


def test_an_altered_spill_file_raises_naming_the_buffer_and_changes_nothing(h5_pool):
    pool, path = h5_pool
    m = pool.movable(2 * MiB)
    _fill(m, 2)
    tail = m.array(dtype=np.uint8)[-64:].tobytes()
    pool.spill()
    at = path.read_bytes().find(tail)
    assert at > 0
    with open(path, "r+b") as f:  # one bit flipped on disk, as a bad sector or another writer would
        f.seek(at)
        f.write(bytes([tail[0] ^ 1]))
    before, gen = pool.stats(), m.generation
    damaged = rf"spilled buffer b0 \(2 MiB\) in {re.escape(str(path))} is damaged: its CRC-32"
    with pytest.raises(cupool.SpillError, match=damaged) as ei:
        m.array()
    assert isinstance(ei.value, spill.CorruptSpillError)
    _assert_unchanged_by_the_failed_restore(pool, m, before, gen)


def test_an_altered_host_copy_raises_naming_the_buffer_and_changes_nothing():
    pool = cupool.Pool("sim", capacity="64MiB", spill="host")
    m = pool.movable(2 * MiB)
    _fill(m, 3)
    pool.spill()
    m.spilled.load()[12345] ^= 1  # load hands out the stored copy itself
    before, gen = pool.stats(), m.generation
    with pytest.raises(cupool.SpillError, match=r"2 MiB buffer in host memory \(pinned pool\) is damaged") as ei:
        m.array()
    assert isinstance(ei.value, spill.CorruptSpillError)
    _assert_unchanged_by_the_failed_restore(pool, m, before, gen)


# ------------------------------------------------------------ symbolic links
def _refused_and_untouched(link: Path, target: Path) -> None:
    pool = cupool.Pool("sim", capacity="64MiB", spill=str(link))
    m = pool.movable(MiB)
    want = _fill(m, 4)
    refused = f"cannot create the spill file {re.escape(str(link))}: it is a symbolic link"
    with pytest.raises(cupool.SpillError, match=refused):
        pool.spill()
    assert m.on_device and _crc(m) == want
    del pool, m
    gc.collect()
    assert link.is_symlink()  # the pool died and removed nothing it did not create


def test_a_dangling_symlink_at_the_spill_path_is_refused(tmp_path):
    link, target = tmp_path / "spill.h5", tmp_path / "elsewhere" / "spill.h5"
    target.parent.mkdir()
    link.symlink_to(target)
    _refused_and_untouched(link, target)
    assert not target.exists()  # nothing was created through the link


def test_a_symlink_to_an_existing_file_is_refused(tmp_path):
    link, target = tmp_path / "spill.h5", tmp_path / "precious.txt"
    target.write_bytes(b"precious\n")
    link.symlink_to(target)
    _refused_and_untouched(link, target)
    assert target.read_bytes() == b"precious\n"


def test_the_pool_removes_only_the_file_it_created(tmp_path):
    path = tmp_path / "s.h5"
    pool = cupool.Pool("sim", capacity="64MiB", spill=str(path))
    m = pool.movable(MiB)
    want = _fill(m, 5)
    pool.spill()
    path.unlink()
    path.write_bytes(b"someone else's\n")  # the name now means another file
    assert _crc(m) == want  # read through the descriptor of the file cupool created
    del pool, m
    gc.collect()
    assert path.read_bytes() == b"someone else's\n"
