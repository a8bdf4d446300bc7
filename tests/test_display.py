"""A pool in Jupyter and IPython: well-formed HTML naming every segment, bounded in size, and a text summary."""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import cupool
from cupool import display
from cupool.device import SimDevice

MiB = 1 << 20
SVG = "{http://www.w3.org/2000/svg}"


def parse(pool: cupool.Pool) -> tuple[str, ET.Element]:
    """The pool's HTML and its tree: ElementTree refuses anything not well formed (unclosed or unbalanced tags,
    stray ``&`` or ``<`` in text)."""
    out = pool._repr_html_()
    return out, ET.fromstring(out)


def svg_of(root: ET.Element) -> ET.Element | None:
    return root.find(f".//{SVG}svg")


def the_svg(root: ET.Element) -> ET.Element:
    svg = svg_of(root)
    assert svg is not None, "no segment map"
    return svg


def elements(root: ET.Element) -> int:
    return len(list(root.iter()))


def labels(root: ET.Element) -> list[str]:
    svg = svg_of(root)
    return [] if svg is None else [t.text or "" for t in svg.iter(f"{SVG}text")]


def tips(root: ET.Element) -> list[str]:
    svg = svg_of(root)
    return [] if svg is None else [t.text or "" for t in svg.iter(f"{SVG}title")]


def assert_names_every_segment(pool: cupool.Pool, root: ET.Element) -> None:
    with pool.hold() as view:
        segments = view.segments()
    named = labels(root)
    assert len(named) == len(segments)
    for seg, label in zip(segments, named):
        assert label.startswith(f"{seg.addr:#x} {cupool.format_bytes(seg.size)} "), label


def test_an_empty_pool_says_it_holds_nothing():
    pool = cupool.Pool("sim", capacity="64MiB")
    out, root = parse(pool)
    assert svg_of(root) is None and "No segments" in "".join(root.itertext())
    assert "cupool.Pool sim" in out and "0 B of 64 MiB" in out
    assert all(name in out for name in display.STATES)  # the legend is there even with nothing to show


@pytest.fixture
def busy():
    """Fragmented, with every state: raw blocks, holes, a movable buffer and a leased one."""
    pool = cupool.Pool("sim", capacity="256MiB", defrag_threshold=None, initial_size="4MiB")
    raw = [pool.malloc(n) for n in (1000, 300, 64 << 10, 5 * MiB, 700 << 10, 3 * MiB, 12 * MiB)]
    for a in raw[1::2]:
        a.free()
    free_later = pool.movable(2 * MiB)
    leased = pool.movable(3 * MiB)
    view = leased.array((3 * MiB,), np.uint8)
    free_later.free()
    kept = pool.movable(1 * MiB)
    return pool, raw, leased, view, kept


def test_a_busy_fragmented_pool_names_every_segment_and_colours_blocks_by_state(busy):
    pool, raw, leased, view, kept = busy
    before = pool.stats()
    _, root = parse(pool)
    assert pool.stats() == before  # looking changes nothing
    assert_names_every_segment(pool, root)
    assert any(label.endswith(" kept") for label in labels(root))  # the preallocated segment says so
    fills = {r.get("fill") for r in the_svg(root).iter(f"{SVG}rect")}
    for state in ("allocated", "movable", "leased", "free"):
        assert display.STATES[state][0] in fills, state
    tip = {t.split(" ")[0]: t for t in tips(root)}
    assert tip[f"{leased.ptr:#x}"] == f"{leased.ptr:#x} 3 MiB leased, 3 MiB asked"
    assert tip[f"{kept.ptr:#x}"] == f"{kept.ptr:#x} 1 MiB movable, 1 MiB asked"
    assert tip[f"{raw[2].ptr:#x}"] == f"{raw[2].ptr:#x} 64 KiB allocated, 64 KiB asked"
    text = " ".join(root.itertext())
    assert f"{pool.fragmentation():.3f}" in text and "2 on the device, 1 leased" in text
    del view


def test_a_closed_pool_shows_what_it_still_holds():
    pool = cupool.Pool("sim", capacity="64MiB")
    alive = pool.malloc(3 * MiB)
    pool.malloc(2000)  # dropped at once: its small segment goes back on close
    with pytest.warns(ResourceWarning):
        pool.close()
    out, root = parse(pool)
    assert "cupool.Pool sim (closed)" in out
    assert_names_every_segment(pool, root)
    assert labels(root) and labels(root)[0].startswith(f"{alive.ptr:#x}")
    alive.free()
    out, root = parse(pool)
    assert "(closed)" in out and svg_of(root) is None


