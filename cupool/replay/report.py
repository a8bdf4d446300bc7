"""Pictures of a trace: memory over time, fragmentation over time, and a segment map.

The curves come from a replay on the sim device (the recorded settings unless
told otherwise), so every trace format gets the same figures.  For a cupool
trace replayed on its recorded settings the curves' peaks and segment counts
equal the recording's (``tests/test_replay.py`` holds the replay to that); the
segments' addresses are the replay's own, and a trace that started mid-run
starts from its recorded live state.  Traces with movable buffers are replayed
by the pool engine, the only one that compacts and spills.  Compactions,
moves, spills, restores and OOMs are marked at their recorded times.  The
segment map shows the pool at its peak reserved moment, where fragmentation
costs the most.

A snapshot with no history (a still picture: only the blocks alive when it was
taken) has no curves to draw; its figure shows what the pool held instead, and
the segment map of that moment.

``report_data`` computes everything the figure shows and ``plot_report`` only
draws it, so that tests can hold the pictures' numbers to the replay's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._files import atomic_output
from .._units import format_bytes
from ..trace import Trace
from .config import VMM_KEYS, recorded_on_vmm
from .driver import FRAGMENTATION_NOTE, default_engine, layout, replay

_MARKED = {"oom": ("tab:red", "x"), "move_in": ("tab:purple", "|"), "compact": ("tab:purple", "v"),
           "spill": ("tab:orange", "v"), "restore": ("tab:green", "^")}
_MAX_SEGMENTS_SHOWN = 48


@dataclass
class ReportData:
    """What ``plot_report`` draws, one entry per trace event where it is a curve.

    ``x`` is seconds since the first event, or the event's index when the trace
    carries no times (``x_label`` says which).  ``reserved`` and ``allocated``
    are the replay's bytes after each event, and ``fragmentation`` is
    (reserved - allocated) / reserved (0 where nothing is reserved).
    ``marks`` maps a marked kind to the indices of its events.  ``segments``
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
    """Replay ``trace`` (with ``config`` over the recorded settings) and gather what the report shows."""
    config = _settings(trace, config)
    engine = default_engine(trace)
    result = replay(trace, config, engine=engine, timeline=True, progress=False)
    tl = result.timeline
    assert tl is not None, "replay(timeline=True) keeps one"
    n = len(trace)
    reserved, allocated = tl["reserved"], tl["allocated"]
    res = reserved.astype(np.float64)
    frag = np.divide(res - allocated, res, out=np.zeros_like(res), where=res > 0)
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
    return ReportData(result.as_dict(), engine, still, x, x_label, reserved, allocated, frag, marks, max(peak, 0),
                      segments)


def _settings(trace: Trace, config: dict[str, Any] | None) -> dict[str, Any] | None:
    """``config``, with a PyTorch snapshot's own segment kind where ``config`` names none (see the module's note).

    PyTorch's expandable segments never stitch, so neither does their replay here.
    """
    if trace.format != "torch" or any(k in (config or {}) for k in VMM_KEYS):
        return config
    vmm = recorded_on_vmm(trace)
    return {"expandable_segments": vmm, **({"stitch": False} if vmm else {}), **(config or {})}


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
    fig = Figure(figsize=(11, 10), layout="constrained")
    title = Path(trace.source).name or "trace"
    vmm = data.summary["config"].get("expandable_segments")
    kind = {True: ", expandable segments", False: ", plain segments"}.get(vmm, "")
    fig.suptitle(f"{title}: {len(trace)} events ({trace.format}), replayed on the sim device "
                 f"({data.engine} engine{kind})", fontsize=12)
    if data.still:
        gs = fig.add_gridspec(2, 1, height_ratios=[0.6, 2.4])
        _still_panel(fig.add_subplot(gs[0]), data)
        when = "when the snapshot was taken"
    else:
        gs = fig.add_gridspec(3, 1, height_ratios=[1.2, 0.8, 1.6])
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
    ax.step(x, data.reserved / scale, where="post", color="tab:blue", label="reserved")
    ax.step(x, data.allocated / scale, where="post", color="tab:green", label="allocated")
    ax.fill_between(x, data.allocated / scale, data.reserved / scale, step="post", color="tab:blue", alpha=0.12,
                    label="reserved, not allocated")
    for kind, idx in data.marks.items():
        color, marker = _MARKED[kind]
        ax.scatter(x[idx], data.reserved[idx] / scale, color=color, marker=marker, s=40, zorder=3,
                   label=f"{'move' if kind == 'move_in' else kind} ({len(idx)})")
    if len(x):
        ax.axvline(x[data.peak_index], color="grey", ls=":", lw=1)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(f"peak reserved {format_bytes(s['peak_reserved'])}, peak allocated "
                 f"{format_bytes(s['peak_allocated'])}, {s['ooms']} OOM(s)", fontsize=10)
    ax.set_ylim(0, 1.3 * max(s["peak_reserved"], 1) / scale)  # headroom for the legend
    ax.legend(loc="upper left", fontsize=8, ncols=4, framealpha=0.9)
    ax.grid(alpha=0.3)


