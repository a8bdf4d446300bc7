"""Expandable segments and stitching: segments made of 2 MiB granules mapped into virtual ranges.

PyTorch's expandable segments, over ``cupool.device.vmm.VirtualMemory``: each
stream and size class gets one *region*, a virtual range a few times the pool's
limit long (addresses cost little), whose mapped prefix is a heap segment that grows at its end when nothing
fits (``grow``: granules mapped there, the last block extended) and shrinks
from its end when its tail is free (``trim``: granules unmapped and released).
On the sim device every granule is its own physical chunk, because the driver
maps only whole chunks from their start (Note [Virtual memory], below): that is
what lets granules be placed independently; on a GPU each grow is one chunk.

*Stitching* (``stitch``) serves a large request no free range fits from the
granules under free blocks in the middle of segments, remapped side by side into
a fresh range without copying a byte.  Reserved bytes are mapped granules, always.

Note [Virtual memory]
~~~~~~~~~~~~~~~~~~~~~
``Pool(expandable_segments=True)`` builds its segments from 2 MiB granules of the
device's virtual memory (``Device.virtual_memory()``, which a device without any
refuses with ``VirtualMemoryUnsupported``; the sim device's is a memfd, so a
block's bytes really live in the mapping, and touching an unmapped granule is
refused, or faults, as on a GPU). As in PyTorch, each stream and size class
has one *region*, a reserved range of addresses ``rules.REGION_LIMITS`` times the pool's
limit long (the highest limit it has had: a raised limit sizes the regions reserved after it,
``may_hold``; a grow longer than that reserves its own length: ``rules.region_size``),
from the pool's own address space (Note [Address arena]); its
mapped prefix is a heap segment (``Segment.region``). When nothing fits, the pool
maps just the granules the region's last free block lacks at the region's end
and extends that block (``Heap.extend``), within the limit, before the ladder; a
segment of a fixed size (``initial_size``, compaction's re-homing, stitching) gets
a range of its own. Free granule-aligned tails are unmapped and their chunks
released by ``empty_cache()`` and the ladder's release step (``trim_all``), and at
once, after a free, above ``release_threshold``.  ``empty_cache()`` also unmaps
the granules under free blocks between live ones, as PyTorch's expandable
segments do, which splits their segments (``Heap.cut``); the ladder's release
step leaves those holes to stitching, which remaps them side by side exactly
where a request needs them. On the sim device each granule is its own chunk
because the driver maps only whole chunks from their start (H100, driver 580):
that is what lets granules move independently.  On a GPU (``Capabilities.whole_handles``,
Note [Per-call costs]) a driver call costs 20-50 µs, so each grow, new
segment or stitch's fresh part is *one* handle (``whole_handles``), mapped with one
``cuMemMap`` and one ``cuMemSetAccess`` per contiguous range (growing by 64 granules:
3 calls where it was 129, about 0.1 ms instead of 3.6 ms on an H200; PyTorch maps
2 MiB handles for small blocks and 20 MiB for large ones).  A handle goes back
whole: trimming, cutting holes and stitching take the handles wholly under free
blocks (``_whole``), so a free tail inside a handle that still holds a live block
stays mapped until the block is freed.  Unmapping is one ``cuMemUnmap`` per
contiguous range and one device synchronization per batch (``trim_all``, a stitch),
the context pushed once per batch (``VirtualMemory.batch``).

*Stitching* (``stitch=True``) is a ladder step after release, for large requests:
the granules under free blocks in the middle of segments (largest holes first,
usable by the request's stream) are unmapped there, which splits their segments
around the hole (``Heap.cut``), and mapped side by side in a fresh range, with no
copy; what they lack is created fresh when the limit allows. A stitched segment
goes back to the device as soon as it is wholly free. When a region's addresses
(granules and the holes cut out of them) would pass ``REGION_LIMITS`` times the most
the pool has held, it retires and the stream starts a new one
(``rules.region_retires``: history, not the limit, decides, as a larger device must).

Note [Stitch before grow]
~~~~~~~~~~~~~~~~~~~~~~~~~
A large request that no free block fits, on a pool that stitches, first tries a
stitch whose fresh granules are fewer than the grow in place would map
(``rules.stitch_first_room``, asked by every ``Expander.grow``, the ladder's retries
included, and by the replay engine's ``_grow_stitching``): the whole free granules of holes
are memory already reserved and otherwise wasted, so using them before mapping new
ones keeps the peak reserved down.  Before this rule the miss path grew first and
stitched only under pressure, so whether the holes were used depended on the room
left, and so on the capacity: a larger device could run out of memory where a smaller
one did not (the 15-call program in ``docs/benchmarks.md``).  Only when the grow
fits: without room the ladder runs (streams, release, stitch), and the grow after each
step stitches first too (it once only grew, so a smaller device grew in place where a
larger one stitched: seed 24 of the monotone scan, ``tests/test_placement.py``).  The price
is driver calls: a stitch unmaps its holes' granules and maps them again, and its
segment goes back to the device as soon as it is wholly free.  So this stitch leaves
the small heap's empty segments alone (``rules.stitch_takes``): they are that heap's
cache, not holes, and taking one only moved a granule between the classes; a loop
of one small and one large request remapped it both ways on every pass (23 driver
calls and two device synchronizations an iteration on the CUDA double, where the
grow it replaced costs none once warm: ``tests/test_cuda_double.py``).

The invariants, checked by ``pool.check()`` and ``tests/test_expandable.py``: every
mapped granule lies in exactly one heap segment and every segment is mapped
whole, so reserved bytes are mapped granules; no chunk is mapped twice, so live
blocks never share physical memory; every live block's bytes survive every
grow, unmap, stitch and remap. On the sim device, compaction's moves of whole mapped granules
(a movable buffer covering them, moved to a granule boundary) are made by
trading chunks between the two ranges, granule by granule in memmove's order,
instead of copying (``Expander.move``; the expander is the arena's segment source, ``cupool.core.segments``);
the rest are copied as on any device.  On a GPU every move is copied: a remapped granule
costs 30x or more what copying its 2 MiB does (Note [Per-call costs]).
Events: ``segment_map`` / ``segment_unmap`` (PyTorch's
names) replace ``segment_alloc`` / ``segment_free``, and PyTorch snapshots show each
contiguous mapped range as a segment with ``is_expandable``. The numba replay engine models growing,
trimming, cutting holes and
stitching (``cupool.replay.engine_memory``), with the ranges' addresses as the
pool's virtual memory hands them out (Note [Address arena]); it does not model
compaction's remapping, since it follows a trace's recorded moves instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..device.base import Device
from ..device.costs import remap_pays
from ..device.vmm import Chunk, VirtualMemory
from ..errors import DeviceOutOfMemory
from .books import RESERVED, SEGMENTS, Books
from .events import Observers
from .heap import Block, Heap, PlannedMove, Segment
from .rules import (
    DROP, TRIM_TAIL, after_free, grow_need, hole, region_retires, region_size, stitch_first_room, stitch_pick,
    stitch_takes, usable,
)
from .segments import execute
from .sizes import LARGE, SMALL, round_up


class Region:
    """A reserved virtual range; its segments are mapped, ``[frontier, end)`` is not."""

    __slots__ = ("base", "size", "frontier", "tail", "segments", "growable", "stitched")

    def __init__(self, base: int, size: int, growable: bool, stitched: bool) -> None:
        self.base = base
        self.size = size
        self.frontier = base  # where the next granule is mapped
        self.tail: Segment | None = None  # the segment ending at the frontier, if any
        self.segments = 0  # heap segments inside
        self.growable = growable  # a stream's region (grows); else one exact segment (initial, re-homed, stitched)
        self.stitched = stitched  # its granules go back as soon as its segment is free

    def __repr__(self) -> str:
        return f"Region({self.base:#x}, {self.size}, mapped to {self.frontier - self.base})"


class Expander:
    """The virtual-memory segment source of one arena (its lock held for every call).

    A ``cupool.core.segments.SegmentSource``: the hooks are numbered there.
    """

    def __init__(
        self, vm: VirtualMemory, device: Device, heaps: tuple[Heap, Heap], books: Books, observers: Observers,
        stitch: bool, holds: int | None = None,
    ) -> None:
        self.vm = vm
        holds = vm.capacity if holds is None else holds  # what the pool may map: its limit
        self.space = vm.address_space(holds)  # the pool's own addresses (Note [Address arena])
        self.device = device
        self.granule = g = vm.granularity
        self.heaps = heaps
        self.books = books
        self.observers = observers
        self.stitching = stitch
        self.whole = False  # free granules go back one by one, wherever they lie
        self.regions: dict[tuple[int, Any], Region] = {}  # (kind, stream) -> growable region
        self.ranges: dict[int, Region] = {}  # every region, by base address
        self.chunks: dict[int, Chunk] = {}  # granule address -> the chunk mapped there (over one or more granules)
        self.base_of: dict[int, int] = {}  # chunk id -> the address it is mapped at
        # Note [Virtual memory]: one handle per grow where each driver call costs more than a copy.
        self.whole_handles = device.capabilities.whole_handles
        self.closed = False  # the arena's finalizer gave everything back: no more device calls
        self.closing = False  # the pool is closed: ranges left empty go back too
        self.maps = 0  # granules mapped
        self.unmaps = 0  # granules unmapped
        self.stitches = 0
        self.stitched_bytes = 0
        self.remapped_bytes = 0  # compaction's moves made by remapping granules instead of copying
        self.most = 0  # the most bytes the pool has had mapped at once (peaks that reset_peak_stats leaves)
        self.batching = False  # inside trim_all: one synchronization for all its unmaps
        self.quiet = False  # the device was synchronized since the lock was taken: unmap without waiting

    # ------------------------------------------------------------------ growth
    def need(self, kind: int, size: int, stream: Any) -> int:
        """The bytes ``grow(kind, size, stream)`` would map: what the tail's free block lacks, in granules
        (a new region: the request's own)."""
        region = self.regions.get((kind, stream))
        if region is None or self._retires(region, size, stream):
            return grow_need(size, 0, 0, 1 << 62, self.granule)  # a new region: no end to run past
        return self._tail_need(region, size, stream)

    def _tail_need(self, region: Region, size: int, stream: Any) -> int:
        have = 0
        if region.tail is not None:
            last = region.tail.tail
            if last is not None and last.free and usable(last.stream, stream, None):
                have = last.size
        return grow_need(size, have, region.frontier, region.base + region.size, self.granule)

    def _retires(self, region: Region, size: int, stream: Any) -> bool:
        """Whether ``region`` gives way to a new one before this grow (``rules.region_retires``)."""
        return region_retires(region.frontier, region.base, region.base + region.size,
                              self.books.current(RESERVED), self.most, self._tail_need(region, size, stream))

    def grow(self, kind: int, size: int, stream: Any, room: int, exact: bool) -> Block | None:
        """Map granules at the end of ``stream``'s region; a free block of at least ``size``.

        None when the granules needed are more than ``room``; ``DeviceOutOfMemory``
        passes through with nothing changed.  ``exact`` changes nothing here: a
        region grows by just what the request lacks anyway.  A large request stitches
        holes first where that maps less (Note [Stitch before grow]).
        """
        if kind == LARGE and self.stitching:
            block = self._stitch_first(kind, size, stream, room)
            if block is not None:
                return block
        n = self.need(kind, size, stream)
        if n > room:
            return None
        chunks = self._create(n)
        region = self.regions.get((kind, stream))
        if region is not None and self._retires(region, size, stream):
            # Its holes outgrew what the pool holds: retire it, and start a new range.
            del self.regions[(kind, stream)]
            region.growable = False
            if not region.segments:
                self._forget(region)
            region = None
        if region is None:
            try:  # REGION_LIMITS times all the pool may map (its limit, told by may_hold when raised), or the grow
                region = self.regions[(kind, stream)] = self._reserve(region_size(self.space.span, n), True, False)
            except BaseException:  # no addresses left: the chunks go back, the request fails
                for c in chunks:
                    self.vm.release(c)
                raise
        at = region.frontier
        self._map(at, chunks)
        region.frontier += n
        self._mapped(kind, at, n, stream)
        if region.tail is None:
            seg = self._add(kind, region, at, n, stream, keep=False)
            region.tail = seg
            block = seg.head
        else:
            block = self.heaps[kind].extend(region.tail, n, stream)
        assert block is not None and block.free and block.size >= size
        return block

    def new(self, kind: int, nbytes: int, stream: Any, keep: bool) -> Segment:
        """A segment of exactly ``nbytes`` in a range of its own (preallocated, or re-homed by compaction)."""
        n = round_up(nbytes, self.granule)
        chunks = self._create(n)
        region = self._reserve(n, growable=False, stitched=False)
        self._map(region.base, chunks)
        region.frontier += n
        self._mapped(kind, region.base, n, stream)
        seg = region.tail = self._add(kind, region, region.base, n, stream, keep)
        return seg

    # ---------------------------------------------------------------- shrinking
    def drop(self, kind: int, seg: Segment) -> None:
        """Unmap a wholly free segment and give its granules back."""
        region = seg.region
        assert isinstance(region, Region)
        self.heaps[kind].remove_segment(seg)
        if not self.closed:
            with self.vm.batch():
                for chunk in self._unmap(seg.addr, seg.size):
                    self.vm.release(chunk)
        self.books.account(kind, SEGMENTS, -1)
        self._unmapped(kind, seg.addr, seg.size, seg.stream)
        region.segments -= 1
        if region.tail is seg:
            region.tail, region.frontier = None, seg.addr
        if not region.segments and (self.closing or not region.growable):
            self._forget(region)

    def after_free(self, kind: int, block: Block, over: bool) -> int:
        """After a free left ``block`` free: the rule book's ``after_free`` (a stitched segment goes back as
        soon as it is wholly free, Note [Virtual memory]; releasing eagerly, a free segment or free tail)."""
        seg = block.segment
        region = seg.region
        assert isinstance(region, Region)
        action = after_free(seg.used, seg.keep, region.stitched, over, block is seg.tail, True)
        if action == DROP:
            self.drop(kind, seg)
            return seg.size
        return self._trim_tail(kind, seg) if action == TRIM_TAIL else 0

    def _trim_tail(self, kind: int, seg: Segment) -> int:
        """Unmap the free granules at the end of ``seg`` (all of it if it is free); returns the bytes."""
        last = seg.tail
        assert last is not None
        if not last.free:
            return 0
        lo, end = hole(last.addr, last.size, self.granule)  # the segment ends on a granule: so does the hole
        lo, end = self._whole(lo, end)
        if lo >= end:
            return 0
        if lo == seg.addr:
            self.drop(kind, seg)
            return end - lo
        self.heaps[kind].trim(seg, end - lo)
        with self.vm.batch():
            for chunk in self._unmap(lo, end - lo):
                self.vm.release(chunk)
        self._unmapped(kind, lo, end - lo, seg.stream)
        region = seg.region
        assert isinstance(region, Region)
        if region.tail is seg:
            region.frontier = lo
        return end - lo

    def trim_all(self, kept_too: bool, holes: bool = False, synced: bool = False) -> int:
        """Unmap every free tail (the ladder's release step), and with ``holes`` every free granule
        between live blocks too (``empty_cache``); returns the bytes.

        ``kept_too`` is the closing pool's call: the preallocated segment goes too,
        and from now on so does every range left empty.  Holes are cut in address
        order, as the replay engine cuts them (``engine_memory.release_holes``).
        The device is synchronized once for the lot, before the first unmap, or not at
        all where the caller says it is ``synced`` (it waited for the device with the
        lock held since, as compaction does).
        """
        self.quiet = synced
        self.batching = True
        try:
            with self.vm.batch():
                return self._trim_all(kept_too, holes)
        finally:
            self.quiet = self.batching = False

    def _trim_all(self, kept_too: bool, holes: bool) -> int:
        if kept_too:
            self.closing = True
        released = 0
        for kind, heap in enumerate(self.heaps):
            for seg in list(heap.segments.values()):
                if seg.region is not None and (kept_too or not seg.keep):
                    released += self._trim_tail(kind, seg)
        if holes:
            cuts = [
                (*self._whole(*hole(b.addr, b.size, self.granule)), kind, b)
                for kind, heap in enumerate(self.heaps) for seg in heap.segments.values()
                if seg.region is not None and (kept_too or not seg.keep)
                for b in seg.blocks() if b.free
            ]
            for lo, hi, kind, b in sorted((c for c in cuts if c[1] > c[0]), key=lambda c: c[0]):
                for chunk in self._cut(kind, b, lo, hi):
                    self.vm.release(chunk)
                released += hi - lo
        if self.closing:
            for region in [r for r in self.ranges.values() if not r.segments]:
                self._forget(region)
            if not self.ranges and not self.closed:
                self.space.give_back()
        return released

    # ---------------------------------------------------------------- stitching
    def _stitch_first(self, kind: int, size: int, stream: Any, room: int) -> Block | None:
        """Stitch before growing, where that maps fewer fresh granules (Note [Stitch before grow]): the
        stitched segment's free block, or None (nothing changed, and the grow follows)."""
        fresh = stitch_first_room(self.need(kind, size, stream), room, self.granule)
        return self._stitch(kind, size, stream, fresh, first=True) if fresh >= 0 else None

    def stitch(self, kind: int, size: int, stream: Any, room: int, first: bool = False) -> bool:
        """Serve ``size`` bytes from granules under free blocks, remapped side by side (no copy).

        Granules from the largest holes first (those ``rules.stitch_takes`` allows: ``first``
        is a stitch before the grow); what they lack is created fresh when ``room`` (bytes
        the limit still allows) covers it.  Returns whether a stitched segment now holds a
        free block of ``size`` for ``stream``; False changes nothing.
        """
        return self._stitch(kind, size, stream, room, first) is not None

    def _stitch(self, kind: int, size: int, stream: Any, room: int, first: bool) -> Block | None:
        """``stitch``, returning the stitched segment's free block (None: nothing changed)."""
        g = self.granule
        room = room // g * g
        want = round_up(size, self.granule)
        holes = []
        for k, heap in enumerate(self.heaps):
            for s in heap.streams():
                if not usable(s, stream, None):
                    continue
                for b in heap.free_blocks(s):
                    lo, hi = self._whole(*hole(b.addr, b.size, g))
                    seg = b.segment
                    if (hi > lo and seg.region is not None and not seg.keep
                            and stitch_takes(first, k == SMALL, seg.used)):
                        holes.append((hi - lo, lo, k, b))
        lengths = np.array([h[0] for h in holes], np.int64)
        order, count, got = stitch_pick(lengths, np.array([h[1] for h in holes], np.int64), want)
        taken = [(holes[i][2], holes[i][3], *self._whole(holes[i][1], holes[i][1] + int(lengths[i])))
                 for i in order[:count]]
        taken = [t for t in taken if t[3] > t[2]]  # a last hole clipped inside one handle gives nothing
        got = sum(hi - lo for _, _, lo, hi in taken)
        fresh = want - got
        if not taken or fresh > room:
            return None
        try:
            new = self._create(fresh) if fresh else []
        except DeviceOutOfMemory:
            return None
        region = self._reserve(want, growable=False, stitched=True)
        chunks: list[Chunk] = []
        self.batching = True  # one synchronization and one context push for every cut
        try:
            with self.vm.batch():
                for k, b, lo, hi in taken:
                    chunks += self._cut(k, b, lo, hi)
                self._map(region.base, chunks + new)
        finally:
            self.batching = self.quiet = False
        region.frontier += want
        self._mapped(kind, region.base, want, stream)
        region.tail = self._add(kind, region, region.base, want, stream, keep=False)
        self.stitches += 1
        self.stitched_bytes += got
        return region.tail.head

    def _cut(self, kind: int, b: Block, lo: int, hi: int) -> list[Chunk]:
        """Unmap ``[lo, hi)`` from under free block ``b``, splitting its segment; the chunks that were there."""
        seg = b.segment
        region = seg.region
        assert isinstance(region, Region)
        left, right = self.heaps[kind].cut(b, lo, hi)
        chunks = self._unmap(lo, hi - lo)
        self._unmapped(kind, lo, hi - lo, seg.stream)
        parts = (left is not None) + (right is not None)
        region.segments += parts - 1
        self.books.account(kind, SEGMENTS, parts - 1)
        if region.tail is seg:
            if right is not None:
                region.tail = right
            else:
                region.tail, region.frontier = left, lo
        if not region.segments and not region.growable:
            self._forget(region)
        return chunks

    # --------------------------------------------------------------- compaction
    def move(self, moves: Sequence[PlannedMove]) -> None:
        """Carry out compaction's moves in order: whole mapped granules trade chunks where that costs the
        device less than copying them (never on a GPU: Note [Per-call costs]), the rest are copied."""
        batch: list[PlannedMove] = []
        costs = self.device.costs
        for x in moves:
            if remap_pays(costs, x.nbytes, self.granule) and self._remappable(x.src, x.dst, x.nbytes):
                execute(self.device, batch)
                batch = []
                self._remap(x.src, x.dst, x.nbytes)
            else:
                batch.append(x)
        execute(self.device, batch)

    def _remappable(self, src: int, dst: int, n: int) -> bool:
        g = self.granule
        if src % g or dst % g or n % g:
            return False
        chunks = self.chunks

        def single(a: int) -> bool:
            c = chunks.get(a)
            return c is not None and c.nbytes == g

        return all(single(a) and single(a - src + dst) for a in range(src, src + n, g))

    def _remap(self, src: int, dst: int, n: int) -> None:
        """Move ``[src, src + n)`` to ``dst`` by swapping chunks granule by granule, as memmove would copy.

        Sliding down, the lowest granule first; sliding up, the highest: a granule is
        swapped away from ``src`` before any swap lands on it.  The bytes left at
        ``src`` are the chunks that were at ``dst`` (free memory: anything will do).
        """
        g = self.granule
        k = n // g
        now: dict[int, Chunk] = {}
        for i in range(k) if dst < src else range(k - 1, -1, -1):
            a, b = dst + i * g, src + i * g
            now[a], now[b] = now.get(b, self.chunks[b]), now.get(a, self.chunks[a])
        changed = {a: c for a, c in now.items() if c is not self.chunks[a]}
        with self.vm.batch():
            for a in changed:
                self.vm.unmap(a, g)
            for a, c in changed.items():
                self.vm.map(a, c)
                self.vm.set_access(a, g)
                self.chunks[a] = c
                self.base_of[c.id] = a
        self.remapped_bytes += n

    # ------------------------------------------------------------------- device
    def _reserve(self, nbytes: int, growable: bool, stitched: bool) -> Region:
        region = Region(self.space.reserve(nbytes), nbytes, growable, stitched)
        self.ranges[region.base] = region
        return region

    def _forget(self, region: Region) -> None:
        del self.ranges[region.base]
        if region.growable:
            self.regions = {k: r for k, r in self.regions.items() if r is not region}
        if not self.closed:
            self.space.free_range(region.base)
            if self.closing and not self.ranges:  # a closed pool, emptied: its addresses go back too
                self.space.give_back()

    def _create(self, nbytes: int) -> list[Chunk]:
        """One chunk per granule, or one for the lot with ``whole_handles`` (Note [Virtual memory]);
        all or none (``DeviceOutOfMemory`` releases those made)."""
        chunks: list[Chunk] = []
        if self.whole_handles:
            return [self.vm.create(nbytes)] if nbytes else []
        try:
            with self.vm.batch():
                for _ in range(nbytes // self.granule):
                    chunks.append(self.vm.create(self.granule))
        except BaseException:
            for c in chunks:
                self.vm.release(c)
            raise
        return chunks

    def _map(self, addr: int, chunks: list[Chunk]) -> None:
        g = self.granule
        at = addr
        with self.vm.batch():
            for chunk in chunks:
                self.vm.map(at, chunk)
                self.base_of[chunk.id] = at
                for a in range(at, at + chunk.nbytes, g):
                    self.chunks[a] = chunk
                at += chunk.nbytes
            self.vm.set_access(addr, at - addr)
        self.maps += (at - addr) // g

    def _whole(self, lo: int, hi: int) -> tuple[int, int]:
        """``[lo, hi)`` of granules narrowed to the handles wholly inside it (a handle is unmapped whole)."""
        if not self.whole_handles or lo >= hi:
            return lo, hi
        g, chunks, base_of = self.granule, self.chunks, self.base_of
        while lo < hi and base_of[chunks[lo].id] != lo:
            lo += g
        while hi > lo and base_of[chunks[hi - g].id] + chunks[hi - g].nbytes != hi:
            hi -= g
        return lo, hi

    def _unmap(self, addr: int, nbytes: int) -> list[Chunk]:
        g = self.granule
        if not self.closed:
            # cudaFree waits for the device; cuMemUnmap does not, and a kernel queued on a
            # stream may still use a block freed there.  So wait first, as PyTorch does:
            # once for a batch of unmaps (``trim_all``), the lock held throughout.
            if not self.quiet:
                self.device.synchronize()
                self.quiet = self.batching
            self.vm.unmap(addr, nbytes)
        self.unmaps += nbytes // g
        out = []
        for a in range(addr, addr + nbytes, g):
            c = self.chunks.pop(a)
            if self.base_of[c.id] == a:
                out.append(c)
        for c in out:
            del self.base_of[c.id]
        return out

    # -------------------------------------------------------------------- books
    def _add(self, kind: int, region: Region, addr: int, n: int, stream: Any, keep: bool) -> Segment:
        seg = self.heaps[kind].add_segment(addr, n, stream, keep=keep)
        seg.region = region
        region.segments += 1
        self.books.account(kind, SEGMENTS, 1)
        return seg

    def _mapped(self, kind: int, addr: int, n: int, stream: Any) -> None:
        self.books.account(kind, RESERVED, n)
        self.most = max(self.most, self.books.current(RESERVED))
        self.books.device_allocs += 1
        if self.observers.active:
            self.observers.emit("segment_map", addr, n, 0 if stream is None else stream)

    def _unmapped(self, kind: int, addr: int, n: int, stream: Any) -> None:
        self.books.account(kind, RESERVED, -n)
        self.books.device_frees += 1
        if self.observers.active:
            self.observers.emit("segment_unmap", addr, n, 0 if stream is None else stream)

    def may_hold(self, holds: int) -> None:
        self.space.may_hold(holds)  # regions reserved from now on are sized by the raised limit (region_size)

    # ----------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Give every granule and range back (the arena's finalizer: the heaps are forgotten with it)."""
        if self.closed:
            return
        self.closed = True
        with self.vm.batch():
            for addr, chunk in list(self.chunks.items()):
                if self.base_of[chunk.id] == addr:
                    self.vm.unmap(addr, chunk.nbytes)
                    self.vm.release(chunk)
        for base in list(self.ranges):
            self.vm.free_range(base)
        if not self.vm.closed:
            self.space.give_back()

    def stats(self) -> dict[str, int]:
        return {
            "expandable.granules_mapped": self.maps,
            "expandable.granules_unmapped": self.unmaps,
            "expandable.mapped_bytes": len(self.chunks) * self.granule,
            "num_stitches": self.stitches,
            "stitched_bytes": self.stitched_bytes,
            "compaction_bytes_remapped": self.remapped_bytes,
        }

    def check(self) -> None:
        """Every mapped granule lies in exactly one segment, and every segment is mapped whole."""
        g = self.granule
        seen = 0
        for heap in self.heaps:
            for seg in heap.segments.values():
                if seg.region is None:
                    continue
                region = seg.region
                assert isinstance(region, Region) and region.base in self.ranges, f"{seg!r} in a forgotten range"
                assert region.base <= seg.addr and seg.addr + seg.size <= region.frontier, f"{seg!r} past {region!r}"
                for a in range(seg.addr, seg.addr + seg.size, g):
                    assert a in self.chunks, f"{seg!r}: granule {a:#x} is not mapped"
                seen += seg.size // g
        assert seen == len(self.chunks), f"{len(self.chunks) - seen} mapped granule(s) lie in no segment"
        for a, c in self.chunks.items():  # each chunk mapped once, whole, from its base
            base = self.base_of[c.id]
            assert base <= a < base + c.nbytes and self.chunks.get(base) is c, f"chunk {c.id} is mapped twice"
        for c_id, base in self.base_of.items():
            c = self.chunks[base]
            assert c.id == c_id and all(self.chunks.get(a) is c for a in range(base, base + c.nbytes, g))
        for region in self.ranges.values():
            tail = region.tail
            assert tail is None or tail.addr + tail.size == region.frontier, f"{region!r}: tail {tail!r}"
