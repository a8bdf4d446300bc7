"""Virtual memory without a GPU: physical granules are pages of a memfd, mapped into reserved address space.

Linux models CUDA's VMM API faithfully, which is what lets expandable segments and
stitching be tested here: a chunk is a range of a memfd, a reserved range is
``PROT_NONE`` anonymous memory, and mapping a chunk is ``mmap(MAP_FIXED |
MAP_SHARED)`` of the file over the range, so two mappings of one chunk really
share bytes and unmapping really takes them away (touching them faults).

Python's ``mmap`` module cannot map at a chosen address, so ``mmap``, ``munmap``,
``mprotect`` and ``fallocate`` are called through ctypes on libc.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .._units import format_bytes, parse_size
from ..errors import DeviceOutOfMemory
from .ranges import FreeRanges
from .vmm import GRANULE, VirtualMemory, VirtualMemoryError, VirtualMemoryUnsupported

_PROT_NONE, _PROT_RW = 0x0, 0x1 | 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FIXED_NOREPLACE = 0x100000  # Linux 4.17; an older kernel takes the address as a hint, which is checked

# Lanes for the address spaces' numbered arenas (Note [Address arena]), one table for every sim virtual
# memory of the process: addresses from 1 TiB to 64 TiB, which a 64-bit Linux process leaves to
# whoever names them (the kernel maps top down from near 128 TiB; programs load far above or below).
_LANES = FreeRanges(1 << 40, 63 << 40)
_LANES_LOCK = threading.Lock()
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


def _give_lanes(lanes: dict[int, int]) -> None:
    with _LANES_LOCK:
        for addr, nbytes in lanes.items():
            _LANES.give(addr, nbytes)
    lanes.clear()


def _dispose(libc: ctypes.CDLL, fd: int, reserved: dict[int, int], lanes: dict[int, int]) -> None:
    """Give back address space and the memfd; unmapping a range takes its mappings with it.

    Runs at ``close()``, when the object dies, or at exit (a pool still alive then
    never closes its virtual memory itself: see ``SimVirtualMemory._disposed``).
    """
    for addr, nbytes in reserved.items():
        libc.munmap(addr, nbytes)
    reserved.clear()
    _give_lanes(lanes)
    os.close(fd)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


class SimVirtualMemory(VirtualMemory):
    """CUDA-style virtual memory over a memfd: ``capacity`` bytes of physical granules, addresses unlimited.

    ``outside`` says how many bytes of the same capacity are held elsewhere (the
    sim device's plain segments, when it lends this object).  The memfd is sparse and grows as chunks are created; released chunks have
    their pages punched out, so memory is charged only while a chunk is live and
    has been written.  Chunks take contiguous ranges of the file (one ``mmap`` per
    mapping) from a first-fit free list; the file may grow past ``capacity``
    when that list is fragmented, which costs address space in the file only.
    """

    def __init__(
        self, capacity: int | str = "4GiB", granularity: int = GRANULE, outside: Callable[[], int] | None = None
    ) -> None:
        if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
            raise VirtualMemoryUnsupported(
                f"sim virtual memory needs Linux's memfd_create; this is {sys.platform}"
            )
        page = os.sysconf("SC_PAGE_SIZE")
        if isinstance(granularity, int) and not isinstance(granularity, bool) and granularity % page:
            raise ValueError(f"granularity must be a multiple of the page size ({page}), got {granularity}")
        super().__init__(parse_size(capacity, name="capacity"), granularity)
        self._others = outside  # a sim device's own segments, which share its capacity
        self._libc = _libc()
        self._fd = os.memfd_create("cupool-vmm", os.MFD_CLOEXEC)
        self._file_end = 0
        self._holes = FreeRanges()  # free ranges of the memfd
        self._punch = True
        self._reserved: dict[int, int] = {}  # what a dropped, unclosed instance must still give back
        self._lanes: dict[int, int] = {}  # and its spaces' lanes
        self._finalizer = weakref.finalize(self, _dispose, self._libc, self._fd, self._reserved, self._lanes)
        _LIVE.add(self)  # Note [Sim memory across fork]

    # -- host access (tests and the sim pool read and write through this) --------
    def bytes_at(self, addr: int, nbytes: int) -> np.ndarray:
        """A uint8 view of mapped, accessible memory; refused (not a segfault) anywhere else.

        Like a device pointer, the view is good only while the memory stays mapped:
        touching it after ``unmap`` faults, as a kernel would on a GPU.  Zero bytes
        are an empty view anywhere, as a zero-byte ``cudaMemcpy`` succeeds and as the
        sim device's plain memory answers: a zero-byte movable buffer spills and
        comes back through here (issue 21 #4).
        """
        if nbytes < 0:
            raise VirtualMemoryError(f"bytes_at: nbytes must not be negative, got {nbytes}")
        if nbytes == 0:
            return np.empty(0, np.uint8)
        self._check_live("bytes_at")
        pos = addr
        while pos < addr + nbytes:
            m = self.mapping_at(pos)
            if m is None:
                raise VirtualMemoryError(f"bytes_at: {pos:#x} is not mapped")
            if not m.accessible:
                raise VirtualMemoryError(f"bytes_at: [{m.addr:#x}, +{format_bytes(m.nbytes)}) has no access set")
            pos = m.end
        return np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(addr)), dtype=np.uint8)

    # -- after the memory was given back ---------------------------------------------
    @property
    def _disposed(self) -> bool:
        """Whether the address space and the memfd are gone: closed, or given back at exit.

        At exit the finalizer gives everything back while pools may still be alive;
        their late frees (an ``Allocation`` dying during shutdown) then reach the
        hooks below.  Those that give memory back do nothing, as ``cuMemFree`` after
        the context is gone may: the addresses may already be someone else's, and
        mapping over them (``MAP_FIXED``) or punching the memfd's number, which the
        process may have reused, would corrupt that owner.  Those that would take
        memory refuse.
        """
        return not self._finalizer.alive

    def _check_live(self, op: str) -> None:
        if self._disposed:
            raise VirtualMemoryError(
                f"{op}: this virtual memory was given back (closed, at interpreter exit, or inherited through fork())"
            )

    # -- hooks ------------------------------------------------------------------
    def _outside(self) -> int:
        return 0 if self._others is None else self._others()

    def _mmap(self, addr: int, nbytes: int, prot: int, flags: int, fd: int, offset: int) -> int:
        p: int | None = self._libc.mmap(addr or None, nbytes, prot, flags, fd, offset)
        if p is None or p == _MAP_FAILED:
            e = ctypes.get_errno()
            raise OSError(e, f"mmap of {format_bytes(nbytes)}: {os.strerror(e)}")
        return p

    def _reserve(self, nbytes: int) -> int:
        self._check_live("reserve")
        # mmap aligns to pages only: over-reserve by a granule and trim both ends.
        g = self.granularity
        raw = self._mmap(0, nbytes + g, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        addr = -(-raw // g) * g
        if addr > raw:
            _check(self._libc.munmap(raw, addr - raw), "munmap")
        _check(self._libc.munmap(addr + nbytes, raw + g - addr), "munmap")
        self._reserved[addr] = nbytes
        return addr

    def _take_lane(self, nbytes: int) -> int | None:
        with _LANES_LOCK:
            addr = _LANES.take(nbytes)
        if addr is not None:
            self._lanes[addr] = nbytes
        return addr

    def _give_lane(self, addr: int, nbytes: int) -> None:
        if self._lanes.pop(addr, None) is not None:  # not given back yet (by the finalizer, at exit)
            with _LANES_LOCK:
                _LANES.give(addr, nbytes)

    def _reserve_at(self, addr: int, nbytes: int) -> bool:
        self._check_live("reserve")
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED_NOREPLACE
        p: int | None = self._libc.mmap(addr, nbytes, _PROT_NONE, flags, -1, 0)
        if p is None or p == _MAP_FAILED:
            return False  # EEXIST: something holds some of it (or ENOMEM: the process has no room)
        if p != addr:  # a kernel without MAP_FIXED_NOREPLACE put it elsewhere
            _check(self._libc.munmap(p, nbytes), "munmap")
            return False
        self._reserved[addr] = nbytes
        return True

    def _free_range(self, addr: int, nbytes: int) -> None:
        if self._disposed:
            return  # unmapped with everything else by the finalizer
        _check(self._libc.munmap(addr, nbytes), "munmap")
        del self._reserved[addr]

    def _create(self, nbytes: int) -> int:
        self._check_live("create")
        off: int
        size: int
        hole = self._holes.take(nbytes)
        if hole is not None:
            return hole
        # No hole fits: take the tail of the file, merging a free hole that ends there.
        last = self._holes.pop_ending_at(self._file_end)
        off = self._file_end if last is None else last
        try:
            os.ftruncate(self._fd, off + nbytes)
        except OSError as e:  # a file-size limit (ulimit -f) or a full /dev/shm caps the memfd too
            if e.errno not in (errno.EFBIG, errno.ENOSPC, errno.ENOMEM):
                raise
            raise DeviceOutOfMemory(
                f"sim virtual memory: its memfd cannot grow to {format_bytes(off + nbytes)} ({e.strerror}: a "
                "file-size limit, ulimit -f, applies to it; Pool(expandable_segments=False) does without it)"
            ) from None
        self._file_end = off + nbytes
        return off

    def _release(self, handle: int, nbytes: int) -> None:
        if self._disposed:
            return  # the memfd is closed, and its number may be another file's now
        if self._punch:
            rc = self._libc.fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, handle, nbytes)
            self._punch = rc == 0  # a kernel without hole punching keeps the pages until close
        self._holes.give(handle, nbytes)

    def _map(self, addr: int, handle: Any, nbytes: int) -> None:
        self._check_live("map")
        self._mmap(addr, nbytes, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, self._fd, handle)

    def _set_access(self, addr: int, nbytes: int) -> None:
        self._check_live("set_access")
        _check(self._libc.mprotect(addr, nbytes, _PROT_RW), "mprotect")

    def _unmap(self, addr: int, nbytes: int) -> None:
        if self._disposed:
            return  # the range is gone: mapping over its addresses could hit whoever has them now
        # Keep the addresses reserved: map inaccessible anonymous memory back over them.
        self._mmap(addr, nbytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)

    def _close(self) -> None:
        self._finalizer()

    def _forked(self) -> None:
        """In a fork's child: this object's bytes become the child's own (Note [Sim memory across fork])."""
        self._lock = threading.RLock()  # a thread of the parent may have held it: it is not here to let go
        if self._disposed:
            return
        for m in self.mappings():
            data = ctypes.string_at(m.addr, m.nbytes) if m.accessible else b""
            prot = _PROT_RW if m.accessible else _PROT_NONE
            self._mmap(m.addr, m.nbytes, prot, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)
            ctypes.memmove(m.addr, data, len(data))
        self._finalizer.detach()  # from now on _disposed: frees do nothing, anything that takes memory refuses
        os.close(self._fd)  # the child's copy of the descriptor only

    def __repr__(self) -> str:
        return f"SimVirtualMemory(capacity={self.capacity}, granularity={self.granularity})"


# Note [Sim memory across fork]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A fork's child inherits the memfd and its ``MAP_SHARED`` mappings: without care,
# a child writing a buffer writes the parent's (issue 36 #5), and its frees punch
# holes in the parent's memory.  So in the child every live instance turns each
# mapping into private anonymous memory holding the same bytes (what fork gives
# every other page: a copy), closes its copy of the memfd and counts as given
# back: frees do nothing, and creating or mapping memory refuses.  Pools made
# before the fork refuse in the child anyway (Note [Fork]); this keeps arrays the
# child already holds from reaching the parent's bytes.  The copy is one pass
# over the mapped bytes, in the child, at the fork (also a subprocess started
# with ``preexec_fn``, which forks through these hooks).
_LIVE: weakref.WeakSet[SimVirtualMemory] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for vm in list(_LIVE):
        vm._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
