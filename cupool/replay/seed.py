"""The state a replay starts from: the segments and live blocks a recording began with.

A recording that started on a busy pool (a cupool trace made with ``record()``
on a pool already holding memory, or a PyTorch snapshot whose window began
mid-run) describes that state in its first events, the *seed*: each segment
(``segment_alloc`` or ``segment_map``), then the live blocks inside it.

Both engines rebuild it the same way, by one short program of ordinary pool
calls (``seed_program``), so that they start from the same stated state:

1. each recorded segment, in order, is made by an exact-size movable buffer
   that is freed at once (a movable buffer grows the pool by just its size);
   the recorded preallocated segment is the replay pool's own ``initial_size``
   one when their sizes agree;
2. it is filled from its start, in address order: the live blocks at their
   recorded offsets, with *filler* blocks over the free gaps between them and,
   where a later request could land there instead, over its free tail (the
   segment's free remainder is the only free block of its size class, so each
   request lands right after the previous one);
3. once every segment is filled, each block that a *placeholder* stood for
   (below) takes its place, and the fillers are freed, which leaves the
   recorded free space; blocks whose segment did not fit the replay's limit are
   then allocated the ordinary way;
4. with a ``release_threshold`` below what is then reserved, the cache is
   emptied, as ``empty_cache()`` does: a policy that gives free segments back
   would never have kept the inherited ones;
5. the peaks start from the state this leaves (fillers never count), so each
   block counts its recorded bytes, as ``recorded_peak_allocated`` counts them.

The pool's own giving back (``release_threshold``, Note [Release before
split]) is switched off while the seed is built, and back on after it, so that
every setting starts from the recorded state itself: a policy that gives memory
back changes what happens next, not what the program already held.  Step 4 is
the one release, and it takes only wholly free segments (and, on expandable
segments, free tails).  A free block's stream is not recorded: the free space
left by fillers belongs to its segment's stream.

Placing a block requires what the pool's placement allows.  In a large
segment, a free gap of 1 MiB or less cannot be filled: a request that small
goes to the small heap.  (In a PyTorch snapshot such a gap is the unsplit tail
of the block before it, part of that block's ``size`` but not of its request;
in a cupool trace it is a free block.)  So the block before the gap is first
requested over both, as a placeholder filler on the block's stream (at the
segment's start, the block starts there and the gap follows it); in step 3
each placeholder is freed and its block requested at its own size, which takes
the hole's first bytes (the hole is the only free block it fits) and leaves the
gap free, split off as the pool splits every remainder.  Growing the block over
the gap instead would count the gap as allocated: the replay's peak allocated
would exceed the recording's by the tails (issue 25).  A block whose size class
does not match its segment is allocated the ordinary way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._units import MAX_DEVICE_BYTES
from ..core.sizes import ALIGNMENT, PAGE, SMALL_MAX, SMALL_SEGMENT, round_size
from ..trace import Trace

#: The operations of a seed program, by code: (code, id, size, stream).
MOVABLE, FREE_MOVABLE, ALLOC, FREE, EMPTY = range(5)


def seed_config(trace: Trace) -> dict[str, Any]:
    """The trace's ``seed`` configuration, checked (empty when the recording started on an empty pool).

    It comes from the file, so every field is checked before use: a malformed
    one is an error naming the trace and the field, not a TypeError deep in a replay.
    """
    seed = trace.config.get("seed")
    if seed is None:
        return {}

    def corrupted(why: str) -> ValueError:
        return ValueError(f"{trace.source}: the trace's seed configuration is corrupted: {why}")

    if not isinstance(seed, dict):
        raise corrupted(f"it must be a mapping, got {seed!r:.100}")
    count = seed.get("events", 0)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(trace):
        raise corrupted(f"'events' must be a count of events from 0 to {len(trace)}, got {count!r:.100}")
    for key in ("small_segments", "kept_segments"):
        addrs = seed.get(key, [])
        if not isinstance(addrs, list) or not all(isinstance(a, int) and not isinstance(a, bool) for a in addrs):
            raise corrupted(f"{key!r} must be a list of segment addresses, got {addrs!r:.100}")
    return seed


def seed_count(trace: Trace, n: int) -> int:
    """How many leading events describe the live state a recording started from (0 if none)."""
    return min(seed_config(trace).get("events", 0), n)


def seeded_blocks(trace: Trace, seeded: int) -> int:
    """Blocks among the first ``seeded`` events: those alive when the recording started."""
    codes = [c for c in (trace.code("alloc"), trace.code("alloc_movable")) if c >= 0]
    return int(np.isin(trace.kind[:seeded], codes).sum())


def has_history(trace: Trace) -> bool:
    """Whether the trace has events beyond its seed (a snapshot without history has none)."""
    snapshot = trace.config.get("snapshot")
    if isinstance(snapshot, dict) and "history" in snapshot:
        return bool(snapshot["history"])
    return len(trace) > seed_config(trace).get("events", 0)


def _segments(trace: Trace, seeded: int) -> list[dict[str, Any]]:
    """The seed's segments, each with its blocks: (offset, size, stream, recorded address, movable)."""
    seed = seed_config(trace)
    small, kept = set(seed.get("small_segments", [])), set(seed.get("kept_segments", []))
    seg_codes = {trace.code("segment_alloc"), trace.code("segment_map")} - {-1}
    movable = trace.code("alloc_movable")
    segs: list[dict[str, Any]] = []
    for i in range(seeded):
        k, a, n, strm = int(trace.kind[i]), int(trace.addr[i]), int(trace.size[i]), int(trace.stream[i])
        if n > MAX_DEVICE_BYTES:
            raise ValueError(f"{trace.source}: seed event {i} has size {n}, more than any device holds")
        if k in seg_codes:
            segs.append({"addr": a, "size": n, "small": a in small, "keep": a in kept, "stream": strm, "blocks": []})
            continue
        if not segs or not segs[-1]["addr"] <= a < segs[-1]["addr"] + segs[-1]["size"]:
            raise ValueError(f"{trace.source}: seed event {i} is not inside the segment before it")
        segs[-1]["blocks"].append([a - segs[-1]["addr"], round_size(n), strm, a, k == movable])
    return segs


