"""How a pool shows itself in Jupyter and IPython: its figures, and a map of its segments.

``Pool._repr_html_`` and ``Pool._repr_pretty_`` read a ``Picture`` under the
pool's lock (one consistent reading) and hand it here; this module only draws.
It sits beside the pool rather than among the observers because the pool calls
it, and it imports nothing above ``cupool.core``, so that call closes no cycle.

The map draws one bar per segment, blocks to scale within it and coloured by
state.  A notebook must stay responsive for a pool of 100k blocks, so the number
of SVG elements is capped (``MAX_ELEMENTS``): blocks too narrow to see are drawn
together as one "many blocks" run, at most ``MAX_ROWS`` segments are drawn, and
the output says how much was coalesced or left out.  A run fills the height of
its bar in proportion to the bytes in use in it, so that free blocks too narrow
to draw still show, as low runs: a 2 GiB segment of 800 blocks with a third of
its bytes free in holes between them reads as a third lower, not as a solid
comb.  Tooltips count the blocks in use and the free ones apart.  Every text that reaches the
HTML goes through ``html.escape``.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from ._palette import BLOCKS
from ._units import format_bytes
from ._words import count
from .core.handles import Movable
from .core.view import ArenaView, BlockInfo, SegmentInfo

__all__ = ["MAX_ELEMENTS", "MAX_ROWS", "STATES", "Picture", "pool_html", "write_pretty"]

#: States a block is drawn in: (colour, what the legend says it means).  The colours are
#: ``cupool._palette``'s, which the report's figure reads too.
STATES: dict[str, tuple[str, str]] = {
    "allocated": (BLOCKS["allocated"], "a raw allocation (malloc, CuPy, Numba): never moves"),
    "movable": (BLOCKS["movable"], "a movable buffer: compaction may move it, the ladder may spill it"),
    "leased": (BLOCKS["leased"], "a movable buffer pinned by a live array from .array()"),
    "free": (BLOCKS["free"], "free space in a segment, ready for reuse"),
    "many": (BLOCKS["many"], "many blocks too narrow to draw one by one, as high as the share of their bytes in use "
                             "(hover for counts)"),
}
#: Segments drawn at most, in address order; the rest are counted in a note.
MAX_ROWS = 100
#: SVG elements (rects, their tooltips, labels) the map may hold, however many blocks the pool has.
MAX_ELEMENTS = 5000

_BAR_W = 640  # px: every segment's bar, so a block's width is its share of its segment
_LABEL_W = 250  # px: the address, size and kind of each segment, left of its bar
_ROW_H, _GAP = 14, 3
_MIN_PX = 2.0  # px: narrower blocks are coalesced even when the budget would allow more


@dataclass(frozen=True)
class Picture:
    """One consistent reading of a pool: what both displays show."""

    title: str  # "Pool sim:1": the class and the device
    closed: bool
    limit: int
    reserved: int
    peak_reserved: int
    allocated: int
    peak_allocated: int
    requested: int
    fragmentation: float  # the books' own figure, read with the rest
    allocations: int
    segments: tuple[SegmentInfo, ...]
    movables: int  # movable buffers on the device
    leased: frozenset[int]  # addresses of those pinned by a live array
    spill: str  # the spill tier and what it has done; "" without one

    @classmethod
    def read(cls, pool: Shown, movables: Callable[[], Iterable[Movable]]) -> Picture:
        """Read ``pool`` under its lock; ``movables`` lists its movable buffers on the device (lock held)."""
        spill = pool.scheduler.stats()
        spilled = f"{spill['tier']}: {count(spill['spills'], 'spill')}, {format_bytes(spill['bytes_spilled'])} so far"
        with pool.hold() as view:
            books = view.books
            on_device = [m for m in movables() if m.ptr is not None]
            return cls(
                title=f"{type(pool).__name__} {pool.device.name}",
                closed=pool.closed,
                limit=view.limit,
                reserved=books.reserved,
                peak_reserved=books.stat("reserved_bytes").peak,
                allocated=books.allocated,
                peak_allocated=books.stat("allocated_bytes").peak,
                requested=books.requested,
                fragmentation=books.fragmentation,
                allocations=books.allocations,
                segments=tuple(view.segments()),
                movables=len(on_device),
                leased=frozenset(m.ptr for m in on_device if m.leased and m.ptr is not None),
                spill=spilled if spill["tier"] else "",
            )

    @property
    def largest_free(self) -> int:
        return max((b.size for s in self.segments for b in s.blocks if b.free), default=0)

    def state(self, b: BlockInfo) -> str:
        if b.free:
            return "free"
        if b.movable:
            return "leased" if b.addr in self.leased else "movable"
        return "allocated"

    def figures(self) -> list[tuple[str, str]]:
        """(name, value) rows, shared by the HTML table and the text summary."""
        small = sum(s.small for s in self.segments)
        fb = format_bytes
        allocations = count(self.allocations, "allocation")
        rows = [
            ("reserved", f"{fb(self.reserved)} of {fb(self.limit)} (peak {fb(self.peak_reserved)})"),
            ("allocated", f"{fb(self.allocated)} in {allocations} (peak {fb(self.peak_allocated)})"),
            ("requested", fb(self.requested)),
            ("segments", f"{len(self.segments)} ({small} small, {len(self.segments) - small} large)"),
            ("fragmentation", f"{self.fragmentation:.3f}; largest free block {format_bytes(self.largest_free)}"),
            ("movable", f"{self.movables} on the device, {len(self.leased)} leased"),
        ]
        if self.spill:
            rows.append(("spill", self.spill))
        return rows

    def heading(self) -> str:
        return f"cupool.{self.title}" + (" (closed)" if self.closed else "")


class Shown(Protocol):
    """What ``Picture.read`` needs of a pool (``cupool.Pool``; this module cannot import it)."""

    device: Any
    scheduler: Any

    @property
    def closed(self) -> bool: ...

    def hold(self) -> AbstractContextManager[ArenaView]: ...


class PrettyPrinter(Protocol):
    """The part of IPython's ``RepresentationPrinter`` that ``write_pretty`` uses."""

    def text(self, obj: str) -> None: ...

    def break_(self) -> None: ...


