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

Every number must fit the int64 columns replay uses (sizes and addresses not
negative): a value that does not is reported with its file and line (or event
index) rather than wrapped around or left to fail deep in numpy.

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

from .format import Trace, TraceError

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
#: The header of an RMM log (how ``load_trace`` recognises one).
RMM_COLUMNS = ("Thread", "Time", "Action", "Pointer", "Size", "Stream")
_CLOCK = re.compile(r"^(\d+):(\d+):(\d+)[.:](\d+)$")
_INT64_MAX = (1 << 63) - 1
_DAY_NS = 86_400 * 10**9


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
        where = f"device_traces[{device}][{i}]"
        if not isinstance(action, str):
            raise TraceError(p, f"{where}: the action must be a string, got {action!r}")
        kind = _TORCH_ACTIONS.get(action)
        if kind is None:
            skipped[action] = skipped.get(action, 0) + 1
            if action not in _TORCH_SKIPPED:
                log.warning("%s: %s: skipping unknown PyTorch trace action %r", p, where, action)
            continue
        values = []
        for name, default, scale in (("time_us", i, 1000), ("addr", 0, 1), ("size", 0, 1), ("stream", 0, 1)):
            v = e.get(name, default)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TraceError(p, f"{where} ({action}): {name} must be an integer, got {v!r}")
            values.append(_checked(p, where, name, v * scale, signed=name in ("time_us", "stream")))
        t_ns, addr, size, stream = values
        events.append((t_ns, kind, addr, size, stream))
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
    if tuple(header[:6]) != RMM_COLUMNS:
        raise TraceError(p, f"not an RMM log: the header must be {','.join(RMM_COLUMNS)}, got {','.join(header)}")
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
            t_ns, a, n, s = _rmm_time(when), int(ptr, 0) if ptr else 0, int(size), int(stream, 0) if stream else 0
        except (ValueError, OverflowError):
            raise TraceError(p, f"line {line}: cannot parse time {when!r}, pointer {ptr!r}, size {size!r} "
                                f"or stream {stream!r}") from None
        where = f"line {line}"
        if events and t_ns < events[-1][0] - _DAY_NS // 2 and _CLOCK.match(when):
            t_ns += _DAY_NS * (1 + (events[-1][0] - t_ns) // _DAY_NS)  # the wall clock passed midnight
        events.append((_checked(p, where, "time", t_ns, signed=True), kind, _checked(p, where, "pointer", a),
                       _checked(p, where, "size", n), _checked(p, where, "stream", s, signed=True)))
    return Trace.from_events(events, config={}, source=str(p), format="rmm")


def _checked(p: Path, where: str, name: str, v: int, signed: bool = False) -> int:
    """``v`` if it fits an int64 column (and is not negative, unless ``signed``); else a TraceError."""
    if not (-_INT64_MAX - 1 if signed else 0) <= v <= _INT64_MAX:
        raise TraceError(p, f"{where}: {name} {v} is out of range "
                            f"({'an int64' if signed else 'from 0 to 2**63 - 1'})")
    return v


def _rmm_time(s: str) -> int:
    """Nanoseconds from RMM's time column.

    Current RMM (spdlog pattern ``%H:%M:%S.%f``) writes the wall clock with
    microseconds, ``08:00:01.000250``; some versions separate the fraction with
    a colon, ``08:00:01:000250``; logs converted by other tools carry seconds as
    a decimal.  A wall clock wraps at midnight: the caller, which sees the
    previous row, adds the day.
    """
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

