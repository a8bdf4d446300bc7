"""``cupool report``: the figure is written, drawn from the replay, and bad input exits 2."""

from __future__ import annotations

import pickle
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

import cupool
from cupool import workloads
from cupool.cli import main
from cupool.replay import plot_report
from cupool.replay.report import report_data
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


# ------------------------------------------------------------------ the pictures' data (issue 20 #1)
MiB = 1 << 20
SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"


def _moved(tmp_path):
    """A recording whose compaction moved buffers: its trace has move_out/move_in pairs."""
    pool = cupool.Pool("sim", capacity="512MiB", initial_size="36MiB", defrag_threshold=None)
    path = tmp_path / "moved.h5"
    with pool.record(path):
        bufs = [pool.movable(3 << 20) for _ in range(12)]
        raw = pool.malloc(5 << 20)
        for m in bufs[::2]:
            m.free()
        assert pool.compact().moves > 0
        bufs.append(pool.movable(1 << 20))
    del raw, bufs
    return load_trace(path)


def test_curves_hold_their_value_through_recorded_moves(tmp_path):
    trace = _moved(tmp_path)
    data = report_data(trace)
    assert data.engine == "pool"
    moves = np.flatnonzero(np.isin(trace.kind, [trace.code("move_out"), trace.code("move_in")]))
    assert len(moves) >= 2
    # A recorded move changes nothing in the replay's books: the curves hold, they never drop to 0.
    assert (data.reserved[moves] == data.reserved[moves - 1]).all() and data.reserved[moves].min() > 0
    assert (data.allocated[moves] == data.allocated[moves - 1]).all() and data.allocated[moves].min() > 0


def _check_map(data):
    """The segment map is the pool at ``peak_index``: the bytes it shows allocated are the curve's."""
    assert data.mapped_allocated == data.allocated[data.peak_index] > 0
    assert sum(s["size"] for s in data.segments) == data.reserved[data.peak_index]
    for seg in data.segments:  # blocks tile their segment
        assert sum(size for _, size, _ in seg["blocks"]) == seg["size"]


def test_segment_map_of_a_movable_trace_shows_its_live_buffers(tmp_path):
    pool = cupool.Pool("sim", capacity="512MiB")
    path = tmp_path / "movable.h5"
    with pool.record(path):
        workloads.weight_streaming(pool, workloads.mixed_shapes(24, seed=0), movable=True)
    data = report_data(load_trace(path))
    assert data.engine == "pool" and data.peak_index == int(np.argmax(data.reserved))
    assert data.reserved[data.peak_index] == pool.stats()["reserved_bytes.all.peak"]
    _check_map(data)
    assert data.live_blocks == 4  # the cache's four layers


def _still(path, segments):
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [[]]}))
    return load_trace(path)


def _segment(addr, blocks, total, kind="large"):
    out, at = [], addr
    for size, live in blocks:
        out.append({"address": at, "size": size, "requested_size": size if live else 0,
                    "state": "active_allocated" if live else "inactive"})
        at += size
    assert at - addr == total
    return {"device": 0, "address": addr, "total_size": total, "stream": 0, "segment_type": kind, "blocks": out}


def test_a_snapshot_without_history_shows_what_it_holds(tmp_path):
    A = 1 << 32
    segments = [_segment(A, [(8 * MiB, True), (4 * MiB, False), (8 * MiB, True)], 20 * MiB),
                _segment(A + (64 * MiB), [(512, True), (2 * MiB - 512, False)], 2 * MiB, "small"),
                _segment(A + (128 * MiB), [(32 * MiB, True)], 32 * MiB)]
    trace = _still(tmp_path / "still.pickle", segments)
    data = report_data(trace, {"capacity": "1GiB"})
    assert data.still and data.peak_index == len(trace) - 1
    assert sorted(s["size"] for s in data.segments) == [2 * MiB, 20 * MiB, 32 * MiB]
    assert data.live_blocks == 4
    _check_map(data)
    out = tmp_path / "still.png"
    plot_report(trace, out, {"capacity": "1GiB"})
    assert out.stat().st_size > 0