def write_pretty(p: PrettyPrinter, picture: Picture | str) -> None:
    """IPython's text view: a heading and one line per figure (``break_`` keeps any nesting's indent).

    A string (the pool's one-line repr, where IPython reports a cycle) is written as it is.
    """
    if isinstance(picture, str):
        p.text(picture)
        return
    p.text(picture.heading())
    for name, value in picture.figures():
        p.break_()
        p.text(f"  {name:<14}{value}")


def pool_html(picture: Picture) -> str:
    """A stats table, a legend and the segment map, as one well-formed HTML fragment."""
    e = html.escape
    rows = "".join(
        f'<tr><th style="text-align:left">{e(k)}</th><td style="text-align:left">{e(v)}</td></tr>'
        for k, v in picture.figures()
    )
    legend = "".join(
        f'<span title="{e(meaning)}" style="margin-right:1em;white-space:nowrap">'
        f'<span style="display:inline-block;width:0.9em;height:0.9em;background:{colour};'
        f'border:1px solid #999;vertical-align:middle"></span> {e(name)}</span>'
        for name, (colour, meaning) in STATES.items()
    )
    body, notes = _segment_map(picture)
    notes_html = "".join(f'<p style="margin:0.2em 0">{e(n)}</p>' for n in notes)
    return (
        f'<div class="cupool-pool"><p style="margin:0.2em 0"><b>{e(picture.heading())}</b></p>'
        f'<table>{rows}</table><p style="margin:0.4em 0">{legend}</p>{body}{notes_html}</div>'
    )


@dataclass(frozen=True)
class _Piece:
    x: float  # px from the bar's left
    w: float
    state: str
    tip: str
    blocks: int = 1
    used: float = 1.0  # a run of many blocks: the share of its bytes in use, drawn as the share of the bar's height


