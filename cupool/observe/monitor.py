"""Alerts before trouble comes: memory usage and fragmentation thresholds.

``Monitor`` watches a pool through ``Pool.subscribe`` and raises an alert when a
figure *crosses* a threshold, not on every event while it stays above one; the
alert re-arms once the figure falls back below the threshold minus a small
hysteresis, so a pool hovering at a threshold does not flood the log.

* **Usage** is reserved / limit: the share of the memory the pool may take that
  it has taken from the device.  Reserved, not allocated, because reserved bytes
  are what the device (and every other library on it) has lost, and because the
  pool runs out when *reserved* reaches the limit and it cannot grow.  Defaults:
  warning at 0.8, critical at 0.9.
* **Fragmentation** is (reserved - allocated) / reserved, and its severity band
  is reported: good < 0.15 <= moderate < 0.30 <= serious < 0.40 <= severe.  The
  ratio alone means little: a fresh 20 MiB segment holding one 4 MiB block is
  "severe" by it, yet harms nobody while the pool may still grow.  Free bytes
  hurt only under pressure, so the ratio alerts (a warning, at 0.30) only while
  usage is at least ``min_usage`` (0.5): free bytes the pool holds while near
  its limit are bytes no other request can get.  And a request the pool
  refused although its free bytes, with what it may still grow by, would have
  served it, had they lain together, is a **critical** fragmentation alert
  naming the request and the largest free block: fragmentation, not the
  amount of live data, made that request fail.  ``min_reserved`` keeps pools
  holding little memory quiet too.  ``Alert.fragmentation`` is the ratio
  whatever the metric, as a stat.

The monitor subscribes with ``small_blocks=False`` and leaves out the kinds
emitted mid-operation, so watching a pool does not switch its fast path off: a
small block's allocation or free reaches the monitor through ``pool.view.books``
at its next event (any large block, segment, movable buffer, compaction, ...),
not at once.

The subscription callback runs under the pool's lock, so it only reads the
pool's figures and does arithmetic.  Alerts are handed to a dispatcher thread
that logs them (logger ``"cupool"``) and calls the user's callbacks outside the
lock, where a callback may safely call into the pool; ``flush()`` waits for it.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._units import format_bytes, parse_size
from ..core.events import KINDS, MID_OPERATION
from ..pool import Pool

log = logging.getLogger("cupool")

#: Upper bounds of the fragmentation severity bands (the last band is open).
SEVERITY_BANDS = ((0.15, "good"), (0.30, "moderate"), (0.40, "serious"))

_LEVELS = ("ok", "warning", "critical")
#: What a monitor listens to: every kind but those emitted mid-operation, when the
#: books show a state no caller ever sees.
_KINDS = frozenset(KINDS) - MID_OPERATION
_LOG_LEVEL = {"ok": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL}


def severity(fragmentation: float) -> str:
    """The severity band of a fragmentation ratio: good, moderate, serious or severe."""
    for bound, name in SEVERITY_BANDS:
        if fragmentation < bound:
            return name
    return "severe"


@dataclass(frozen=True)
class Alert:
    """One threshold crossing.

    ``level`` is ``"warning"`` or ``"critical"`` when a figure rises past a
    threshold, and ``"ok"`` when it has fallen back below the lowest one.  A
    request refused for fragmentation is an alert of its own, not a crossing:
    ``"critical"``, with ``request`` and ``largest_free`` set and threshold 0.
    """

    metric: str  # "usage" or "fragmentation"
    level: str
    value: float
    threshold: float
    severity: str  # fragmentation band of the pool at the time
    reserved: int
    allocated: int
    limit: int
    t_ns: int
    fragmentation: float = 0.0  # (reserved - allocated) / reserved at the time, whatever the metric
    request: int = 0  # a refused request's bytes (a critical fragmentation alert), else 0
    largest_free: int = 0  # the pool's largest free block when that request was refused

    @property
    def message(self) -> str:
        figures = (
            f"reserved {format_bytes(self.reserved)} of {format_bytes(self.limit)}, "
            f"allocated {format_bytes(self.allocated)}"
        )
        if self.level == "ok":
            return f"cupool: {self.metric} back to {self.value:.3f}, below {self.threshold:.2f} ({figures})"
        if self.request:
            return (
                f"cupool: {self.level}: fragmentation refused a request of {format_bytes(self.request)}: "
                f"{format_bytes(self.reserved - self.allocated)} free in the pool and "
                f"{format_bytes(max(self.limit - self.reserved, 0))} it may still grow by, but its largest free "
                f"block is {format_bytes(self.largest_free)}; fragmentation {self.value:.3f}, {self.severity} "
                f"({figures})"
            )
        usage = self.reserved / self.limit if self.limit else 0.0
        extra = f", {self.severity}, at usage {usage:.2f}" if self.metric == "fragmentation" else ""
        return (
            f"cupool: {self.level}: {self.metric} {self.value:.3f} passed {self.threshold:.2f}{extra} ({figures})"
        )


class _Gauge:
    """Crossing detection for one figure with ascending thresholds."""

    __slots__ = ("metric", "thresholds", "hysteresis", "level")

    def __init__(self, metric: str, thresholds: tuple[float, ...], hysteresis: float) -> None:
        self.metric = metric
        self.thresholds = thresholds
        self.hysteresis = hysteresis
        self.level = 0

    def update(self, value: float) -> tuple[str, float] | None:
        """The (level, threshold) to report if ``value`` changed the gauge's state, else None."""
        raised = 0
        for i, t in enumerate(self.thresholds, 1):
            if value >= t:
                raised = i
        if raised > self.level:
            self.level = raised
            return _LEVELS[raised], self.thresholds[raised - 1]
        was = self.level
        while self.level and value < self.thresholds[self.level - 1] - self.hysteresis:
            self.level -= 1
        if was and not self.level:
            return "ok", self.thresholds[0]
        return None