def test_very_many_blocks_are_coalesced_and_the_element_count_is_capped():
    pool = cupool.Pool("sim", capacity="256MiB", defrag_threshold=None)
    blocks = [pool.malloc(512) for _ in range(30_000)]
    for a in blocks[::3]:
        a.free()
    out, root = parse(pool)
    assert elements(the_svg(root)) <= display.MAX_ELEMENTS
    assert_names_every_segment(pool, root)
    (note,) = [p for p in root.iter("p") if "too narrow" in (p.text or "")]
    coalesced = int((note.text or "").split()[0])
    assert 20_000 <= coalesced <= 30_000  # nearly every block: each is a sixth of a pixel
    assert any(t.startswith("many") or " blocks, " in t for t in tips(root))
    assert len(out) < 1_000_000


@pytest.mark.parametrize("expandable, rows", [(False, display.MAX_ROWS), (None, 1)])
def test_the_cap_holds_when_narrow_and_wide_blocks_alternate(expandable, rows):
    """Each wide block ends a run of narrow ones: the layout that makes the most pieces per bar.

    Plain segments: 16 pairs fill each 2 MiB small segment exactly, 100 bars; at 100 bars a 120 KiB block
    is wide, an 8 KiB one narrow. Expandable ones (the default): all 3200 blocks in one stream's segment,
    one bar, where the cap must hold within the row."""
    pool = cupool.Pool("sim", capacity="512MiB", expandable_segments=expandable)
    held = [pool.malloc(n) for _ in range(display.MAX_ROWS * 16) for n in (8 << 10, 120 << 10)]
    assert 2 * len(held) > display.MAX_ELEMENTS  # a rect and a tooltip for each block would pass the cap
    _, root = parse(pool)
    assert len(labels(root)) == rows
    if rows == 1:
        assert_names_every_segment(pool, root)
    assert elements(the_svg(root)) <= display.MAX_ELEMENTS
    del held


def test_very_many_segments_stop_at_max_rows_and_say_so():
    # Plain segments: expandable ones (the default) grow one segment per stream and size class.
    pool = cupool.Pool("sim", capacity="1GiB", expandable_segments=False)
    held = [pool.malloc(MiB) for _ in range(2 * display.MAX_ROWS + 10)]  # two per 2 MiB small segment
    out, root = parse(pool)
    assert len(labels(root)) == display.MAX_ROWS
    assert elements(the_svg(root)) <= display.MAX_ELEMENTS
    assert f"The map stops at {display.MAX_ROWS} segments: 5 more (10 MiB) are not drawn." in out
    del held


class _OddlyNamed(SimDevice):
    @property
    def name(self) -> str:
        return "<script>alert('x')</script> & \"co\""


def test_everything_in_the_html_is_escaped():
    pool = cupool.Pool(_OddlyNamed("16MiB"))
    a = pool.malloc(1000)
    out, root = parse(pool)
    assert "<script>" not in out and "&lt;script&gt;" in out
    assert "<script>alert('x')</script> & \"co\"" in "".join(root.itertext())
    a.free()


def test_the_spill_tier_and_its_work_are_shown():
    pool = cupool.Pool("sim", capacity="64MiB", spill="host")
    m = pool.movable(MiB)
    assert pool.spill() == MiB and not m.on_device
    out, root = parse(pool)
    assert re.search(r"spill.*: 1 spill, 1 MiB so far", " ".join(root.itertext()))
    assert "0 on the device" in out


def test_repr_pretty_is_a_short_summary_and_honours_cycles(busy):
    pretty = pytest.importorskip("IPython.lib.pretty", reason="IPython comes with the test extra (ipykernel)")
    from IPython.core.formatters import DisplayFormatter

    pool = busy[0]
    text = pretty.pretty(pool)
    lines = text.splitlines()
    assert lines[0] == "cupool.Pool sim" and 6 <= len(lines) <= 8
    reserved = cupool.format_bytes(pool.stats()["reserved_bytes.all.current"])
    assert lines[1] == f"  reserved      {reserved} of 256 MiB (peak {reserved})"
    nested = pretty.pretty([pool])  # inside a container the summary keeps the container's indent
    assert nested.splitlines()[1].startswith("   reserved")
    printer = pretty.RepresentationPrinter(io.StringIO())
    pool._repr_pretty_(printer, cycle=True)
    printer.flush()
    assert printer.output.getvalue() == repr(pool)
    data, _ = DisplayFormatter().format(pool)  # what Jupyter asks for
    assert data["text/plain"] == text and data["text/html"].startswith('<div class="cupool-pool">')


