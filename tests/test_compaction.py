"""Movable buffers, leases and compaction: the planner alone, then the pool."""

import itertools
import time

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

import cupool
from conftest import needs_gpu
from cupool import workloads
from cupool.core.heap import Heap
from cupool.pressure.plan import plan

A = 512
MiB = 1 << 20


# ------------------------------------------------------------- the planner
def build(layout, seg_units):
    """layout: string per segment of '.' (free unit), 'p' (pinned unit), 'm' (movable unit)."""
    h = Heap(A)
    owners = {}
    base = 0
    for seg in layout:
        segment = h.add_segment(base, seg_units * A)
        # allocate every unit, then free the '.' ones
        blocks = []
        for ch in seg:
            b = h.take(next(x for x in segment.blocks() if x.free), A)
            blocks.append((ch, b))
        for i, (ch, b) in enumerate(blocks):
            if ch == ".":
                h.give(b, None)
            else:
                b.payload = (ch, base + i * A)  # identity: where it started
                owners[b.payload] = ch
        base += seg_units * A + 64 * A
    return h, owners


def execute(moves, mem):
    for mv in moves:
        mem[mv.dst : mv.dst + mv.nbytes] = bytes(mem[mv.src : mv.src + mv.nbytes])


@pytest.mark.parametrize("layout", ["".join(p) for p in itertools.product(".pm", repeat=6)])
def test_slide_every_single_segment_layout(layout):
    """All 729 layouts of a 6-unit segment: moves are valid and the result is tight."""
    h, owners = build([layout], 6)
    mem = bytearray(6 * A)
    for (ch, start) in owners:
        mem[start : start + A] = bytes([start // A + 1]) * A
    moves, emptied = plan(h, lambda b: b.payload[0] == "m")
    h.check()
    execute(moves, mem)
    seg = next(iter(h.segments.values()))
    seen_free = False
    for b in seg.blocks():
        if b.free:
            seen_free = True
            continue
        ch, start = b.payload
        assert bytes(mem[b.addr : b.addr + A]) == bytes([start // A + 1]) * A, "bytes did not follow the block"
        if ch == "p":
            assert b.addr == start, "a pinned block moved"
            seen_free = False
        else:
            assert not seen_free, "a movable block was left after a hole"
    assert emptied == [] or layout.count("p") == 0


def test_evacuation_empties_sparse_segments_and_respects_pins():
    h, owners = build(["mm.m....", "m.......", "pm......"], 8)
    stride = 8 * A + 64 * A
    mem = bytearray(3 * stride)
    for (_, start) in owners:
        mem[start : start + A] = bytes([start // A % 251 + 1]) * A
    moves, emptied = plan(h, lambda b: b.payload[0] == "m")
    h.check()
    execute(moves, mem)
    # the sparsest all-movable segment goes first, then the other fits too; the pinned one stays
    assert [s.addr for s in emptied] == [stride, 0] and all(s.used == 0 for s in emptied)
    third = h.segments[2 * stride]
    blocks = [b for b in third.blocks() if not b.free]
    assert blocks[0].payload == ("p", 2 * stride) and len(blocks) == 6
    for b in blocks:
        start = b.payload[1]
        assert bytes(mem[b.addr : b.addr + A]) == bytes([start // A % 251 + 1]) * A


def test_budget_bounds_each_pass_and_later_passes_continue():
    h, _ = build([".m" * 8], 16)  # filling takes 4 moves: the last block into the first hole, and so on
    moves, _ = plan(h, lambda b: True, max_moves=2)
    assert len(moves) == 2
    moves2, _ = plan(h, lambda b: True, max_bytes=A)
    assert len(moves2) == 1
    moves3, _ = plan(h, lambda b: True)
    assert len(moves3) == 1
    assert plan(h, lambda b: True)[0] == []
    h.check()


def test_filling_moves_half_the_buffers_in_one_batch_where_sliding_moved_all_in_a_chain():
    """Every other buffer of 64 freed (issue 34's compaction check): the last buffers fill the first holes,
    32 units in 32 moves of which none reads what another writes, and the buffers that did not move stay."""
    h, owners = build([".m" * 64], 128)
    moves, _ = plan(h, lambda b: True)
    h.check()
    assert len(moves) == 32 and sum(m.nbytes for m in moves) == 32 * A  # sliding: 64 moves, each waiting on one
    written = set()
    for m in moves:
        assert m.dst + m.nbytes <= m.src  # each to a hole below it
        assert not any(m.src <= w < m.src + m.nbytes for w in written)  # reads nothing an earlier move wrote
        written.update(range(m.dst, m.dst + m.nbytes))
    seg = next(iter(h.segments.values()))
    assert [b.free for b in seg.blocks()] == [False] * 64 + [True]  # tight: one free run at the end


# ---------------------------------------------------------------- the pool
def fill(m, value):
    m.array()[:] = value


def test_movable_basics_and_leases_pin(pool):
    m = pool.movable(3 * MiB)
    assert m.on_device and m.nbytes == 3 * MiB and m.generation == 0 and not m.leased
    x = m.array((3 * MiB // 4,), np.float32)
    assert m.leased and x.ctypes.data == m.ptr
    with pytest.raises(ValueError, match="needs"):
        m.array((3 * MiB,), np.float32)
    with pytest.raises(TypeError, match="objects"):
        m.array(4, object)
    del x
    assert not m.leased


def test_compaction_moves_only_unleased_movables_and_keeps_bytes():
    # Plain segments, one per buffer, each given back whole once emptied (an expandable region
    # returns only its free tail, and raw, pinned at its end, keeps the whole region mapped).
    p = cupool.Pool("sim", capacity="256MiB", defrag_threshold=None, expandable_segments=False)
    bufs = [p.movable(2 * MiB) for _ in range(8)]
    raw = p.malloc(2 * MiB)
    for i, m in enumerate(bufs):
        fill(m, i + 1)
    p.device.bytes_at(raw.ptr, 2 * MiB)[:] = 99
    for m in bufs[:6:2]:
        m.free()
    pinned = bufs[5]
    view = pinned.array()
    seen = []
    bufs[7].on_move = lambda mv, old, new: seen.append((mv, old, new))
    ptrs = {id(m): m.ptr for m in bufs}
    raw_ptr, pinned_ptr = raw.ptr, pinned.ptr
    report = p.compact()
    assert report.moves > 0 and report.bytes_moved >= 2 * MiB
    # the freed buffers' segments went back and survivors were packed into holes
    assert report.reserved_after < report.reserved_before and report.segments_released > 0
    assert report.fragmentation_after < report.fragmentation_before
    assert pinned.ptr == pinned_ptr and raw.ptr == raw_ptr
    for i, m in enumerate(bufs):
        if not m.freed:
            assert (m.array() == i + 1).all(), f"buffer {i} lost its bytes"
            if m.ptr != ptrs[id(m)]:
                assert m.generation >= 1
    assert (p.device.bytes_at(raw.ptr, 2 * MiB) == 99).all()
    if bufs[7].generation:
        assert seen and seen[-1][0] is bufs[7] and seen[-1][2] == bufs[7].ptr
    del view
    p.check()


def test_compaction_gives_emptied_segments_back():
    # Plain segments: the counts and the segment given back whole are theirs.
    p = cupool.Pool("sim", capacity="256MiB", defrag_threshold=None, expandable_segments=False)
    big = [p.movable(18 * MiB) for _ in range(2)]
    del big  # two cached 18 MiB segments (movables grow by exactly what they need)
    bufs = [p.movable(3 * MiB) for _ in range(12)]  # six in each
    assert p.stats()["segment.all.current"] == 2
    for i, m in enumerate(bufs):
        fill(m, i + 1)
    for m in bufs[0:6:2] + bufs[6:11]:
        m.free()  # the first segment keeps three, the second only one
    r = p.compact()
    assert r.segments_released == 1 and r.bytes_released == 18 * MiB
    assert r.reserved_after == r.reserved_before - 18 * MiB
    assert r.fragmentation_after < r.fragmentation_before
    for i, m in enumerate(bufs):
        if not m.freed:
            assert (m.array() == i + 1).all()
    p.check()


def test_free_with_live_arrays_waits_for_the_last_one(pool):
    m = pool.movable(4096)
    x = m.array()
    x[:] = 5
    m.free()
    assert m.freed and pool.stats()["allocation.all.current"] == 1
    with pytest.raises(ValueError, match="freed"):
        m.array()
    with pytest.raises(cupool.DoubleFreeError):
        m.free()
    assert (x == 5).all()
    del x
    assert pool.stats()["allocation.all.current"] == 0


def test_dropping_a_movable_frees_it(pool):
    m = pool.movable(4096)
    del m
    assert pool.stats()["allocation.all.current"] == 0


def test_bad_input_for_movables_and_compact(pool):
    with pytest.raises(ValueError, match="nbytes"):
        pool.movable(-1)
    with pytest.raises(TypeError, match="on_move"):
        pool.movable(10, on_move=3)
    with pytest.raises(ValueError, match="max_moves"):
        pool.compact(max_moves=-2)
    with pytest.raises(ValueError, match="max_bytes"):
        pool.compact(max_bytes="lots")
    other = cupool.Pool("sim", capacity="8MiB")
    with pytest.raises(cupool.ForeignAllocationError):
        pool.free(other.malloc(10))
    with pytest.raises(TypeError, match="Allocation"):
        pool.free(other.movable(10))  # a movable buffer is freed by its own .free()
    with pytest.raises(ValueError, match="defrag_threshold"):
        cupool.Pool("sim", capacity="8MiB", defrag_threshold=1.5)


def test_oom_ladder_compacts_before_failing():
    """Live bytes fit, contiguous space does not: compaction makes room.

    On plain segments: stitching (the default's) would serve the 8 MiB from the holes'
    granules first, with no compaction (tests/test_expandable.py).
    """
    p = cupool.Pool("sim", capacity="24MiB", defrag_threshold=None, expandable_segments=False)
    p.movable(20 * MiB)  # dropped at once: leaves one cached 20 MiB segment
    bufs = [p.movable(2 * MiB) for _ in range(10)]  # which these fill
    assert p.stats()["segment.all.current"] == 1
    for i, m in enumerate(bufs):
        fill(m, i)
    for m in bufs[::2]:
        m.free()  # 10 MiB free in five 2 MiB holes; 4 MiB left on the device
    big = p.malloc(8 * MiB)  # needs a contiguous 8 MiB
    assert big.nbytes == 8 * MiB
    s = p.stats()
    assert s["num_compactions"] >= 1 and s["num_ooms"] == 0
    for i, m in enumerate(bufs[1::2]):
        assert (m.array() == 2 * i + 1).all()


def test_streaming_completes_on_a_device_5_percent_above_the_live_peak():
    shapes = workloads.mixed_shapes(80, seed=3)
    peak = workloads.peak_live_bytes(shapes)
    cap = int(peak * 1.05)
    p = cupool.Pool("sim", capacity=cap, expandable_segments=False)
    workloads.weight_streaming(p, shapes, fill=True, movable=True)
    assert p.stats()["num_ooms"] == 0
    # Without movables, plain segments that split their cache fragment past the device: compaction
    # is what made room.  Releasing before the split makes room too (Note [Release before split]).
    q = cupool.Pool("sim", capacity=cap, expandable_segments=False, release_before_split=False)
    with pytest.raises(cupool.OutOfMemoryError):
        workloads.weight_streaming(q, shapes, fill=True, movable=False)
    q = cupool.Pool("sim", capacity=cap, expandable_segments=False)
    workloads.weight_streaming(q, shapes, fill=True, movable=False)
    assert q.stats()["num_ooms"] == 0 and q.stats()["num_releases_before_split"] > 0
    # The default (expandable segments with stitching) completes too, movable or not: stitching
    # joins the holes' granules instead of moving bytes.
    for movable in (True, False):
        r = cupool.Pool("sim", capacity=cap)
        workloads.weight_streaming(r, shapes, fill=True, movable=movable)
        assert r.stats()["num_ooms"] == 0
        r.check()


def test_automatic_compaction_above_the_threshold():
    p = cupool.Pool("sim", capacity="256MiB", defrag_threshold=0.3)
    bufs = [p.movable(12 * MiB) for _ in range(4)]
    for m in bufs[:3]:
        m.free()
    assert p.stats()["fragmentation"] > 0.3
    p.movable(1024)  # an allocation while fragmentation is high compacts first
    s = p.stats()
    assert s["num_compactions"] == 1 and s["fragmentation"] < 0.3


def test_background_compaction_thread():
    p = cupool.Pool("sim", capacity="256MiB", defrag_threshold=0.2)
    bufs = [p.movable(3 * MiB) for _ in range(6)]
    for m in bufs[::2]:
        m.free()
    p.start_background_compaction(interval=0.01)
    with pytest.raises(RuntimeError, match="already running"):
        p.start_background_compaction()
    deadline = time.time() + 20
    while p.stats()["num_compactions"] == 0 and time.time() < deadline:
        time.sleep(0.01)
    p.stop_background_compaction()
    assert p.stats()["num_compactions"] >= 1
    with pytest.raises(RuntimeError, match="not running"):
        p.stop_background_compaction()


class CompactionMachine(RuleBasedStateMachine):
    """Movables, leases, raw blocks and compactions: bytes never change, pins never move."""

    bufs = Bundle("bufs")

    def __init__(self):
        super().__init__()
        self.pool = cupool.Pool("sim", capacity="64MiB", defrag_threshold=None)
        self.model = {}  # id -> (Movable, value)
        self.views = {}  # id -> (array, ptr at lease time)
        self.raw = []  # (Allocation, value, ptr)
        self.v = 0

    def _next(self):
        self.v = self.v % 250 + 1
        return self.v

    @rule(target=bufs, n=st.sampled_from([512, 4096, 100_000, MiB, 3 * MiB, 11 * MiB]))
    def movable(self, n):
        try:
            m = self.pool.movable(n)
        except cupool.OutOfMemoryError:
            return None
        v = self._next()
        fill(m, v)
        self.model[id(m)] = (m, v)
        return m

    @rule(n=st.sampled_from([512, 70_000, 2 * MiB]))
    def raw_malloc(self, n):
        try:
            a = self.pool.malloc(n)
        except cupool.OutOfMemoryError:
            return
        v = self._next()
        self.pool.device.bytes_at(a.ptr, n)[:] = v
        self.raw.append((a, v, a.ptr))

    @precondition(lambda self: self.raw)
    @rule(data=st.data())
    def raw_free(self, data):
        a, _, _ = self.raw.pop(data.draw(st.integers(0, len(self.raw) - 1)))
        a.free()

    @rule(m=bufs)
    def lease(self, m):
        if m is None or m.freed or id(m) in self.views:
            return
        self.views[id(m)] = (m.array(), m.ptr)

    @rule(m=bufs)
    def unlease(self, m):
        if m is not None:
            self.views.pop(id(m), None)

    @rule(m=consumes(bufs))
    def free(self, m):
        if m is None:
            return
        self.model.pop(id(m))
        m.free()
        self.views.pop(id(m), None)

    @rule(budget=st.one_of(st.none(), st.integers(1, 8)))
    def compact(self, budget):
        r = self.pool.compact(max_moves=budget)
        if budget is not None:
            assert r.moves <= budget
        assert r.fragmentation_after <= r.fragmentation_before + 1e-12 or r.bytes_released == 0

    @invariant()
    def consistent(self):
        self.pool.check()

    @invariant()
    def bytes_unchanged_and_pins_hold(self):
        for key, (m, v) in self.model.items():
            if key in self.views:
                arr, ptr = self.views[key]
                assert m.ptr == ptr, "a leased buffer moved"
                assert (arr == v).all()
            else:
                assert (self.pool.device.bytes_at(m.ptr, m.nbytes) == v).all(), "a buffer's bytes changed"
        for a, v, ptr in self.raw:
            assert a.ptr == ptr
            assert (self.pool.device.bytes_at(a.ptr, a.size) == v).all()

    @invariant()
    def no_overlap(self):
        spans = sorted([(m.ptr, m.block.size) for m, _ in self.model.values()] + [(a.ptr, a.nbytes) for a, _, _ in self.raw])
        for (p0, n0), (p1, _) in zip(spans, spans[1:]):
            assert p0 + n0 <= p1

    @invariant()
    def accounting(self):
        s = self.pool.stats()
        assert s["allocation.all.current"] == len(self.model) + len(self.raw)
        assert s["movable.all.current"] == len(self.model)


TestCompactionMachine = CompactionMachine.TestCase


@needs_gpu
def test_compaction_on_the_gpu_keeps_bytes_and_pins():
    import cupy

    p = cupool.Pool("cuda", max_size="512MiB", defrag_threshold=None)
    p.movable(64 * MiB)  # dropped at once: one cached segment the buffers then share
    bufs = [p.movable(4 * MiB) for _ in range(16)]
    for i, m in enumerate(bufs):
        m.array((MiB,), cupy.float32)[...] = i
    for m in bufs[::2]:
        m.free()
    pinned = bufs[5].array((MiB,), cupy.float32)
    pinned_ptr = bufs[5].ptr
    r = p.compact()
    assert r.moves > 0 and bufs[5].ptr == pinned_ptr
    for i, m in enumerate(bufs):
        if not m.freed:
            assert bool((m.array((MiB,), cupy.float32) == i).all()), f"buffer {i} lost its bytes"
    assert bool((pinned == 5).all())
    p.check()
