"""Fault injection: make a pool refuse allocations, compact or spill between steps, or shrink its limit.

Refusals go through the pool's own door (``Pool.set_admission``), so the code
under test meets the very ``OutOfMemoryError`` a full device gives, and the pool
is left exactly as it was (only ``num_ooms`` and an ``oom`` event record it).
A shrunk limit is ``Pool.set_limit``: the pool gives cached memory back and
grows no further.  Every fault is a context manager that undoes itself; mix
``FaultRules`` into a ``PoolStateMachine`` to let hypothesis place them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from .._units import format_bytes, parse_size
from ..core.sizes import PAGE
from ..errors import OutOfMemoryError, StateError
from ..pool import Pool
from .strategies import sizes

__all__ = ["REASON", "AllocationFaults", "FaultRules", "fail_allocations", "fail_nth_allocation", "shrunk_limit"]

#: The reason an injected refusal gives, so a test can tell it from a real one.
REASON = "refused by cupool.testing.faults"


#: The fault blocks entered on each pool, innermost last (held weakly: a dropped pool takes its list along).
_active: weakref.WeakKeyDictionary[Pool, list[AllocationFaults]] = weakref.WeakKeyDictionary()


class AllocationFaults:
    """Refuse the requests ``decide(index, nbytes, what)`` picks, while entered.

    ``index`` counts requests from 1 since entering; ``what`` is ``"malloc"`` or
    ``"movable"`` (``empty``, CuPy and Numba allocations are mallocs).
    ``requests`` counts them and ``refused`` lists ``(index, nbytes, what)`` of
    those refused.  A refusal is an ``OutOfMemoryError`` whose ``reason`` is
    ``REASON``; leaving the block gives the pool back the check it had on
    entering (``Pool.admission``): the enclosing block's, your own from
    ``Pool.set_admission``, or none.

    Blocks nest: the innermost decides first, and a request it lets through goes
    on to the enclosing block (which counts it).  They must be left in the
    reverse order of entering, as ``with`` does; leaving an outer block first, or
    entering one block twice, raises ``RuntimeError``.
    """

    def __init__(self, pool: Pool, decide: Callable[[int, int, str], bool]) -> None:
        if not isinstance(pool, Pool):
            raise TypeError(f"AllocationFaults needs a cupool.Pool, got {type(pool).__name__}")
        if not callable(decide):
            raise TypeError(f"decide must be callable, got {decide!r}")
        self.pool = pool
        self.decide = decide
        self.requests = 0
        self.refused: list[tuple[int, int, str]] = []
        self._outer: Callable[[int, str], str | None] | None = None  # the check in place before entering

    def _check(self, nbytes: int, what: str) -> str | None:
        self.requests += 1
        if self.decide(self.requests, nbytes, what):
            self.refused.append((self.requests, nbytes, what))
            return REASON
        return None if self._outer is None else self._outer(nbytes, what)

    def __enter__(self) -> AllocationFaults:
        stack = _active.setdefault(self.pool, [])
        if self in stack:
            raise StateError(f"{self!r} is already entered; make a new one to nest")
        self._outer = self.pool.admission  # an outer fault block's, or the user's own, or None
        self.pool.set_admission(self._check)
        stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        stack = _active.get(self.pool, [])
        if self not in stack:
            return  # left already (FaultRules leaves its faults before teardown)
        if stack[-1] is not self:
            raise StateError(
                f"{self!r} left before the fault block entered inside it ({stack[-1]!r}); leave blocks innermost first"
            )
        stack.pop()
        self.pool.set_admission(self._outer)
        self._outer = None

    def __repr__(self) -> str:
        return f"<AllocationFaults on {self.pool!r}: {self.requests} request(s), {len(self.refused)} refused>"


def fail_nth_allocation(pool: Pool, n: int, what: tuple[str, ...] = ("malloc", "movable")) -> AllocationFaults:
    """Refuse the ``n``-th request (counting from 1, only requests of the kinds in ``what``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"fail_nth_allocation: n must be an int >= 1, got {n!r}")
    seen = [0]

    def decide(index: int, nbytes: int, kind: str) -> bool:
        if kind not in what:
            return False
        seen[0] += 1
        return seen[0] == n

    return AllocationFaults(pool, decide)