class Monitor:
    """Threshold alerts for a pool, delivered to callbacks and the ``cupool`` logger.

    Use as a context manager, or call ``close()``: the monitor stays subscribed
    to the pool (and its dispatcher thread alive) until then.
    """

    def __init__(
        self,
        pool: Pool,
        callbacks: Callable[[Alert], Any] | list[Callable[[Alert], Any]] | None = None,
        usage_warning: float = 0.8,
        usage_critical: float = 0.9,
        fragmentation: float = 0.30,
        hysteresis: float = 0.05,
        min_reserved: int | str = 0,
        history: int = 1000,
        min_usage: float = 0.5,
    ) -> None:
        if not isinstance(pool, Pool):
            raise TypeError(f"Monitor watches a cupool.Pool, got {type(pool).__name__}")
        for name, v in (
            ("usage_warning", usage_warning),
            ("usage_critical", usage_critical),
            ("fragmentation", fragmentation),
        ):
            _check_fraction(name, v, "(0, 1]")
        _check_fraction("hysteresis", hysteresis, "[0, 1)")
        _check_fraction("min_usage", min_usage, "[0, 1]")
        if usage_critical < usage_warning:
            raise ValueError(
                f"usage_critical ({usage_critical}) must not be below usage_warning ({usage_warning})"
            )
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be a positive int, got {history!r}")
        cbs = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        for cb in cbs:
            if not callable(cb):
                raise TypeError(f"callbacks must be callables, got {cb!r}")
        # Held weakly (Note [Lifetimes]): the pool's subscribers are reachable from its arena, which
        # outlives a dropped pool while its allocations live; a strong reference here kept a pool
        # whose Monitor was never closed alive for good.  Its death stops the dispatcher.
        self._pool = weakref.ref(pool)
        self.min_reserved = parse_size(min_reserved, pool.limit, "min_reserved")
        #: Fragmentation warns only while reserved / limit is at least this.
        self.min_usage = min_usage
        self._usage = _Gauge("usage", (usage_warning, usage_critical), hysteresis)
        self._frag = _Gauge("fragmentation", (fragmentation,), hysteresis)
        self._callbacks = cbs
        self.alerts: collections.deque[Alert] = collections.deque(maxlen=history)
        self._queue: queue.SimpleQueue[Alert | threading.Event | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._dispatch, name="cupool-monitor", daemon=True)
        self._thread.start()
        weakref.finalize(pool, self._queue.put, None)
        # small_blocks=False keeps the pool's fast path on: small blocks' allocs and
        # frees reach the books, and the monitor sees them at its next event.
        self._unsubscribe = pool.subscribe(self._on_event, kinds=_KINDS, small_blocks=False)
        with pool.hold():
            self._evaluate()

    # ----------------------------------------------------------------- public
    @property
    def pool(self) -> Pool | None:
        """The pool watched, or None once it is gone (a monitor does not keep its pool alive)."""
        return self._pool()

    def add_callback(self, callback: Callable[[Alert], Any]) -> None:
        if not callable(callback):
            raise TypeError(f"add_callback() takes a callable, got {callback!r}")
        self._callbacks.append(callback)

    @property
    def usage_level(self) -> str:
        """The usage gauge's state: ok, warning or critical."""
        return _LEVELS[self._usage.level]

    @property
    def fragmentation_level(self) -> str:
        """The fragmentation gauge's state: ok or warning."""
        return _LEVELS[self._frag.level]

    def flush(self, timeout: float | None = 10.0) -> None:
        """Wait until every alert raised so far has been logged and passed to the callbacks."""
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout):
            raise TimeoutError("cupool monitor: alert callbacks did not finish in time")

    def close(self) -> None:
        """Unsubscribe from the pool, deliver pending alerts and stop the dispatcher."""
        if self._thread.is_alive():
            self._unsubscribe()
            self._queue.put(None)
            self._thread.join()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- internals
    def _on_event(self, event: tuple[int, str, int, int, int]) -> None:
        # Under the pool's lock.  The subscription leaves out the events that come in
        # the middle of a pool operation, when the books show a state no caller ever
        # sees: a segment_alloc comes before its block is taken (fresh reserved bytes,
        # nothing allocated yet), and the moves of a compaction or a re-home are
        # emitted while the old segment and its exact-size replacement are both
        # reserved.  The event that ends the operation is evaluated instead.
        if event[1] == "oom":
            self._refused(event[3])
        self._evaluate()

    def _evaluate(self) -> None:
        pool = self.pool
        if pool is None:
            return
        books = pool.view.books  # folds the frees the fast path has only logged so far
        reserved = books.reserved
        allocated = books.allocated
        usage = reserved / pool.limit if pool.limit else 0.0
        frag = (reserved - allocated) / reserved if reserved else 0.0
        pressed = reserved >= self.min_reserved and usage >= self.min_usage
        crossings = ((self._usage, usage), (self._frag, frag if pressed else 0.0))
        for gauge, value in crossings:
            change = gauge.update(value)
            if change is not None:
                level, threshold = change
                self._raise(Alert(
                    gauge.metric, level, value, threshold, severity(frag), reserved, allocated, pool.limit,
                    time.perf_counter_ns(), frag,
                ))

    def _refused(self, request: int) -> None:
        """A refused request is fragmentation's doing when the pool's free bytes, and what its limit
        still allows, add up to it but no free block is that large (an injected refusal finds one)."""
        pool = self.pool
        if pool is None:
            return
        books = pool.view.books
        reserved, allocated = books.reserved, books.allocated
        if request == 0 or request > pool.limit - allocated:
            return  # the live data itself leaves no room (or the request alone is over the limit)
        largest = max((b.size for seg in pool.view.segments() for b in seg.blocks if b.free), default=0)
        if largest >= request:
            return
        frag = (reserved - allocated) / reserved if reserved else 0.0
        self._raise(Alert(
            "fragmentation", "critical", frag, 0.0, severity(frag), reserved, allocated,
            pool.limit, time.perf_counter_ns(), frag, request, largest,
        ))

    def _raise(self, alert: Alert) -> None:
        self.alerts.append(alert)
        self._queue.put(alert)

    def _dispatch(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            log.log(_LOG_LEVEL[item.level], item.message)
            for cb in list(self._callbacks):
                try:
                    cb(item)
                except Exception:  # a broken callback must not silence the others
                    log.exception("cupool monitor: alert callback %r raised", cb)


def _check_fraction(name: str, value: object, span: str) -> None:
    """Refuse ``value`` unless it is a number in ``span``: "(0, 1]", "[0, 1)" or "[0, 1]"."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    low_ok = value > 0 if span[0] == "(" else value >= 0
    high_ok = value < 1 if span[-1] == ")" else value <= 1
    if not (low_ok and high_ok):
        raise ValueError(f"{name} must be in {span}, got {value}")
