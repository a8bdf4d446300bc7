"""``PoolStateMachine``: a hypothesis state machine over a pool, with cupool's invariants after every step.

Users subclass it and add rules that drive their own code on ``self.pool``; the
machine interleaves those with its own (malloc, free, movable buffers, leases,
compaction, spilling, stream work) and checks, after every step, what cupool
promises: the pool's own consistency check, live blocks never overlapping,
every tracked allocation's bytes intact, the books agreeing with what the test
holds and with the pool's layout (allocations a subclass's rules make without
tracking them included), reserved bytes agreeing with the sim device's, and the
limit respected.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from ..core.fast import Allocation
from ..core.handles import Movable
from ..core.sizes import round_size
from ..device import SimDevice
from ..errors import ClosedError, OutOfMemoryError
from ..pool import Pool
from .ledger import Ledger
from .strategies import sizes

__all__ = ["PoolStateMachine"]

log = logging.getLogger("cupool")

_SIZES = sizes()
_STREAMS = st.integers(0, 2)


class PoolStateMachine(RuleBasedStateMachine):
    """Stress-test code that uses a cupool pool: subclass, add rules, run ``MyMachine.TestCase``.

    A subclass's rules use ``self.pool`` freely: what they allocate is found in
    the pool's layout after every step and checked with the rest (it must not
    overlap other live blocks, and the books must count it).  One line more,
    ``self.ledger.track(obj)`` (an ``Allocation``, a ``Movable``, an array, or
    ``obj, ptr=, nbytes=``), also overwrites the memory with a byte of its own,
    which the invariants then check after every step, wherever compaction or
    spilling takes it; call ``self.ledger.forget(obj)`` before that memory is
    freed.  ::

        import cupool
        from hypothesis import strategies as st
        from hypothesis.stateful import rule
        from cupool.testing import PoolStateMachine

        class MyCacheMachine(PoolStateMachine):
            def make_pool(self):                  # the default: a 48 MiB sim pool spilling to host
                return cupool.Pool("sim", capacity="64MiB")

            def __init__(self):
                super().__init__()                # makes self.pool and self.ledger
                self.cache = MyCache(self.pool, on_evict=self.ledger.forget)   # the code under test

            @rule(key=st.integers(0, 9))
            def load(self, key):
                try:
                    buf = self.cache.load(key)    # a Movable from self.pool, new or cached
                except cupool.OutOfMemoryError:
                    return                        # the cache must survive this
                if id(buf) not in self.ledger.entries:
                    self.ledger.track(buf)        # filled now, checked after every later step

        TestMyCache = MyCacheMachine.TestCase

    Hooks: ``make_pool()`` picks the pool; ``stream(i)`` names the pool's stream
    for the machine's streams 0..2 (integers on sim; CuPy stream pointers on a
    GPU).  ``exact_books = True`` says the ledger tracks everything alive in the
    pool, so untracked memory (which the code under test forgot to free, say)
    fails the books; ``self.ledger.untracked()`` lists it either way.  A
    rule redefined under the same name replaces the machine's (``malloc`` with
    other sizes, say); ``super().malloc(n, stream)`` still works inside it.  Mix
    in ``cupool.testing.faults.FaultRules`` for injected failures.  The machine
    frees what it tracks in ``teardown``; a subclass holding memory of its own
    drops it first, then calls ``super().teardown()``.
    """

    allocations = Bundle("allocations")
    movables = Bundle("movables")

    #: Whether the ledger holds everything alive in the pool (see the class docstring).
    exact_books = False

    def __init__(self) -> None:
        super().__init__()
        self.pool = self.make_pool()
        self.device = self.pool.device
        self.sim = isinstance(self.device, SimDevice)
        self.ledger = Ledger(self.pool)
        #: id(movable) -> (movable, array, address, generation) of the leases the machine holds.
        self.leases: dict[int, tuple[Movable, Any, int | None, int]] = {}
        #: Set by a subclass that closes the pool: allocations are then refused with ``ClosedError``.
        self.closed = False
        #: Raw allocations the machine's rules made (subclasses count their own too).
        self.mallocs = 0
        self._busy: list[tuple[int, int, Any, Any]] = []  # freed while their stream had work in flight
        if self.sim:  # a segment given back is safe to reuse: the device waits, as cudaFree does
            ref = weakref.ref(self)  # a bound method would keep this machine and its pool in a cycle

            def returned(event: tuple[int, str, int, int, int]) -> None:
                machine = ref()
                if machine is not None:
                    machine.segment_returned(event[2], event[3])

            self.pool.subscribe(returned, kinds=["segment_free"])
        self._reserved_before = self._reserved()

    # ------------------------------------------------------------------ hooks
    def make_pool(self) -> Pool:
        """The pool under test: a 48 MiB sim pool that spills to host memory, unless overridden."""
        return Pool(SimDevice("48MiB"), spill="host")

    def stream(self, i: int) -> Any:
        """The pool's stream for the machine's stream ``i`` (0, 1 or 2)."""
        return i

    def device_is_the_examples(self) -> bool:
        """Whether what the device refuses depends on this example alone: a sim device (the default
        ``make_pool`` makes one per example), not a GPU that other pools and processes share.

        Hypothesis replays an example by replaying its draws, and what the machine draws
        next depends on what the pool served (a refused ``malloc`` adds nothing to the
        ``allocations`` bundle, so the rules drawn after it differ).  A device that refuses
        for reasons outside the example would make a replay draw differently, which hypothesis
        reports as ``FlakyStrategyDefinition`` ("the data drawn depends on state outside the
        test case"), naming nothing.  So on such a device a refusal within the pool's limit
        is logged (``_refused``), where the failure's report shows it.  The machine's own part is
        to leave nothing of an example to the next: ``teardown`` closes the pool.
        """
        return self.sim

    # ---------------------------------------------------------------- helpers
    def _reserved(self) -> int:
        return int(self.pool.stats()["reserved_bytes.all.current"])

    def note_free(self, ptr: int, nbytes: int, key: Any) -> None:
        """Remember a block freed while its stream still had work queued (sim only, Note [Streams])."""
        if self.sim:
            work = self.device.record_event(key)
            if not self.device.event_done(work):
                self._busy.append((ptr, max(nbytes, 1), key, work))

    def segment_returned(self, addr: int, size: int) -> None:
        """The pool gave ``[addr, addr + size)`` back to the device, which waited for its work."""
        self._busy = [b for b in self._busy if not addr <= b[0] < addr + size]

    def check_stream_rule(self, ptr: int, nbytes: int, key: Any) -> None:
        """A new block on stream ``key`` overlaps no block another stream may still be using."""
        if not self.sim:  # work in flight is modelled on the sim device only
            return
        self._busy = [b for b in self._busy if not self.device.event_done(b[3])]
        for addr, size, other, _ in self._busy:
            if other != key:
                assert not (ptr < addr + size and addr < ptr + max(nbytes, 1)), (
                    f"block {ptr:#x} reused on stream {key} while stream {other} may still use it"
                )

    def _refused(self, e: Exception) -> Any:
        if isinstance(e, ClosedError):
            assert self.closed, f"an open pool refused a valid request: {e}"
        # "the device refused" is the arena's word for a refusal of the device itself, not of the pool's limit.
        if isinstance(e, OutOfMemoryError) and "the device refused" in e.reason and not self.device_is_the_examples():
            log.warning(
                "cupool.testing: the device refused memory within the pool's limit (%s); that depends on state "
                "outside this example (other pools or processes on the device), so hypothesis may find the "
                "example's data drawn differently when it replays it (FlakyStrategyDefinition)", e)
        return multiple()

    # ------------------------------------------------------------------ rules
    @rule(target=allocations, n=_SIZES, stream=_STREAMS)
    def malloc(self, n: int, stream: int) -> Any:
        try:
            a = self.pool.malloc(n, self.stream(stream))
        except (OutOfMemoryError, ClosedError) as e:
            return self._refused(e)
        assert not self.closed, "a closed pool handed out memory"
        self.mallocs += 1
        self.check_stream_rule(a.ptr, a.nbytes, a.stream)
        self.ledger.track(a)
        return a

    @rule(a=consumes(allocations))
    def free(self, a: Allocation) -> None:
        self.ledger.forget(a)
        self.note_free(a.ptr, a.nbytes, a.stream)
        self.pool.free(a)

    @rule(target=movables, n=_SIZES, stream=_STREAMS)
    def movable(self, n: int, stream: int) -> Any:
        try:
            m = self.pool.movable(n, self.stream(stream))
        except (OutOfMemoryError, ClosedError) as e:
            return self._refused(e)
        assert not self.closed, "a closed pool handed out memory"
        assert m.ptr is not None
        self.check_stream_rule(m.ptr, round_size(n), m.stream)
        self.ledger.track(m)
        return m

    @rule(m=consumes(movables))
    def free_movable(self, m: Movable) -> None:
        self.leases.pop(id(m), None)
        self.ledger.forget(m)
        if m.ptr is not None:
            self.note_free(m.ptr, round_size(m.size), m.stream)
        m.free()

    @rule(m=movables)
    def lease(self, m: Movable) -> None:
        """Take an array over ``m`` (bringing it back if spilled): its bytes must have survived."""
        if id(m) in self.leases:
            return
        try:
            view = m.array(dtype=np.uint8)
        except (OutOfMemoryError, ClosedError) as e:
            self._refused(e)
            return
        entry = self.ledger.entry(m)
        assert bool((view[: entry.requested] == entry.pattern).all()), f"{m!r} lost its bytes"
        self.leases[id(m)] = (m, view, m.ptr, m.generation)

    @rule(m=movables)
    def unlease(self, m: Movable) -> None:
        self.leases.pop(id(m), None)

    @rule(max_moves=st.one_of(st.none(), st.integers(1, 8)))
    def compact(self, max_moves: int | None) -> None:
        report = self.pool.compact(max_moves=max_moves)
        assert max_moves is None or report.moves <= max_moves, f"{report.moves} moves past a budget of {max_moves}"

    @precondition(lambda self: self.pool.scheduler.tier is not None)
    @rule(nbytes=st.one_of(st.none(), _SIZES))
    def spill(self, nbytes: int | None) -> None:
        if self.closed:  # a closed pool's buffers stay where they are
            before = self.pool.stats()
            try:
                self.pool.spill(nbytes)
            except ClosedError:
                assert self.pool.stats() == before, "a refused spill() changed the pool"
                return
            raise AssertionError("spill() on a closed pool was not refused")
        self.pool.spill(nbytes)

    @rule()
    def empty_cache(self) -> None:
        before = self._reserved()
        released = self.pool.empty_cache()
        assert self._reserved() == before - released, "empty_cache() misreported what it released"

    @precondition(lambda self: self.sim)
    @rule(stream=_STREAMS)
    def launch_work(self, stream: int) -> None:
        assert isinstance(self.device, SimDevice)
        self.device.enqueue(self.stream(stream))

    @precondition(lambda self: self.sim)
    @rule(stream=_STREAMS)
    def synchronize(self, stream: int) -> None:
        assert isinstance(self.device, SimDevice)
        self.device.synchronize(self.stream(stream))

    # ------------------------------------------------------------- invariants
    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check()

    @invariant()
    def live_blocks_do_not_overlap_and_are_aligned(self) -> None:
        self.ledger.check_spans()

    @invariant()
    def data_is_intact(self) -> None:
        self.ledger.check_bytes()
        for m, _, ptr, generation in self.leases.values():
            assert m.ptr == ptr and m.generation == generation, f"{m!r} moved while an array viewed it"

    @invariant()
    def stats_match_the_model(self) -> None:
        self.ledger.check_books(self.exact_books)
        if isinstance(self.device, SimDevice):  # what the device hands out: segments, and mapped granules
            free, total = self.device.mem_info()
            assert self._reserved() == total - free, (
                f"the pool reserves {self._reserved()} bytes, the sim device has {total - free} in use"
            )

    @invariant()
    def limit_is_respected(self) -> None:
        """Reserved bytes stay within the limit, or (after the limit was lowered) do not grow."""
        reserved = self._reserved()
        assert reserved <= max(self.pool.limit, self._reserved_before), (
            f"reserved {reserved} grew past the limit {self.pool.limit}"
        )
        self._reserved_before = reserved

    def teardown(self) -> None:
        """Free everything the machine tracks and close the pool, so that one example's memory and
        addresses never leak into the next (on a GPU the next example's pool shares the device)."""
        self.leases.clear()
        for entry in list(self.ledger.entries.values()):
            if isinstance(entry.obj, (Allocation, Movable)) and not entry.obj.freed:
                entry.obj.free()
        self.ledger.entries.clear()
        with warnings.catch_warnings():  # what a subclass keeps goes back when it dies: no need to say so
            warnings.simplefilter("ignore", ResourceWarning)
            self.pool.close()
