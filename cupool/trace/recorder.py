"""Recording a pool's events: an in-memory ring buffer, optionally streamed to an HDF5 trace.

The recorder hangs on ``Pool.subscribe``, so a pool nobody records pays only the
one truth test its event sites already make.  A recording pool pays one Python
call per event that stores the event tuple in a ring slot (see
``benchmarks/bench_recorder.py`` for the measured cost).

All file I/O happens in ``_flush``, under the pool's lock (which is what keeps
the ring consistent): every ``batch`` events, inside the event that fills the
batch, and every ``flush_interval`` seconds from a timer thread, which takes the
lock through ``pool.hold()``.  So a process killed at any moment leaves a trace
with every event up to the last completed flush, and at most the last
``flush_interval`` seconds of events are lost even when the program goes quiet
(the file's side of that promise is ``cupool.trace.format``).

A write that fails (disk full, file-size limit, a kind that does not fit) must
not hurt the pool whose lock the recorder runs under: the recorder stops
writing, keeps its ring buffer going, and raises the error, naming the file and
how many events it holds, at ``stop()`` (the end of the ``with`` block).  The
writer never leaves h5py a file to close after a failed write, which would
crash the process (see ``Hdf5Writer``).

A recording keeps its pool alive only for the length of a ``with`` block (and a
recorder not yet started, so that ``Pool(...).record(path)`` works).  Otherwise it
holds the pool weakly (Note [Lifetimes]): a finished recording keeps nothing
alive, and one started and never stopped ends with its pool: the recorder
detaches, its flush thread writes what the ring holds and closes the file, and a
``ResourceWarning`` says that ``stop()`` was never called.

The recorder reaches the pool only through the ``Recordable`` surface below, and
never imports ``cupool.pool``: the pool imports this module in ``Pool.record()``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import StateError, add_note
from ..pressure.spill import tier_name
from .format import Hdf5Writer, Trace, TraceError

if TYPE_CHECKING:
    from ..core.view import ArenaView

#: Frames from files under this folder are the pool's own, left out of recorded stacks.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class Recordable(Protocol):
    """What a recorder needs of a pool (``cupool.Pool`` is one)."""

    scheduler: Any  # its ``tier`` and ``policy`` are recorded with the configuration

    @property
    def config(self) -> dict[str, Any]: ...

    def hold(self) -> AbstractContextManager[ArenaView]: ...

    def subscribe(
        self, callback: Callable[[tuple], Any], kinds: Iterable[str] | None = None, small_blocks: bool = True
    ) -> Callable[[], None]: ...


def _stack() -> str:
    # Drop the recorder's and the pool's own frames: the user wants their call site.
    frames = [f for f in traceback.extract_stack()[:-3] if not _in_package(f.filename)]
    return "".join(traceback.format_list(frames[-8:]))


@functools.lru_cache(maxsize=4096)
def _in_package(filename: str) -> bool:
    """Whether a frame's file is part of this installed package (not merely under some "cupool" folder)."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


_active: weakref.WeakKeyDictionary[object, list[EventRecorder]] = weakref.WeakKeyDictionary()
_active_lock = threading.Lock()


def active_recorder(pool: object) -> EventRecorder | None:
    """The most recently started recorder still attached to ``pool`` (any object: a lookup), if any."""
    with _active_lock:
        recs = _active.get(pool)
        return recs[-1] if recs else None


