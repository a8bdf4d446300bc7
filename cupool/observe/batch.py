"""A memory-aware batch size: grow while memory is plentiful, back off before it runs out.

The rule is the one in the memory-management notes behind cupool: aim for
``target`` usage (70%); when a step used more than ``target + 0.1`` multiply the
batch by 0.8, when it used less than ``target - 0.1`` multiply it by 1.2, and
keep it within ``[minimum, maximum]``.

Usage here is the *peak allocated* bytes since the previous ``update()``, over the
pool's limit, read from a ``Pool.peak_window()``.  Peak, because by the time a training step returns its
activations are usually freed and the current figure says nothing about what the
step needed; allocated rather than reserved, because reserved bytes include
cache that a caching pool keeps after a big step, which would make the batch
shrink for memory nobody is using.
"""

from __future__ import annotations

import math

from ..pool import Pool

_BAND = 0.1
_SHRINK = 0.8
_GROW = 1.2


class BatchSizer:
    """Adjusts a batch size to the memory the previous batches needed.

    Call ``update()`` once per step, after the step, and use the returned size for
    the next one.
    """

    def __init__(self, pool: Pool, initial: int, minimum: int, maximum: int, target: float = 0.7) -> None:
        if not isinstance(pool, Pool):
            raise TypeError(f"BatchSizer needs a cupool.Pool, got {type(pool).__name__}")
        for name, v in (("initial", initial), ("minimum", minimum), ("maximum", maximum)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not minimum <= initial <= maximum:
            raise ValueError(f"need minimum <= initial <= maximum, got {minimum}, {initial}, {maximum}")
        if isinstance(target, bool) or not isinstance(target, (int, float)):
            raise TypeError(f"target must be a number, got {target!r}")
        if not _BAND < target < 1 - _BAND:
            raise ValueError(f"target must be in ({_BAND}, {1 - _BAND}) so that both bands exist, got {target}")
        self.pool = pool
        self.batch = initial
        self.minimum = minimum
        self.maximum = maximum
        self.target = target
        # rounded, so that 0.7 + 0.1 is 0.8 and a usage of exactly 0.8 stays in the band
        self._high = round(target + _BAND, 9)
        self._low = round(target - _BAND, 9)
        self.last_usage: float | None = None
        # A peak window, not a subscription: it costs nothing on the pool's fast path
        # and needs no unsubscribing when the sizer dies (Note [Fast path]).
        self._window = pool.peak_window()

    def update(self, usage: float | None = None) -> int:
        """Adjust the batch to the usage of the step just done; returns the new batch size.

        ``usage`` overrides the measured figure (peak allocated / limit since the
        previous call), for callers who measure memory themselves.
        """
        if usage is None:
            pool = self.pool
            with pool.hold() as view:
                usage = self._window.peak / pool.limit
                self._window.peak = view.books.allocated
        elif isinstance(usage, bool) or not isinstance(usage, (int, float)):
            raise TypeError(f"usage must be a number (a fraction of the pool's limit) or None, got {usage!r}")
        elif not math.isfinite(usage) or usage < 0:
            raise ValueError(f"usage must be a finite number >= 0, got {usage!r}")
        b = self.batch
        if usage > self._high:
            # round, then insist on a step, so that small batches move at all
            b = min(b - 1, round(b * _SHRINK))
        elif usage < self._low:
            b = max(b + 1, round(b * _GROW))
        self.batch = max(self.minimum, min(self.maximum, b))
        self.last_usage = usage
        return self.batch

    def __repr__(self) -> str:
        return (
            f"<cupool.BatchSizer batch={self.batch} in [{self.minimum}, {self.maximum}] "
            f"target={self.target} last_usage={self.last_usage}>"
        )