def _fragmentation_panel(ax: Any, data: ReportData) -> None:
    s = data.summary
    ax.step(data.x, data.fragmentation, where="post", color="tab:red")
    for lo, hi, color in ((0.15, 0.30, "gold"), (0.30, 0.40, "orange"), (0.40, 1.0, "tab:red")):
        ax.axhspan(lo, hi, color=color, alpha=0.08)
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
    rows = [("reserved", reserved, "tab:blue"), ("allocated", allocated, "tab:green"),
            ("free", reserved - allocated, "0.6"), ("largest free block", max(holes, default=0), "0.75")]
    for i, (label, value, color) in enumerate(rows):
        ax.barh(i, value / scale, color=color)
        ax.text(value / scale, i, f"  {format_bytes(value)}", va="center", fontsize=9)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15 * max(reserved, 1) / scale)  # room for the numbers
    ax.set_xlabel(f"memory ({unit})")
    ax.set_title(f"no history: this snapshot records only the {data.live_blocks} blocks alive when it was taken, "
                 f"in {len(data.segments)} segments; fragmentation "
                 f"{data.summary['fragmentation_at_peak']:.3f}", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def _segment_map(ax: Any, segs: list[dict[str, Any]], when: str) -> None:
    from matplotlib.patches import Patch

    shown = sorted(segs, key=lambda s: s["size"], reverse=True)[:_MAX_SEGMENTS_SHOWN]
    shown.sort(key=lambda s: s["address"])
    scale, unit = _unit(max((s["size"] for s in shown), default=1))
    for row, seg in enumerate(shown):
        used = [(off / scale, size / scale) for off, size, alloc in seg["blocks"] if alloc]
        free = [(off / scale, size / scale) for off, size, alloc in seg["blocks"] if not alloc]
        ax.broken_barh(free, (row - 0.4, 0.8), facecolors="0.85", edgecolors="white", linewidth=0.5)
        ax.broken_barh(used, (row - 0.4, 0.8), facecolors="tab:green", edgecolors="white", linewidth=0.5)
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([f"{s['kind'][0]} {format_bytes(s['size'])}" for s in shown],
                       fontsize=7 if len(shown) > 16 else 8)
    ax.invert_yaxis()
    ax.set_xlabel(f"offset in segment ({unit})")
    extra = f" (the {len(shown)} largest of {len(segs)})" if len(segs) > len(shown) else ""
    ax.set_title(f"segment map {when}: {len(segs)} segments{extra}; s = small pool, l = large pool", fontsize=10)
    # Outside the axes, on the right: inside, it would hide the end of some segment.
    ax.legend(handles=[Patch(color="tab:green", label="allocated"), Patch(color="0.85", label="free")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)


def _unit(n: int) -> tuple[float, str]:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= 2 * scale:
            return float(scale), unit
    return 1.0, "B"
