"""The recorded program's own ``empty_cache()`` and ``compact()`` calls, read from a trace's events.

A replay must make them at the same points: a program that trims its cache
between phases would otherwise replay as if it held every phase's segments at
once (three 30 MiB blocks freed, ``empty_cache()``, two 45 MiB blocks: 92 MiB
reserved in the recording, 182 MiB in a replay that ignores the call).

cupool records each call as an event of its own (``call:empty_cache``,
``call:compact``, after what the call did), and those are read as they are.
Older cupool traces, and PyTorch's snapshots, do not have them, so there each
call is read from what it leaves behind:

* PyTorch snapshots: ``cupool.trace.importers.empty_cache_marks`` (a burst of
  segment frees that no allocation retried).
* cupool traces: ``empty_cache()`` is a burst of ``segment_free`` /
  ``segment_unmap`` events (a maximal run of them) that no pool rule explains.
  The rules that release segments on their own leave other marks: the reclaim
  ladder's steps are followed by their ``reclaim:<step>`` annotation, compaction
  by its ``compact`` event, stitching by the ``segment_map`` of the stitched
  range, spilling comes after ``spill`` events, and a free that gives its own
  segment (or tail) back (``release_threshold`` set, or expandable segments)
  releases exactly one, right after its ``free`` event.  An ``empty_cache()``
  that released nothing leaves no trace and is not replayed (it also settled
  the streams, which only matters to multi-stream traces).
  ``compact()`` is each ``compact`` event that the ladder's ``reclaim:compact``
  does not follow.  An automatic compaction (``defrag_threshold``) looks the
  same; replaying it as a call at the same point changes nothing under the
  recorded settings, since the replay pool would have compacted right there.
"""

from __future__ import annotations

import numpy as np

from ..trace import Trace
from ..trace.format import FORMAT
from ..trace.importers import empty_cache_marks

#: Values of ``program_calls``' marks.
EMPTY_CACHE, COMPACT = 1, 2
_RELEASES = ("segment_free", "segment_unmap")


def program_calls(trace: Trace, n: int, seeded: int) -> np.ndarray:
    """Per event: ``EMPTY_CACHE`` or ``COMPACT`` where the program made that call (after the event), else 0.

    Only the first ``n`` events are read, and none of the first ``seeded`` (the seed).
    """
    if trace.format == "torch":
        return empty_cache_marks(trace, n, seeded)
    marks = np.zeros(len(trace), np.int8)
    if trace.format != FORMAT or n <= seeded:
        return marks
    calls = [(trace.code("call:empty_cache"), EMPTY_CACHE), (trace.code("call:compact"), COMPACT)]
    if any(code >= 0 for code, _ in calls):  # recorded as they were made
        kind = trace.kind[:n]
        for code, mark in calls:
            if code >= 0:
                at = np.flatnonzero(kind == code)
                marks[at[at >= seeded]] = mark
        return marks
    kinds = trace.kinds
    kind = trace.kind[:n]
    releases = np.isin(kind, [trace.code(k) for k in _RELEASES if trace.code(k) >= 0])
    after = [i for i, k in enumerate(kinds) if k.startswith("reclaim:") or k == "compact"]
    mapped, stitched_code = trace.code("segment_map"), trace.code("reclaim:stitch")
    frees = [trace.code(k) for k in ("free", "free_movable") if trace.code(k) >= 0]
    spill = trace.code("spill")
    threshold = trace.config.get("release_threshold")
    reserved = _reserved(trace, n)
    stitched = _stitched(trace, n)
    starts = np.flatnonzero(releases & ~np.concatenate([[False], releases[:-1]]))
    ends = np.flatnonzero(releases & ~np.append(releases[1:], False))
    for lo, hi in zip(starts.tolist(), ends.tolist()):
        if lo < seeded:
            continue
        before = int(kind[lo - 1]) if lo else -1
        if hi + 1 < n and int(kind[hi + 1]) in after:
            continue  # the ladder or a compaction released these
        if hi + 2 < n and mapped >= 0 and int(kind[hi + 1]) == mapped and int(kind[hi + 2]) == stitched_code:
            continue  # a stitch unmapped these, to map them side by side
        if before == spill and spill >= 0:
            continue  # spilling gives the segments it emptied back
        if hi == lo and before in frees:
            over = threshold is not None and reserved[lo - 1] > threshold
            if over or int(trace.addr[lo]) in stitched:
                continue  # the free gave its own segment (or tail) back
        marks[hi] = EMPTY_CACHE
    compact, ladder = trace.code("compact"), trace.code("reclaim:compact")
    if compact >= 0:
        for i in np.flatnonzero(kind == compact).tolist():
            if i >= seeded and not (i + 1 < n and int(kind[i + 1]) == ladder):
                marks[i] = COMPACT
    return marks


def _reserved(trace: Trace, n: int) -> np.ndarray:
    """Reserved bytes after each of the first ``n`` events, from the trace's segment events."""
    sign = np.zeros(len(trace.kinds), np.int64)
    for k, v in (("segment_alloc", 1), ("segment_map", 1), ("segment_free", -1), ("segment_unmap", -1)):
        if trace.code(k) >= 0:
            sign[trace.code(k)] = v
    return np.cumsum(sign[trace.kind[:n]] * trace.size[:n])


def _stitched(trace: Trace, n: int) -> set[int]:
    """Addresses of the granules of stitched ranges (a ``segment_map`` that ``reclaim:stitch`` follows).

    A stitched segment goes back to the device as soon as it is free, whatever the release threshold.
    """
    mapped, stitch = trace.code("segment_map"), trace.code("reclaim:stitch")
    out: set[int] = set()
    if mapped < 0 or stitch < 0:
        return out
    kind = trace.kind[:n]
    for i in np.flatnonzero(kind[:-1] == mapped).tolist():
        if int(kind[i + 1]) == stitch:
            base, size = int(trace.addr[i]), int(trace.size[i])
            out.update(range(base, base + size, 2 << 20))
    return out