def test_counts_in_the_map_are_singular_when_one():
    pool = cupool.Pool("sim", capacity="64MiB", expandable_segments=False)
    whole = pool.malloc(20 * MiB)  # a segment of its own, which this one block fills
    _, root = parse(pool)
    (tip,) = [t for t in tips(root) if t.startswith("segment ")]
    assert tip.endswith(": 20 MiB used in 1 block"), tip
    assert "20 MiB in 1 allocation (peak 20 MiB)" in " ".join(root.itertext())
    # One run of many narrow blocks: "1 run", not "1 runs".
    tiny = [pool.malloc(512) for _ in range(12)]
    _, root = parse(pool)
    notes = " ".join(p.text or "" for p in root.iter("p"))
    assert "drawn as 1 run of many blocks" in notes, notes
    del whole, tiny


def _large_fragmented_pool() -> tuple[cupool.Pool, list]:
    """About 800 blocks of 1-5 MiB in one expandable segment of about 2 GiB, every third freed: a third of the
    bytes free in holes a pixel or less wide (issue 36, item 15)."""
    rng = np.random.default_rng(1)
    pool = cupool.Pool("sim", capacity="4GiB", defrag_threshold=None)
    held = [pool.malloc(int(rng.integers(1, 5)) * MiB + int(rng.integers(0, 1000)) * 512) for _ in range(800)]
    for a in held[::3]:
        a.free()
    return pool, [a for i, a in enumerate(held) if i % 3]


def test_the_map_of_a_large_pool_shows_its_holes():
    """Before: every run of narrow blocks filled its bar's height, so a segment with a third of its bytes in
    holes was drawn as a solid comb.  The drawn height now holds the bytes in use: the dark area is the
    segment's used share, run by run."""
    pool, held = _large_fragmented_pool()
    with pool.hold() as view:
        (seg,) = view.segments()
    frag = pool.stats()["fragmentation"]
    assert 0.3 < frag < 0.4 and seg.size > (1 << 30)
    _, root = parse(pool)
    rects = list(the_svg(root).iter(f"{SVG}rect"))[1:]  # the first is the bar itself, drawn in the free colour
    assert len(rects) > 100
    area = sum(float(r.get("width")) * float(r.get("height")) for r in rects)
    bar_w, row_h = display._BAR_W, display._ROW_H
    # Pieces are placed to 0.1 px and sized to 0.01 px: their area matches the bytes in use to a few px.
    assert area / (bar_w * row_h) == pytest.approx(seg.used / seg.size, abs=0.01)
    assert abs(area / (bar_w * row_h) - (1 - frag)) < 0.02
    heights = {round(float(r.get("height")), 1) for r in rects}
    assert len(heights) > 10  # runs differ: where the holes are shows
    for r in rects:  # every piece stands on the bar's foot
        assert float(r.get("y")) + float(r.get("height")) == pytest.approx(row_h, abs=0.01)
    del held


def test_a_runs_tooltip_counts_the_free_blocks_apart_from_those_in_use():
    """Before: "3 blocks, 7 MiB from 0x...: 2 allocated, 1 free" counted free blocks among the run's blocks,
    and the segment's "used in 801 blocks" counted them among the used ones (issue 36, item 15)."""
    pool, held = _large_fragmented_pool()
    with pool.hold() as view:
        (seg,) = view.segments()
    _, root = parse(pool)
    runs = [t for t in tips(root) if " in use (" in t]
    assert runs
    pattern = re.compile(r"^(\S+ \S+) from 0x[0-9a-f]+: (\d+) blocks? in use \((\S+ \S+): (.+)\), "
                         r"(\d+) blocks? free \((\S+ \S+)\)$")
    in_use = free = 0
    for tip in runs:
        m = pattern.match(tip)
        assert m, tip
        named = sum(int(part.split()[0]) for part in m.group(4).split(", "))
        assert named == int(m.group(2)) and "free" not in m.group(4), tip
        in_use, free = in_use + int(m.group(2)), free + int(m.group(5))
    n_free = sum(b.free for b in seg.blocks)
    assert in_use <= len(seg.blocks) - n_free and 0 < free <= n_free
    (tip,) = [t for t in tips(root) if t.startswith("segment ")]
    assert tip.endswith(f"used in {len(seg.blocks) - n_free} blocks, "
                        f"{cupool.format_bytes(seg.size - seg.used)} free in {n_free} blocks"), tip
    del held
