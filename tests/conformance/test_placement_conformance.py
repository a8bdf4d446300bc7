"""One behaviour suite for every placement algorithm, in the manner of RMM's ``mr_ref_test``.

The arena and the compaction planner rely on the placement contract written in
``cupool.core.heap.Heap``'s docstring, not on best fit as such, so a new
algorithm (first fit, a buddy allocator, size-segregated lists) must pass the
same suite before it may replace the heap.  The suite therefore speaks only the
contract: ``add_segment`` / ``remove_segment``, ``find``, ``take``, ``give``,
``reassign``, ``free_blocks``, ``streams``, ``largest_free``, ``reserved``,
``allocated``, ``n_allocated``, ``segments`` and ``check()``; never an index or
any other private structure.

A state machine drives random sequences of those calls and holds the placement
to a reference model that knows only what the contract lets a caller know:
which byte ranges are allocated, and, for every free byte, the stream it
was freed under (and when).  Which free blocks exist is the algorithm's
business, so the model does not predict them; it checks the ones the placement
reports: they tile the free bytes exactly, never hand a stream's bytes to
another stream, and are coalesced.  ``find`` is then checked against those
blocks.  Algorithm-specific promises (best fit's choice of block) are a check
function in the algorithm's factory entry.

Addresses and sizes are in units of the alignment so that hypothesis shrinks
failures to a handful of small integers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cupool.core.heap import Heap

#: The alignment every placement is built with in this suite (the pool's own).
ALIGN = 512
#: Segments live in fixed slots of this many units, so that they never overlap;
#: a segment may fill its slot, which puts it right against the next one and
#: tests that blocks never merge across segments.
SLOT_UNITS = 12
SLOTS = 4
#: Segment and request sizes in units; a whole slot often, so that segments touch.
UNITS = st.integers(1, SLOT_UNITS) | st.just(SLOT_UNITS)
#: Streams: None (anyone's), and two streams.
STREAMS: tuple[Hashable | None, ...] = (None, 1, 2)

#: A check of an algorithm's own promise about which block ``find`` picks:
#: ``(found, usable, size)``, where ``usable`` are the reported free blocks the stream
#: may use that are large enough.  Raises AssertionError when the choice is wrong.
FitCheck = Callable[[Any, Sequence[Any], int], None]


#: The bad calls the contract refuses with ValueError, leaving the placement as it was.
BAD_INPUT = (
    "take more than the block has",
    "take a misaligned size",
    "take an allocated block",
    "give a free block",
    "give a block twice",
    "remove a segment in use",
    "add a segment twice",
    "add a misaligned or empty segment",
)


def _slot_addr(slot: int) -> int:
    """A segment slot's address; never 0, which must not be special to a placement."""
    return (1 + slot * SLOT_UNITS) * ALIGN


def best_fit(found: Any, usable: Sequence[Any], size: int) -> None:
    """Best fit: the smallest usable block that is large enough, the lowest address among equals.

    The pool wants this because it leaves the large free blocks whole for the
    large requests to come, which keeps fragmentation down and makes growth rare.
    """
    smallest = min(b.size for b in usable)
    assert found.size == smallest, f"best fit took {found!r} for {size} bytes while a {smallest}-byte block fits"
    lowest = min(b.addr for b in usable if b.size == smallest)
    assert found.addr == lowest, f"best fit took {found!r}, not the lowest-addressed of equal blocks ({lowest:#x})"


@dataclass(frozen=True)
class Placement:
    """One algorithm under test: how to make it, and its own promise about ``find``."""

    name: str
    make: Callable[[int], Any]  # alignment -> a placement
    fit: FitCheck | None = None
    #: Whether it keeps epochs (when the bytes of a stream's block were freed): the replay engine's sim
    #: streams finish at once, so it never asks, and has none.
    epochs: bool = True


def _engine_heap(alignment: int) -> Any:
    from .engine_placement import EngineHeap  # compiles the engine on first use (cached after)

    return EngineHeap(alignment)


#: Every placement algorithm cupool has; each one runs the whole suite.  The numba replay engine's
#: heap is the pool's twin in arrays: both ask the rule book (``cupool.core.rules``), and this suite
#: holds both to one contract.
PLACEMENTS = [Placement("best-fit-heap", Heap, best_fit), Placement("replay-engine", _engine_heap, best_fit, False)]


@pytest.fixture(params=PLACEMENTS, ids=lambda p: p.name)
def placement(request: pytest.FixtureRequest) -> Placement:
    return request.param


def _usable(block_stream: Hashable | None, stream: Hashable | None) -> bool:
    """Whether a request for ``stream`` may take a free block of ``block_stream`` (the contract)."""
    return block_stream is None or block_stream == stream


