"""Pictures of a trace: memory over time, fragmentation over time, and a segment map.

The curves come from a replay on the sim device (the recorded settings unless
told otherwise), so every trace format gets the same figures.  For a cupool
trace replayed on its recorded settings the curves' peaks and segment counts
equal the recording's (``tests/test_replay.py`` holds the replay to that); the
segments' addresses are the replay's own, and a trace that started mid-run
starts from its recorded live state.  Traces with movable buffers are replayed
by the pool engine, the only one that compacts and spills.  Compactions,
moves, spills, restores and OOMs are marked at their recorded times, and the
replay's own OOMs where it ran out (a marker of their own: a replay on a smaller
device runs out where the recording did not).  The segment map shows the pool
at its peak reserved moment, where fragmentation costs the most; the figure
grows with the segments it lists, so that their labels never overlap.  Its
colours are ``cupool._palette``'s, as the Jupyter map's are.

The fragmentation curve is drawn where the replay samples it, while anything
is allocated (``FRAGMENTATION_NOTE``): where nothing is, the ratio is 1.0 by its
formula and says nothing, so the curve has a gap there.  Its coloured bands
are ``cupool.Monitor``'s severity bands (``SEVERITY_BANDS``), named in its
legend.  The segment map lists every segment in address order while
they fit; past ``_MAX_SEGMENTS_SHOWN`` it lists the largest, largest first.

A snapshot with no history (a still picture: only the blocks alive when it was
taken) has no curves to draw; its figure shows what the pool held instead, and
the segment map of that moment.  It records no request: if it was taken at an
out-of-memory error (as PyTorch's OOM observer takes them; the file does not
say), the request that failed is not in it, and the figure says what any
request larger than the largest free block needed: a new segment.

``report_data`` computes everything the figure shows and ``plot_report`` only
draws it, so that tests can hold the pictures' numbers to the replay's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._files import atomic_output
from .._palette import BLOCKS, RESERVED
from .._units import format_bytes
from .._words import count
from ..observe.monitor import SEVERITY_BANDS
from ..trace import Trace
from .driver import FRAGMENTATION_NOTE, default_engine, layout, replay

#: Recorded events marked on the memory curve: (colour, marker, legend label).
_MARKED = {"oom": ("tab:red", "x", "OOM, recorded"), "move_in": ("tab:purple", "|", "move"),
           "compact": ("tab:purple", "v", "compact"), "spill": ("tab:orange", "v", "spill"),
           "restore": ("tab:green", "^", "restore")}
#: The replay's own OOMs: a hollow ring, so that one where the recording also ran out shows both.
_REPLAY_OOM = ("tab:red", "o", "OOM in this replay")
_MAX_SEGMENTS_SHOWN = 48
#: Inches: each row of the segment map (its label needs about 0.12 at 7 points), the map's
#: title and axis around its rows, and the panels above it.
_ROW_IN, _MAP_FRAME_IN, _MAP_MIN_IN = 0.17, 1.0, 3.9
_MEMORY_IN, _FRAGMENTATION_IN, _STILL_IN, _TITLE_IN = 2.9, 1.9, 2.0, 0.5


@dataclass
class ReportData:
    """What ``plot_report`` draws, one entry per trace event where it is a curve.

    ``x`` is seconds since the first event, or the event's index when the trace
    carries no times (``x_label`` says which).  ``reserved`` and ``allocated``
    are the replay's bytes after each event, and ``fragmentation`` is
    (reserved - allocated) / reserved where anything is allocated, NaN (not
    sampled, not drawn) where nothing is, as the summary's figures are taken.
    ``marks`` maps a marked kind to the indices of its events; ``replay_ooms``
    holds the indices of the events where the replay itself ran out.  ``segments``
    is ``layout`` after event ``peak_index``: the peak reserved moment, or for
    a still picture (``still``) the moment the snapshot was taken.
    """

    summary: dict[str, Any]
    engine: str
    still: bool
    x: np.ndarray
    x_label: str
    reserved: np.ndarray
    allocated: np.ndarray
    fragmentation: np.ndarray
    marks: dict[str, np.ndarray]
    replay_ooms: np.ndarray
    peak_index: int
    segments: list[dict[str, Any]]

    @property
    def live_blocks(self) -> int:
        """Allocated blocks in the segment map."""
        return sum(alloc for seg in self.segments for *_, alloc in seg["blocks"])

    @property
    def mapped_allocated(self) -> int:
        """Allocated bytes in the segment map (equal to ``allocated[peak_index]``)."""
        return sum(size for seg in self.segments for _, size, alloc in seg["blocks"] if alloc)


def report_data(trace: Trace, config: dict[str, Any] | None = None) -> ReportData:
    """Replay ``trace`` (with ``config`` over the recorded settings, as ``cupool replay`` takes them:
    a PyTorch snapshot's own kind of segments included) and gather what the report shows."""
    engine = default_engine(trace)
    result = replay(trace, config, engine=engine, timeline=True, progress=False)
    tl = result.timeline
    assert tl is not None, "replay(timeline=True) keeps one"
    n = len(trace)
    reserved, allocated = tl["reserved"], tl["allocated"]
    res = reserved.astype(np.float64)
    frag = np.divide(res - allocated, res, out=np.full_like(res, np.nan), where=allocated > 0)
    t = (trace.t_ns - trace.t_ns[0]) / 1e9 if n else np.zeros(0)
    timed = n > 1 and bool(np.all(np.diff(trace.t_ns) >= 0)) and t[-1] > 0
    x, x_label = (t, "time (s)") if timed else (np.arange(n, dtype=np.float64), "event")
    marks = {}
    for kind in _MARKED:
        c = trace.code(kind)
        idx = np.flatnonzero(trace.kind == c) if c >= 0 else np.zeros(0, np.int64)
        if len(idx):
            marks[kind] = idx
    still = not result.history
    if still or not n:
        peak = n - 1
    else:
        # Events of the seed (the live state the recording started from) all hold the
        # state after the seed: the map is drawn no earlier than that.
        peak = max(int(np.argmax(reserved)), _seed_events(trace) - 1)
    segments = layout(trace, config, stop=peak + 1, engine=engine) if n else []
    replay_ooms = np.flatnonzero(tl["ooms"])
    return ReportData(result.as_dict(), engine, still, x, x_label, reserved, allocated, frag, marks, replay_ooms,
                      max(peak, 0), segments)


def _seed_events(trace: Trace) -> int:
    """How many leading events describe the live state the recording started from.

    ``replay`` has already checked the trace's seed configuration, so it is read here as it stands.
    """
    seed = trace.config.get("seed")
    return int(seed.get("events", 0)) if isinstance(seed, dict) else 0


def plot_report(trace: Trace, path: str | Path, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the figure for ``trace`` to ``path`` (PNG, SVG or PDF by extension).

    Returns the replay summary the figure was drawn from.
    """
    from matplotlib.figure import Figure  # not pyplot: the caller's backend and figures are left alone

    data = report_data(trace, config)
    rows = min(len(data.segments), _MAX_SEGMENTS_SHOWN)
    heights = [_STILL_IN] if data.still else [_MEMORY_IN, _FRAGMENTATION_IN]
    heights.append(max(_MAP_MIN_IN, _MAP_FRAME_IN + rows * _ROW_IN))  # rows never squeezed below their labels
    fig = Figure(figsize=(11, sum(heights) + _TITLE_IN), layout="constrained")
    title = Path(trace.source).name or "trace"
    vmm = data.summary["config"].get("expandable_segments")
    kind = {True: ", expandable segments", False: ", plain segments"}.get(vmm, "")
    # A still picture's events are only its live blocks and their segments: "N events" would read as history.
    what = (f"a still picture of {count(data.live_blocks, 'block')}" if data.still
            else count(len(trace), "event"))
    fig.suptitle(f"{title}: {what} ({trace.format}), replayed on the sim device "
                 f"({data.engine} engine{kind})", fontsize=12)
    gs = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    if data.still:
        _still_panel(fig.add_subplot(gs[0]), data)
        when = "when the snapshot was taken"
    else:
        ax1 = fig.add_subplot(gs[0])
        _memory_panel(ax1, trace, data)
        _fragmentation_panel(fig.add_subplot(gs[1], sharex=ax1), data)
        at = data.x[data.peak_index] if len(data.x) else 0.0
        when = f"at peak reserved ({f't = {at:.3g} s' if data.x_label != 'event' else f'event {int(at)}'})"
    _segment_map(fig.add_subplot(gs[-1]), data.segments, when)
    with atomic_output(path, "the report") as fh:  # a full disk leaves no empty or torn image
        fig.savefig(fh, format=Path(path).suffix[1:].lower() or "png", dpi=110)
    return data.summary


def _memory_panel(ax: Any, trace: Trace, data: ReportData) -> None:
    s = data.summary
    scale, unit = _unit(max(s["peak_reserved"], 1))
    x = data.x
    ax.step(x, data.reserved / scale, where="post", color=RESERVED, label="reserved")
    ax.step(x, data.allocated / scale, where="post", color=BLOCKS["allocated"], label="allocated")
    ax.fill_between(x, data.allocated / scale, data.reserved / scale, step="post", color=BLOCKS["free"],
                    label="reserved, not allocated")  # free space in segments: the map's free colour
    for kind, idx in data.marks.items():
        color, marker, label = _MARKED[kind]
        ax.scatter(x[idx], data.reserved[idx] / scale, color=color, marker=marker, s=40, zorder=3,
                   label=f"{label} ({len(idx)})")
    if len(data.replay_ooms):
        color, marker, label = _REPLAY_OOM
        idx = data.replay_ooms
        ax.scatter(x[idx], data.reserved[idx] / scale, facecolors="none", edgecolors=color, marker=marker, s=90,
                   linewidths=1.5, zorder=4, label=f"{label} ({len(idx)})")
    if len(x):
        ax.axvline(x[data.peak_index], color="grey", ls=":", lw=1)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(f"peak reserved {format_bytes(s['peak_reserved'])}, peak allocated "
                 f"{format_bytes(s['peak_allocated'])}, {count(s['ooms'], 'OOM')} in this replay", fontsize=10)
    ax.set_ylim(0, 1.3 * max(s["peak_reserved"], 1) / scale)  # headroom for the legend
    ax.legend(loc="upper left", fontsize=8, ncols=4, framealpha=0.9)
    ax.grid(alpha=0.3)


def severity_bands() -> list[tuple[float, float, str, str]]:
    """The fragmentation panel's bands: (low, high, colour, legend label), from the Monitor's severity bands.

    "good" (below the first bound) is left unshaded.
    """
    bounds = [bound for bound, _ in SEVERITY_BANDS] + [1.0]
    names = [name for _, name in SEVERITY_BANDS[1:]] + ["severe"]
    colours = ("gold", "orange", "tab:red")
    assert len(names) == len(colours), "a colour per shaded band"
    return [(lo, hi, colour, f"{name}: {lo:.2f}-{hi:.2f}" if hi < 1.0 else f"{name}: >= {lo:.2f}")
            for lo, hi, colour, name in zip(bounds, bounds[1:], colours, names)]


def _fragmentation_panel(ax: Any, data: ReportData) -> None:
    s = data.summary
    ax.step(data.x, data.fragmentation, where="post", color="tab:red", label="fragmentation")
    for lo, hi, color, label in severity_bands():
        ax.axhspan(lo, hi, color=color, alpha=0.08, label=label)
    # Outside the axes, as the segment map's: inside, it would hide the curve where it runs high.
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="bands: cupool.Monitor's\nseverity",
              title_fontsize=8, alignment="left")
    ax.set_ylim(0, 1)
    ax.set_ylabel("fragmentation")
    ax.set_xlabel(data.x_label)
    ax.set_title(f"(reserved - allocated) / reserved: max {s['max_fragmentation']:.3f}, "
                 f"mean {s['mean_fragmentation']:.3f} ({FRAGMENTATION_NOTE}); "
                 f"{s['fragmentation_at_peak']:.3f} at peak reserved", fontsize=10)
    ax.grid(alpha=0.3)


def _still_panel(ax: Any, data: ReportData) -> None:
    """A snapshot without history: what the pool held, as bars, in place of curves over time."""
    reserved = sum(seg["size"] for seg in data.segments)
    allocated = data.mapped_allocated
    holes = [size for seg in data.segments for _, size, alloc in seg["blocks"] if not alloc]
    scale, unit = _unit(max(reserved, 1))
    rows = [("reserved", reserved, RESERVED), ("allocated", allocated, BLOCKS["allocated"]),
            ("free", reserved - allocated, BLOCKS["free"]), ("largest free block", max(holes, default=0), "0.75")]
    for i, (label, value, color) in enumerate(rows):
        ax.barh(i, value / scale, color=color)
        ax.text(value / scale, i, f"  {format_bytes(value)}", va="center", fontsize=9)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15 * max(reserved, 1) / scale)  # room for the numbers
    ax.set_xlabel(f"memory ({unit})")
    ax.set_title(still_title(data), fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def oom_caveat(largest: int | None = None) -> str:
    """What a still picture cannot say of an out-of-memory error it may have been taken at: the one text of
    the replay's note (``cupool replay``) and the report's title; ``largest``: its largest free block, if known."""
    over = "the largest free block" if largest is None else f"{format_bytes(largest)} (the largest free block)"
    return ("if it was taken at an out-of-memory error, the request that failed is not in it; "
            f"any request over {over} needed a new segment")


def still_title(data: ReportData) -> str:
    """The still picture's title: what it holds, and what it cannot say of an OOM it may have been taken at."""
    largest = max((size for seg in data.segments for _, size, alloc in seg["blocks"] if not alloc), default=0)
    return (f"no history: this snapshot records only the {count(data.live_blocks, 'block')} alive when it was taken, "
            f"in {count(len(data.segments), 'segment')}; fragmentation {data.summary['fragmentation_at_peak']:.3f}\n"
            "and no request: " + oom_caveat(largest).replace("; ", ";\n"))


def shown_segments(segs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The segment map's rows, top to bottom, and what the title says of their order.

    All of them in address order while they fit; past ``_MAX_SEGMENTS_SHOWN``, the
    largest, largest first (address order among equals), so that the order a
    title calls "the largest" is the order drawn.
    """
    if len(segs) <= _MAX_SEGMENTS_SHOWN:
        return sorted(segs, key=lambda s: s["address"]), ""
    shown = sorted(segs, key=lambda s: (-s["size"], s["address"]))[:_MAX_SEGMENTS_SHOWN]
    return shown, f" (the {len(shown)} largest of {len(segs)}, largest first)"


def _segment_map(ax: Any, segs: list[dict[str, Any]], when: str) -> None:
    from matplotlib.patches import Patch

    shown, extra = shown_segments(segs)
    scale, unit = _unit(max((s["size"] for s in shown), default=1))
    for row, seg in enumerate(shown):
        used = [(off / scale, size / scale) for off, size, alloc in seg["blocks"] if alloc]
        free = [(off / scale, size / scale) for off, size, alloc in seg["blocks"] if not alloc]
        ax.broken_barh(free, (row - 0.4, 0.8), facecolors=BLOCKS["free"], edgecolors="white", linewidth=0.5)
        ax.broken_barh(used, (row - 0.4, 0.8), facecolors=BLOCKS["allocated"], edgecolors="white", linewidth=0.5)
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([f"{s['kind'][0]} {format_bytes(s['size'])}" for s in shown],
                       fontsize=7 if len(shown) > 16 else 8)
    ax.invert_yaxis()
    ax.set_xlabel(f"offset in segment ({unit})")
    ax.set_title(f"segment map {when}: {count(len(segs), 'segment')}{extra}; s = small pool, l = large pool",
                 fontsize=10)
    # Outside the axes, on the right: inside, it would hide the end of some segment.
    ax.legend(handles=[Patch(color=BLOCKS["allocated"], label="allocated"), Patch(color=BLOCKS["free"], label="free")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)


def _unit(n: int) -> tuple[float, str]:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= 2 * scale:
            return float(scale), unit
    return 1.0, "B"
