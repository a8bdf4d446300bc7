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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .._units import format_bytes
from ..trace import Trace
from .driver import FRAGMENTATION_NOTE, default_engine, layout, replay

_MARKED = {"oom": ("tab:red", "x"), "move_in": ("tab:purple", "|"), "compact": ("tab:purple", "v"),
           "spill": ("tab:orange", "v"), "restore": ("tab:green", "^")}
_MAX_SEGMENTS_SHOWN = 48


def plot_report(trace: Trace, path: str | Path, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the three-panel figure for ``trace`` to ``path`` (PNG, SVG or PDF by extension).

    Returns the replay summary the figure was drawn from.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    engine = default_engine(trace)
    result = replay(trace, config, engine=engine, timeline=True, progress=False)
    tl = result.timeline
    assert tl is not None
    n = len(trace)
    t = (trace.t_ns - trace.t_ns[0]) / 1e9 if n else np.zeros(0)
    peak_i = int(np.argmax(tl["reserved"])) if n else 0
    segs = layout(trace, config, stop=peak_i + 1, engine=engine) if n else []
    scale, unit = _unit(max(result.peak_reserved, 1))

    fig = plt.figure(figsize=(11, 10), layout="constrained")
    gs = fig.add_gridspec(3, 1, height_ratios=[1.2, 0.8, 1.6])
    ax1 = fig.add_subplot(gs[0])
    ax2 = fig.add_subplot(gs[1], sharex=ax1)
    ax3 = fig.add_subplot(gs[2])
    title = Path(trace.source).name or "trace"
    fig.suptitle(f"{title}: {n} events ({trace.format}), replayed on the sim device ({engine} engine)",
                 fontsize=12)

    ax1.step(t, tl["reserved"] / scale, where="post", color="tab:blue", label="reserved")
    ax1.step(t, tl["allocated"] / scale, where="post", color="tab:green", label="allocated")
    ax1.fill_between(t, tl["allocated"] / scale, tl["reserved"] / scale, step="post", color="tab:blue", alpha=0.12,
                     label="reserved, not allocated")
    for kind, (color, marker) in _MARKED.items():
        c = trace.code(kind)
        if c < 0:
            continue
        idx = np.flatnonzero(trace.kind == c)
        if len(idx):
            ax1.scatter(t[idx], tl["reserved"][idx] / scale, color=color, marker=marker, s=40, zorder=3,
                        label=f"{'move' if kind == 'move_in' else kind} ({len(idx)})")
    ax1.axvline(t[peak_i] if n else 0, color="grey", ls=":", lw=1)
    ax1.set_ylabel(f"memory ({unit})")
    ax1.set_title(f"peak reserved {format_bytes(result.peak_reserved)}, peak allocated "
                  f"{format_bytes(result.peak_allocated)}, {result.ooms} OOM(s)", fontsize=10)
    ax1.set_ylim(0, 1.3 * max(result.peak_reserved, 1) / scale)  # headroom for the legend
    ax1.legend(loc="upper left", fontsize=8, ncols=4, framealpha=0.9)
    ax1.grid(alpha=0.3)

    res = tl["reserved"].astype(np.float64)
    frag = np.divide(res - tl["allocated"], res, out=np.zeros_like(res), where=res > 0)
    ax2.step(t, frag, where="post", color="tab:red")
    for lo, hi, color in ((0.15, 0.30, "gold"), (0.30, 0.40, "orange"), (0.40, 1.0, "tab:red")):
        ax2.axhspan(lo, hi, color=color, alpha=0.08)
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("fragmentation")
    ax2.set_xlabel("time (s)")
    ax2.set_title(f"(reserved - allocated) / reserved: max {result.max_fragmentation:.3f}, "
                  f"mean {result.mean_fragmentation:.3f} ({FRAGMENTATION_NOTE}); "
                  f"{result.fragmentation_at_peak:.3f} at peak reserved", fontsize=10)
    ax2.grid(alpha=0.3)

    _segment_map(ax3, segs, t[peak_i] if n else 0.0)
    ax3.legend(handles=[Patch(color="tab:green", label="allocated"), Patch(color="0.85", label="free")],
               loc="lower right", fontsize=8)
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise OSError(f"cannot write the report {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return result.as_dict()


def _segment_map(ax: Any, segs: list[dict[str, Any]], when: float) -> None:
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
    ax.set_title(f"segment map at peak reserved (t = {when:.3g} s): {len(segs)} segments{extra}; "
                 "s = small pool, l = large pool", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def _unit(n: int) -> tuple[float, str]:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= 2 * scale:
            return float(scale), unit
    return 1.0, "B"