def test_a_snapshot_is_drawn_on_its_own_segment_kind_unless_told_otherwise(tmp_path):
    # cupool's default (expandable segments) would merge the recorded segments into one growing
    # segment per stream and size class: a picture of cupool, not of the snapshot.
    A = 1 << 32
    segments = [_segment(A + i * 64 * MiB, [(8 * MiB, True), (12 * MiB, False)], 20 * MiB) for i in range(3)]
    trace = _still(tmp_path / "plain.pickle", segments)
    own = report_data(trace, {"capacity": "1GiB"})
    assert own.summary["config"]["expandable_segments"] is False and len(own.segments) == 3
    asked = report_data(trace, {"capacity": "1GiB", "expandable_segments": True})  # what the user asked
    assert asked.summary["config"]["expandable_segments"] is True and len(asked.segments) == 1
    _check_map(own)
    _check_map(asked)
    mapped = tmp_path / "mapped.pickle"  # recorded on PyTorch's expandable segments, which never stitch
    mapped.write_bytes(pickle.dumps({"segments": [], "device_traces": [[
        {"action": "segment_map", "addr": A, "size": 20 * MiB, "stream": 0, "time_us": 1, "frames": []},
        {"action": "alloc", "addr": A, "size": 8 * MiB, "stream": 0, "time_us": 2, "frames": []}]]}))
    vmm = report_data(load_trace(mapped), {"capacity": "1GiB"})
    assert {k: vmm.summary["config"][k] for k in ("expandable_segments", "stitch")} == \
        {"expandable_segments": True, "stitch": False}
    out = tmp_path / "plain.png"
    plot_report(trace, out, {"capacity": "1GiB"})
    assert out.stat().st_size > 0


def test_the_map_of_a_window_opened_mid_run_includes_what_was_there_before(tmp_path):
    # Two segments were full when recording started; the window only frees one block: the peak is the seed.
    A = 1 << 32
    segments = [_segment(A, [(10 * MiB, False), (10 * MiB, True)], 20 * MiB),
                _segment(A + 64 * MiB, [(20 * MiB, True)], 20 * MiB)]
    free = [{"action": "free_completed", "addr": A, "size": 10 * MiB, "stream": 0, "time_us": 5, "frames": []}]
    path = tmp_path / "mid.pickle"
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [free]}))
    data = report_data(load_trace(path), {"capacity": "1GiB"})
    assert not data.still and len(data.segments) == 2
    assert data.mapped_allocated == 40 * MiB  # the map is after the seed, at peak reserved
    _check_map(data)


def test_untimed_traces_are_drawn_over_the_event_index():
    events = [(0, "segment_alloc", 1 << 30, 2 << 20, 0), (0, "alloc", 1 << 30, 512, 0), (0, "free", 1 << 30, 512, 0)]
    data = report_data(Trace.from_events(events, source="untimed"))
    assert data.x_label == "event" and list(data.x) == [0, 1, 2]


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"the shared real traces are not here ({SHARED})")
def test_real_snapshots(tmp_path):
    still = load_trace(SHARED / "yiyi_6a8eab0_oom_snapshot.pickle")
    data = report_data(still)
    assert data.still and len(data.segments) == 176 and data.live_blocks == 460  # as `cupool replay` says
    _check_map(data)
    timed = report_data(load_trace(SHARED / "zidongliu_decomfl_memory.pickle"))
    assert not timed.still and timed.x_label == "time (s)" and timed.x[-1] > 1
    _check_map(timed)


def test_the_report_leaves_the_callers_matplotlib_alone(tmp_path):
    # In Jupyter the inline backend must survive a report, or the notebook's later plots stop showing.
    import matplotlib
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    matplotlib.use("pdf")
    try:
        figures = plt.get_fignums()
        plot_report(Trace.from_events([(0, "alloc", 1 << 30, 512, 0)], source="one"), tmp_path / "r.png")
        assert matplotlib.get_backend() == "pdf" and plt.get_fignums() == figures
    finally:
        matplotlib.use(before)


