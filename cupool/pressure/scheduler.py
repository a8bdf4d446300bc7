"""Memory pressure: what the pool tries, in which order, when a request cannot be met.

The pool's reclaim ladder is a list of named steps (streams, release, compact,
rehome, gc).  The scheduler adds one, **spill**, which copies unleased movable
buffers to a tier (host memory or an HDF5 file, see ``cupool.pressure.spill``) and frees
their device blocks, and it decides the order of the steps each time the ladder
runs:

* ``lru`` and ``fifo``: the cheap steps first (wait for streams, release cached
  segments, cut holes where stitching will not gather them, stitch), then compact,
  then spill, then ``gc.collect()``: the order of the first design's OOM ladder.
  They differ in the victims spilled first: least recently used (``last_used``,
  set by ``Movable.array()``) or oldest (creation order).
* ``adaptive`` looks at the pool when the request fails.  With fragmentation at
  or above ``fragmentation_threshold`` (0.30) free memory exists but is scattered:
  compact first.  With usage (allocated / limit) at or above ``usage_threshold``
  (0.8) the live data itself does not fit: spill first, then collect garbage,
  and only then compact.  Otherwise garbage is collected before anything is
  moved or spilled, since freeing dead objects costs no copies.  Victims go in
  least-recently-used order.

Spilling goes one victim at a time: the pool retries the request after each, so
no more is spilled than the request needs.  Every step taken is recorded as a
``Decision`` (``Scheduler.decisions``, which also has the reserved bytes given
back to the device) and, for subscribers, as an annotation event of kind
``"reclaim:<step>"`` with address 0 and size the bytes of allocations freed.
Victims are held weakly: a buffer its owner drops while the ladder runs, or
after, dies at once (Note [Lifetimes]).
Spills and restores also emit ``"spill"`` and ``"restore"`` events (from the pool).
The figures a step is judged by are read after folding the pool's fast-path
accounting log, so small blocks freed a moment ago count as freed.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .._units import format_bytes
from ..core.arena import Arena
from ..core.events import LADDER_STEPS
from ..core.handles import Movable
from ..core.movables import Movables
from ..core.rules import release_cuts_holes
from ..core.sizes import LARGE
from ..errors import SpillError, StateError
from .compact import compact, rehome

POLICIES = ("lru", "fifo", "adaptive")
#: The ladder without spilling or stitching, in the order lru and fifo run it (spill goes before gc
#: when a tier exists; stitch after release in a pool that stitches).
BASE_LADDER = tuple(step for step in LADDER_STEPS if step not in ("spill", "stitch"))
_CHEAP = ("streams", "release", "stitch")


@dataclass(frozen=True)
class Decision:
    """One step of the reclaim ladder and what it achieved."""

    step: str
    policy: str
    usage: float  # allocated / limit before the step
    fragmentation: float  # before the step
    bytes_freed: int  # allocations freed (spilled or collected)
    bytes_released: int  # reserved bytes given back to the device
    progress: bool  # whether the step reported that it changed anything
    t_ns: int


class Scheduler:
    """Orders a pool's reclaim ladder and carries out its steps.

    Made by ``Pool(spill=..., spill_policy=...)``; reached as ``pool.scheduler``.
    """

    def __init__(
        self,
        arena: Arena,
        movables: Movables,
        tier: Any = None,
        policy: str = "lru",
        usage_threshold: float = 0.8,
        fragmentation_threshold: float = 0.30,
        history: int = 1000,
    ) -> None:
        if not isinstance(policy, str) or policy not in POLICIES:
            raise ValueError(f"spill_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.tier = tier
        self.policy = policy
        self.usage_threshold = usage_threshold
        self.fragmentation_threshold = fragmentation_threshold
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=history)
        self.spills = 0
        self.bytes_spilled = 0
        self._arena = arena
        self._movables = movables
        self._victims: collections.deque[weakref.ref[Movable]] | None = None
        self._run_spilled = 0
        self._run_failure = ""
        self._last_progress = False
        self._request: tuple[int, int, Any] | None = None  # (size class, bytes, stream) the ladder is for
        #: Whether the ladder runs its gc step: a replay's pool holds no Python garbage, and turns it off.
        self.collect_garbage = True

    # ----------------------------------------------------------------- public
    def order(self) -> list[str]:
        """The order the ladder would run in now (adaptive: for the pool as it is)."""
        with self._locked("scheduler.order()"):
            return self._order()

    def victims(self) -> list[Movable]:
        """Movable buffers that may spill now (on the device, unleased), first victim first."""
        with self._locked("scheduler.victims()"):
            return self._victims_now()

    def spill(self, nbytes: int | None) -> int:
        """Spill victims in policy order until ``nbytes`` (None: all) have left the device; lock held.

        Each victim is a ``Decision`` of step ``"spill"``, as in the ladder, with the
        segments it emptied given back at once (its ``bytes_released``).  Being the
        program's own call, not a ladder step, it emits no ``reclaim:spill`` event:
        a trace shows it by its ``spill`` events alone.
        """
        if self.tier is None:
            raise StateError("spill() needs a pool made with Pool(..., spill='host' or 'file.h5')")
        done = 0
        for m in self._victims_now():
            if nbytes is not None and done >= nbytes:
                break
            self._record("spill", functools.partial(self._spill_and_release, m), annotate=False)
            done += m.size
        return done

    def oom_reason(self) -> str:
        """Why the ladder's spilling did not save the request that is about to fail (lock held)."""
        if self.tier is None:
            return ""
        if self._run_failure:
            return f"spilling did not help: {self._run_failure}; nothing was lost, the buffer stays on the device"
        held = self._holders()
        if self._run_spilled:
            return f"spilled {format_bytes(self._run_spilled)} to {self.tier.describe()}, not enough: {held}"
        return f"nothing could be spilled: no unleased movable buffer is on the device; {held}"

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "tier": None if self.tier is None else self.tier.describe(),
            "spills": self.spills,
            "bytes_spilled": self.bytes_spilled,
            "decisions": len(self.decisions),
        }

    def __iter__(self) -> Iterator[tuple[str, Callable[[], bool]]]:
        return self.ladder()

    def ladder(self, request: tuple[int, int, Any] | None = None) -> Iterator[tuple[str, Callable[[], bool]]]:
        """The ladder for one failing request ``(size class, bytes, stream)``; the pool iterates it with its lock held.

        The pool asks for the next step only when the previous one did not make the
        request fit, which is what lets spill repeat one victim at a time.  Stitching
        needs to know the request; without one it is left out.
        """
        self._request = request
        self._run_spilled = 0
        self._run_failure = ""
        try:
            for name in self._order():
                if name == "spill":
                    while True:
                        yield name, self._step_spill
                        if not self._last_progress:
                            break
                else:
                    # Looked up per run: a table of bound methods would be a
                    # scheduler -> table -> scheduler cycle (Note [Lifetimes]).
                    step = getattr(self, f"_{name}")
                    yield name, functools.partial(self._record, name, step)
        finally:
            self._victims = None
            self._request = None

    # --------------------------------------------------------------- steps
    def _streams(self) -> bool:
        return self._arena.settle_streams(wait=True) > 0

    def _release(self) -> bool:
        request, segments = self._request, self._arena.segments
        holes = request is not None and release_cuts_holes(request[0] == LARGE, segments.stitching)
        return self._arena.release_free_segments(holes=holes) > 0

    def _compact(self) -> bool:
        if not self._arena.books.movables:
            return False
        report = compact(self._arena, self._movables, None, None)
        return bool(report.moves or report.bytes_released)

    def _stitch(self) -> bool:
        request = self._request
        if request is None:
            return False
        kind, size, stream = request
        return self._arena.segments.stitch(kind, size, stream, self._arena.room())

    def _rehome(self) -> bool:
        return rehome(self._arena, self._movables)

    def _gc(self) -> bool:
        # Finalizers that run now find the lock held and queue their frees; drain them.
        gc.collect()
        return self._arena.drain() > 0

    # --------------------------------------------------------------- internals
    @contextlib.contextmanager
    def _locked(self, what: str) -> Iterator[None]:
        """The arena's lock, queued frees applied; refused where it would deadlock (Note [Finalizers])."""
        arena = self._arena
        if arena.holds():
            yield  # inside hold() or a subscriber on this thread: the lock is ours already
            return
        with arena.locked(what):  # Note [Lock protocol]
            yield

    def _order(self) -> list[str]:
        """``order()`` with the lock held."""
        names = [n for n in BASE_LADDER if n != "gc" or self.collect_garbage]
        if self._arena.segments.stitching and self._request is not None and self._request[0] == LARGE:
            names.insert(names.index("release") + 1, "stitch")
        if self.tier is not None:
            names.insert(names.index("gc") if "gc" in names else len(names), "spill")
        if self.policy == "adaptive":
            usage, frag = self._figures()
            if frag >= self.fragmentation_threshold:
                front = ["compact", "rehome", "spill", "gc"]
            elif usage >= self.usage_threshold:
                front = ["spill", "gc", "compact", "rehome"]
            else:
                front = ["gc", "compact", "rehome", "spill"]
            head = [n for n in names if n in _CHEAP]
            mid = [n for n in front if n in names]
            names = head + mid + [n for n in names if n not in head and n not in mid]
        return names

    def _victims_now(self) -> list[Movable]:
        found = [m for m in self._movables.live() if _spillable(m)]
        if self.policy == "fifo":
            found.sort(key=lambda m: m.seq)
        else:
            found.sort(key=lambda m: (m.last_used, m.seq))
        return found

    def _holders(self) -> str:
        """What holds the device when spilling cannot help: leased movables and raw allocations."""
        on_device = self._movables.live()
        leased = [m for m in on_device if m.leases]
        raw = self._arena.view.books.allocated - sum(m.block.size for m in on_device if m.block is not None)
        parts = []
        if leased:
            total = format_bytes(sum(m.size for m in leased))
            parts.append(f"{len(leased)} movable buffer(s) ({total}) are leased by live arrays")
        if raw:
            parts.append(f"{format_bytes(raw)} of raw allocations hold the device and never move")
        return " and ".join(parts) if parts else "the device holds no allocations this pool could move"

    def _figures(self) -> tuple[float, float]:
        books = self._arena.view.books
        limit = self._arena.limit
        return (books.allocated / limit if limit else 1.0), books.fragmentation

    def _step_spill(self) -> bool:
        return self._record("spill", self._spill_one)

    def _spill_one(self) -> bool:
        """Spill the next victim and give back any segment that left empty."""
        self._last_progress = False
        if self.tier is None or self._run_failure:
            return False
        if self._victims is None:
            self._victims = collections.deque(weakref.ref(m) for m in self._victims_now())
        while self._victims:
            m = self._victims.popleft()()
            if m is None or not (m.on_device and _spillable(m)):
                continue  # dropped, leased, freed or spilled since the list was made
            try:
                self._spill(m)
            except SpillError as e:
                self._run_failure = str(e)
                return False
            self._run_spilled += m.size
            self._arena.release_free_segments()
            self._last_progress = True
            return True
        return False

    def _spill(self, m: Movable) -> None:
        """Copy ``m`` to the tier, then free its device block (lock held).

        The one device synchronization of a spill is here: kernels on any stream may
        still be writing the buffer, and the tiers' copies do not wait themselves.
        """
        arena = self._arena
        arena.device.synchronize()
        assert m.block is not None, "a victim is on the device"
        handle = self.tier.store(arena.device, m.block.addr, m.size)  # the block is untouched if this raises
        self._movables.unplace(m, handle)
        self.spills += 1
        self.bytes_spilled += m.size

    def _spill_and_release(self, m: Movable) -> bool:
        """``spill()``'s step: one victim off the device, and the segments that left empty back."""
        self._spill(m)
        self._arena.release_free_segments()
        return True

    def _record(self, name: str, step: Callable[[], bool], annotate: bool = True) -> bool:
        """Run ``step`` and keep its ``Decision``; ``annotate``: also emit ``reclaim:<name>`` (the ladder's)."""
        books = self._arena.view.books
        usage, frag = self._figures()
        alloc0, res0 = books.allocated, books.reserved
        progress = bool(step())
        freed = alloc0 - books.allocated
        released = res0 - books.reserved
        self.decisions.append(
            Decision(name, self.policy, usage, frag, freed, released, progress, time.perf_counter_ns())
        )
        observers = self._arena.observers
        if annotate and observers.active:
            observers.emit(f"reclaim:{name}", 0, max(freed, 0), 0)
        return progress


def _spillable(m: Movable) -> bool:
    return not m.leases and not m.freed and m.block is not None
