"""One sim pool serving CuPy arrays, Numba device pointers and raw malloc at once.

Built on ``cupool.testing.PoolStateMachine`` (its rules and invariants: bytes,
spans, books and limit after every step); this machine adds the hooks' ways in
and Numba's deferred frees, which the ledger counts as held back until they land.
"""

import cupy
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

import cupool
from cupool.numba import CupoolMemoryManager
from cupool.testing import PoolStateMachine

MiB = 1 << 20
SIZES = st.one_of(st.just(0), st.integers(1, 4096), st.integers(4097, MiB), st.integers(MiB + 1, 6 * MiB))


class HooksMachine(PoolStateMachine):
    exact_books = True  # this machine tracks all it allocates: anything untracked is a leak

    def __init__(self):
        super().__init__()
        self.mm = CupoolMemoryManager(context=None, pool=self.pool)
        self.alloc = cupool.cupy_allocator(self.pool)
        self.held = []  # (kind, object)
        self.defer_stack = []

    def make_pool(self):
        return cupool.Pool("sim", capacity="48MiB")

    # The base's malloc and movable, with this machine's sizes: requests past 6 MiB would mostly
    # run the out-of-memory ladder, whose gc.collect() is slow with CuPy and Numba loaded.
    @rule(target=PoolStateMachine.allocations, n=SIZES, stream=st.integers(0, 2))
    def malloc(self, n, stream):
        return super().malloc(n, stream)

    @rule(target=PoolStateMachine.movables, n=SIZES, stream=st.integers(0, 2))
    def movable(self, n, stream):
        return super().movable(n, stream)

    def _keep(self, kind, obj, ptr, n):
        self.ledger.track(obj, ptr=ptr, nbytes=n)
        self.held.append((kind, obj))

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
        kind, obj = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        # Numba's frees inside defer_cleanup() stay on the pool's books until it ends.
        self.ledger.forget(obj, held_back=bool(self.defer_stack) and kind == "numba")
        if explicit and kind != "cupy":
            obj.free()
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
            self.ledger.release_held_back()

    def teardown(self):
        while self.defer_stack:
            self.defer_stack.pop().__exit__(None, None, None)
        self.ledger.release_held_back()
        self.held.clear()
        super().teardown()
        assert self.pool.stats()["allocation.all.current"] == 0


TestHooksMachine = HooksMachine.TestCase
