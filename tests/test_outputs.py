"""Outputs go into what they name: a device or FIFO is written into, not replaced; ``-`` is standard output (issue 28).

``cupool export -o`` onto a device node or a FIFO used to replace it with a
regular file (as root, ``-o /dev/full`` destroyed the machine's ``/dev/full``),
``-o /dev/stdout`` failed ("No such file or directory"), and ``-o -`` wrote a
file named ``-``.  Device nodes here are made in a temporary folder (root only),
never the machine's own.
"""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import cupool
from cupool.cli import main

ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"
RMM_HEADER = b"Thread,Time,Action,Pointer,Size,Stream\n"
#: (arguments after the trace, what the output starts with)
OUTPUTS = {"snapshot": ([], b"\x80"), "rmm-csv": (["--format", "rmm-csv"], RMM_HEADER), "report": ([], PNG)}
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="making a device node takes root")


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    pool = cupool.Pool("sim", capacity="64MiB")
    path = tmp_path_factory.mktemp("trace") / "t.h5"
    with pool.record(path):
        keep = [pool.malloc(n * 1000) for n in range(1, 40)]
        for a in keep[::2]:
            a.free()
    return path


def _argv(kind: str, trace: Path, out: str | Path) -> list[str]:
    extra, _ = OUTPUTS[kind]
    return ["report" if kind == "report" else "export", str(trace), "-o", str(out), *extra]


def _read_fifo(path: Path) -> tuple[threading.Thread, list[bytes]]:
    """A reader of the FIFO ``path`` in a thread (a writer's open waits for one); what it read lands in the list."""
    got: list[bytes] = []

    def read() -> None:
        with open(path, "rb") as fh:
            got.append(fh.read())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t, got


@pytest.mark.parametrize("kind", sorted(OUTPUTS))
def test_a_fifo_is_written_into_not_replaced(tmp_path, trace, capsys, kind):
    fifo = tmp_path / "out"  # no extension: a report is a PNG
    os.mkfifo(fifo)
    reader, got = _read_fifo(fifo)
    assert main(_argv(kind, trace, fifo)) == 0
    reader.join(30)
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # still the FIFO, not a file in its place
    assert got and got[0].startswith(OUTPUTS[kind][1]) and len(got[0]) > 1000
    assert capsys.readouterr().out.startswith(f"wrote {fifo}:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary file beside it


def test_pool_export_snapshot_into_a_fifo(tmp_path):
    pool = cupool.Pool("sim", capacity="64MiB")
    fifo = tmp_path / "snap.fifo"
    os.mkfifo(fifo)
    reader, got = _read_fifo(fifo)
    with pool.record():
        keep = pool.malloc(5000)
        pool.export_snapshot(fifo)
        pool.export_snapshot(tmp_path / "snap.pickle")
    reader.join(30)
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    snap = pickle.loads(got[0])
    assert snap == pickle.loads((tmp_path / "snap.pickle").read_bytes())
    assert [e["action"] for e in snap["device_traces"][0]].count("alloc") == 1
    del keep


def _device(path: Path, minor: int) -> Path:
    """A character device of the memory driver (major 1): 3 is null, 7 is full; made in a temporary folder."""
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
    return path


@root_only
@pytest.mark.parametrize("kind", sorted(OUTPUTS))
def test_a_device_is_written_into_not_replaced(tmp_path, trace, capsys, kind):
    null = _device(tmp_path / "null", 3)
    assert main(_argv(kind, trace, null)) == 0
    st = null.stat()
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    assert capsys.readouterr().out.startswith(f"wrote {null}:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]  # nor a report beside it (null.png)


@root_only
@pytest.mark.parametrize("kind, what", [("snapshot", "snapshot"), ("rmm-csv", "RMM log"), ("report", "report")])
def test_a_full_device_is_an_error_and_stays_a_device(tmp_path, trace, capsys, kind, what):
    full = _device(tmp_path / "full", 7)
    assert main(_argv(kind, trace, full)) == 2
    assert capsys.readouterr().err == f"cupool: error: cannot write the {what} {full}: No space left on device\n"
    st = full.stat()
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 7)  # /dev/full was replaced by a file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def _cupool(cwd: Path, *args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "cupool", *args], cwd=cwd, env=env, stdout=stdout,
                          stderr=subprocess.PIPE, timeout=120, check=False)


STANDARD = ["-", "/dev/stdout", "/dev/fd/1"]


@pytest.fixture(scope="module")
def standard_runs(trace, tmp_path_factory) -> dict[tuple[str, str], tuple[Path, subprocess.CompletedProcess]]:
    """``cupool`` writing each kind of output to each name of standard output, each in a process and an empty
    folder of its own, two at a time (the test run only waits on them): {(kind, name): (folder, process)}."""
    cases = [(kind, name) for kind in sorted(OUTPUTS) for name in STANDARD]
    folders = [tmp_path_factory.mktemp("standard") for _ in cases]
    with ThreadPoolExecutor(2) as workers:
        runs = workers.map(lambda case, folder: _cupool(folder, *_argv(case[0], trace, case[1])), cases, folders)
        return {case: (folder, r) for case, folder, r in zip(cases, folders, runs)}


@pytest.mark.parametrize("name", STANDARD)
@pytest.mark.parametrize("kind", sorted(OUTPUTS))
def test_standard_output(tmp_path, trace, standard_runs, kind, name):
    """The output is on standard output, bytes as they are; what was written is said on standard error."""
    folder, r = standard_runs[kind, name]
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.startswith(OUTPUTS[kind][1]) and b"wrote" not in r.stdout
    assert r.stderr.decode().startswith(f"wrote {'standard output' if name == '-' else name}: ")  # not "wrote -:"
    assert list(folder.iterdir()) == []  # no file named "-" (or anything else)
    if kind == "snapshot":
        file = tmp_path / "s.pickle"
        assert main(_argv(kind, trace, file)) == 0
        assert pickle.loads(r.stdout) == pickle.loads(file.read_bytes())


def test_dev_stdout_onto_a_file_opened_for_appending_appends(tmp_path, trace):
    """Written through the descriptor the shell opened (``>> log``), not by replacing or truncating its file."""
    log = tmp_path / "log"
    log.write_bytes(b"before\n")
    with open(log, "ab") as fh:
        r = _cupool(tmp_path, "export", str(trace), "-o", "/dev/stdout", "--format", "rmm-csv", stdout=fh)
    assert r.returncode == 0, r.stderr.decode()
    assert log.read_bytes().startswith(b"before\n" + RMM_HEADER)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]


def test_standard_output_that_is_the_input_is_refused(tmp_path, trace):
    copy = tmp_path / "t.h5"
    copy.write_bytes(trace.read_bytes())
    with open(copy, "ab") as fh:
        r = _cupool(tmp_path, "export", str(copy), "-o", "-", stdout=fh)
    assert r.returncode == 2 and b"it is the input" in r.stderr
    assert copy.read_bytes() == trace.read_bytes()
