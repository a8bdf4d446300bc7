"""The files the command line writes: never over its input, whole or not at all (issue 21 #11)."""

from __future__ import annotations

import builtins
import errno
import os
import stat
from pathlib import Path

import pytest

import cupool
from cupool.cli import main

ENOSPC = os.strerror(errno.ENOSPC)


@pytest.fixture
def trace(tmp_path) -> Path:
    pool = cupool.Pool("sim", capacity="256MiB")
    path = tmp_path / "t.h5"
    with pool.record(path):
        keep = [pool.malloc(n * 1000) for n in range(1, 300)]  # each output is well over the disk's 4 KiB
        for a in keep[::2]:
            a.free()
    return path


def _refused(capsys, argv, trace: Path, before: bytes) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cupool: error: cannot write the ") and "it is the input" in err and err.count("\n") == 1
    assert trace.read_bytes() == before  # the trace is untouched
    return err


@pytest.mark.parametrize("fmt", ["torch", "rmm-csv"])
def test_export_refuses_to_write_over_its_input(tmp_path, trace, capsys, fmt):
    before = trace.read_bytes()
    (tmp_path / "sub").mkdir()
    link = tmp_path / "link.h5"
    link.symlink_to(trace)
    hard = tmp_path / "hard.h5"
    os.link(trace, hard)
    for out in (trace, tmp_path / "sub" / ".." / "t.h5", link, hard):
        err = _refused(capsys, ["export", str(trace), "-o", str(out), "--format", fmt], trace, before)
        assert str(out) in err and str(trace) in err
    assert link.is_symlink()
    # The same file named by a relative path.
    os.chdir(tmp_path)
    _refused(capsys, ["export", "t.h5", "-o", "./t.h5", "--format", fmt], trace, before)


def test_report_refuses_to_write_over_its_input(tmp_path, trace, capsys):
    odd = tmp_path / "trace.png"  # a trace may have any name
    odd.write_bytes(trace.read_bytes())
    _refused(capsys, ["report", str(odd), "-o", str(odd)], odd, odd.read_bytes())


class _FullDisk:
    """A file on a disk with ``room`` bytes left: what does not fit raises ENOSPC, as write(2) does."""

    def __init__(self, fh, room: int) -> None:
        self._fh, self._room = fh, room

    def write(self, data):
        if len(data) > self._room:
            self._fh.write(data[: self._room])
            self._fh.flush()
            self._room = 0
            raise OSError(errno.ENOSPC, ENOSPC)
        self._room -= len(data)
        return self._fh.write(data)

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


def _fill_disk(monkeypatch, room: int, suffixes: tuple[str, ...]) -> None:
    """Every file opened for writing (by name with one of ``suffixes``, or by descriptor) gets ``room`` bytes."""
    real = builtins.open

    def open_on_a_full_disk(file, mode="r", *args, **kwargs):
        fh = real(file, mode, *args, **kwargs)
        named = isinstance(file, int) or str(file).endswith(suffixes)
        return _FullDisk(fh, room) if "w" in mode and named else fh

    monkeypatch.setattr(builtins, "open", open_on_a_full_disk)


@pytest.mark.parametrize("argv, name, what", [
    (["export", "{trace}", "-o", "{out}"], "snap.pickle", "snapshot"),
    (["export", "{trace}", "-o", "{out}", "--format", "rmm-csv"], "log.csv", "RMM log"),
    (["report", "{trace}", "-o", "{out}"], "report.png", "report"),
])
@pytest.mark.parametrize("existing", [False, True])
def test_a_full_disk_leaves_no_partial_file_and_names_it(tmp_path, trace, capsys, monkeypatch, argv, name, what,
                                                        existing):
    out = tmp_path / name
    if existing:
        out.write_bytes(b"the previous output")
    before = sorted(p.name for p in tmp_path.iterdir())
    _fill_disk(monkeypatch, 4096, (".pickle", ".csv", ".png", ".partial"))
    assert main([a.format(trace=trace, out=out) for a in argv]) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert err == f"cupool: error: cannot write the {what} {out}: {ENOSPC}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing torn, no temporary file left
    if existing:
        assert out.read_bytes() == b"the previous output"


def test_outputs_are_written_whole_with_a_new_files_permissions(tmp_path, trace, capsys):
    target = tmp_path / "real.pickle"
    target.write_bytes(b"old")
    link = tmp_path / "snap.pickle"
    link.symlink_to(target)
    assert main(["export", str(trace), "-o", str(link)]) == 0
    assert link.is_symlink() and target.read_bytes()[:1] == b"\x80"  # through the link, as open() would
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []


def test_a_read_only_output_is_refused_as_open_would(tmp_path, trace, capsys):
    if os.geteuid() == 0:
        pytest.skip("root may write any file: the permission check has nothing to refuse")
    out = tmp_path / "locked.pickle"
    out.write_bytes(b"keep me")
    out.chmod(0o444)
    assert main(["export", str(trace), "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"cupool: error: cannot write the snapshot {out}: Permission denied\n"
    assert out.read_bytes() == b"keep me"


# ------------------------------------------------------------------ -o and folders (issue 36 #10)
@pytest.mark.parametrize("argv, default, what", [
    (["export"], "snapshot.pickle", "snapshot"),
    (["export", "--format", "rmm-csv"], "rmm_log.csv", "RMM log"),
    (["report"], "report.png", "report"),
])
def test_a_folder_as_output_means_a_file_in_it_for_every_command(tmp_path, trace, capsys, argv, default, what):
    cmd, *options = argv
    existing = tmp_path / "existing"
    existing.mkdir()
    for output in (str(existing), str(existing) + "/"):  # an existing folder, with or without its slash
        assert main([cmd, str(trace), "-o", output, *options]) == 0
        assert capsys.readouterr().out.startswith(f"wrote {existing / default}")
        assert sorted(p.name for p in existing.iterdir()) == [default]
    # A name ending in a slash is a folder too: one that is not there is refused, and nothing is written.
    missing = tmp_path / "missing"
    assert main([cmd, str(trace), "-o", f"{missing}/", *options]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"cupool: error: cannot write the {what} {missing / default}: "
                                 f"the folder {missing} does not exist\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing", "t.h5"]
