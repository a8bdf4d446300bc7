"""Traces from other allocators: PyTorch memory snapshots and RMM logs.

Both become a ``Trace`` so that they replay on the sim device against cupool's
settings.  Only what replay and plots need is kept: time, action, address, size
and stream.

* PyTorch (``torch.cuda.memory._snapshot()`` saved with ``pickle``):
  ``device_traces`` holds one list of events per device.  A block becomes reusable
  at ``free_completed`` (``free_requested`` only marks the user's intent while
  streams may still use it), so that is the free replay sees.  Expandable
  segments' ``segment_map``/``segment_unmap`` count as segment events.  Blocks
  older than the recording window, and the old list form without history, become
  the trace's seed (``load_torch_snapshot`` says how).
* RMM (``logging_resource_adaptor``): a CSV with ``Thread,Time,Action,Pointer,Size,Stream``
  rows; ``allocate``, ``free`` (or ``deallocate``) and ``allocate failure``.

Every number must fit the int64 columns replay uses (sizes and addresses not
negative): a value that does not is reported with its file and line (or event
index) rather than wrapped around or left to fail deep in numpy.  A block (an
allocation, a free, a segment) larger than any device can hold
(``MAX_DEVICE_BYTES``) is damage, not a workload, and is refused the same way;
a refused request (``oom``, ``allocate failure``) may be of any size.

Snapshots are pickles, untrusted input: ``untrusted.read_pickle`` loads only
plain containers, numbers and strings, which is all a snapshot holds, with work
and memory bounded by the file's size, and a value in the wrong place is named
in errors by its type and size (``untrusted.describe``), never printed.
"""

from __future__ import annotations

import bisect
import csv
import io
import logging
import math
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from .._units import MAX_DEVICE_BYTES, format_bytes
from ..core.sizes import PAGE, SMALL_SEGMENT, round_page, round_size
from .format import FORMAT, Trace, TraceError
from .untrusted import describe, read_pickle

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
#: Kinds whose size is a block that some device held (a refused request's is not).
_BLOCK_KINDS = ("alloc", "free", "segment_alloc", "segment_free")
#: A snapshot's sim device: its recorded peak reserved times this, rounded up to a 2 MiB page.
#: A replay places blocks its own way, so it may need a little more than the recording reserved;
#: a quarter more absorbs that without hiding a configuration that really needs far more.
CAPACITY_HEADROOM = Fraction(5, 4)


