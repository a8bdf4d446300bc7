"""The heap alone: pure placement, checked against a brute-force model."""

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cupool.core.heap import Heap

A = 512


def test_best_fit_picks_smallest_then_lowest_address():
    h = Heap(A)
    h.add_segment(0, 100 * A)
    blocks = [h.take(h.find(10 * A, None), 10 * A) for _ in range(6)]
    # free blocks of 10, 10 (non adjacent) and a 40 tail: request 8 must take the lowest 10
    h.give(blocks[3], None)
    h.give(blocks[1], None)
    b = h.find(8 * A, None)
    assert (b.addr, b.size) == (blocks[1].addr, 10 * A)
    assert h.find(41 * A, None) is None
    assert h.find(40 * A, None).size == 40 * A
    h.check()


def test_split_and_coalesce_both_sides():
    h = Heap(A)
    seg = h.add_segment(1 << 20, 30 * A)
    a, b, c = (h.take(h.find(10 * A, None), 10 * A) for _ in range(3))
    assert len(h) == 0 and h.allocated == 30 * A
    h.give(a, None)
    h.give(c, None)
    assert len(h) == 2
    merged = h.give(b, None)
    assert (merged.addr, merged.size) == (seg.addr, 30 * A)
    assert len(h) == 1 and h.free_segments() == [seg]
    h.check()


def test_streams_keep_their_free_blocks_until_reassigned():
    h = Heap(A)
    h.add_segment(0, 4 * A, stream=1)
    x = h.take(h.find(2 * A, 1), 2 * A)
    # the tail is stream 1's: stream 2 cannot see it
    assert h.find(A, 2) is None
    h.give(x, 1)
    assert h.find(A, 2) is None and h.find(4 * A, 1).size == 4 * A
    h.reassign(h.find(4 * A, 1), None)
    assert h.find(4 * A, 2).size == 4 * A
    h.check()


def test_anyones_block_merges_into_a_streams_and_the_stricter_stream_is_kept():
    h = Heap(A)
    h.add_segment(0, 4 * A, stream=None)
    x = h.take(h.find(2 * A, 7), 2 * A)
    merged = h.give(x, 7)
    assert merged.size == 4 * A and merged.stream == 7
    assert h.find(A, 8) is None
    h.check()


def test_bad_calls_are_refused():
    h = Heap(A)
    with pytest.raises(ValueError, match="aligned"):
        h.add_segment(1, A)
    seg = h.add_segment(0, 2 * A)
    with pytest.raises(ValueError, match="already exists"):
        h.add_segment(0, 2 * A)
    b = h.take(h.find(A, None), A)
    with pytest.raises(ValueError, match="still has allocated"):
        h.remove_segment(seg)
    with pytest.raises(ValueError, match="cannot take"):
        h.take(b, A)
    h.give(b, None)
    with pytest.raises(ValueError, match="already free"):
        h.give(b, None)
    h.check()
    with pytest.raises(ValueError, match="power of two"):
        Heap(3)


class HeapMachine(RuleBasedStateMachine):
    """Random segment/take/give/reassign sequences against a byte-map model."""

    def __init__(self):
        super().__init__()
        self.heap = Heap(A)
        self.next_addr = 0
        self.live = {}  # addr -> size
        self.blocks = {}  # addr -> allocated Block
        self.segs = {}

    @rule(units=st.integers(1, 64))
    def add_segment(self, units):
        seg = self.heap.add_segment(self.next_addr, units * A, stream=None)
        self.segs[seg.addr] = seg
        self.next_addr += units * A + 7 * A  # leave gaps: segments are not neighbours

    @rule(units=st.integers(1, 70), tag=st.sampled_from([None, 1, 2]))
    def take(self, units, tag):
        size = units * A
        b = self.heap.find(size, tag)
        fits = [
            (blk.size, blk.addr)
            for t in {tag, None}
            for blk in self.heap.free_blocks(t)
            if blk.size >= size
        ]
        if b is None:
            assert not fits
            return
        assert (b.size, b.addr) == min(fits), "not the best fit"
        self.heap.take(b, size)
        assert all(not (b.addr < a + s and a < b.addr + size) for a, s in self.live.items())
        self.live[b.addr] = size
        self.blocks[b.addr] = b

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tag=st.sampled_from([None, 1, 2]))
    def give(self, data, tag):
        addr = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[addr]
        self.heap.give(self.blocks.pop(addr), tag)

    @rule(tag=st.sampled_from([1, 2]))
    def settle(self, tag):
        for b in self.heap.free_blocks(tag):
            if self.heap.is_indexed(b) and b.stream == tag:
                self.heap.reassign(b, None)

    @rule()
    def drop_free_segments(self):
        for seg in self.heap.free_segments():
            self.heap.remove_segment(seg)
            del self.segs[seg.addr]

    @invariant()
    def consistent(self):
        self.heap.check()
        assert self.heap.allocated == sum(self.live.values())
        assert self.heap.reserved == sum(s.size for s in self.segs.values())
        assert self.heap.free_bytes + self.heap.allocated == self.heap.reserved


TestHeapMachine = HeapMachine.TestCase
