"""Export a pool's state and recent events, or a recorded trace, in PyTorch's memory-snapshot format.

``torch.cuda.memory._snapshot()`` pickles a dict with ``segments`` (each with its
``blocks``) and ``device_traces`` (one event list per device).  Writing the same
shape lets PyTorch's own viewers (``torch.cuda._memory_viz`` ``trace_plot``,
``segment_plot``, ``segsum``, and https://pytorch.org/memory_viz) show a cupool
pool without any code of ours in the loop.

Two sources:

* a pool (``Pool.export_snapshot``): its segments now, and the events of its
  active recorder (``pool.record()``).  A pool that nobody records exports its
  segments with empty traces, and says so with a warning: once a ``with
  pool.record(...)`` block has ended its events are in the trace file (or
  ``rec.trace()``), not in the pool;
* a trace (``export_trace``, ``cupool export TRACE -o snap.pickle``): its events,
  and the segments and live blocks they leave at the end, at the recorded
  addresses, which is what the viewers replay backwards from.

cupool's ``free`` becomes PyTorch's ``free_requested`` + ``free_completed`` pair
(cupool never defers a free).  Movable buffers are blocks to PyTorch:
``alloc_movable`` / ``free_movable`` export as an alloc / free, and a compaction
move (``move_out`` then ``move_in``) as a free of the old address followed by an
alloc of the new one, so PyTorch's viewers track the block to where it went.
The annotations (``compact``, ``spill``, ``restore``, ``reclaim:*``) have no
PyTorch counterpart and are left out; their block events carry the memory.
"""

from __future__ import annotations

import bisect
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Protocol

from .._files import atomic_output
from ..core.sizes import SMALL_MAX, SMALL_SEGMENT
from ..trace import Trace, active_recorder


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
    "segment_map": ("segment_map",),
    "segment_unmap": ("segment_unmap",),
    "oom": ("oom",),
}
_NOT_RECORDED = ("the pool is not being recorded: export inside its `with pool.record(...)` block, or export "
                 "the recording afterwards (cupool export TRACE -o snap.pickle, or export_trace(rec.trace(), path))")


def to_torch_snapshot(pool: SnapshotSource) -> dict[str, Any]:
    """The pool as a ``torch.cuda.memory._snapshot()``-shaped dict (events only while it is recorded)."""
    snap = pool.snapshot()
    device = pool.device.index
    expandable = bool(getattr(pool, "config", {}).get("expandable_segments"))
    segments = [_segment(seg, device, [{**b, "frames": []} for b in seg["blocks"]], expandable)
                for seg in snap["segments"]]
    return _snapshot(segments, snap.get("device_traces") or _traces([], device))  # Pool.snapshot(): while recorded


def with_traces(pool: SnapshotSource, snap: dict[str, Any]) -> dict[str, Any]:
    """``snap`` (``pool``'s segments) with the events of ``pool``'s active recorder as
    ``torch.cuda.memory._snapshot()``'s ``device_traces`` (one list per device index up to the pool's,
    the others empty), as ``Pool.snapshot()`` gives it (``pool.record()``,
    ``cupool.torch.record_memory_history()``); unchanged while nobody records the pool."""
    rec = active_recorder(pool)
    if rec is not None:
        snap["device_traces"] = _traces(_entries(rec.events()), pool.device.index)
    return snap


def export_snapshot(pool: SnapshotSource, path: str | Path) -> int:
    """Pickle ``to_torch_snapshot(pool)`` to ``path`` (torch is not needed to write it); returns the events written.

    A snapshot without events is still written (its segments are the pool's
    state), with a warning saying why there are none.
    """
    data = to_torch_snapshot(pool)
    n = _write(data, path)
    if not n:
        why = _NOT_RECORDED if active_recorder(pool) is None else "the recording has seen no events yet"
        warnings.warn(f"cupool: {path}: the snapshot has no events: {why}", stacklevel=3)
    return n


def trace_to_torch_snapshot(trace: Trace, device: int = 0) -> dict[str, Any]:
    """A trace as a ``torch.cuda.memory._snapshot()``-shaped dict: its events, and the state they end in."""
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"device must be an int >= 0, got {device!r}")
    cols = (trace.t_ns.tolist(), [trace.kinds[k] for k in trace.kind.tolist()], trace.addr.tolist(),
            trace.size.tolist(), trace.stream.tolist())
    events = list(zip(*cols, trace.stacks)) if trace.stacks is not None else list(zip(*cols))
    return _snapshot(_final_segments(events, device), _traces(_entries(events), device))


def export_trace(trace: Trace, path: str | Path, device: int = 0) -> int:
    """Pickle ``trace_to_torch_snapshot(trace, device)`` to ``path``; returns the events written."""
    return _write(trace_to_torch_snapshot(trace, device), path)


def _write(data: dict[str, Any], path: str | Path) -> int:
    with atomic_output(path, "the snapshot") as fh:  # whole or not at all: a full disk leaves no torn pickle
        pickle.dump(data, fh, protocol=4)
    return sum(len(t) for t in data["device_traces"])


def _snapshot(segments: list[dict[str, Any]], traces: list[list[dict[str, Any]]]) -> dict[str, Any]:
    return {"segments": segments, "device_traces": traces, "allocator_settings": {}}