def load_torch_snapshot(path: str | Path, device: int | None = None) -> Trace:
    """Events of one device of a PyTorch memory snapshot (the busiest one unless ``device`` is given).

    A recording window rarely covers the whole run: ``_record_memory_history()``
    keeps only what came after it was switched on, and at most ``max_entries``.
    Blocks allocated before (weights, optimizer state) show up only as frees of
    unknown addresses or as active blocks in the final ``segments``; replayed as
    they stand, the live set would be too small.  So they, and the segments
    holding them, become the trace's seed (``config["seed"]``, as a cupool
    recording started on a busy pool has), and ``config["snapshot"]`` says how
    many blocks that is, whether there was any history, and the recorded
    allocated peak (``recorded_peak_allocated``).  The old list form of
    ``torch.cuda.memory_snapshot()`` and a snapshot without history are read the
    same way: a seed and nothing after it, a still picture of the live blocks.

    The device's total memory is not in a snapshot (its fields are
    ``segments``, ``device_traces``, ``allocator_settings`` and
    ``external_annotations``; only an ``oom`` event's ``device_free`` hints at
    it, and that leaves out what other processes held), so the replay sizes its
    device from the recorded peak reserved instead (``recorded_peak_reserved``).
    """
    p = Path(path)
    snap = read_pickle(p)
    if isinstance(snap, list):  # torch.cuda.memory_snapshot() before 2.1: the segments alone
        snap = {"segments": snap}
    if not isinstance(snap, dict) or ("device_traces" not in snap and "segments" not in snap):
        raise TraceError(p, "a pickle, but not a PyTorch memory snapshot (no 'device_traces' or 'segments')")
    traces = snap.get("device_traces", [])
    segments = snap.get("segments", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise TraceError(p, "'device_traces' must be a list of per-device lists of events")
    if not isinstance(segments, list) or not all(isinstance(s, dict) for s in segments):
        raise TraceError(p, "'segments' must be a list of segment dicts")
    _check_size(p, traces, segments)
    on = [_field(p, f"segments[{j}]", s, "device", 0, "segment") for j, s in enumerate(segments)]
    holding = sorted(d for d in set(on) | set(range(len(traces))) if d in on or _replayable(traces, d))
    if device is None:
        # The device with the most replayable events, else the most segments: a device whose trace
        # holds only markers (a "snapshot" action) is not the program's.
        device = max(holding, key=lambda d: (_replayable(traces, d), on.count(d)), default=0)
    elif isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise TraceError(p, f"device must be a device index (an int >= 0), got {device!r}")
    elif device not in holding:
        which = ", ".join(map(str, holding)) or "none"
        raise TraceError(p, f"device {device} holds nothing in this snapshot: no allocations, frees or segments "
                            f"(devices that do: {which})")
    events = _torch_events(p, device, traces[device] if device < len(traces) else [])
    held = _torch_segments(p, [(j, s) for j, s in enumerate(segments) if on[j] == device])
    seed, config = _torch_seed(events, held)
    history = any(kind in _BLOCK_KINDS for _, kind, *_ in events)
    t0 = events[0][0] if events else 0
    seed_events = [(t0, *ev) for ev in seed]
    settings = snap.get("allocator_settings")
    expandable = any(isinstance(e, dict) and e.get("action") in ("segment_map", "segment_unmap")
                     for e in (traces[device] if device < len(traces) else []))
    expandable = expandable or (isinstance(settings, dict) and settings.get("expandable_segments") is True)
    # A still snapshot has no map events; its segments say whether they were expandable (PyTorch >= 2.1).
    expandable = expandable or any(s.get("is_expandable") is True for s in segments if s.get("device", 0) == device)
    config["snapshot"] = {"history": history, "seeded_blocks": sum(ev[0] == "alloc" for ev in seed),
                          "device": device, "expandable_segments": expandable,
                          "peak_allocated": _peak_allocated(seed_events + events, len(seed_events)),
                          "peak_reserved": _peak_reserved(seed_events + events)}
    return Trace.from_events(seed_events + events, config=config, source=str(p), format="torch")


def recorded_peak_allocated(trace: Trace) -> int | None:
    """The recorded program's allocated peak, for a PyTorch snapshot or a cupool trace (None: no record of it).

    Allocated bytes are the sum of live blocks, each request rounded up to 512
    bytes as PyTorch's allocator (and cupool) rounds it, counting the blocks
    already alive when recording started; the peak is their maximum over the
    recorded window, with a block freed at ``free_completed`` (when it can be
    reused, which is when the replay frees it).  PyTorch's own
    ``allocated_bytes`` differs in two ways that the trace cannot follow: it
    counts the unsplit tail of a block (up to 1 MiB in a large segment; events
    give only the request, and the seed, which could know it from the final
    segments, leaves it free as cupool splits it off), and it drops a block at
    ``free_requested``.  Both engines count as this does, so a replay reproduces
    this peak exactly (``tests/test_snapshot_fidelity.py``).  A cupool trace
    records every block at its size, from the seed (the blocks alive at the
    start) on, so its peak is the pool's ``allocated_bytes.all.peak`` over the recording; one
    without a seed (a ring buffer that dropped its start) has no record of it.
    """
    if trace.format == FORMAT:
        return _cupool_peak_allocated(trace) if "seed" in trace.config else None
    peak = trace.config.get("snapshot", {}).get("peak_allocated")
    return peak if isinstance(peak, int) else None


def _cupool_peak_allocated(trace: Trace) -> int:
    """The running sum of a cupool trace's block events (allocations up, frees down), at its highest."""
    sign = np.zeros(len(trace.kinds), np.int64)
    for kind, s in (("alloc", 1), ("alloc_movable", 1), ("free", -1), ("free_movable", -1)):
        if trace.code(kind) >= 0:
            sign[trace.code(kind)] = s
    if not len(trace):
        return 0
    return max(0, int(np.cumsum(sign[trace.kind] * trace.size).max()))


def recorded_peak_reserved(trace: Trace) -> int | None:
    """The recorded allocator's reserved peak, for a PyTorch snapshot (None: not one, or no segments).

    Reserved bytes are the segments held, counting those from before the
    recording window (the seed) and following the window's ``segment_alloc`` /
    ``segment_free`` (and ``segment_map`` / ``segment_unmap``); a snapshot
    without history holds its final segments, so their sum.
    """
    peak = trace.config.get("snapshot", {}).get("peak_reserved")
    return peak if isinstance(peak, int) and peak > 0 else None


def sized_capacity(trace: Trace) -> tuple[int, str] | None:
    """A sim device for a PyTorch snapshot, in bytes, and why that size (None: no segments to go by).

    The snapshot records no device total (see ``load_torch_snapshot``), so its
    peak reserved times ``CAPACITY_HEADROOM``, rounded up to a 2 MiB page.
    """
    peak = recorded_peak_reserved(trace)
    if peak is None:
        return None
    why = (f"{float(CAPACITY_HEADROOM):g}x the recorded peak reserved {format_bytes(peak)}; "
           "the snapshot does not record the device's total")
    return math.ceil(peak * CAPACITY_HEADROOM / PAGE) * PAGE, why


def empty_cache_marks(trace: Trace, n: int, seeded: int) -> np.ndarray:
    """Where the recorded program emptied its cache: 1 at the last event of each burst, over ``trace``.

    A PyTorch program that calls ``torch.cuda.empty_cache()`` gives its cached
    segments back, and the replay does too, at that point (``pool.empty_cache()``;
    the numba engine waits for all streams and releases every wholly free
    segment, as the pool does): a program that trims its cache between phases would
    otherwise look, in the replay, as if it held every phase's segments at once.
    The trace records no call, only its effect, so a call is read from its
    *burst*: a maximal run of consecutive ``segment_free`` (or ``segment_unmap``)
    events after the seed, in a PyTorch snapshot, that is not followed by a
    ``segment_alloc`` or an ``oom`` (PyTorch frees its cache itself on the way to
    those, when a device allocation failed, and the replay's own reclaim ladder
    does that by its own rules).  One segment is a burst too: PyTorch's
    allocator otherwise keeps every segment it maps.  The replay empties its
    cache after the burst's last event.  cupool's own traces are left alone:
    their recorded settings reproduce their releases.  Only the first ``n``
    events are read, and none of the first ``seeded`` (the seed).
    """
    marks = np.zeros(len(trace), np.int8)
    sf = trace.code("segment_free")
    if trace.format != "torch" or sf < 0:
        return marks
    kind = trace.kind[:n]
    retries = [c for c in (trace.code("segment_alloc"), trace.code("oom")) if c >= 0]
    ends = np.flatnonzero((kind == sf) & (np.append(kind[1:], -1) != sf))
    ends = ends[ends >= seeded]
    nxt = ends + 1 < n
    retried = np.zeros(len(ends), bool)
    retried[nxt] = np.isin(kind[ends[nxt] + 1], retries)
    marks[ends[~retried]] = 1
    return marks


def _check_size(p: Path, traces: list[list], segments: list[dict]) -> None:
    """Refuse a snapshot with more events, segments and blocks than its file could hold.

    Each is a dict of its own in an honest snapshot, and a pickled dict costs at
    least a byte; a pickle can name one dict a million times by reference
    (a memo lookup is two bytes), so a 12 KB file can claim 9 M blocks and cost
    minutes of work.  Counting list lengths costs one step per segment, so the
    work of reading is bounded by the file's size before any block is looked at.
    """
    nbytes = p.stat().st_size
    count = len(segments) + sum(len(t) for t in traces)
    for j, seg in enumerate(segments):
        blocks = seg.get("blocks", [])
        count += len(blocks) if isinstance(blocks, list) else 0
        if count > nbytes:
            raise TraceError(p, f"the snapshot claims more events, segments and blocks (over {count:,}, by "
                                f"segments[{j}]) than a file of {nbytes:,} bytes can hold: it repeats objects "
                                "by reference, which no PyTorch snapshot does; refusing it")
    if count > nbytes:
        raise TraceError(p, f"the snapshot claims {count:,} events, segments and blocks, more than a file of "
                            f"{nbytes:,} bytes can hold: it repeats objects by reference, which no PyTorch "
                            "snapshot does; refusing it")


def _replayable(traces: list[list], device: int) -> int:
    """How many of a device's trace entries are allocations, frees, segments or OOMs."""
    entries = traces[device] if device < len(traces) else []
    # Only a string is looked up: hashing an untrusted tuple can take exponential time (see ``untrusted``).
    return sum(isinstance(e, dict) and isinstance(a := e.get("action"), str) and a in _TORCH_ACTIONS
               for e in entries)


def _torch_events(p: Path, device: int, entries: list) -> list[tuple]:
    """The replayable events of one device's trace, every number checked."""
    events = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or "action" not in e:
            raise TraceError(p, f"device_traces[{device}][{i}] is not an event dict with an 'action'")
        action = e["action"]
        where = f"device_traces[{device}][{i}]"
        if not isinstance(action, str):
            raise TraceError(p, f"{where}: the action must be a string, got {describe(action)}")
        kind = _TORCH_ACTIONS.get(action)
        if kind is None:
            if action not in _TORCH_SKIPPED:
                log.warning("%s: %s: skipping unknown PyTorch trace action %s", p, where, describe(action))
            continue
        values = []
        for name, default, scale in (("time_us", i, 1000), ("addr", 0, 1), ("size", 0, 1), ("stream", 0, 1)):
            values.append(_field(p, where, e, name, default, action, scale, signed=name in ("time_us", "stream")))
        t_ns, addr, size, stream = values
        if kind in _BLOCK_KINDS:
            _held(p, where, size)
        events.append((t_ns, kind, addr, size, stream))
    return events


def _field(p: Path, where: str, d: dict, name: str, default: int, what: str, scale: int = 1,
           signed: bool = False) -> int:
    """``d[name]`` (or ``default``) times ``scale``, checked; ``what`` the entry is (an action, "segment")."""
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(p, f"{where} ({what}): {name} must be an integer, got {describe(v)}")
    return _checked(p, where, name, v * scale, signed=signed)


def _torch_segments(p: Path, segments: list[tuple[int, dict]]) -> list[tuple[int, int, bool, int,
                                                                              list[tuple[int, int]]]]:
    """The snapshot's final segments: (address, size, small, stream, [(address, size) of active blocks]).

    A block's size is its request (``requested_size``), as trace events give it.
    Snapshots before PyTorch 2.1 give blocks no address: they lie end to end
    from their segment's start.  ``segments``: (index in the snapshot, segment).
    """
    out = []
    for j, seg in segments:
        where = f"segments[{j}]"
        base = _field(p, where, seg, "address", 0, "segment")
        total = _field(p, where, seg, "total_size", 0, "segment")
        _held(p, where, total)
        if not isinstance(seg.get("blocks", []), list):
            raise TraceError(p, f"{where}: 'blocks' must be a list of block dicts")
        blocks, at = [], base
        for k, b in enumerate(seg.get("blocks", [])):
            at_k = f"{where}.blocks[{k}]"
            if not isinstance(b, dict):
                raise TraceError(p, f"{at_k} is not a block dict")
            size = _field(p, at_k, b, "size", 0, "block")
            at = _field(p, at_k, b, "address", at, "block")
            state = b.get("state", "")
            if not isinstance(state, str):
                raise TraceError(p, f"{at_k} (block): state must be a string, got {describe(state)}")
            if state.startswith("active"):
                blocks.append((at, _field(p, at_k, b, "requested_size", size, "block")))
            at += size
        out.append((base, total, seg.get("segment_type") == "small",
                    _field(p, where, seg, "stream", 0, "segment", signed=True), blocks))
    return out


def _torch_seed(events: list[tuple], held: list[tuple]) -> tuple[list[tuple], dict[str, Any]]:
    """What was alive before the window: seed events (kind, address, size, stream) and their configuration.

    A block is older than the window if the window frees it without having
    allocated it, or if it is active at the end and the window never allocated
    it; a segment, likewise.  Each older block is seeded inside the older
    segment holding it; one whose segment is unknown gets a segment of its own.
    """
    live: dict[int, int] = {}
    segs_live: set[int] = set()
    sizes: dict[int, int] = {}  # segment address -> size, as the window mapped it
    old_blocks: dict[int, tuple[int, int]] = {}  # address -> size, stream
    old_segs: dict[int, tuple[int, bool, int]] = {}  # address -> size, small, stream
    for _, kind, addr, size, stream in events:
        if kind == "alloc":
            live[addr] = size
        elif kind == "free" and live.pop(addr, None) is None:
            old_blocks.setdefault(addr, (size, stream))
        elif kind == "segment_alloc":
            segs_live.add(addr)
            sizes[addr] = size
        elif kind == "segment_free":
            if addr in segs_live:
                segs_live.discard(addr)
            else:
                old_segs.setdefault(addr, (size, size == SMALL_SEGMENT, stream))
    mapped = sorted(segs_live)
    for base, total, small, stream, blocks in held:
        if base not in segs_live:
            # An expandable segment may have grown in the window: only its older start was there before.
            lo, hi = bisect.bisect_left(mapped, base), bisect.bisect_left(mapped, base + total)
            grown = sum(sizes[a] for a in mapped[lo:hi])
            if total > grown:
                old_segs.setdefault(base, (total - grown, small, stream))
        for addr, size in blocks:
            if addr not in live:
                old_blocks.setdefault(addr, (size, stream))
    starts = sorted(old_segs)
    inside: dict[int, list[int]] = {a: [] for a in starts}
    for addr in sorted(old_blocks):
        k = bisect.bisect_right(starts, addr) - 1
        if k >= 0 and addr + round_size(old_blocks[addr][0]) <= starts[k] + old_segs[starts[k]][0]:
            inside[starts[k]].append(addr)
        else:
            size, stream = old_blocks[addr]
            old_segs[addr] = (round_page(round_size(size)), False, stream)
            inside[addr] = [addr]
    seed: list[tuple] = []
    for base in sorted(old_segs):
        size, _, stream = old_segs[base]
        seed.append(("segment_alloc", base, size, stream))
        seed.extend(("alloc", a, round_size(old_blocks[a][0]), old_blocks[a][1]) for a in inside[base])
    small = [a for a in sorted(old_segs) if old_segs[a][1]]
    return seed, {"seed": {"events": len(seed), "small_segments": small, "kept_segments": []}}


def _peak_allocated(events: list[tuple], seeded: int) -> int:
    """Allocated bytes at their highest, each block counted at its rounded size (see ``recorded_peak_allocated``)."""
    live: dict[int, int] = {}
    now = peak = 0
    for i, (_, kind, addr, size, _) in enumerate(events):
        if kind == "alloc":
            now += round_size(size) - live.pop(addr, 0)
            live[addr] = round_size(size)
        elif kind == "free":
            now -= live.pop(addr, 0)
        if i + 1 >= seeded:
            peak = max(peak, now)
    return peak


def _peak_reserved(events: list[tuple]) -> int:
    """Segment bytes held at their highest (see ``recorded_peak_reserved``)."""
    now = peak = 0
    for _, kind, _, size, _ in events:
        if kind == "segment_alloc":
            now += size
            peak = max(peak, now)
        elif kind == "segment_free":
            now -= size
    return peak


def is_rmm_log(head: bytes) -> bool:
    """Whether a file's first bytes are an RMM log's header (a UTF-8 byte-order mark allowed).

    Five columns, not six: a log whose header lacks Stream still goes to the RMM
    reader, whose error names the header it expected.
    """
    first = head.split(b"\n", 1)[0].decode("utf-8", "replace").lstrip("\ufeff").strip().replace(" ", "")
    return first.lower().startswith(",".join(RMM_COLUMNS[:5]).lower())


def load_rmm_log(path: str | Path) -> Trace:
    """Events of an RMM ``logging_resource_adaptor`` CSV log."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # a spreadsheet's export starts with a byte-order mark
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(p, f"cannot read the RMM log ({e})") from None
    reader = csv.reader(io.StringIO(text))
    try:
        header = [h.strip() for h in next(reader, [])]
        if tuple(header[:6]) != RMM_COLUMNS:
            raise TraceError(p, f"not an RMM log: the header must be {','.join(RMM_COLUMNS)}, "
                                f"got {','.join(header)[:200]}")
        events: list[tuple] = []
        for row in reader:
            if row and "".join(row).strip():
                events.append(_rmm_event(p, reader.line_num, row, events[-1][0] if events else None))
    except csv.Error as e:
        raise TraceError(p, f"line {reader.line_num}: not CSV that can be read ({e})") from None
    return Trace.from_events(events, config={}, source=str(p), format="rmm")


def _rmm_event(p: Path, line: int, row: list[str], previous_ns: int | None) -> tuple:
    """One row of an RMM log as an event; ``previous_ns``: the time of the row before."""
    if len(row) < 6:
        raise TraceError(p, f"line {line}: expected 6 fields, got {len(row)} (truncated?)")
    _, when, action, ptr, size, stream = (c.strip() for c in row[:6])
    kind = _RMM_ACTIONS.get(action.lower())
    if kind is None:
        raise TraceError(p, f"line {line}: unknown action {action[:100]!r} "
                            "(expected allocate, free or allocate failure)")
    where = f"line {line}"
    t_ns = _parsed(p, where, "time", when, _rmm_time)
    a = _parsed(p, where, "pointer", ptr, _rmm_pointer)
    n = _parsed(p, where, "size", size, int)
    s = _parsed(p, where, "stream", stream, _rmm_stream)
    if previous_ns is not None and t_ns < previous_ns - _DAY_NS // 2 and _CLOCK.match(when):
        t_ns += _DAY_NS * (1 + (previous_ns - t_ns) // _DAY_NS)  # the wall clock passed midnight
    n = _checked(p, where, "size", n)
    if kind != "oom":
        _held(p, where, n)
    return (_checked(p, where, "time", t_ns, signed=True), kind, _checked(p, where, "pointer", a), n,
            _checked(p, where, "stream", s, signed=True))


def _parsed(p: Path, where: str, name: str, text: str, parse: Callable[[str], int]) -> int:
    """``parse(text)``, or a TraceError naming the field that does not parse."""
    try:
        return parse(text)
    except (ValueError, OverflowError):
        raise TraceError(p, f"{where}: cannot parse the {name} {text[:100]!r}") from None


def _rmm_pointer(text: str) -> int:
    """A pointer as RMM writes it: hexadecimal, and ``(nil)`` for the null pointer of a failed allocation.

    RMM formats pointers with ``%p`` (``0x7f...``), which glibc writes as
    ``(nil)`` for null: the pointer of every ``allocate failure`` row; some
    versions write ``%llx`` (no ``0x``).  RMM's own parser reads them as
    hexadecimal with or without the prefix, and so does this.
    """
    return 0 if text in ("", "(nil)") else int(text, 16)


def _rmm_stream(text: str) -> int:
    """A stream as RMM writes it (``0x...`` or hexadecimal digits) or as cupool writes it (decimal)."""
    if text in ("", "(nil)"):
        return 0
    try:
        return int(text, 0)
    except ValueError:
        return int(text, 16)


def _held(p: Path, where: str, size: int) -> None:
    """Refuse a block no device could hold: the replay engines' arithmetic assumes real sizes."""
    if size > MAX_DEVICE_BYTES:
        raise TraceError(p, f"{where}: size {size} is larger than any device holds "
                            f"({format_bytes(MAX_DEVICE_BYTES)}, 2**48 bytes)")


def _checked(p: Path, where: str, name: str, v: int, signed: bool = False) -> int:
    """``v`` if it fits an int64 column (and is not negative, unless ``signed``); else a TraceError."""
    if not (-_INT64_MAX - 1 if signed else 0) <= v <= _INT64_MAX:
        raise TraceError(p, f"{where}: {name} {describe(v)} is out of range "
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
    sign, digits = (-1, s[1:]) if s.startswith("-") else (1, s)
    whole, dot, frac = digits.partition(".")
    if not whole.isdigit() or (dot and not frac.isdigit()):
        # Exponent forms and the like: a float is close enough (float seconds lose ns anyway).
        return int(round(float(s) * 1e9))
    # Parse digits, not a float: epoch seconds in a double keep only ~0.2 us; a sign applies to the whole.
    return sign * (int(whole) * 10**9 + int(frac.ljust(9, "0")[:9] or 0))

