"""Pool events: the one list of kinds, and subscribers that cannot hurt the pool.

An event is a tuple ``(t_ns, kind, address, size, stream)``.  ``stream`` is always
an int (0 where no stream applies, as in PyTorch's snapshots).

Blocks (``size`` is the block's, i.e. rounded, size):

- ``alloc`` / ``free``: a raw allocation (malloc, empty, CuPy, Numba) handed out
  or returned;
- ``alloc_movable`` / ``free_movable``: a movable buffer's device block taken or
  given back (on creation and restore; on free and spill);
- ``move_out`` then ``move_in``: compaction moved a movable block from the first
  address to the second;
- ``segment_alloc`` / ``segment_free``: device memory taken or returned;
- ``segment_map`` / ``segment_unmap``: granules of virtual memory mapped at or
  unmapped from ``[address, address + size)`` (expandable segments and
  stitching, Note [Virtual memory]), as PyTorch's expandable segments report them.

Annotations: ``oom`` (size requested), ``compact`` (size: bytes moved),
``spill`` / ``restore`` (after the matching free_movable / alloc_movable) and
``reclaim:<step>`` for each step of the reclaim ladder, and ``call:empty_cache``
/ ``call:compact`` for the program's own ``Pool.empty_cache()`` and
``Pool.compact()`` (size: bytes released, bytes moved), after what the call did,
so that a replay makes the call at the same point even when it released or moved
nothing; their address is 0 unless it names a block.  New kinds are appended:
a trace stores its kinds by name, so older traces read as they were.

See Note [Subscribers] below for the rules a subscriber lives by.

Note [Subscribers]
~~~~~~~~~~~~~~~~~~
A subscriber runs with the pool's lock held, in the middle of a pool operation.
So: it must not call back into the pool (reading ``pool.view`` is fine); and **a
subscriber that raises is detached** and its exception logged on the ``cupool``
logger, while the operation that emitted the event completes as if nothing
happened. The alternative, letting the exception out, abandons a half-done
operation (a block freed in the heap but not in the books) and corrupts the pool
for good. The subscriber list is replaced, never mutated, so ``emit`` reads it
without a lock; ``unsubscribe`` only marks a subscription dead, so it is safe from
a finalizer. An ``on_move`` callback that raises is logged the same way, and never
breaks the unrelated call (another buffer's ``.array()``, a ``malloc``) that
happened to trigger the move.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from .interrupts import defer

log = logging.getLogger("cupool")

#: The steps of the reclaim ladder, in the pool's default order (the scheduler adds "spill").
LADDER_STEPS = ("streams", "release", "stitch", "compact", "rehome", "gc", "spill")

#: Every event kind a pool emits, in a fixed order (trace files store kinds as indices into it).
KINDS: tuple[str, ...] = (
    "alloc", "free", "alloc_movable", "free_movable", "move_out", "move_in", "segment_alloc",
    "segment_free", "segment_map", "segment_unmap", "compact", "spill", "restore", "oom",
    *(f"reclaim:{step}" for step in LADDER_STEPS),
    "call:empty_cache", "call:compact",
)

#: Kinds emitted inside a pool operation, before the books reach a state any caller can see.
MID_OPERATION = frozenset({"segment_alloc", "segment_map", "move_out", "move_in"})

#: Kinds whose subscribers need every small block's allocation and free as it happens.
_BLOCK_KINDS = frozenset({"alloc", "free"})

Event = tuple[int, str, int, int, int]
Callback = Callable[[Event], Any]


class _Subscription:
    __slots__ = ("callback", "kinds", "small", "live")

    def __init__(self, callback: Callback, kinds: frozenset[str] | None, small: bool) -> None:
        self.callback = callback
        self.kinds = kinds
        self.small = small
        self.live = True


class Observers:
    """The subscribers of one pool.

    ``active`` is the one flag a pool operation tests before building an event, so
    a pool nobody watches pays one attribute read per event.  ``exact`` says that
    some subscriber wants every small block's alloc and free: only then must the
    pool's fast path (parked small blocks, see Note [Fast path]) stay off.

    The subscriber list is replaced, never mutated, so ``emit`` reads it without a
    lock.  ``unsubscribe`` marks a subscription dead and drops it from the list
    when the list's own small lock is free (else whoever holds that lock drops
    it), never waiting: that makes it safe from a finalizer that runs while the
    pool's lock is held (Note [Finalizers]).
    """

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._on_change = on_change  # told when ``exact`` may have changed
        self._subs: tuple[_Subscription, ...] = ()
        self._lock = threading.Lock()  # serialises subscribe and pruning, never held while emitting
        self._stale = False
        self.active = False
        self.exact = False
        # The thread delivering an event now: a pool call from a callback would wait for
        # the lock that thread holds (Note [Subscribers]), so the arena refuses it instead.
        self.running: int | None = None

    def subscribe(
        self, callback: Callback, kinds: Iterable[str] | None = None, small: bool = True
    ) -> Callable[[], None]:
        if not callable(callback):
            raise TypeError(f"subscribe() takes a callable, got {callback!r}")
        wanted = _check_kinds(kinds)
        if not isinstance(small, bool):
            raise TypeError(f"small must be True or False, got {small!r}")
        sub = _Subscription(callback, wanted, small)
        with self._lock:
            self._subs = tuple(s for s in self._subs if s.live) + (sub,)
            self._refresh()
        if self._stale:  # an unsubscribe found the lock busy just now
            self._prune()

        def unsubscribe() -> None:
            # Dropped from the list at once, not at the next event: a pool nobody uses
            # again must not keep a closed subscriber (and what it holds) alive.
            sub.live = False
            self._stale = True
            self._prune()

        return unsubscribe

    def emit(self, kind: str, addr: int, size: int, stream: int, small: bool = False) -> None:
        """Deliver one event.  ``small``: a small-pool block's alloc or free (see ``subscribe``)."""
        ev = (time.perf_counter_ns(), kind, addr, size, stream)
        outer, self.running = self.running, threading.get_ident()
        try:
            self._deliver(ev, kind, small)
        finally:
            self.running = outer
        if self._stale:
            self._prune()

    def _deliver(self, ev: Event, kind: str, small: bool) -> None:
        for sub in self._subs:
            if not sub.live or (sub.kinds is not None and kind not in sub.kinds) or (small and not sub.small):
                continue
            try:
                sub.callback(ev)
            except KeyboardInterrupt as e:  # raised at the operation's end (Note [Interrupts])
                defer(e)
            except Exception:  # noqa: BLE001 - Note [Subscribers]: a raising subscriber is detached
                sub.live = False
                self._stale = True
                log_callback_error(f"cupool: subscriber {sub.callback!r} raised on a {kind} event; it is detached")

    def detach_all(self) -> None:
        """Every subscription ends now (a dropped pool's: Note [Lifetimes]); never waits, like ``unsubscribe``."""
        for s in self._subs:
            s.live = False
        self._stale = True
        self._prune()

    def _prune(self) -> None:
        if self._lock.acquire(False):  # busy: a subscribe is running and prunes anyway
            try:
                self._subs = tuple(s for s in self._subs if s.live)
                self._stale = False
                self._refresh()
            finally:
                self._lock.release()

    def _refresh(self) -> None:
        subs = self._subs
        self.active = bool(subs)
        self.exact = any(s.small and (s.kinds is None or s.kinds & _BLOCK_KINDS) for s in subs)
        if self._on_change is not None:
            self._on_change()


def log_callback_error(what: str) -> None:
    """Log the exception being handled, as text: a kept traceback would keep the frames that
    raised alive, and with them whatever they held (an array pinning a buffer, a lock's holder)."""
    log.error("%s\n%s", what, traceback.format_exc().rstrip())


def _check_kinds(kinds: Iterable[str] | None) -> frozenset[str] | None:
    if kinds is None:
        return None
    if isinstance(kinds, str):
        kinds = (kinds,)
    try:
        wanted = frozenset(kinds)
    except TypeError:
        raise TypeError(f"kinds must be None or an iterable of event kind names, got {kinds!r}") from None
    unknown = sorted(str(k) for k in wanted if k not in KINDS)
    if unknown:
        raise ValueError(f"kinds: unknown event kind(s) {', '.join(unknown)}; known: {', '.join(KINDS)}")
    return wanted
