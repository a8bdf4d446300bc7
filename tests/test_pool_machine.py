"""A stateful hypothesis machine over the whole pool: on the sim device, and on a GPU when there is one."""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

import cupool
from cupool.device import SimDevice
from conftest import needs_gpu

MiB = 1 << 20
SIZES = st.one_of(
    st.just(0),
    st.integers(1, 4096),
    st.integers(4097, MiB),
    st.integers(MiB + 1, 10 * MiB),
    st.integers(10 * MiB + 1, 24 * MiB),
)
STREAMS = st.sampled_from([0, 1, 2])


class PoolMachine(RuleBasedStateMachine):
    allocs = Bundle("allocs")
    freed = Bundle("freed")

    def __init__(self):
        super().__init__()
        self._setup()
        self.sim = isinstance(self.dev, SimDevice)
        self.live = {}  # ptr -> (Allocation or array, nbytes, pattern, stream)
        self.arrays = []
        self.counter = 0
        self.unsafe = []  # (addr, size, stream, mark): freed while the stream was busy
        self.subs = []  # subscribers: their filter, what they saw, and the raw allocations since they came
        self.raw_allocs = 0  # successful mallocs and empties: each must reach an exact subscriber
        self.closed = False

    # -- helpers
    def _setup(self):
        self.dev = SimDevice("48MiB")
        self.pool = cupool.Pool(self.dev)

    def _stream(self, i):
        """The pool's name for the machine's stream i (sim streams are integers)."""
        return i

    def _fill(self, ptr, n):
        self.counter = self.counter % 250 + 1
        if n:
            self.dev.from_host(ptr, np.full(n, self.counter, dtype=np.uint8))
        return self.counter

    def _check_stream_rule(self, ptr, n, stream):
        if not self.sim:  # work in flight is modelled on the sim device only
            return
        self.unsafe = [u for u in self.unsafe if not self.dev.event_done(u[3])]
        for addr, size, s, _ in self.unsafe:
            if s != stream:
                assert not (ptr < addr + size and addr < ptr + max(n, 1)), (
                    f"block {ptr:#x} reused on stream {stream} while stream {s} may still use it"
                )

    def _books(self):
        return {k: v for k, v in self.pool.stats().items() if "peak" not in k}

    # -- rules
    @rule(target=allocs, n=SIZES, stream=STREAMS)
    def malloc(self, n, stream):
        try:
            a = self.pool.malloc(n, stream=self._stream(stream))
        except cupool.OutOfMemoryError:
            return None
        except ValueError:
            assert self.closed, "only a closed pool refuses a valid request with ValueError"
            return None
        assert not self.closed, "a closed pool handed out memory"
        self.raw_allocs += 1
        self._check_stream_rule(a.ptr, a.nbytes, stream)
        self.live[a.ptr] = (a, n, self._fill(a.ptr, n), stream)
        return a

    @rule(a=consumes(allocs))
    def free(self, a):
        if a is None:
            return
        _, n, pattern, stream = self.live.pop(a.ptr)
        if self.sim:
            work = self.dev.record_event(stream)  # completes once the stream's work so far has
            if not self.dev.event_done(work):
                self.unsafe.append((a.ptr, a.nbytes, stream, work))
        self.pool.free(a)

    @rule(
        shape=st.lists(st.integers(0, 300), min_size=1, max_size=3).map(tuple),
        dtype=st.sampled_from([np.uint8, np.float32, np.int64]),
    )
    def empty(self, shape, dtype):
        try:
            x = self.pool.empty(shape, dtype)
        except cupool.OutOfMemoryError:
            return
        except ValueError:
            assert self.closed
            return
        self.raw_allocs += 1
        self._check_stream_rule(_ptr(x), x.nbytes, 0)
        x.view(np.uint8).reshape(-1)[...] = pattern = self._fill(_ptr(x), 0)
        self.arrays.append((x, pattern))

    @rule(data=st.data())
    def drop_array(self, data):
        if self.arrays:
            i = data.draw(st.integers(0, len(self.arrays) - 1))
            self.arrays.pop(i)

    @rule()
    def empty_cache(self):
        before = self.pool.stats()["reserved_bytes.all.current"]
        released = self.pool.empty_cache()
        assert self.pool.stats()["reserved_bytes.all.current"] == before - released

    @precondition(lambda self: self.sim)
    @rule(stream=STREAMS)
    def launch_work(self, stream):
        self.dev.enqueue(stream)

    @precondition(lambda self: self.sim)
    @rule(stream=STREAMS)
    def synchronize(self, stream):
        self.dev.synchronize(stream)

    @rule(a=freed)
    def double_free_is_refused(self, a):
        if a is None:
            return
        before = self._books()
        with pytest.raises(cupool.DoubleFreeError):
            self.pool.free(a)
        assert self._books() == before

    @rule(target=freed, a=consumes(allocs))
    def free_and_keep(self, a):
        if a is None:
            return None
        self.free(a)
        return a

    @rule(
        kinds=st.one_of(st.none(), st.sets(st.sampled_from(["alloc", "free", "segment_alloc", "segment_free"]))),
        small=st.booleans(),
        raises=st.booleans(),
    )
    def subscribe(self, kinds, small, raises):
        sub = {"kinds": kinds, "small": small, "raises": raises, "seen": [], "since": self.raw_allocs}

        def callback(ev, sub=sub):
            sub["seen"].append(ev)
            if sub["raises"]:
                raise RuntimeError("a broken observer")

        sub["unsubscribe"] = self.pool.subscribe(callback, kinds=kinds, small_blocks=small)
        self.subs.append(sub)

    @rule(data=st.data())
    def unsubscribe(self, data):
        if self.subs:
            self.subs.pop(data.draw(st.integers(0, len(self.subs) - 1)))["unsubscribe"]()

    @rule()
    def close(self):
        alive = (self.live or self.arrays) and not self.closed  # closing again is a no-op
        with pytest.warns(ResourceWarning) if alive else _no_warning():
            self.pool.close()
        self.closed = True

    @rule(bad=st.sampled_from([-1, -4096, 1.0, "8", None, True]))
    def bad_size_is_refused(self, bad):
        before = self._books()
        with pytest.raises((TypeError, ValueError)):
            self.pool.malloc(bad)
        assert self._books() == before

    # -- invariants
    @invariant()
    def heap_is_consistent(self):
        self.pool.check()

    @invariant()
    def live_blocks_do_not_overlap_and_are_aligned(self):
        spans = sorted((a.ptr, a.nbytes) for a, *_ in self.live.values())
        spans += sorted((_ptr(x), max(x.nbytes, 1)) for x, _ in self.arrays)
        spans.sort()
        for (p0, n0), (p1, _) in zip(spans, spans[1:]):
            assert p0 + n0 <= p1, f"{p0:#x}+{n0} overlaps {p1:#x}"
        assert all(p % 512 == 0 for p, _ in spans)

    @invariant()
    def stats_match_the_model(self):
        s = self.pool.stats()
        n_arrays = len(self.arrays)
        assert s["allocation.all.current"] == len(self.live) + n_arrays
        req = sum(n for _, n, _, _ in self.live.values()) + sum(x.nbytes for x, _ in self.arrays)
        assert s["requested_bytes.all.current"] == req
        blocks = sum(a.nbytes for a, *_ in self.live.values())
        assert s["allocated_bytes.all.current"] >= blocks
        assert s["reserved_bytes.all.current"] <= self.pool.limit
        snap = self.pool.snapshot()
        free = sum(b["size"] for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "inactive")
        assert s["allocated_bytes.all.current"] + free == s["reserved_bytes.all.current"]
        if self.sim:
            assert s["reserved_bytes.all.current"] == self.dev.used

    @invariant()
    def subscribers_see_what_they_asked_for(self):
        for sub in self.subs:
            seen = sub["seen"]
            assert all(type(ev[4]) is int for ev in seen), "an event without an int stream"
            if sub["kinds"] is not None:
                assert {ev[1] for ev in seen} <= sub["kinds"]
            if sub["raises"]:
                assert len(seen) <= 1, "a subscriber that raised was called again"
            elif sub["small"] and (sub["kinds"] is None or "alloc" in sub["kinds"]):
                # Exact: every raw allocation since it subscribed, fast path or not.
                assert sum(ev[1] == "alloc" for ev in seen) == self.raw_allocs - sub["since"]

    @invariant()
    def a_closed_pool_keeps_only_segments_in_use(self):
        if self.closed:
            for seg in self.pool.snapshot()["segments"]:
                assert seg["allocated_size"] > 0, "a closed pool kept a wholly free segment"

    @invariant()
    def data_is_intact(self):
        for a, n, pattern, _ in self.live.values():
            if n:
                assert (self.dev.to_host(a.ptr, n) == pattern).all(), f"{a!r} was overwritten"
        for x, pattern in self.arrays:
            assert bool((x.view(np.uint8) == pattern).all()), "an array's bytes changed"


class _no_warning:
    """``pytest.warns`` for no warning: any ResourceWarning escaping is an error."""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", ResourceWarning)

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


def _ptr(x):
    """The address of a numpy (sim) or CuPy (GPU) array."""
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr


TestPoolMachine = PoolMachine.TestCase


class CudaPoolMachine(PoolMachine):
    """The same machine on the GPU, with two real CuPy streams beside the null stream."""

    def _setup(self):
        import cupy

        self.pool = cupool.Pool("cuda", max_size="48MiB")
        self.dev = self.pool.device
        self._stream_objects = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]  # kept alive
        self._streams = [0] + [st.ptr for st in self._stream_objects]

    def _stream(self, i):
        return self._streams[i]


TestCudaPoolMachine = needs_gpu(CudaPoolMachine.TestCase)