def _segment_map(picture: Picture) -> tuple[str, list[str]]:
    """The SVG map and the notes that say what it leaves out."""
    segments = picture.segments
    if not segments:
        return "", ["No segments: the pool holds no device memory."]
    drawn = segments[:MAX_ROWS]
    # Each row costs a label, a bar and the bar's tooltip; each piece a rect and a tooltip; the <svg> one.
    per_row = ((MAX_ELEMENTS - 1) // len(drawn) - 3) // 2
    e = html.escape
    parts: list[str] = []
    coalesced = runs = 0
    for i, seg in enumerate(drawn):
        y = i * (_ROW_H + _GAP)
        label = f"{seg.addr:#x} {format_bytes(seg.size)} {'small' if seg.small else 'large'}"
        label += " kept" if seg.keep else ""
        label += f" stream {seg.stream}" if seg.stream else ""
        free = [b for b in seg.blocks if picture.state(b) == "free"]
        tip = f"segment {label}: {format_bytes(seg.used)} used in {count(len(seg.blocks) - len(free), 'block')}"
        if free:
            tip += f", {format_bytes(sum(b.size for b in free))} free in {count(len(free), 'block')}"
        parts.append(f'<text x="0" y="{y + _ROW_H - 2}">{e(label)}</text>')
        parts.append(
            f'<rect x="{_LABEL_W}" y="{y}" width="{_BAR_W}" height="{_ROW_H}" fill="{STATES["free"][0]}" '
            f'stroke="#999" stroke-width="0.5"><title>{e(tip)}</title></rect>'
        )
        # Runs of narrow blocks are usually about min_px wide, so bar / per_row mostly fits;
        # at worst a row has 2 * bar / min_px + 1 pieces (see _pieces), so the retry always does.
        pieces = _pieces(seg, picture, max(_MIN_PX, _BAR_W / per_row))
        if len(pieces) > per_row:
            pieces = _pieces(seg, picture, 2 * _BAR_W / (per_row - 1))
        for piece in pieces:
            if piece.state == "many":
                runs += 1
                coalesced += piece.blocks
            h = _ROW_H * piece.used  # from the bar's foot up; the rest of the height is the bar's free colour
            parts.append(
                f'<rect x="{_LABEL_W + piece.x:.1f}" y="{y + _ROW_H - h:.2f}" width="{piece.w:.2f}" height="{h:.2f}" '
                f'fill="{STATES[piece.state][0]}" stroke="#fff" stroke-width="0.3">'
                f"<title>{e(piece.tip)}</title></rect>"
            )
    height = len(drawn) * (_ROW_H + _GAP)
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LABEL_W + _BAR_W}" height="{height}" '
        f'font-family="monospace" font-size="11">{"".join(parts)}</svg>'
    )
    notes = ["Each bar is one segment at full width; blocks are to scale within it."]
    if runs:
        notes.append(f"{coalesced} blocks too narrow to draw one by one are drawn as {count(runs, 'run')} "
                     "of many blocks.")
    if len(segments) > len(drawn):
        rest = segments[len(drawn) :]
        notes.append(
            f"The map stops at {MAX_ROWS} segments: {len(rest)} more "
            f"({format_bytes(sum(s.size for s in rest))}) are not drawn."
        )
    return svg, notes


def _pieces(seg: SegmentInfo, picture: Picture, min_px: float) -> list[_Piece]:
    """The rects of one bar, free space left to the bar's own colour.

    A block at least ``min_px`` wide is a piece of its own; narrower neighbours
    gather into one run until the run is that wide or a wide block follows.  So
    every piece but a run cut short by a wide block or the bar's end is at least
    ``min_px`` wide: at most ``2 * bar / min_px + 1`` pieces, whatever the blocks.
    """
    scale = _BAR_W / seg.size
    out: list[_Piece] = []
    run: list[BlockInfo] = []

    def flush() -> None:
        if not run:
            return
        x = (run[0].addr - seg.addr) * scale
        w = (run[-1].addr + run[-1].size - run[0].addr) * scale
        if len(run) == 1:
            out.append(_block_piece(run[0], picture, x, w))
        else:
            out.append(_run_piece(run, picture, x, w))
        run.clear()

    for b in seg.blocks:
        if b.size * scale >= min_px:
            flush()
            out.append(_block_piece(b, picture, (b.addr - seg.addr) * scale, b.size * scale))
        else:
            run.append(b)
            if (b.addr + b.size - run[0].addr) * scale >= min_px:
                flush()
    flush()
    return [p for p in out if p.state != "free" and p.used > 0]


def _run_piece(run: list[BlockInfo], picture: Picture, x: float, w: float) -> _Piece:
    """Blocks too narrow to draw one by one, as one piece: its tooltip counts those in use apart from the free."""
    in_use = [b for b in run if picture.state(b) != "free"]
    free = len(run) - len(in_use)
    nbytes = sum(b.size for b in run)
    used = sum(b.size for b in in_use)
    states = ", ".join(f"{n} {s}" for s, n in Counter(picture.state(b) for b in in_use).most_common())
    tip = (f"{format_bytes(nbytes)} from {run[0].addr:#x}: {count(len(in_use), 'block')} in use "
           f"({format_bytes(used)}: {states or 'none'}), {count(free, 'block')} free ({format_bytes(nbytes - used)})")
    return _Piece(x, w, "many", tip, len(run), used / nbytes)


def _block_piece(b: BlockInfo, picture: Picture, x: float, w: float) -> _Piece:
    state = picture.state(b)
    asked = f", {format_bytes(b.requested)} asked" if b.requested else ""
    return _Piece(x, w, state, f"{b.addr:#x} {format_bytes(b.size)} {state}{asked}")