def _mergeable(a: Hashable | None, b: Hashable | None) -> bool:
    """Two adjacent free blocks of these streams must have been coalesced (the contract's rule)."""
    return a is None or b is None or a == b


def reported_free_blocks(heap: Any) -> list[Any]:
    """Every free block the placement reports, in address order, through ``streams`` and ``free_blocks``."""
    blocks = [b for t in heap.streams() for b in heap.free_blocks(t)]
    blocks.sort(key=lambda b: b.addr)
    return blocks


def visible_state(heap: Any) -> tuple:
    """Everything a caller can see of a placement, for "a refused call changes nothing"."""
    return (
        heap.reserved,
        heap.allocated,
        heap.n_allocated,
        heap.largest_free(),
        sorted((s.addr, s.size, s.used) for s in heap.segments.values()),
        sorted(map(repr, heap.streams())),
        [(b.addr, b.size, b.free, b.stream, b.epoch) for b in reported_free_blocks(heap)],
    )


class PlacementMachine(RuleBasedStateMachine):
    """Random calls against the placement contract, checked against a byte-range model.

    The model: ``segments`` (slot -> (addr, units, handle)), ``allocated`` (addr ->
    (units, block handle)) and ``free_units`` (unit address -> (stream, epoch)), the
    stream and epoch of the ``give`` or ``reassign`` that last freed each free unit.
    """

    def __init__(self, placement: Placement) -> None:
        super().__init__()
        self.placement = placement
        self.heap = placement.make(ALIGN)
        self.segments: dict[int, tuple[int, int, Any]] = {}
        self.allocated: dict[int, tuple[int, Any]] = {}
        self.free_units: dict[int, tuple[Hashable | None, int]] = {}
        self.given: list[Any] = []  # handles given back: giving one again is bad input while it is free

    # ----------------------------------------------------------------- helpers
    def _segment_of(self, addr: int, nbytes: int) -> int | None:
        """The slot of the model segment wholly holding ``[addr, addr + nbytes)``, if any."""
        for slot, (base, units, _) in self.segments.items():
            if base <= addr and addr + nbytes <= base + units * ALIGN:
                return slot
        return None

    def _in_use(self, slot: int) -> bool:
        addr, units, _ = self.segments[slot]
        return any(addr <= a < addr + units * ALIGN for a in self.allocated)

    def _free_blocks(self) -> list[Any]:
        return reported_free_blocks(self.heap)

    def _refused(self, call: Callable[[], Any]) -> None:
        """``call`` is bad input: it must raise ValueError and leave everything as it was."""
        before = visible_state(self.heap)
        with pytest.raises(ValueError):
            call()
        assert visible_state(self.heap) == before, "a refused call changed the placement"
        self.heap.check()

    # ------------------------------------------------------------------- rules
    @initialize(first=UNITS, second=UNITS, streams=st.tuples(st.sampled_from(STREAMS), st.sampled_from(STREAMS)))
    def two_segments(self, first: int, second: int, streams: tuple[Hashable | None, Hashable | None]) -> None:
        """Start from two segments side by side (when the first fills its slot), as a pool soon has."""
        self._add(0, first, streams[0])
        self._add(1, second, streams[1])

    @precondition(lambda self: len(self.segments) < SLOTS)
    @rule(i=st.integers(0, SLOTS), units=UNITS, stream=st.sampled_from(STREAMS))
    def add_segment(self, i: int, units: int, stream: Hashable | None) -> None:
        empty = [slot for slot in range(SLOTS) if slot not in self.segments]
        self._add(empty[i % len(empty)], units, stream)

    def _add(self, slot: int, units: int, stream: Hashable | None) -> None:
        addr = _slot_addr(slot)
        seg = self.heap.add_segment(addr, units * ALIGN, stream)
        assert (seg.addr, seg.size, seg.used) == (addr, units * ALIGN, 0)
        self.segments[slot] = (addr, units, seg)
        for u in range(units):
            self.free_units[addr + u * ALIGN] = (stream, 0)

    @precondition(lambda self: any(not self._in_use(slot) for slot in self.segments))
    @rule(i=st.integers(0, 10**6))
    def remove_segment(self, i: int) -> None:
        unused = [slot for slot in sorted(self.segments) if not self._in_use(slot)]
        slot = unused[i % len(unused)]
        addr, units, seg = self.segments.pop(slot)
        self.heap.remove_segment(seg)
        for u in range(units):
            del self.free_units[addr + u * ALIGN]

    @rule(units=UNITS, stream=st.sampled_from(STREAMS), frac=st.integers(1, 4))
    def find_and_take(self, units: int, stream: Hashable | None, frac: int) -> None:
        """The arena's way: ``find`` a block for the request, then ``take`` part or all of it."""
        block = self.heap.find(units * ALIGN, stream)
        if block is None:
            return  # whether None was right is the invariants' business
        self._take(block, max(units, block.size // ALIGN // frac) * ALIGN)

    @precondition(lambda self: self.free_units)
    @rule(i=st.integers(0, 10**6), units=UNITS)
    def take_any(self, i: int, units: int) -> None:
        """``take`` does not care about streams (the arena checks them through ``find``): any free block will do."""
        blocks = self._free_blocks()
        block = blocks[i % len(blocks)]
        self._take(block, min(units * ALIGN, block.size))

    def _take(self, block: Any, nbytes: int) -> None:
        addr = block.addr
        tail = block.size - nbytes
        got = self.heap.take(block, nbytes)
        # The contract: the first nbytes of the block are allocated, the rest stays free.
        assert (got.addr, got.size, got.free) == (addr, nbytes, False), got
        assert self._segment_of(addr, nbytes) is not None, f"{got!r} lies outside every segment"
        for a, (n, _) in self.allocated.items():
            assert addr + nbytes <= a or a + n * ALIGN <= addr, f"{got!r} overlaps the allocation at {a:#x}"
        for u in range(nbytes // ALIGN):
            assert self.free_units.pop(addr + u * ALIGN, None) is not None, f"{got!r} took bytes that were not free"
        self.allocated[addr] = (nbytes // ALIGN, got)
        if tail:
            rest = [b for b in self._free_blocks() if b.addr == addr + nbytes]
            assert rest and rest[0].size >= tail, "the rest of a taken block must stay free"

    @precondition(lambda self: self.allocated)
    @rule(i=st.integers(0, 10**6), stream=st.sampled_from(STREAMS), epoch=st.integers(0, 3))
    def give(self, i: int, stream: Hashable | None, epoch: int) -> None:
        addr = sorted(self.allocated)[i % len(self.allocated)]
        units, block = self.allocated.pop(addr)
        merged = self.heap.give(block, stream, epoch)
        for u in range(units):
            self.free_units[addr + u * ALIGN] = (stream, epoch if stream is not None else 0)
        self.given.append(block)
        assert merged.free and merged.addr <= addr and addr + units * ALIGN <= merged.addr + merged.size, (
            f"give returned {merged!r}, which does not hold the freed bytes at {addr:#x}"
        )
        assert any(b is merged for b in self.heap.free_blocks(merged.stream)), "give returned an unreported block"

    @precondition(lambda self: self.free_units)
    @rule(i=st.integers(0, 10**6), stream=st.sampled_from(STREAMS))
    def reassign(self, i: int, stream: Hashable | None) -> None:
        """What the arena does once a stream is done with its frees (to None), or a move to another stream."""
        blocks = self._free_blocks()
        block = blocks[i % len(blocks)]
        addr, size = block.addr, block.size
        merged = self.heap.reassign(block, stream)
        for u in range(size // ALIGN):
            _, epoch = self.free_units[addr + u * ALIGN]
            self.free_units[addr + u * ALIGN] = (stream, epoch if stream is not None else 0)
        assert merged.free and merged.addr <= addr and addr + size <= merged.addr + merged.size

    @rule(kind=st.sampled_from(BAD_INPUT), i=st.integers(0, 10**6), units=UNITS)
    def bad_input(self, kind: str, i: int, units: int) -> None:
        """Each kind of bad call must raise ValueError and change nothing (when the state allows it)."""
        heap = self.heap
        free = self._free_blocks()
        used = [block for _, block in self.allocated.values()]
        if kind == "take more than the block has" and free:
            block = free[i % len(free)]
            self._refused(lambda: heap.take(block, block.size + units * ALIGN))
        elif kind == "take a misaligned size" and free:
            self._refused(lambda: heap.take(free[i % len(free)], ALIGN // 2))
        elif kind == "take an allocated block" and used:
            self._refused(lambda: heap.take(used[i % len(used)], ALIGN))
        elif kind == "give a free block" and free:
            self._refused(lambda: heap.give(free[i % len(free)], None))
        elif kind == "give a block twice":
            # A handle given back already: merged away, or still a free block of its own.
            # (One taken again since is a live allocation, not bad input.)
            twice = [block for block in self.given if block.free]
            if twice:
                self._refused(lambda: heap.give(twice[i % len(twice)], None))
        elif kind == "remove a segment in use":
            busy = [slot for slot in sorted(self.segments) if self._in_use(slot)]
            if busy:
                self._refused(lambda: heap.remove_segment(self.segments[busy[i % len(busy)]][2]))
        elif kind == "add a segment twice" and self.segments:
            slot = sorted(self.segments)[i % len(self.segments)]
            self._refused(lambda: heap.add_segment(_slot_addr(slot), units * ALIGN))
        elif kind == "add a misaligned or empty segment" and len(self.segments) < SLOTS:
            addr = _slot_addr(next(slot for slot in range(SLOTS) if slot not in self.segments))
            self._refused(lambda: heap.add_segment(addr + ALIGN // 2, units * ALIGN))
            self._refused(lambda: heap.add_segment(addr, units * ALIGN - 1))
            self._refused(lambda: heap.add_segment(addr, 0))

    # -------------------------------------------------------------- invariants
    @invariant()
    def self_check_passes(self) -> None:
        self.heap.check()

    @invariant()
    def figures_match_the_model(self) -> None:
        heap = self.heap
        assert heap.reserved == sum(units * ALIGN for _, units, _ in self.segments.values())
        assert heap.allocated == sum(units * ALIGN for units, _ in self.allocated.values())
        assert heap.n_allocated == len(self.allocated)
        assert sorted(heap.segments) == sorted(addr for addr, _, _ in self.segments.values())
        for addr, units, _ in self.segments.values():
            used = sum(n for a, (n, _) in self.allocated.items() if addr <= a < addr + units * ALIGN)
            assert heap.segments[addr].used == used * ALIGN
        for a, (n, block) in self.allocated.items():
            assert (block.addr, block.size, block.free) == (a, n * ALIGN, False), "an allocated block changed"

    @invariant()
    def allocations_are_disjoint_and_inside_segments(self) -> None:
        spans = sorted((a, a + n * ALIGN) for a, (n, _) in self.allocated.items())
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, "two allocations overlap"
        for a, n in ((a, n) for a, (n, _) in self.allocated.items()):
            assert self._segment_of(a, n * ALIGN) is not None, f"allocation at {a:#x} outside every segment"

    @invariant()
    def free_blocks_tile_the_free_bytes(self) -> None:
        """The reported free blocks cover exactly the bytes the model says are free, each once."""
        covered: set[int] = set()
        for b in self._free_blocks():
            assert b.free and b.size > 0 and b.addr % ALIGN == 0 and b.size % ALIGN == 0, b
            assert self._segment_of(b.addr, b.size) is not None, f"{b!r} crosses or leaves its segment"
            units = {b.addr + u * ALIGN for u in range(b.size // ALIGN)}
            assert not units & covered, f"{b!r} overlaps another free block"
            covered |= units
        assert covered == set(self.free_units), "the free blocks do not cover exactly the free bytes"

    @invariant()
    def no_stream_gets_bytes_it_may_not_use(self) -> None:
        """A free block of stream T holds only bytes freed on T or anyone's, and says when they were freed.

        This is what makes reuse across streams safe: a request for T may take any
        block of T or anyone's, so bytes freed on another stream must never sit
        in one (a merge keeps the stricter stream).  And a stream's block's epoch must be
        no earlier than any of its bytes' frees, or the arena would release it to all
        streams before the stream that freed those bytes is done with them.
        """
        for b in self._free_blocks():
            for u in range(b.size // ALIGN):
                stream, epoch = self.free_units[b.addr + u * ALIGN]
                assert stream is None or stream == b.stream, f"{b!r} holds bytes freed on stream {stream!r}"
                if b.stream is not None and self.placement.epochs:
                    assert b.epoch >= epoch, f"{b!r} has epoch {b.epoch}, but a byte was freed at epoch {epoch}"

    @invariant()
    def free_blocks_are_coalesced(self) -> None:
        """No two adjacent free blocks of one segment could have merged (give and reassign coalesce)."""
        blocks = self._free_blocks()
        for a, b in zip(blocks, blocks[1:]):
            if a.addr + a.size == b.addr and self._segment_of(a.addr, b.addr + b.size - a.addr) is not None:
                assert not _mergeable(a.stream, b.stream), f"{a!r} and {b!r} were left unmerged"

    @invariant()
    def runs_of_a_streams_bytes_are_found(self) -> None:
        """Bytes freed on stream T in one contiguous run are one block, which ``find`` for T must see."""
        runs: list[list[Any]] = []  # [stream, end address, units] of maximal runs of one stream's free bytes
        for addr in sorted(self.free_units):
            stream, _ = self.free_units[addr]
            if stream is None:
                continue
            last = runs[-1] if runs else None
            if last and last[0] == stream and last[1] == addr and self._segment_of(addr - ALIGN, 2 * ALIGN) is not None:
                last[1] += ALIGN
                last[2] += 1
            else:
                runs.append([stream, addr + ALIGN, 1])
        for stream, _, units in runs:
            assert self.heap.find(units * ALIGN, stream) is not None, f"{units} units freed on {stream!r} not found"

    @invariant()
    def find_honours_the_contract(self) -> None:
        """``find`` returns a reported free block usable by the stream and large enough, or None only if none is."""
        blocks = self._free_blocks()
        sizes = sorted({b.size for b in blocks} | {b.size + ALIGN for b in blocks} | {ALIGN})
        for stream in STREAMS:
            for size in sizes:
                usable = [b for b in blocks if _usable(b.stream, stream) and b.size >= size]
                found = self.heap.find(size, stream)
                if found is None:
                    assert not usable, f"find({size}, {stream!r}) found nothing, but {usable[0]!r} fits"
                    continue
                assert any(b is found for b in blocks), f"find returned {found!r}, which is not a free block"
                assert found.free and found.size >= size and _usable(found.stream, stream), (
                    f"find({size}, {stream!r}) returned {found!r}"
                )
                if self.placement.fit is not None:
                    self.placement.fit(found, usable, size)

    @invariant()
    def largest_free_is_the_largest_free_block(self) -> None:
        blocks = self._free_blocks()
        assert self.heap.largest_free() == max((b.size for b in blocks), default=0)


@pytest.mark.parametrize("placement_", PLACEMENTS, ids=lambda p: p.name)
def test_random_sequences_keep_the_contract(placement_: Placement) -> None:
    """Under the active hypothesis profile (``ci`` unless HYPOTHESIS_PROFILE says otherwise)."""
    run_state_machine_as_test(lambda: PlacementMachine(placement_))


# ----------------------------------------------------------- fixed examples
# The machine reaches these too; written out, each promise also reads as a sentence
# and fails with a short story when broken.


def test_a_refused_take_give_or_remove_changes_nothing(placement: Placement) -> None:
    heap = placement.make(ALIGN)
    seg = heap.add_segment(ALIGN, 8 * ALIGN)
    block = heap.find(2 * ALIGN, None)
    assert block is not None
    used = heap.take(block, 2 * ALIGN)
    before = visible_state(heap)
    (rest,) = reported_free_blocks(heap)
    for bad in (
        lambda: heap.take(rest, rest.size + ALIGN),  # more than the block has
        lambda: heap.take(used, ALIGN),  # an allocated block
        lambda: heap.take(rest, ALIGN // 2),  # not a multiple of the alignment
        lambda: heap.give(rest, None),  # a free block
        lambda: heap.remove_segment(seg),  # a segment in use
        lambda: heap.add_segment(ALIGN, 4 * ALIGN),  # an address already there
    ):
        with pytest.raises(ValueError):
            bad()
        assert visible_state(heap) == before
        heap.check()


def test_freed_neighbours_coalesce_within_a_segment_but_never_across(placement: Placement) -> None:
    heap = placement.make(ALIGN)
    left = heap.add_segment(ALIGN, 4 * ALIGN)
    heap.add_segment(5 * ALIGN, 4 * ALIGN)  # right against the first
    blocks = [heap.take(heap.find(2 * ALIGN, None), 2 * ALIGN) for _ in range(4)]
    for b in blocks:
        heap.give(b, None)
    assert [(b.addr, b.size) for b in reported_free_blocks(heap)] == [(ALIGN, 4 * ALIGN), (5 * ALIGN, 4 * ALIGN)]
    assert heap.largest_free() == 4 * ALIGN
    heap.remove_segment(left)
    assert heap.reserved == 4 * ALIGN
    heap.check()


def test_a_streams_free_bytes_stay_its_own_until_reassigned(placement: Placement) -> None:
    heap = placement.make(ALIGN)
    heap.add_segment(ALIGN, 4 * ALIGN)
    a = heap.take(heap.find(2 * ALIGN, None), 2 * ALIGN)
    heap.give(a, 7, epoch=3)  # merges with anyone's rest: the whole segment is stream 7's
    assert heap.find(ALIGN, None) is None and heap.find(ALIGN, 8) is None
    (block,) = reported_free_blocks(heap)
    assert heap.find(4 * ALIGN, 7) is block and block.stream == 7 and (block.epoch >= 3 or not placement.epochs)
    heap.reassign(block, None)
    assert heap.find(4 * ALIGN, 8) is not None
    heap.check()