def fail_allocations(pool: Pool, data: Any, what: tuple[str, ...] = ("malloc", "movable")) -> AllocationFaults:
    """Let hypothesis choose, request by request, which to refuse (``data`` from ``st.data()``).

    Hypothesis then shrinks toward the fewest refusals that still break the code
    under test.
    """
    def decide(index: int, nbytes: int, kind: str) -> bool:
        return kind in what and bool(data.draw(st.booleans(), label=f"refuse request {index} ({kind} {nbytes})"))

    return AllocationFaults(pool, decide)


@contextlib.contextmanager
def shrunk_limit(pool: Pool, max_size: int | str) -> Iterator[int]:
    """Lower ``pool``'s limit to ``max_size`` inside the block (yields the new limit); the old one comes back after.

    A ``max_size`` of 0 bytes is refused (``ValueError``, the limit unchanged): ``Pool.set_limit`` reads 0
    as CuPy's does, as no cap at all, which would lift the limit this block is asked to lower.
    """
    if parse_size(max_size, pool.mem_info()[1], "max_size") == 0:
        raise ValueError(f"shrunk_limit: max_size {max_size!r} is 0 bytes, which Pool.set_limit reads as CuPy's "
                         f"set_limit does, as no cap; give at least {format_bytes(PAGE)}")
    old = pool.limit
    pool.set_limit(max_size)
    try:
        yield pool.limit
    finally:
        pool.set_limit(old)


class FaultRules:
    """Rules that inject faults: ``class M(FaultRules, PoolStateMachine)``.

    Hypothesis places refused allocations (the n-th request from now, or ones it
    picks itself), forced compactions and spills, and a lowered limit between the
    other rules, so the code under test meets them at every point of its life.
    ``refusal_changes_nothing`` checks the pool's side: a refused request leaves
    every figure (but ``num_ooms``) and the layout as they were.
    """

    pool: Pool
    _faults: AllocationFaults | None = None
    _limit: int | None = None  # the limit before the machine lowered it

    def _stop_faults(self) -> None:
        if self._faults is not None:
            self._faults.__exit__(None, None, None)
            self._faults = None

    @rule(n=st.integers(1, 4))
    def fail_a_later_allocation(self, n: int) -> None:
        self._stop_faults()
        self._faults = fail_nth_allocation(self.pool, n).__enter__()

    @rule(data=st.data())
    def let_hypothesis_fail_allocations(self, data: Any) -> None:
        self._stop_faults()
        self._faults = fail_allocations(self.pool, data).__enter__()

    @rule()
    def stop_failing_allocations(self) -> None:
        self._stop_faults()

    @rule()
    def force_compaction(self) -> None:
        self.pool.compact()

    @precondition(lambda self: self.pool.scheduler.tier is not None)
    @rule()
    def force_spill(self) -> None:
        self.pool.spill()

    @rule(fraction=st.floats(0.0, 1.0))
    def shrink_limit(self, fraction: float) -> None:
        if self._limit is None:
            self._limit = self.pool.limit
        self.pool.set_limit(max(PAGE, int(self._limit * fraction) // PAGE * PAGE))  # 0 would lift the cap (CuPy's rule)
        assert self.pool.limit <= self._limit

    @precondition(lambda self: self._limit is not None)
    @rule()
    def restore_limit(self) -> None:
        assert self._limit is not None
        self.pool.set_limit(self._limit)
        self._limit = None

    @rule(n=sizes())
    def refusal_changes_nothing(self, n: int) -> None:
        self._stop_faults()
        before, layout = self.pool.stats(), self.pool.snapshot()
        with fail_nth_allocation(self.pool, 1) as faults:
            try:
                self.pool.malloc(n)
            except OutOfMemoryError as e:
                assert e.reason == REASON, f"a refused request failed for another reason: {e}"
            else:
                raise AssertionError("an allocation the fault injector refused was served")
        assert faults.refused == [(1, n, "malloc")]
        after = self.pool.stats()
        assert after["num_ooms"] == before["num_ooms"] + 1, "a refusal was not counted"
        assert {**after, "num_ooms": before["num_ooms"]} == before, "a refused request changed the pool's figures"
        assert self.pool.snapshot() == layout, "a refused request changed the pool's layout"

    def teardown(self) -> None:
        self._stop_faults()
        super().teardown()  # type: ignore[misc]

