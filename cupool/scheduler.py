"""Memory pressure: what the pool tries, in which order, when a request cannot be met.

The pool's reclaim ladder is a list of named steps (streams, release, compact,
rehome, gc).  The scheduler adds one, **spill**, which copies unleased movable
buffers to a tier (host memory or an HDF5 file, see ``cupool.spill``) and frees
their device blocks, and it decides the order of the steps each time the ladder
runs:

* ``lru`` and ``fifo``: the cheap steps first (wait for streams, release cached
  segments), then compact, then spill, then ``gc.collect()``, as in DESIGN.md.
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
Spills and restores also emit ``"spill"`` and ``"restore"`` events (from the pool).
The figures a step is judged by are read after folding the pool's fast-path
accounting log, so small blocks freed a moment ago count as freed.
"""

from __future__ import annotations

import collections
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._units import format_bytes
from .spill import HDF5Tier, HostTier, SpillError, make_tier

if TYPE_CHECKING:
    from .movable import Movable
    from .pool import Pool

POLICIES = ("lru", "fifo", "adaptive")
_CHEAP = ("streams", "release")


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
    """Orders a pool's reclaim ladder and carries out its spill step.

    Made by ``Pool(spill=..., spill_policy=...)``; reached as ``pool.scheduler``.
    """

    def __init__(
        self,
        pool: Pool,
        spill: Any = None,
        policy: str = "lru",
        usage_threshold: float = 0.8,
        fragmentation_threshold: float = 0.30,
        history: int = 1000,
    ) -> None:
        if not isinstance(policy, str) or policy not in POLICIES:
            raise ValueError(f"spill_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.tier: HostTier | HDF5Tier | None = make_tier(spill, pool)
        self.policy = policy
        self.usage_threshold = usage_threshold
        self.fragmentation_threshold = fragmentation_threshold
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=history)
        self.spills = 0
        self.bytes_spilled = 0
        # Weakly, and the ladder's steps by method name: holding the pool or its bound
        # methods would make a Pool -> Scheduler -> Pool cycle, so a dropped pool (and
        # its HDF5 spill file) would linger until the cycle collector ran.
        self._pool_ref = weakref.ref(pool)
        self._methods = dict(pool.LADDER)
        self._base = [name for name, _ in pool.LADDER]
        self._victims: collections.deque[Movable] | None = None
        self._run_spilled = 0
        self._run_failure = ""
        self._last_progress = False

    # ----------------------------------------------------------------- public
    def order(self) -> list[str]:
        """The order the ladder would run in now (adaptive: for the pool as it is)."""
        pool = self._pool
        with pool._lock:
            pool._drain()  # frees queued by finalizers and the fast path's log count
            return self._order()

    def victims(self) -> list[Movable]:
        """Movable buffers that may spill now (on the device, unleased), first victim first."""
        pool = self._pool
        with pool._lock:
            pool._drain()
            return self._victims_now()

    def spill(self, nbytes: int | None) -> int:
        """Spill victims in policy order until ``nbytes`` (None: all) have left the device; with the lock held."""
        if self.tier is None:
            raise RuntimeError("spill() needs a pool made with Pool(..., spill='host' or 'file.h5')")
        done = 0
        for m in self._victims_now():
            if nbytes is not None and done >= nbytes:
                break
            self._spill(m)
            done += m.size
        return done

    def oom_reason(self) -> str:
        """Why the ladder's spilling did not save the request that is about to fail (lock held)."""
        if self._run_failure:
            return f"spilling did not help: {self._run_failure}; nothing was lost, the buffer stays on the device"
        if self.tier is None:
            idle = self._victims_now()
            if not idle:
                return ""
            total = format_bytes(sum(m.size for m in idle))
            return (
                f"{len(idle)} unleased movable buffer(s) ({total}) could be spilled with "
                f"Pool(spill='host') or Pool(spill='file.h5')"
            )
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
        """The ladder for one failing request; the pool iterates it with its lock held.

        The pool asks for the next step only when the previous one did not make the
        request fit, which is what lets spill repeat one victim at a time.
        """
        self._victims = None
        self._run_spilled = 0
        self._run_failure = ""
        pool = self._pool
        for name in self._order():
            if name == "spill":
                while True:
                    yield name, self._step_spill
                    if not self._last_progress:
                        break
            else:
                yield name, _Recorded(self, name, getattr(pool, self._methods[name]))

    # --------------------------------------------------------------- internals
    @property
    def _pool(self) -> Pool:
        pool = self._pool_ref()
        assert pool is not None, "the scheduler outlived its pool"
        return pool

    def _order(self) -> list[str]:
        """``order()`` with the lock held."""
        names = list(self._base)
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
        """``victims()`` with the lock held."""
        found = [m for m in _movables(self._pool) if _spillable(m)]
        if self.policy == "fifo":
            found.sort(key=lambda m: m.seq)
        else:
            found.sort(key=lambda m: (m.last_used, m.seq))
        return found

    def _holders(self) -> str:
        """What holds the device when spilling cannot help: leased movables and raw allocations."""
        from .pool import _B_ALLOC

        pool = self._pool
        if pool._log:
            pool._fold()
        on_device = _movables(pool)
        leased = [m for m in on_device if m._leases]
        raw = pool._cur[_B_ALLOC][2] - sum(m._block.size for m in on_device)
        parts = []
        if leased:
            total = format_bytes(sum(m.size for m in leased))
            parts.append(f"{len(leased)} movable buffer(s) ({total}) are leased by live arrays")
        if raw:
            parts.append(f"{format_bytes(raw)} of raw allocations hold the device and never move")
        return " and ".join(parts) if parts else "the device holds no allocations this pool could move"

    def _figures(self) -> tuple[float, float]:
        """Usage and fragmentation now (lock held).

        Folds the fast path's accounting log first: frees of small blocks are only
        logged until then, and the tables alone would show them still allocated.
        """
        from .pool import _B_ALLOC

        pool = self._pool
        if pool._log:
            pool._fold()
        allocated = pool._cur[_B_ALLOC][2]
        return (allocated / pool.limit if pool.limit else 1.0), pool._fragmentation()

    def _step_spill(self) -> bool:
        return self._record("spill", self._spill_one)

    def _spill_one(self) -> bool:
        """Spill the next victim and give back any segment that left empty."""
        self._last_progress = False
        if self.tier is None or self._run_failure:
            return False
        if self._victims is None:
            self._victims = collections.deque(self._victims_now())
        while self._victims:
            m = self._victims.popleft()
            if not (m.on_device and _spillable(m)):
                continue  # leased, freed or spilled since the list was made
            try:
                self._spill(m)
            except SpillError as e:
                self._run_failure = str(e)
                return False
            self._run_spilled += m.size
            self._pool._release_free_segments()
            self._last_progress = True
            return True
        return False

    def _spill(self, m: Movable) -> None:
        """Copy ``m`` to the tier, then free its device block (lock held).

        The one device synchronization of a spill is here: kernels on any stream may
        still be writing the buffer, and the tiers' copies do not wait themselves.
        """
        pool = self._pool
        old = m._block.addr
        pool.device.synchronize()
        m._spilled = self.tier.store(pool.device, old, m.size)  # the block is untouched if this raises
        pool._unplace(m)
        if m.on_move is not None:
            pool._moved_pending.append((m, old, None))
        self.spills += 1
        self.bytes_spilled += m.size

    def _record(self, name: str, step: Callable[[], bool]) -> bool:
        from .pool import _B_ALLOC, _B_RES

        pool = self._pool
        usage, frag = self._figures()  # folds the log: the figures below are current
        alloc0, res0 = pool._cur[_B_ALLOC][2], pool._cur[_B_RES][2]
        progress = bool(step())
        if pool._log:
            pool._fold()
        freed = alloc0 - pool._cur[_B_ALLOC][2]
        released = res0 - pool._cur[_B_RES][2]
        self.decisions.append(
            Decision(name, self.policy, usage, frag, freed, released, progress, time.perf_counter_ns())
        )
        if pool._observers:
            pool._emit(f"reclaim:{name}", 0, max(freed, 0), 0)
        return progress


class _Recorded:
    """A ladder step that records a Decision when the pool runs it."""

    __slots__ = ("_sched", "_name", "_step")

    def __init__(self, sched: Scheduler, name: str, step: Callable[[], bool]) -> None:
        self._sched = sched
        self._name = name
        self._step = step

    def __call__(self) -> bool:
        return self._sched._record(self._name, self._step)


def _spillable(m: Movable) -> bool:
    return not m._leases and not m._freed and m._block is not None


def _movables(pool: Pool) -> list[Movable]:
    out = []
    for heap in pool._heaps:
        for seg in heap.segments.values():
            for b in seg.blocks():
                ref = b.payload
                if not b.free and type(ref) is weakref.ReferenceType:
                    m = ref()
                    if m is not None:
                        out.append(m)
    return out
