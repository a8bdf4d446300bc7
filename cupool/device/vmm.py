"""Virtual memory: the few operations of CUDA's VMM API, checked and booked once for every backend.

Expandable segments and stitching need to separate addresses from physical memory:
reserve a range of addresses, create physical chunks, and map whole chunks
into ranges, remapping them at will.  ``VirtualMemory`` is that protocol.  Its
public methods validate every argument and keep the books (ranges, chunks,
mappings, physical bytes in use) before they call a backend hook, so that

* bad input raises a clear error and leaves the state exactly as it was, on
  every backend alike (the CUDA driver would often say only ``INVALID_VALUE``,
  or worse, accept it);
* the pool can read the state (``ranges()``, ``chunks()``, ``mappings()``)
  without asking the driver.

The rules are CUDA's, made strict where CUDA is loose or undefined:

* sizes and addresses are multiples of ``granularity``;
* a chunk is mapped whole: CUDA documents an offset and a size for
  ``cuMemMap``, but the driver refuses anything but the whole chunk from its
  start (``CUDA_ERROR_NOT_SUPPORTED`` on an H100, driver 580, 2026-11-22), so a
  caller who wants to place granules independently creates one chunk per granule;
* capacity counts physical bytes (live chunks), never addresses: reserving a
  terabyte of addresses costs nothing;
* a mapping lies inside one reserved range and overlaps no other mapping;
* ``unmap`` and ``set_access`` take whole mappings (one or several contiguous
  ones), as ``cuMemUnmap`` does;
* a mapping is not accessible until ``set_access`` (``cuMemMap`` grants none);
* a chunk still mapped cannot be released and a range still mapped cannot be
  freed (CUDA defers the first and leaves the second undefined).

Note [Address arena]
~~~~~~~~~~~~~~~~~~~~
Placement breaks ties by address: best fit takes the lowest address among equal
sizes, stitching the lowest among equal holes.  So where a reserved range lies
must not depend on where the operating system or the driver likes to put a
mapping, nor on what other pools do, or a replay of a recording (on the sim
device, in the numba engine) places differently from the recording.  One
virtual memory serves every pool of a device (``shared``: one per GPU, one per
sim device), and each pool reserves from an ``AddressSpace`` of its own: ranges
first fit, lowest address first, from an *arena* that the space reserves from
the backend on first use, sized by what the pool may hold (``address_arena``:
``ARENA_SPANS`` times its limit, the device's capacity without one; a growing
region is ``REGION_LIMITS`` (2) times ``region_span``, two limits long, so that
when it retires depends on the pool's history, never on its limit: ``rules.region_size``,
Note [Virtual memory]).  A limit raised later (``Pool.set_limit``) is told to the space
(``may_hold``): regions and arenas reserved after it are sized by the highest limit
the pool has had, and its next arena starts a new lane (below), so the rule stays
one of the pool's own calls; what was reserved before stays where it is.
``free_range`` only returns
a range to its space's arena; the backend's ``_free_range`` runs for a whole
arena, when the space is given back (its pool closed and emptied, or collected)
or at ``close``.  So a pool holds a few times what it may map in addresses, never
a device-sized arena, and a process holds as many pools as it likes; the ranges
a pool gets depend on that pool's own calls alone.  Each range is followed by one
granule that is never lent (``RANGE_GAP`` granules), so two ranges never touch:
whoever reads the mapping events (a trace's exporter) can tell two ranges from
one grown range.  The numba replay engine models exactly this
(``cupool.replay.engine_memory``, with the arena and span of ``config_array``).
A space whose arena runs out reserves another, numbered after the first: where
the backend lets addresses be chosen (the sim device, ``_reserve_at``), arena k
lies k arenas past the base of the space's *lane*, addresses set aside (not
reserved) for ``LANE_ARENAS`` of them, so the arenas follow each other and first
fit runs on over them as over one, which is what the engine models
(``config_array``'s arena is a lane).  Elsewhere (a GPU, or a lane whose
addresses something else holds) the next arena lies wherever the backend puts
it: from then on only the order within each arena is the rule's.  An
arena holds one growing region with room to spare for exact segments and
stitching; a pool that grows both size classes, or more streams, takes more
arenas of its lane (a 2-limit region straddles two).  That
is the price of holding no more than ``ARENA_SPANS`` times what the pool may
hold (issue 34; the arena was 64 regions of twice the device before, 17.5 TiB on
an H200, and ran a GPU out of addresses after a few pools).  A backend that refuses a whole
arena reserves that range on its own, and says so in ``arena_fallback``; one that
refuses that too has run out of address space, which is ``AddressSpaceExhausted``
(a ``DeviceOutOfMemory``: the pool's request fails with ``OutOfMemoryError``
naming the address space, and every pool keeps what it has).

Backends: ``SimVirtualMemory`` (``cupool.device.sim_vmm``, a memfd on Linux) and
``CudaVirtualMemory`` (``cupool.device.cuda_vmm``, ``cuda.bindings.driver``).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedDict

from .._units import format_bytes, round_up
from ..errors import AddressSpaceExhausted, DeviceOutOfMemory
from ..errors import VirtualMemoryError as VirtualMemoryError  # re-exported: the device layer's errors
from ..errors import VirtualMemoryUnsupported as VirtualMemoryUnsupported
from .ranges import FreeRanges

#: What ``cuMemGetAllocationGranularity`` reports on every current NVIDIA GPU.
GRANULE = 2 << 20
#: A pool's arena holds this many growing regions' worth of addresses (Note [Address arena]): one per
#: size class of one stream, and as much again for a second stream, exact segments and stitching.
ARENA_SPANS = 4


#: The arenas one space may number in its lane (Note [Address arena]): arena k lies k arenas past the lane's base.
LANE_ARENAS = 16


#: Granules left unlent after each reserved range, so that no two ranges touch (Note [Address arena]).
RANGE_GAP = 1


def region_span(holds: int, granularity: int = GRANULE) -> int:
    """A growing region's addresses, for a pool that may hold ``holds`` bytes: all it may map, in granules."""
    return round_up(max(holds, 1), granularity)