class EventRecorder:
    """A ring buffer of the last ``capacity`` events of a pool, optionally streamed to HDF5.

    Use as a context manager (``with pool.record(): ...``) or call ``start``/``stop``.
    When started on a pool that already holds memory, the recorder first writes
    its current segments and live blocks as ``segment_alloc``/``alloc``/``alloc_movable``
    events, and notes in the trace's configuration (``"seed"``) how many events
    that is and which segments are small-pool or preallocated ones, so that a
    replay starts from the same segments and live set.  The live state is read
    and the recorder subscribed under one hold of the pool's lock, so no event
    falls between the two.

    Events reach the file every ``batch`` events (4096, or ``capacity`` when that
    is smaller) and every ``flush_interval`` seconds.  If writing the file fails,
    recording to the file stops (the ring buffer goes on), the pool is unaffected,
    and ``stop()`` raises the ``TraceError``.

    Between ``start()`` and ``stop()`` (outside a ``with`` block) the recorder holds
    its pool weakly: ``pool`` is None once the pool is gone, and a recording that
    was never stopped is flushed and closed then.
    """

    def __init__(
        self,
        pool: Recordable,
        path: str | Path | None = None,
        capacity: int = 1 << 16,
        stacks: bool = False,
        batch: int | None = None,
        flush_interval: float = 1.0,
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if batch is None:  # a small ring still records: its batch is the whole ring
            batch = min(4096, capacity)
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= capacity:
            raise ValueError(f"batch must be an int in [1, capacity={capacity}], got {batch!r}")
        if not 0 < flush_interval < math.inf:
            raise ValueError(f"flush_interval must be a finite number of seconds > 0, got {flush_interval!r}")
        self._pool = weakref.ref(pool)
        self._held: Recordable | None = pool  # strong only before start() and inside `with`
        self._death: weakref.ref | None = None  # calls _pool_died while started
        self.capacity = capacity
        self.stacks = bool(stacks)
        self._ring: list[tuple[Any, ...]] = [()] * capacity  # a slot is read only once written
        self._n = 0
        self._batch = batch
        self._interval = flush_interval
        self._flushed = 0
        self._writer = None if path is None else Hdf5Writer(Path(path), self.stacks)
        # The event count at which the ring is written out: one comparison per event
        # (infinite with no file to write, or after a failed write).
        self._flush_at = batch if self._writer is not None else math.inf
        self._timer: threading.Thread | None = None
        self._stopping = threading.Event()
        self._unsubscribe: Callable[[], None] | None = None
        self._finished = False  # the file is flushed and closed (or abandoned)
        self._config: dict[str, Any] = {}
        self.error: TraceError | None = None

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> EventRecorder:
        if self._unsubscribe is not None:
            raise StateError("this recorder is already started")
        pool = self._pool()
        if pool is None:
            raise StateError("this recorder's pool is gone")
        self._config = recording_config(pool)
        # One hold of the pool's lock for subscribing and reading the live state: no
        # event comes between the two.  Subscribed first: wanting every event turns the
        # pool's parking off, which gives its parked blocks to the heap (Note [Reads park
        # nothing]), so the live state read next is the heap the replay then follows.
        with pool.hold() as view:
            unsubscribe = pool.subscribe(self._on_event)
            try:
                segment = "segment_map" if self._config.get("expandable_segments") else "segment_alloc"
                seed, self._config["seed"] = _live_state(view, time.perf_counter_ns(), segment)
                if self._writer is not None:
                    self._writer.open(self._config)  # a TraceError here leaves nothing subscribed
            except BaseException:
                unsubscribe()
                raise
            for ev in seed:
                self._on_event(ev)
            self._unsubscribe = unsubscribe
        self._death = weakref.ref(pool, self._pool_died)
        self._held = None
        with _active_lock:
            _active.setdefault(pool, []).append(self)
        if self._writer is not None:
            self._stopping.clear()
            self._timer = threading.Thread(target=self._flush_on_timer, name="cupool-trace-flush", daemon=True)
            self._timer.start()
        return self

    def stop(self) -> None:
        """Detach from the pool, flush and close the file; raise the ``TraceError`` of a failed write."""
        if self._unsubscribe is None:
            return
        pool = self._pool()
        if pool is not None:
            # Under the pool's lock, so that no event is still being delivered when the ring is flushed below.
            with pool.hold():
                self._unsubscribe()
            with _active_lock:
                recs = _active.get(pool, [])
                if self in recs:
                    recs.remove(self)
            del pool
        else:  # the pool died first: _pool_died has detached the recorder already
            self._unsubscribe()
        self._unsubscribe = None
        self._death = None
        self._held = None
        if self._timer is not None:
            self._stopping.set()
            self._timer.join()
            self._timer = None
        # No event arrives and no timer runs any more: the last flush needs no lock.
        self._finish()
        if self.error is not None:
            raise self.error

    def _finish(self) -> None:
        """The last flush and closing the file; once, by ``stop()`` or by the flush thread of a dead pool."""
        if self._finished or self._writer is None:
            return
        self._finished = True
        if self.error is None:
            self._flush()
            if self.error is None:
                try:
                    self._writer.close()
                except Exception as e:  # noqa: BLE001 - reported at stop() like any write failure
                    self._fail(e)

    def _pool_died(self, _ref: weakref.ref) -> None:
        """The pool is gone while recording: detach, and let the flush thread write out and close the file.

        Runs wherever the pool died, possibly inside another pool operation, so it
        takes no lock and does no I/O: it marks the subscription dead (safe from a
        finalizer), stops flushing from events, and wakes the flush thread.
        """
        if self._unsubscribe is None:
            return
        self._flush_at = math.inf
        self._unsubscribe()
        self._stopping.set()
        where = "" if self.path is None else f" to {self.path}"
        warnings.warn(
            f"cupool: a recording{where} was never stopped; its pool is gone, so it ended with "
            f"{self._n} events (call stop() or use `with pool.record(...):`)",
            ResourceWarning,
            stacklevel=2,
        )

    def __enter__(self) -> EventRecorder:
        pool = self._pool()
        self.start()
        self._held = pool  # the block bounds the recording: the pool lives at least as long
        return self

    def __exit__(self, et: type | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if ev is None:
            self.stop()
            return
        # The block already raised: that error stays the one reported, the trace's goes in a note.
        try:
            self.stop()
        except TraceError as e:
            add_note(ev, f"cupool: also, the trace was not fully written: {e}")

    # -- the hot path -----------------------------------------------------------
    def _on_event(self, ev: tuple) -> None:
        # Runs under the pool's lock, so the ring needs no lock of its own.
        if self.stacks:
            ev = (*ev, _stack())
        self._ring[self._n % self.capacity] = ev
        self._n += 1
        if self._n >= self._flush_at:
            self._flush()

    def _flush_on_timer(self) -> None:
        """The timer thread: write out what the ring holds every ``flush_interval`` seconds.

        The pool's lock (taken through ``hold()``, as from any thread outside the
        pool) keeps events from arriving while the ring is read and the file written.
        """
        while not self._stopping.wait(self._interval):
            pool = self._pool()
            if pool is None:
                break
            with pool.hold():
                if self.error is None and self._n > self._flushed:
                    self._flush()
            del pool  # held only while flushing: this thread must not keep the pool alive
        if self._pool() is None:
            # The pool died without stop(): no event arrives any more, so the last flush needs no lock.
            self._finish()

    def _flush(self) -> None:
        assert self._writer is not None, "only a recording to a file flushes"
        lo, hi = self._flushed, self._n
        if hi > lo:
            try:
                self._writer.append([self._ring[i % self.capacity] for i in range(lo, hi)])
            except Exception as e:  # noqa: BLE001 - see _fail
                self._fail(e)
                return
            self._flushed = hi
        self._flush_at = hi + self._batch

    def _fail(self, e: BaseException) -> None:
        """Stop writing after a failed write, keeping the error for ``stop()``.

        Any exception is caught, not only OSError: this runs inside a pool
        operation holding the pool's lock, and an exception escaping here would
        abandon that operation half done (a block taken but never handed out, a
        free applied to the heap but not to the caller's handle).
        """
        assert self._writer is not None, "only a write fails"
        reason = str(e) or type(e).__name__
        self.error = TraceError(
            self._writer.path,
            f"writing the trace failed after {self._flushed} events ({reason}); the file holds those "
            f"{self._flushed} events, and recording to it stopped there (the pool was not affected)",
        )
        self._flush_at = math.inf
        self._writer.abandon()

    # -- reading ----------------------------------------------------------------
    @property
    def n_events(self) -> int:
        """Events seen since start (including those the ring no longer holds)."""
        return self._n

    @property
    def flushed(self) -> int:
        """Events already in the HDF5 file: what a reader sees if this process dies now."""
        return self._flushed

    @property
    def dropped(self) -> int:
        """Events that fell out of the ring (they are still in the HDF5 file, if any)."""
        return max(0, self._n - self.capacity)

    def events(self) -> list[tuple]:
        """The retained events, oldest first, as ``(t_ns, kind, addr, size, stream[, stack])``."""
        pool = self._pool() if self._unsubscribe is not None else None
        with contextlib.nullcontext() if pool is None else pool.hold():
            lo = max(0, self._n - self.capacity)
            return [self._ring[i % self.capacity] for i in range(lo, self._n)]

    def trace(self) -> Trace:
        evs = self.events()
        stacks = [e[5] for e in evs] if self.stacks else None
        config = dict(self._config)
        if self.dropped:
            config.pop("seed", None)  # the ring no longer starts with the live state
        return Trace.from_events(evs, config, source="<memory>", stacks=stacks)

    @property
    def path(self) -> Path | None:
        return None if self._writer is None else self._writer.path

    @property
    def pool(self) -> Recordable | None:
        """The pool recorded, or None once it is gone (the recorder holds it weakly)."""
        return self._pool()


def recording_config(pool: Recordable) -> dict[str, Any]:
    """The pool's configuration plus its spill settings, as stored with a trace.

    The spill tier is recorded by name (``"host"``, ``"hdf5"``, or a user tier's
    ``name``); a replay spills to host memory whatever the name says.
    """
    cfg = dict(pool.config)
    cfg["spill"] = tier_name(pool.scheduler.tier)
    cfg["spill_policy"] = pool.scheduler.policy
    return cfg


def _live_state(view: ArenaView, now: int, segment: str) -> tuple[list[tuple], dict[str, Any]]:
    """The pool's segments and live blocks as events, and what a replay needs to rebuild them.

    ``view`` is read under the pool's lock; ``segment`` is the kind a segment is
    reported as (``segment_map`` on virtual memory, Note [Virtual memory]).  A raw block's stream is not kept on
    the block, so it is reported as its segment's stream.
    """
    events: list[tuple] = []
    small: list[int] = []
    kept: list[int] = []
    for seg in view.segments():
        events.append((now, segment, seg.addr, seg.size, seg.stream))
        if seg.small:
            small.append(seg.addr)
        if seg.keep:
            kept.append(seg.addr)
        for b in seg.blocks:
            if not b.free:
                events.append((now, "alloc_movable" if b.movable else "alloc", b.addr, b.size, b.stream))
    return events, {"events": len(events), "small_segments": small, "kept_segments": kept}