def _traces(entries: list[dict[str, Any]], device: int) -> list[list[dict[str, Any]]]:
    traces: list[list[dict[str, Any]]] = [[] for _ in range(device + 1)]
    traces[device] = entries
    return traces


def _segment(seg: dict[str, Any], device: int, blocks: list[dict[str, Any]], expandable: bool) -> dict[str, Any]:
    return {**seg, "device": device, "segment_pool_id": (0, 0), "is_expandable": expandable, "frames": [],
            "blocks": blocks}


def _entries(events: list[tuple]) -> list[dict[str, Any]]:
    """Recorded events ``(t_ns, kind, addr, size, stream[, stack])`` as PyTorch trace entries."""
    entries: list[dict[str, Any]] = []
    t0 = events[0][0] if events else 0
    for ev in events:
        frames = _frames(ev[5]) if len(ev) > 5 else []
        for action in _ACTIONS.get(ev[1], ()):
            entries.append({
                "action": action, "addr": int(ev[2]), "size": int(ev[3]), "stream": int(ev[4] or 0),
                "time_us": (ev[0] - t0) // 1000, "frames": frames,
            })
    return entries


def _final_segments(events: list[tuple], device: int) -> list[dict[str, Any]]:
    """The segments and live blocks the events leave, at their recorded addresses.

    A block outside every recorded segment (logs of allocators that record no
    segments, such as RMM's) is shown as a segment of its own, so the viewers
    find every live block in some segment.
    """
    segs: dict[int, tuple[int, int]] = {}  # address -> size, stream
    live: dict[int, int] = {}  # address -> size
    mapped = _Mapped()
    moving = None
    for ev in events:
        kind, addr, size = ev[1], ev[2], ev[3]
        if kind == "segment_alloc":
            segs[addr] = (size, ev[4])
        elif kind == "segment_free":
            segs.pop(addr, None)
        elif kind == "segment_map":
            mapped.map(addr, size, ev[4])
        elif kind == "segment_unmap":
            mapped.unmap(addr, size)
        elif kind in ("alloc", "alloc_movable"):
            live[addr] = size
        elif kind in ("free", "free_movable"):
            live.pop(addr, None)
        elif kind == "move_out":
            moving = live.pop(addr, None)
        elif kind == "move_in" and moving is not None:
            live[addr], moving = moving, None
    expandable = set(mapped.ranges)
    segs.update(mapped.ranges)
    starts = sorted(segs)
    inside: dict[int, list[tuple[int, int]]] = {a: [] for a in starts}
    for addr, size in sorted(live.items()):
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr + size <= starts[i] + segs[starts[i]][0]:
            inside[starts[i]].append((addr, size))
        else:
            segs[addr] = (size, 0)
            inside[addr] = [(addr, size)]
    out = []
    for base in sorted(inside):
        total, stream = segs[base]
        blocks, at = [], base
        for addr, size in inside[base]:
            if addr > at:
                blocks.append(_block(at, addr - at, False))
            blocks.append(_block(addr, size, True))
            at = max(at, addr + size)
        if at < base + total:
            blocks.append(_block(at, base + total - at, False))
        used = sum(size for _, size in inside[base])
        small = total == SMALL_SEGMENT and all(size <= SMALL_MAX for _, size in inside[base])
        out.append(_segment({"address": base, "total_size": total, "allocated_size": used, "active_size": used,
                             "requested_size": used, "stream": stream, "segment_type": "small" if small else "large",
                             "preallocated": False}, device, blocks, base in expandable))
    return out


class _Mapped:
    """Mapped virtual memory as PyTorch shows expandable segments: each contiguous mapped range a segment."""

    def __init__(self) -> None:
        self.ranges: dict[int, tuple[int, int]] = {}  # address -> size, stream
        self._ends: dict[int, int] = {}  # end address -> address

    def map(self, addr: int, size: int, stream: int) -> None:
        start, end = addr, addr + size
        if addr in self._ends:  # a range ends where this one starts: it grows
            start = self._ends.pop(addr)
            stream = self.ranges.pop(start)[1]
        nxt = self.ranges.pop(end, None)  # a range starts where this one ends: they join
        if nxt is not None:
            del self._ends[end + nxt[0]]
            end += nxt[0]
        self.ranges[start] = (end - start, stream)
        self._ends[end] = start

    def unmap(self, addr: int, size: int) -> None:
        for start, (n, stream) in list(self.ranges.items()):
            end = start + n
            if start < addr + size and addr < end:
                del self.ranges[start], self._ends[end]
                if start < addr:
                    self.ranges[start], self._ends[addr] = (addr - start, stream), start
                if addr + size < end:
                    self.ranges[addr + size], self._ends[end] = (end - addr - size, stream), addr + size


def _block(addr: int, size: int, allocated: bool) -> dict[str, Any]:
    return {"address": addr, "size": size, "requested_size": size if allocated else 0,
            "state": "active_allocated" if allocated else "inactive", "frames": []}


def _frames(stack: str) -> list[dict[str, Any]]:
    """Recorded stack text (traceback format, outermost first) -> PyTorch frames (innermost first)."""
    out = []
    for line in stack.splitlines():
        m = _FRAME.match(line)
        if m:
            out.append({"filename": m["filename"], "line": int(m["line"]), "name": m["name"]})
    out.reverse()
    return out
