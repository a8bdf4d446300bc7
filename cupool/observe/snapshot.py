"""Export a pool's state and recent events in PyTorch's memory-snapshot format.

``torch.cuda.memory._snapshot()`` pickles a dict with ``segments`` (each with its
``blocks``) and ``device_traces`` (one event list per device).  Writing the same
shape lets PyTorch's own viewers (``torch.cuda._memory_viz`` ``trace_plot``,
``segment_plot``, ``segsum``, and https://pytorch.org/memory_viz) show a cupool
pool without any code of ours in the loop.

The events come from the pool's active recorder (``pool.record()``), if any; a
pool that nobody records exports its segments with empty traces.  cupool's
``free`` becomes PyTorch's ``free_requested`` + ``free_completed`` pair (cupool
never defers a free).  Movable buffers are blocks to PyTorch: ``alloc_movable`` /
``free_movable`` export as an alloc / free, and a compaction move
(``move_out`` then ``move_in``) as a free of the old address followed by an
alloc of the new one, so PyTorch's viewers track the block to where it went.
The annotations (``compact``, ``spill``, ``restore``, ``reclaim:*``) have no
PyTorch counterpart and are left out; their block events carry the memory.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any, Protocol

from ..trace import active_recorder


class SnapshotSource(Protocol):
    """What the export reads of a pool: its device's index and ``snapshot()``.

    A protocol rather than ``cupool.Pool`` because the pool imports this module
    (``Pool.export_snapshot`` forwards here): naming the pool back, even for type
    checking only, would make an import cycle.
    """

    @property
    def device(self) -> Any: ...

    def snapshot(self) -> dict[str, Any]: ...


_FRAME = re.compile(r'^\s*File "(?P<filename>[^"]*)", line (?P<line>\d+), in (?P<name>.*)$')
_FREE = ("free_requested", "free_completed")
_ACTIONS = {
    "alloc": ("alloc",),
    "free": _FREE,
    "alloc_movable": ("alloc",),
    "free_movable": _FREE,
    "move_out": _FREE,
    "move_in": ("alloc",),
    "segment_alloc": ("segment_alloc",),
    "segment_free": ("segment_free",),
    "oom": ("oom",),
}


def to_torch_snapshot(pool: SnapshotSource) -> dict[str, Any]:
    """The pool as a ``torch.cuda.memory._snapshot()``-shaped dict."""
    snap = pool.snapshot()
    device = pool.device.index
    segments = []
    for seg in snap["segments"]:
        blocks = [{**b, "frames": []} for b in seg["blocks"]]
        segments.append({**seg, "device": device, "segment_pool_id": (0, 0), "is_expandable": False,
                         "frames": [], "blocks": blocks})
    rec = active_recorder(pool)
    entries: list[dict[str, Any]] = []
    if rec is not None:
        events = rec.events()
        t0 = events[0][0] if events else 0
        for ev in events:
            frames = _frames(ev[5]) if len(ev) > 5 else []
            for action in _ACTIONS.get(ev[1], ()):
                entries.append({
                    "action": action, "addr": int(ev[2]), "size": int(ev[3]), "stream": int(ev[4] or 0),
                    "time_us": (ev[0] - t0) // 1000, "frames": frames,
                })
    traces: list[list[dict[str, Any]]] = [[] for _ in range(device + 1)]
    traces[device] = entries
    return {"segments": segments, "device_traces": traces, "allocator_settings": {}}


def export_snapshot(pool: SnapshotSource, path: str | Path) -> None:
    """Pickle ``to_torch_snapshot(pool)`` to ``path`` (torch is not needed to write it)."""
    data = to_torch_snapshot(pool)
    with open(path, "wb") as fh:
        pickle.dump(data, fh, protocol=4)


def _frames(stack: str) -> list[dict[str, Any]]:
    """Recorded stack text (traceback format, outermost first) -> PyTorch frames (innermost first)."""
    out = []
    for line in stack.splitlines():
        m = _FRAME.match(line)
        if m:
            out.append({"filename": m["filename"], "line": int(m["line"]), "name": m["name"]})
    out.reverse()
    return out
