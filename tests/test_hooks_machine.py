"""One sim pool serving CuPy arrays, Numba device pointers and raw malloc at once."""

import cupy
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cupool
from cupool.numba import CupoolMemoryManager

MiB = 1 << 20
SIZES = st.one_of(st.just(0), st.integers(1, 4096), st.integers(4097, MiB), st.integers(MiB + 1, 6 * MiB))


class HooksMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = cupool.Pool("sim", capacity="48MiB")
        self.mm = CupoolMemoryManager(context=None, pool=self.pool)
        self.alloc = cupool.cupy_allocator(self.pool)
        self.held = []  # (kind, object, ptr, requested, pattern)
        self.deferred = 0
        self.defer_stack = []
        self.counter = 0

    def _fill(self, ptr, n):
        self.counter = self.counter % 250 + 1
        if n:
            self.pool.device.bytes_at(ptr, n)[:] = self.counter
        return self.counter

    def _keep(self, kind, obj, ptr, n):
        self.held.append((kind, obj, ptr, n, self._fill(ptr, n)))

    @rule(n=SIZES)
    def cupy_array(self, n):
        with cupy.cuda.using_allocator(self.alloc):
            try:
                x = cupy.empty((n,), np.uint8)
            except cupool.OutOfMemoryError:
                return
        self._keep("cupy", x, x.data.ptr, n)

    @rule(n=SIZES)
    def numba_pointer(self, n):
        try:
            p = self.mm.memalloc(n)
        except cupool.OutOfMemoryError:
            return
        self._keep("numba", p, p.device_pointer_value or 0, n)

    @rule(n=SIZES)
    def raw_malloc(self, n):
        try:
            a = self.pool.malloc(n)
        except cupool.OutOfMemoryError:
            return
        self._keep("raw", a, a.ptr, n)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), explicit=st.booleans())
    def drop(self, data, explicit):
        kind, obj, *_ = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        if explicit and kind != "cupy":
            obj.free()
        if self.defer_stack and kind == "numba":
            self.deferred += 1
        del obj

    @precondition(lambda self: len(self.defer_stack) < 2)
    @rule()
    def enter_defer(self):
        cm = self.mm.defer_cleanup()
        cm.__enter__()
        self.defer_stack.append(cm)

    @precondition(lambda self: self.defer_stack)
    @rule()
    def exit_defer(self):
        self.defer_stack.pop().__exit__(None, None, None)
        if not self.defer_stack:
            self.deferred = 0

    @rule()
    def empty_cache(self):
        self.pool.empty_cache()

    def teardown(self):
        while self.defer_stack:
            self.defer_stack.pop().__exit__(None, None, None)
        self.held.clear()
        assert self.pool.stats()["allocation.all.current"] == 0

    @invariant()
    def books_agree(self):
        self.pool.check()
        s = self.pool.stats()
        assert s["allocation.all.current"] == len(self.held) + self.deferred
        if not self.deferred:
            assert s["requested_bytes.all.current"] == sum(h[3] for h in self.held)

    @invariant()
    def no_overlap_and_intact(self):
        spans = sorted((ptr, max(n, 1)) for _, _, ptr, n, _ in self.held)
        for (p0, n0), (p1, _) in zip(spans, spans[1:]):
            assert p0 + n0 <= p1, f"{p0:#x}+{n0} overlaps {p1:#x}"
        for _, _, ptr, n, pattern in self.held:
            if n:
                assert (self.pool.device.bytes_at(ptr, n) == pattern).all()


TestHooksMachine = HooksMachine.TestCase
