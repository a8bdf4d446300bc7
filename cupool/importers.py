"""Traces from other allocators: PyTorch memory snapshots and RMM logs.

Both become a ``Trace`` so that they replay on the sim device against cupool's
settings.  Only what replay and plots need is kept: time, action, address, size
and stream.

* PyTorch (``torch.cuda.memory._snapshot()`` saved with ``pickle``):
  ``device_traces`` holds one list of events per device.  A block becomes reusable
  at ``free_completed`` (``free_requested`` only marks the user's intent while
  streams may still use it), so that is the free replay sees.  Expandable
  segments' ``segment_map``/``segment_unmap`` count as segment events.
* RMM (``logging_resource_adaptor``): a CSV with ``Thread,Time,Action,Pointer,Size,Stream``
  rows; ``allocate``, ``free`` (or ``deallocate``) and ``allocate failure``.

Snapshots are pickles, and unpickling can run code; the loader accepts only
plain containers, numbers and strings, which is all a snapshot holds.
"""

from __future__ import annotations

import csv
import io
import logging
import pickle
import re
from pathlib import Path
from typing import Any

from .trace import Trace, TraceError

log = logging.getLogger("cupool")

_TORCH_ACTIONS = {
    "alloc": "alloc",
    "free_completed": "free",
    "free": "free",
    "segment_alloc": "segment_alloc",
    "segment_free": "segment_free",
    "segment_map": "segment_alloc",
    "segment_unmap": "segment_free",
    "oom": "oom",
}
_TORCH_SKIPPED = {"free_requested", "snapshot", "user_defined"}
_RMM_ACTIONS = {"allocate": "alloc", "free": "free", "deallocate": "free", "allocate failure": "oom"}
_RMM_COLUMNS = ("Thread", "Time", "Action", "Pointer", "Size", "Stream")
_CLOCK = re.compile(r"^(\d+):(\d+):(\d+)[.:](\d+)$")


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it references the Python object {module}.{name}")


def load_torch_snapshot(path: str | Path, device: int | None = None) -> Trace:
    """Events of one device of a PyTorch memory snapshot (the busiest one unless ``device`` is given)."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            snap = _PlainUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as e:
        raise TraceError(p, f"not a readable PyTorch memory snapshot pickle ({e or type(e).__name__})") from None
    except OSError as e:
        raise TraceError(p, f"cannot read the file ({e.strerror or e})") from None
    if not isinstance(snap, dict) or "device_traces" not in snap:
        raise TraceError(p, "a pickle, but not a PyTorch memory snapshot (no 'device_traces')")
    traces = snap["device_traces"]
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise TraceError(p, "'device_traces' must be a list of per-device lists of events")
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d]), default=0)
    if not 0 <= device < max(len(traces), 1):
        raise TraceError(p, f"the snapshot has no device {device} ({len(traces)} device(s))")
    entries = traces[device] if traces else []
    events = []
    skipped: dict[str, int] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or "action" not in e:
            raise TraceError(p, f"device_traces[{device}][{i}] is not an event dict with an 'action'")
        action = e["action"]
        kind = _TORCH_ACTIONS.get(action)
        if kind is None:
            skipped[action] = skipped.get(action, 0) + 1
            if action not in _TORCH_SKIPPED:
                log.warning("%s: skipping unknown PyTorch trace action %r", p, action)
            continue
        try:
            t_ns = int(e.get("time_us", i)) * 1000
            events.append((t_ns, kind, int(e.get("addr", 0)), int(e.get("size", 0)), int(e.get("stream", 0))))
        except (TypeError, ValueError):
            raise TraceError(p, f"device_traces[{device}][{i}] has a non-integer addr, size, stream or time") from None
    return Trace.from_events(events, config={}, source=str(p), format="torch")


def load_rmm_log(path: str | Path) -> Trace:
    """Events of an RMM ``logging_resource_adaptor`` CSV log."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(p, f"cannot read the RMM log ({e})") from None
    reader = csv.reader(io.StringIO(text))
    header = [h.strip() for h in next(reader, [])]
    if tuple(header[:6]) != _RMM_COLUMNS:
        raise TraceError(p, f"not an RMM log: the header must be {','.join(_RMM_COLUMNS)}, got {','.join(header)}")
    events = []
    for line, row in enumerate(reader, start=2):
        if not row or not "".join(row).strip():
            continue
        if len(row) < 6:
            raise TraceError(p, f"line {line}: expected 6 fields, got {len(row)} (truncated?)")
        _, when, action, ptr, size, stream = (c.strip() for c in row[:6])
        kind = _RMM_ACTIONS.get(action.lower())
        if kind is None:
            raise TraceError(p, f"line {line}: unknown action {action!r} (expected allocate, free or allocate failure)")
        try:
            events.append((_rmm_time(when), kind, int(ptr, 0) if ptr else 0, int(size), int(stream, 0) if stream else 0))
        except ValueError:
            raise TraceError(p, f"line {line}: cannot parse time {when!r}, pointer {ptr!r}, size {size!r} "
                                f"or stream {stream!r}") from None
    return Trace.from_events(events, config={}, source=str(p), format="rmm")


def _rmm_time(s: str) -> int:
    """Nanoseconds from RMM's time column: seconds as a decimal, or HH:MM:SS:micro (older RMM)."""
    m = _CLOCK.match(s)
    if m:
        h, mi, sec, frac = m.groups()
        return ((int(h) * 60 + int(mi)) * 60 + int(sec)) * 10**9 + int(frac.ljust(9, "0")[:9])
    whole, dot, frac = s.partition(".")
    if not whole.isdigit() or (dot and not frac.isdigit()):
        # Exponent forms and the like: a float is close enough (float seconds lose ns anyway).
        return int(round(float(s) * 1e9))
    # Parse digits, not a float: epoch seconds in a double keep only ~0.2 us.
    return int(whole) * 10**9 + int(frac.ljust(9, "0")[:9] or 0)