# ------------------------------------------------------------------ what the figure shows (issue 28)
def _figure(monkeypatch, trace, config=None):
    """Draw the report of ``trace`` and return its figure, as it was saved."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    saved = []
    save = Figure.savefig

    def keep(fig, *args, **kwargs):
        saved.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    summary = plot_report(trace, Path(trace.source).with_suffix(".png"), config)
    (fig,) = saved
    FigureCanvasAgg(fig)  # a canvas to measure the texts on
    fig.draw_without_rendering()
    return fig, summary


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_the_replays_own_ooms_are_marked_apart_from_the_recorded_ones(tmp_path, monkeypatch):
    path, _ = _trace(tmp_path)  # recorded one OOM, at its end
    trace = load_trace(path)
    data = report_data(trace, {"capacity": "60MiB"})  # on a smaller device the replay runs out more often
    oom = trace.code("oom")
    assert data.summary["ooms"] == len(data.replay_ooms) == 4
    assert list(data.marks["oom"]) == list(np.flatnonzero(trace.kind == oom))
    assert set(data.marks["oom"]) < set(data.replay_ooms)  # the recorded OOM runs out here too
    for engine in ("numba", "pool"):  # both engines say where they ran out, and only there
        r = cupool.replay.replay(trace, {"capacity": "60MiB"}, engine=engine, timeline=True)
        assert r.timeline["ooms"].sum() == r.ooms == 4 and list(np.flatnonzero(r.timeline["ooms"])) == \
            list(data.replay_ooms), engine
    fig, _ = _figure(monkeypatch, trace, {"capacity": "60MiB"})
    memory = fig.axes[0]
    assert {"OOM, recorded (1)", "OOM in this replay (4)"} <= set(_legend(memory))
    assert "4 OOMs in this replay" in memory.get_title()
    # On the recorded settings the replay runs out where the recording did, and nowhere else: one of each.
    fig, _ = _figure(monkeypatch, trace)
    assert {"OOM, recorded (1)", "OOM in this replay (1)"} <= set(_legend(fig.axes[0]))
    assert "1 OOM in this replay" in fig.axes[0].get_title()


def _many_segments(tmp_path, n=60):
    pool = cupool.Pool("sim", capacity="2GiB", expandable_segments=False)
    path = tmp_path / "many.h5"
    with pool.record(path):
        keep = [pool.malloc((11 + i % 7) * MiB) for i in range(n)]  # one plain segment each
        for a in keep[::3]:
            a.free()
        del keep
    return load_trace(path)


def test_the_segment_maps_labels_never_overlap(tmp_path, monkeypatch):
    fig, _ = _figure(monkeypatch, _many_segments(tmp_path))
    segment_map = fig.axes[-1]
    assert "60 segments (the 48 largest of 60, largest first)" in segment_map.get_title()
    renderer = fig.canvas.get_renderer()
    boxes = sorted((t.get_window_extent(renderer) for t in segment_map.get_yticklabels()), key=lambda b: b.y0)
    assert len(boxes) == 48
    for lower, upper in zip(boxes, boxes[1:]):
        assert lower.y1 <= upper.y0, (lower, upper)


def test_the_report_draws_blocks_in_the_jupyter_maps_colours(tmp_path, monkeypatch):
    from matplotlib.colors import to_hex

    from cupool.display import STATES

    path, _ = _trace(tmp_path)
    fig, _ = _figure(monkeypatch, load_trace(path))
    allocated, free = STATES["allocated"][0], STATES["free"][0]
    curves = {line.get_label(): to_hex(line.get_color()) for line in fig.axes[0].get_lines()}
    assert curves["allocated"] == allocated
    bars = {to_hex(c.get_facecolor()[0]) for c in fig.axes[-1].collections}
    assert bars == {allocated, free}
    legend = {t.get_text(): to_hex(h.get_facecolor()) for t, h in
              zip(fig.axes[-1].get_legend().get_texts(), fig.axes[-1].get_legend().legend_handles)}
    assert legend == {"allocated": allocated, "free": free}
    assert "1 segment;" in fig.axes[-1].get_title()  # not "1 segments"


def test_fragmentation_is_not_drawn_where_nothing_is_allocated(tmp_path, monkeypatch):
    """Before: the curve was 1.0 wherever the pool held only cache, against its title's
    "while anything is allocated" and the summary's maximum (issue 36, item 14)."""
    pool = cupool.Pool("sim", capacity="256MiB")
    path = tmp_path / "idle.h5"
    with pool.record(path):
        for size in (3 * MiB, 5 * MiB, 1 * MiB):
            a = pool.malloc(size)
            b = pool.malloc(size // 3)
            a.free()
            b.free()  # nothing allocated, the segments kept
    trace = load_trace(path)
    data = report_data(trace)
    idle = data.allocated == 0
    assert idle.any() and (data.reserved[idle] > 0).any()
    assert np.isnan(data.fragmentation[idle]).all() and not np.isnan(data.fragmentation[~idle]).any()
    assert np.nanmax(data.fragmentation) == pytest.approx(data.summary["max_fragmentation"])
    assert data.summary["max_fragmentation"] < 1.0
    fig, _ = _figure(monkeypatch, trace)
    panel = fig.axes[1]
    (curve,) = [line for line in panel.get_lines() if line.get_label() == "fragmentation"]
    assert np.nanmax(curve.get_ydata()) < 1.0


def test_the_fragmentation_panel_names_its_bands(tmp_path, monkeypatch):
    """Before: three coloured bands (0.15, 0.30, 0.40) had no legend (issue 36, item 14).
    They are the Monitor's severity bands, and the legend names each with its bounds."""
    from matplotlib.colors import to_hex

    from cupool.observe.monitor import severity

    path, _ = _trace(tmp_path)
    fig, _ = _figure(monkeypatch, load_trace(path))
    panel = fig.axes[1]
    legend = panel.get_legend()
    assert legend.get_title().get_text() == "bands: cupool.Monitor's\nseverity"
    assert _legend(panel) == ["fragmentation", "moderate: 0.15-0.30", "serious: 0.30-0.40", "severe: >= 0.40"]
    named = {t.get_text(): to_hex(h.get_facecolor()) for t, h in zip(legend.get_texts(), legend.legend_handles)
             if t.get_text() != "fragmentation"}
    assert len(panel.patches) == 3  # every band drawn is one the legend names, in its colour
    for band in panel.patches:
        label = band.get_label()
        assert label in named and to_hex(band.get_facecolor()) == named[label], label
        name, bounds = label.split(": ")
        lo = float(bounds.split("-")[0].removeprefix(">= "))
        assert severity(lo) == name and severity(lo - 0.001) != name  # the Monitor's band starts there


def test_the_largest_segments_are_drawn_largest_first(tmp_path, monkeypatch):
    """Before: "the 48 largest of 60" were drawn in address order (issue 36, item 14)."""
    from cupool.replay.report import shown_segments

    trace = _many_segments(tmp_path)
    data = report_data(trace)
    rows, note = shown_segments(data.segments)
    sizes = [seg["size"] for seg in rows]
    assert len(rows) == 48 and sizes == sorted(sizes, reverse=True)
    assert min(sizes) >= max(seg["size"] for seg in data.segments if seg not in rows)
    assert note == " (the 48 largest of 60, largest first)"
    fig, _ = _figure(monkeypatch, trace)
    labels = [t.get_text() for t in fig.axes[-1].get_yticklabels()]
    assert labels == [f"{seg['kind'][0]} {cupool.format_bytes(seg['size'])}" for seg in rows]
    few = data.segments[:10]  # all of them fit: address order, and the title says nothing of order
    assert shown_segments(few) == (sorted(few, key=lambda seg: seg["address"]), "")


def test_a_still_picture_counts_blocks_not_events_and_says_what_it_cannot_of_an_oom(tmp_path, monkeypatch, capsys):
    """Before: the title said "9 events", the panel "records only the blocks", and nothing was said of
    an out-of-memory error the snapshot may have been taken at (issue 36, item 14)."""
    A = 1 << 32
    segments = [_segment(A, [(8 * MiB, True), (4 * MiB, False), (8 * MiB, True)], 20 * MiB),
                _segment(A + (64 * MiB), [(512, True), (2 * MiB - 512, False)], 2 * MiB, "small")]
    trace = _still(tmp_path / "still.pickle", segments)
    fig, _ = _figure(monkeypatch, trace)
    title = fig.get_suptitle()
    assert "a still picture of 3 blocks" in title and "event" not in title
    panel = fig.axes[0].get_title()
    assert "only the 3 blocks alive when it was taken, in 2 segments" in panel
    assert "the request that failed is not in it" in panel
    assert "any request over 4 MiB (the largest free block) needed a new segment" in panel
    assert main(["replay", str(tmp_path / "still.pickle")]) == 0
    out = capsys.readouterr().out
    assert "records no events" not in out
    # one text, the report's and the replay's (before, each wrote its own: "a request over the largest
    # free block below needed a new segment" in the replay's note)
    assert ("if it was taken at an out-of-memory error, the request that failed is not in it; "
            "any request over the largest free block needed a new segment") in " ".join(out.split())