def address_arena(holds: int, granularity: int = GRANULE) -> int:
    """The addresses one arena of a pool that may hold ``holds`` bytes reserves (Note [Address arena])."""
    return ARENA_SPANS * region_span(holds, granularity)


_chunk_ids = itertools.count()


@dataclass(eq=False)
class Chunk:
    """Physical memory from ``create``: ``nbytes`` of granules, mapped wherever the caller likes.

    ``handle`` is the backend's (a memfd offset, a ``CUmemGenericAllocationHandle``).
    Identity is the chunk: two chunks are never equal, whatever their sizes.
    """

    nbytes: int
    handle: Any = field(repr=False)
    id: int = field(default_factory=lambda: next(_chunk_ids))
    live: bool = True


@dataclass(frozen=True)
class Mapping:
    """The whole of ``chunk`` (``nbytes``), seen at ``addr``."""

    addr: int
    nbytes: int
    chunk: Chunk
    accessible: bool = False

    @property
    def end(self) -> int:
        return self.addr + self.nbytes


class VirtualMemory(ABC):
    """Reserve, create, map, set access, unmap, release, free: checked, booked, thread-safe.

    Subclasses implement the underscore hooks, which may assume valid arguments;
    a hook that raises leaves the books as they were for that step.
    """

    def __init__(self, capacity: int, granularity: int) -> None:
        if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity <= 0:
            raise ValueError(f"granularity must be a positive int, got {granularity!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(f"capacity must be an int, got {capacity!r}")
        self.granularity = granularity
        self.capacity = capacity - capacity % granularity
        if self.capacity <= 0:
            raise ValueError(f"capacity: {capacity!r} holds not one granule of {format_bytes(granularity)}")
        self._lock = threading.RLock()
        self._ranges: SortedDict = SortedDict()  # addr -> nbytes
        self._maps: SortedDict = SortedDict()  # addr -> Mapping
        self._chunks: dict[int, Chunk] = {}  # id -> live chunk
        self._mapped_of: dict[int, int] = {}  # chunk id -> number of mappings
        self._in_use = 0
        self._closed = False
        # Note [Address arena]: the arenas reserved from the backend (base -> bytes), every space's, and
        # the space each reserved range came from.
        self._arenas: dict[int, int] = {}
        self._space_of: dict[int, AddressSpace] = {}
        #: The space ``reserve`` takes from when no pool's is named: one arena's worth of the device.
        self.space = AddressSpace(self, self.capacity)
        #: Why a range was last reserved on its own from the backend (it refused an arena), or None.
        self.arena_fallback: str | None = None

    # -- reading the state ------------------------------------------------------
    @property
    def in_use(self) -> int:
        """Physical bytes held by live chunks: what capacity is charged."""
        return self._in_use

    def ranges(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(self._ranges.items())

    def chunks(self) -> list[Chunk]:
        with self._lock:
            return list(self._chunks.values())

    def mappings(self) -> list[Mapping]:
        with self._lock:
            return list(self._maps.values())

    def mapping_at(self, addr: int) -> Mapping | None:
        """The mapping holding byte ``addr`` (any alignment), found by bisection, or None."""
        with self._lock:
            i = self._maps.bisect_right(addr) - 1
            if i >= 0:
                m: Mapping = self._maps.peekitem(i)[1]
                if addr < m.end:
                    return m
            return None

    # -- the operations ---------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def address_bytes(self) -> int:
        """Addresses reserved from the backend now, every pool's arenas together (Note [Address arena])."""
        with self._lock:
            return sum(self._arenas.values())

    def address_space(self, holds: int) -> AddressSpace:
        """A pool's own addresses, for a pool that may hold ``holds`` bytes (Note [Address arena])."""
        with self._lock:
            self._check_open()
            return AddressSpace(self, holds)

    def reserve(self, nbytes: int, space: AddressSpace | None = None) -> int:
        """Reserve ``nbytes`` of addresses (no memory), granule-aligned, from ``space`` (this object's own
        when None); return the base address.  ``AddressSpaceExhausted`` when the backend has none left."""
        with self._lock:
            self._check_open()
            self._check_size(nbytes, "nbytes")
            space = self.space if space is None else space
            if space.vm is not self:
                raise VirtualMemoryError("reserve: that address space belongs to another virtual memory")
            lent = nbytes + RANGE_GAP * self.granularity
            addr = space.free.take(lent)
            if addr is None:
                addr = self._new_arena(space, lent)
            self._ranges[addr] = nbytes
            self._space_of[addr] = space
            return addr

    def _new_arena(self, space: AddressSpace, nbytes: int) -> int:
        """Reserve another arena of ``space`` from the backend and take ``nbytes`` from it (Note [Address arena]):
        the next of its lane where the backend lets addresses be chosen, else wherever the backend puts it; a
        backend that refuses the arena is asked for the range alone, and one that refuses that too is out of
        address space."""
        base = self._numbered_arena(space)
        if base is not None:  # it follows the last: first fit runs on over both, as the replay engine's does
            space.arenas[base] = self._arenas[base] = space.arena
            space.free.give(base, space.arena)
            addr = space.free.take(nbytes)
            if addr is not None:
                return addr
        size = max(nbytes, space.arena)
        try:
            base = self._reserve(size)
        except (DeviceOutOfMemory, VirtualMemoryError, OSError) as e:
            self.arena_fallback = f"the backend refused an arena of {format_bytes(size)}: {e}"
            size = nbytes
            try:
                base = self._reserve(size)
            except (DeviceOutOfMemory, VirtualMemoryError, OSError) as e2:
                raise AddressSpaceExhausted(
                    f"{self!r}: out of address space: {format_bytes(nbytes)} of addresses refused ({e2}); "
                    f"this device's pools hold {len(self._arenas)} arena(s), {format_bytes(sum(self._arenas.values()))}"
                ) from None
        self._arenas[base] = size
        space.arenas[base] = size
        if size > nbytes:
            space.free.give(base + nbytes, size - nbytes)
        return base

    def free_range(self, addr: int) -> None:
        """Give back a reserved range to its space; refused while anything is mapped in it."""
        with self._lock:
            nbytes = self._ranges.get(addr)
            if nbytes is None:
                raise VirtualMemoryError(f"free_range: {addr:#x} is not the base of a reserved range")
            if self._mappings_within(addr, addr + nbytes):
                raise VirtualMemoryError(f"free_range: [{addr:#x}, +{format_bytes(nbytes)}) still has mappings")
            del self._ranges[addr]
            # The arena keeps it reserved (Note [Address arena]), its gap with it.
            self._space_of.pop(addr).free.give(addr, nbytes + RANGE_GAP * self.granularity)

    def _numbered_arena(self, space: AddressSpace) -> int | None:
        """The next arena of ``space``'s lane, reserved at its number's address, or None where the backend
        chooses addresses itself, the lane is full, or its addresses are taken (lock held)."""
        if space.lane is None and not space.numbered:  # its first arena, or the first since its limit rose
            space.lane = self._take_lane(LANE_ARENAS * space.arena)
            if space.lane is not None:
                space.lanes[space.lane] = LANE_ARENAS * space.arena
        if space.lane is None or space.numbered >= LANE_ARENAS:
            space.numbered = LANE_ARENAS  # no lane: this backend (or this lane) numbers no more arenas
            return None
        at = space.lane + space.numbered * space.arena
        if not self._reserve_at(at, space.arena):  # something holds its addresses: no more numbered arenas
            if not space.numbered:
                self._give_lane(space.lane, space.lanes.pop(space.lane))
                space.lane = None
            space.numbered = LANE_ARENAS
            return None
        space.numbered += 1
        return at

    def _give_back(self, space: AddressSpace) -> None:
        """Free ``space``'s arenas in the backend, and its lane; refused while it holds a range (lock held)."""
        held = [a for a, s in self._space_of.items() if s is space]
        if held:
            raise VirtualMemoryError(f"give_back: the address space still holds {len(held)} range(s), at {held[0]:#x}")
        for base, size in space.arenas.items():
            del self._arenas[base]
            if not self._closed:
                self._free_range(base, size)
        space.arenas.clear()
        space.free = FreeRanges()
        for lane, size in space.lanes.items():
            self._give_lane(lane, size)
        space.lanes.clear()
        space.lane, space.numbered = None, 0

    def create(self, nbytes: int) -> Chunk:
        """A physical chunk of ``nbytes`` (whole granules), charged against capacity."""
        with self._lock:
            self._check_open()
            self._check_size(nbytes, "nbytes")
            free = self.capacity - self._in_use - self._outside()
            if nbytes > free:
                raise DeviceOutOfMemory(
                    f"virtual memory: a chunk of {format_bytes(nbytes)} requested, "
                    f"{format_bytes(max(free, 0))} of {format_bytes(self.capacity)} free"
                )
            chunk = Chunk(nbytes, self._create(nbytes))
            self._chunks[chunk.id] = chunk
            self._mapped_of[chunk.id] = 0
            self._in_use += nbytes
            return chunk

    def release(self, chunk: Chunk) -> None:
        """Return a chunk's physical memory; refused while it is mapped anywhere."""
        with self._lock:
            self._check_chunk(chunk)
            if self._mapped_of[chunk.id]:
                raise VirtualMemoryError(f"release: chunk {chunk.id} is still mapped {self._mapped_of[chunk.id]} time(s)")
            self._release(chunk.handle, chunk.nbytes)
            chunk.live = False
            del self._chunks[chunk.id], self._mapped_of[chunk.id]
            self._in_use -= chunk.nbytes

    def map(self, addr: int, chunk: Chunk) -> Mapping:
        """Map the whole of ``chunk`` at ``addr``, not yet accessible."""
        with self._lock:
            self._check_chunk(chunk)
            nbytes = chunk.nbytes
            self._check_addr(addr, "map")
            base, size = self._range_of(addr)
            if addr + nbytes > base + size:
                raise VirtualMemoryError(
                    f"map: [{addr:#x}, +{format_bytes(nbytes)}) passes the end of its reserved range "
                    f"[{base:#x}, +{format_bytes(size)})"
                )
            if self._mappings_within(addr, addr + nbytes):
                raise VirtualMemoryError(f"map: [{addr:#x}, +{format_bytes(nbytes)}) overlaps a mapping")
            self._map(addr, chunk.handle, nbytes)
            m = self._maps[addr] = Mapping(addr, nbytes, chunk)
            self._mapped_of[chunk.id] += 1
            return m

    def set_access(self, addr: int, nbytes: int) -> None:
        """Make whole mappings covering ``[addr, addr + nbytes)`` readable and writable by the device:
        one backend call for the whole range, as ``cuMemSetAccess`` takes it (PyTorch makes one too)."""
        with self._lock:
            spanned = self._span(addr, nbytes, "set_access")
            self._set_access(addr, nbytes)
            for m in spanned:
                self._maps[m.addr] = Mapping(m.addr, m.nbytes, m.chunk, accessible=True)

    def unmap(self, addr: int, nbytes: int) -> None:
        """Unmap whole mappings covering ``[addr, addr + nbytes)``, in one backend call; their chunks stay alive."""
        with self._lock:
            spanned = self._span(addr, nbytes, "unmap")
            self._unmap(addr, nbytes)
            for m in spanned:
                del self._maps[m.addr]
                self._mapped_of[m.chunk.id] -= 1

    def batch(self) -> AbstractContextManager[Any]:
        """Several calls in a row under one hold of the lock; a backend whose every call needs setting
        up (CUDA's context push and pop) sets up once for the lot (``CudaVirtualMemory.batch``)."""
        return self._lock

    def close(self) -> None:
        """Unmap, release and free everything, then give up the backend; idempotent."""
        with self._lock:
            if self._closed:
                return
            for m in list(self._maps.values()):
                self.unmap(m.addr, m.nbytes)
            for c in list(self._chunks.values()):
                self.release(c)
            for a in list(self._ranges):
                self.free_range(a)
            for base, size in self._arenas.items():
                self._free_range(base, size)
            self._arenas.clear()
            self._close()
            self._closed = True

    def __enter__(self) -> VirtualMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- checks -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise VirtualMemoryError("virtual memory: closed")

    def _check_size(self, n: object, name: str) -> None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{name} must be an int, got {n!r}")
        if n <= 0 or n % self.granularity:
            raise VirtualMemoryError(
                f"{name}: {n} is not a positive multiple of the granularity "
                f"({format_bytes(self.granularity)})"
            )

    def _check_addr(self, addr: object, op: str) -> None:
        if isinstance(addr, bool) or not isinstance(addr, int):
            raise TypeError(f"{op}: addr must be an int, got {addr!r}")
        if addr % self.granularity:
            raise VirtualMemoryError(f"{op}: {addr:#x} is not aligned to the granularity ({format_bytes(self.granularity)})")

    def _check_chunk(self, chunk: object) -> None:
        if not isinstance(chunk, Chunk):
            raise TypeError(f"expected a Chunk from create(), got {chunk!r}")
        if self._chunks.get(chunk.id) is not chunk:
            raise VirtualMemoryError(f"chunk {chunk.id} is {'released' if not chunk.live else 'not of this device'}")

    def _range_of(self, addr: int) -> tuple[int, int]:
        i = self._ranges.bisect_right(addr) - 1
        if i >= 0:
            base, size = self._ranges.peekitem(i)
            if addr < base + size:
                return base, size
        raise VirtualMemoryError(f"{addr:#x} lies in no reserved range")

    def _mappings_within(self, lo: int, hi: int) -> list[Mapping]:
        """Mappings that overlap [lo, hi)."""
        i = max(self._maps.bisect_right(lo) - 1, 0)
        out = []
        for a in self._maps.islice(i):
            if a >= hi:
                break
            m = self._maps[a]
            if m.end > lo:
                out.append(m)
        return out

    def _span(self, addr: int, nbytes: int, op: str) -> list[Mapping]:
        """The mappings that exactly tile [addr, addr + nbytes), or a VirtualMemoryError."""
        self._check_addr(addr, op)
        self._check_size(nbytes, "nbytes")
        ms = self._mappings_within(addr, addr + nbytes)
        pos = addr
        for m in ms:
            if m.addr != pos:
                break
            pos = m.end
        else:
            if pos == addr + nbytes:
                return ms
        raise VirtualMemoryError(
            f"{op}: [{addr:#x}, +{format_bytes(nbytes)}) is not covered exactly by whole mappings"
        )

    # -- backend hooks (arguments already valid) -----------------------------------
    def _outside(self) -> int:
        """Physical bytes of the device held other than through this object (a sim device's plain segments).

        The driver counts those itself on a GPU; a backend that models a device
        whose memory is shared with other allocations says how much they hold.
        """
        return 0

    @abstractmethod
    def _reserve(self, nbytes: int) -> int: ...

    def _take_lane(self, nbytes: int) -> int | None:
        """Addresses, not reserved, for a space's numbered arenas (Note [Address arena]); None: this backend
        chooses every address itself."""
        return None

    def _give_lane(self, addr: int, nbytes: int) -> None:
        """A lane from ``_take_lane`` is free again."""

    def _reserve_at(self, addr: int, nbytes: int) -> bool:
        """Reserve exactly ``[addr, addr + nbytes)``, if nothing holds any of it; whether it was."""
        return False

    @abstractmethod
    def _free_range(self, addr: int, nbytes: int) -> None: ...

    @abstractmethod
    def _create(self, nbytes: int) -> Any: ...

    @abstractmethod
    def _release(self, handle: Any, nbytes: int) -> None: ...

    @abstractmethod
    def _map(self, addr: int, handle: Any, nbytes: int) -> None: ...

    @abstractmethod
    def _set_access(self, addr: int, nbytes: int) -> None: ...

    @abstractmethod
    def _unmap(self, addr: int, nbytes: int) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...


class AddressSpace:
    """One pool's addresses (Note [Address arena]): ranges first fit, lowest first, from arenas of ``arena``
    bytes that it reserves from its virtual memory's backend as it needs them, the first on first use.

    ``give_back()`` frees the arenas once the space holds no range (the pool closed and emptied, or
    collected); a later ``reserve`` starts a new arena.  Thread-safe under the virtual memory's lock.
    Whoever holds a space holds its virtual memory too (a pool's ``Expander`` does).
    """

    def __init__(self, vm: VirtualMemory, holds: int) -> None:
        if isinstance(holds, bool) or not isinstance(holds, int) or holds < 0:
            raise ValueError(f"holds: the bytes a pool may hold, an int >= 0, got {holds!r}")
        self._vm = weakref.ref(vm)  # not the object: its own space would make a cycle, delaying its finalizer
        #: What the pool may hold, a growing region's bytes (``region_span``) and those of each arena the
        #: space reserves (``address_arena``): all sized by the pool's limit, the highest it has had.
        self.holds = holds
        self.span = region_span(holds, vm.granularity)
        self.arena = address_arena(holds, vm.granularity)
        #: Its arenas (base -> bytes), in the order they were reserved, and their addresses not lent.
        self.arenas: dict[int, int] = {}
        self.free = FreeRanges()
        #: Where its numbered arenas go now, and how many it has there (None: the backend chooses, not yet
        #: asked, or its limit rose since); every lane it has taken (base -> bytes), given back with it.
        self.lane: int | None = None
        self.numbered = 0
        self.lanes: dict[int, int] = {}

    @property
    def vm(self) -> VirtualMemory:
        vm = self._vm()
        if vm is None:
            raise VirtualMemoryError("address space: its virtual memory is gone")
        return vm

    def reserve(self, nbytes: int) -> int:
        return self.vm.reserve(nbytes, self)

    def may_hold(self, holds: int) -> None:
        """The pool may now hold ``holds`` bytes (its limit was raised): the regions and arenas it reserves
        from now on are sized by that, and its next arena starts a lane of its own, numbered from 0, so
        that arenas still follow each other where the backend lets them (Note [Address arena]).  What is
        reserved stays as it is; a lower figure changes nothing (a raise afterwards needs no new lane)."""
        vm = self.vm
        with vm._lock:
            if holds > self.holds:
                self.holds, self.span = holds, region_span(holds, vm.granularity)
                self.arena = address_arena(holds, vm.granularity)
                self.lane, self.numbered = None, 0

    def free_range(self, addr: int) -> None:
        self.vm.free_range(addr)

    def give_back(self) -> None:
        with self.vm._lock:
            self.vm._give_back(self)

    @property
    def address_bytes(self) -> int:
        """Addresses this space holds reserved from the backend."""
        return sum(self.arenas.values())

    def __repr__(self) -> str:
        return f"AddressSpace(arena={format_bytes(self.arena)}, {len(self.arenas)} arena(s))"


_shared: weakref.WeakValueDictionary[Hashable, VirtualMemory] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()


def shared(key: Hashable, make: Callable[[], VirtualMemory]) -> VirtualMemory:
    """The one virtual memory of the device ``key`` names (``("cuda", 0)``), made by ``make()`` when none is
    alive (Note [Address arena]).

    Every pool on the device shares it: one retained context, one set of books of
    the device's physical memory, and each pool's arena inside.  It lives while a
    device object or a pool holds it; then its finalizer gives its address space
    (and a GPU's retained context) back.  A closed one is replaced.
    """
    with _shared_lock:
        vm = _shared.get(key)
        if vm is None or vm.closed:
            vm = _shared[key] = make()
        return vm