def _fill(seg: dict[str, Any], tail: bool) -> tuple[list[tuple[int, int, int, bool, int]], list]:
    """The requests that fill ``seg`` from its start (its free tail too with ``tail``), and its blocks
    that cannot be placed in it.

    Each request: (size, stream, id or -1 for a filler, movable, the block's own size).  A block
    followed by a free gap that no request can fill is requested over both (a placeholder: its
    size is then above the block's own; ``seed_program`` puts the block in its place later).
    """
    size, small, stream = seg["size"], seg["small"], seg["stream"]
    blocks = sorted(seg["blocks"], key=lambda b: b[0])
    fits, other = [], []
    at = 0
    for b in blocks:
        off, n = b[0], b[1]
        if off < at or off + n > size or off % ALIGNMENT or (n <= SMALL_MAX) != small:
            other.append(b)
            continue
        fits.append([off, n, b[2], b[3], b[4]])
        at = off + n
    out: list[tuple[int, int, int, bool, int]] = []
    at = 0  # bytes the requests so far cover
    for off, n, strm, addr, mov in fits:
        end = off + n
        gap = off - at
        if gap and not small and gap <= SMALL_MAX:
            if out:  # the block before holds the gap's place until its placeholder is swapped
                last = out.pop()
                out.append((last[0] + gap, *last[1:]))
                out.append((n, strm, addr, mov, n))
            else:  # at the segment's start: the block starts there, the gap follows it
                out.append((n + gap, strm, addr, mov, n))
        else:
            out += [(piece, stream, -1, False, piece) for piece in _pieces(gap, small)]
            out.append((n, strm, addr, mov, n))
        at = end
    rest = size - at if tail else 0
    if not small and rest <= SMALL_MAX:
        rest = 0  # left free: no large request fits it, so nothing filled later lands there
    out += [(piece, stream, -1, False, piece) for piece in _pieces(rest, small)]
    return out, other


