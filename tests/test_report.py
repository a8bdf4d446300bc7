"""``cupool report``: the figure is written, drawn from the replay, and bad input exits 2."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg
import numpy as np

import cupool
from cupool import workloads
from cupool.cli import main
from cupool.replay import plot_report
from cupool.trace import Trace, load_trace


def _trace(tmp_path):
    pool = cupool.Pool("sim", capacity="512MiB", max_size="400MiB")
    path = tmp_path / "run.h5"
    with pool.record(path):
        workloads.weight_streaming(pool, workloads.mixed_shapes(20, seed=4))
        try:
            pool.malloc(450 << 20)
        except cupool.OutOfMemoryError:
            pass
    return path, pool.stats()


def test_report_png(tmp_path):
    path, stats = _trace(tmp_path)
    out = tmp_path / "report.png"
    summary = plot_report(load_trace(path), out)
    assert summary["peak_reserved"] == stats["reserved_bytes.all.peak"]
    assert summary["ooms"] == stats["num_ooms"] == 1
    img = mpimg.imread(out)
    assert img.shape[0] > 800 and img.shape[1] > 900
    # Not a blank canvas: the curves and the segment map put many colours on it.
    assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 50


def test_report_cli_and_empty_trace(tmp_path, capsys):
    path, _ = _trace(tmp_path)
    out = tmp_path / "r.svg"
    assert main(["report", str(path), "-o", str(out), "--config", "max_size=none"]) == 0
    assert out.read_text().lstrip().startswith("<?xml") and "wrote" in capsys.readouterr().out
    empty = Trace.from_events([], source="empty")
    plot_report(empty, tmp_path / "empty.png")
    assert (tmp_path / "empty.png").stat().st_size > 0


def test_report_bad_input(tmp_path, capsys):
    bad = tmp_path / "x.csv"
    bad.write_text("Thread,Time,Action,Pointer,Size,Stream\n1,2,explode,0x1,2,0x0\n")
    assert main(["report", str(bad), "-o", str(tmp_path / "o.png")]) == 2
    err = capsys.readouterr().err
    assert "x.csv: line 2: unknown action 'explode'" in err
    assert not (tmp_path / "o.png").exists()


def test_report_to_a_missing_folder_exits_2(tmp_path, capsys):
    path, _ = _trace(tmp_path)
    out = tmp_path / "missing_dir" / "x.png"
    assert main(["report", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the report {out}" in err and "does not exist" in err and "Traceback" not in err


def test_report_of_a_compacting_pool_uses_the_pool_engine(tmp_path):
    pool = cupool.Pool("sim", capacity="512MiB")
    path = tmp_path / "movable.h5"
    with pool.record(path):
        workloads.weight_streaming(pool, workloads.mixed_shapes(24, seed=0), movable=True)
    summary = plot_report(load_trace(path), tmp_path / "m.png")
    assert summary["engine"] == "pool" and not summary["warnings"]
    assert summary["peak_reserved"] == pool.stats()["reserved_bytes.all.peak"]
    assert summary["max_fragmentation"] < 1.0


def test_report_says_which_file_it_wrote(tmp_path, capsys, monkeypatch):
    path, _ = _trace(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(path), "-o", "dir"]) == 0  # no extension: matplotlib's .png, and said so
    assert capsys.readouterr().out.startswith("wrote dir.png: ") and (tmp_path / "dir.png").stat().st_size
    (tmp_path / "out").mkdir()
    assert main(["report", str(path), "-o", "out"]) == 0  # a folder: report.png in it
    assert capsys.readouterr().out.startswith(f"wrote {Path('out') / 'report.png'}: ")
    assert (tmp_path / "out" / "report.png").stat().st_size > 0


def test_report_refuses_a_format_it_cannot_write_before_replaying(tmp_path, capsys):
    missing = tmp_path / "never-read.h5"  # the format is checked first: the trace is not even opened
    assert main(["report", str(missing), "-o", str(tmp_path / "r.pgn")]) == 2
    err = capsys.readouterr().err
    assert "cannot write the report" in err and "'.pgn' is not an image format" in err and ".png" in err
