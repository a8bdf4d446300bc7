"""Owner lifetimes and leak reports: who allocated what, and is it still alive.

Every allocation the pool hands out already frees itself when its owner dies
(``Allocation.__del__``; arrays from ``Pool.empty`` and the CuPy and Numba hooks
hold their ``Allocation`` as the memory's owner; a ``Movable`` frees itself when
it and the arrays leasing it are gone).  This module adds one thing on top:

* ``SiteTracker``, switched on by ``Pool(track_sites=True)``, remembers for each
  live allocation the line that asked for it (the first frame outside cupool and
  the array libraries that call it) and a short stack.  It holds allocations
  through weak references only, so tracking never keeps memory alive, and an
  entry disappears by itself when its owner dies.

With tracking off, the cost is the one truth test ``Pool.malloc`` makes on its
``sites`` attribute.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .fast import Allocation
from .handles import Movable

#: A weak reference to a tracked allocation or movable buffer.
_Ref = weakref.ref[Allocation | Movable]

#: Top-level packages whose frames are plumbing between the user's line and the pool.
_PLUMBING = frozenset({"cupool", "cupy", "cupyx", "cupy_backends", "numba", "numba_cuda"})

#: Frames kept per allocation, starting at the allocating site and walking outwards.
STACK_DEPTH = 8


@dataclass(frozen=True)
class Leak:
    """A live allocation as ``Pool.leaks()`` reports it."""

    ptr: int | None  # None for a movable buffer that is spilled
    size: int  # bytes requested
    nbytes: int  # device bytes it holds now: its block, size rounded up; 0 while spilled
    stream: Any
    site: str  # "file:line" of the allocating call
    age: float  # seconds since it was allocated
    stack: tuple[str, ...]  # "file:line in function", innermost first
    movable: bool = False

    def __str__(self) -> str:
        where = "spilled" if self.ptr is None else f"at {self.ptr:#x}"
        lines = [f"{self.size} bytes {where}, alive {self.age:.1f} s, allocated at {self.site}"]
        lines += [f"    {frame}" for frame in self.stack]
        return "\n".join(lines)


@dataclass(frozen=True)
class SiteUsage:
    """Live memory of one allocating site, as ``Pool.largest_allocations()`` reports it."""

    site: str
    count: int
    size: int  # bytes requested, summed
    nbytes: int  # device bytes they hold now, summed (as Leak.nbytes)


class _Record:
    __slots__ = ("ref", "born", "frames")

    def __init__(self, ref: _Ref, born: float, frames: tuple[tuple[str, int, str], ...]) -> None:
        self.ref = ref
        self.born = born
        self.frames = frames


class SiteTracker:
    """Allocating sites of a pool's live allocations and movable buffers, held weakly.

    Keyed by object identity rather than pointer: a movable buffer changes address
    when compacted or spilled.  An identity is reused only after its object died;
    an entry is dropped only if it still holds the weak reference that died, so a
    new owner at a reused identity keeps its record.

    The weak references' callbacks take no lock: the cycle collector can run them
    on any thread at any allocation, including one made while this thread holds
    ``_lock`` (in ``live()``), where taking the lock would hang.  They queue the
    dead entry on ``_dead`` (``deque.append`` is atomic) and the next ``add()`` or
    ``live()`` drops it under the lock.
    """

    def __init__(self, depth: int = STACK_DEPTH) -> None:
        self._depth = depth
        self._records: dict[int, _Record] = {}
        self._dead: collections.deque[tuple[int, _Ref]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, allocation: Allocation | Movable) -> None:
        frames = _user_frames(sys._getframe(1), self._depth)
        key = id(allocation)
        dead = self._dead

        def forget(ref: _Ref) -> None:
            dead.append((key, ref))

        rec = _Record(weakref.ref(allocation, forget), time.monotonic(), frames)
        with self._lock:
            self._purge()
            self._records[key] = rec

    def live(self) -> list[tuple[Allocation | Movable, _Record]]:
        with self._lock:
            self._purge()
            recs = list(self._records.values())
        out = []
        for rec in recs:
            a = rec.ref()
            if a is not None and not a.freed:
                out.append((a, rec))
        return out

    def _purge(self) -> None:
        """Drop the records whose owners died (lock held)."""
        records = self._records
        dead = self._dead
        while dead:
            key, ref = dead.popleft()
            rec = records.get(key)
            if rec is not None and rec.ref is ref:
                del records[key]

    def leaks(self, older_than: float | None = None) -> list[Leak]:
        if older_than is not None:
            if isinstance(older_than, bool) or not isinstance(older_than, (int, float)):
                raise TypeError(f"older_than must be a number of seconds or None, got {older_than!r}")
            if older_than < 0:
                raise ValueError(f"older_than must be >= 0 seconds, got {older_than}")
        now = time.monotonic()
        out = []
        for a, rec in self.live():
            age = now - rec.born
            if older_than is not None and age < older_than:
                continue
            out.append(
                Leak(
                    a.ptr, a.size, _device_bytes(a), a.stream, _site(rec.frames), age,
                    tuple(_fmt(f) for f in rec.frames), isinstance(a, Movable),
                )
            )
        out.sort(key=lambda leak: -leak.age)
        return out

    def largest(self, n: int) -> list[SiteUsage]:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {n!r}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        groups: dict[str, list[int]] = {}
        for a, rec in self.live():
            g = groups.setdefault(_site(rec.frames), [0, 0, 0])
            g[0] += 1
            g[1] += a.size
            g[2] += _device_bytes(a)
        rows = [SiteUsage(site, c, s, nb) for site, (c, s, nb) in groups.items()]
        rows.sort(key=lambda r: (-r.nbytes, r.site))
        return rows[:n]


def _device_bytes(a: Allocation | Movable) -> int:
    """The bytes ``a`` holds on the device, measured the same way for both kinds.

    ``Allocation.nbytes`` is its block's size but ``Movable.nbytes`` is the size
    asked for; the report reads the block of either, so that its figures add up
    to the pool's ``allocated_bytes`` (a spilled buffer holds none).
    """
    b = a.block
    return 0 if b is None else b.size


def _user_frames(frame: FrameType | None, depth: int) -> tuple[tuple[str, int, str], ...]:
    while frame is not None and _is_plumbing(frame):
        frame = frame.f_back
    out: list[tuple[str, int, str]] = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(out)


def _is_plumbing(frame: FrameType) -> bool:
    name = frame.f_globals.get("__name__") or ""
    return name.partition(".")[0] in _PLUMBING


def _site(frames: tuple[tuple[str, int, str], ...]) -> str:
    if not frames:
        return "<unknown>"
    filename, lineno, _ = frames[0]
    return f"{filename}:{lineno}"


def _fmt(frame: tuple[str, int, str]) -> str:
    filename, lineno, name = frame
    return f"{filename}:{lineno} in {name}"