def _pieces(gap: int, small: bool) -> list[int]:
    """Fillers covering ``gap`` bytes: 1 MiB at most in a small segment, one request in a large one."""
    if gap <= 0:
        return []
    if not small:
        return [gap]
    return [SMALL_MAX] * (gap // SMALL_MAX) + ([gap % SMALL_MAX] if gap % SMALL_MAX else [])


def seed_program(trace: Trace, seeded: int, limit: int, initial: int, threshold: int | None) -> np.ndarray:
    """The pool calls that rebuild the seed (rows: code, id, size, stream; see the module's docstring).

    Ids are the blocks' recorded addresses, so that the replay's later events find
    them; fillers and the segment-making buffers get negative ids.
    """
    ops: list[tuple[int, int, int, int]] = []
    segs = _segments(trace, seeded)
    fid = -1
    fillers: list[tuple[int, int]] = []  # (id, code that frees it)
    later: list = []
    kept = next((j for j, s in enumerate(segs) if s["keep"] and initial and s["size"] == initial), None)
    order = ([] if kept is None else [kept]) + [j for j in range(len(segs)) if j != kept]
    for seg in segs:
        seg["small"] = seg["small"] and seg["size"] == SMALL_SEGMENT
    made, reserved = [], initial
    for j in order:  # the segments that fit the limit, in order; the others' blocks are allocated afterwards
        if j == kept:
            made.append(j)
        elif segs[j]["size"] % PAGE == 0 and reserved + segs[j]["size"] <= limit:
            reserved += segs[j]["size"]
            made.append(j)
    if initial and kept is None and any(not segs[j]["small"] for j in made):
        # The replay pool's own preallocated segment stays out of the way while segments are filled.
        ops.append((ALLOC, fid, initial, 0))
        fillers.append((fid, FREE))
        fid -= 1
    # A free tail is filled only where a later request could land in it instead of where it belongs:
    # while another segment of its size class is still to be filled, or where a placeholder of its
    # class is swapped for its block.  Otherwise it is left free, as recorded: a filler freed there
    # would give the free space its stream, where the recording's may be anyone's.
    rank = {j: r for r, j in enumerate(made)}
    last = {cls: max((r for r, j in enumerate(made) if segs[j]["small"] == cls), default=-1) for cls in (False, True)}
    swapped = {cls: any(ident >= 0 and own < n for j in made if segs[j]["small"] == cls
                        for n, _, ident, _, own in _fill(segs[j], True)[0]) for cls in (False, True)}
    swaps: list[tuple[int, tuple[int, int, int, int]]] = []  # (placeholder's id, the block's op)
    for j in order:
        seg = segs[j]
        if j not in made:
            later += seg["blocks"]
            continue
        if j != kept:
            ops.append((MOVABLE, fid, ALIGNMENT if seg["small"] else seg["size"], seg["stream"]))
            ops.append((FREE_MOVABLE, fid, 0, 0))
            fid -= 1
        requests, other = _fill(seg, rank[j] < last[seg["small"]] or swapped[seg["small"]])
        later += other
        for n, strm, ident, mov, own in requests:
            if ident < 0 or own < n:  # a filler, or a placeholder over a block and the gap after it
                ops.append((ALLOC, fid, n, strm))
                if ident < 0:
                    fillers.append((fid, FREE))
                else:
                    swaps.append((fid, (MOVABLE if mov else ALLOC, ident, own, strm)))
                fid -= 1
            else:
                ops.append((MOVABLE if mov else ALLOC, ident, n, strm))
    # Each placeholder's hole is then the only free block its block fits (every segment is full,
    # but for gaps no large request fits); last first, so that no hole merges with a gap before it.
    for ident, op in reversed(swaps):
        ops += [(FREE, ident, 0, 0), op]
    ops += [(code, ident, 0, 0) for ident, code in fillers]
    for b in sorted(later, key=lambda b: b[3]):
        ops.append((MOVABLE if b[4] else ALLOC, b[3], b[1], b[2]))
    if threshold is not None and reserved > threshold:
        ops.append((EMPTY, 0, 0, 0))
    return np.array(ops, np.int64).reshape(-1, 4)
