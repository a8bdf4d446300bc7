"""``CudaMover`` (the GPU's compaction moves) against a fake CUDA runtime, kernel and batched copy (issue 18).

The fake runtime's "device memory" is host memory, so its ``cudaMemcpyAsync`` is a
real ``memmove`` and the fake kernel reads the plan the mover uploaded, from the
address the mover passed, the way ``move_cuda`` does (all of a group's loads
before its stores).  Every call is recorded, so the tests see which path each move
took, on which stream, and what was allocated.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import needs_gpu
from cupool.device.cuda_moves import BATCH_MIN, SCRATCH_BYTES, CudaMover, batch_copy_over

STREAM = 77
ARENA = 1 << 20


def at(addr: int, n: int, dtype=np.uint8) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * int(n * np.dtype(dtype).itemsize)).from_address(int(addr))).view(dtype)


class FakeRuntime:
    """``cupy.cuda.runtime``'s calls the mover makes, over a host arena."""

    CUDARuntimeError = RuntimeError

    def __init__(self) -> None:
        self.mem = np.zeros(4 * ARENA + SCRATCH_BYTES, np.uint8)  # room for prepare()'s scratch
        self.base = self.mem.ctypes.data
        self.top = 2 * ARENA  # the first half is the "pool"; malloc hands out the second
        self.calls: list[tuple] = []
        self.full = False

    def malloc(self, n: int) -> int:
        if self.full:
            raise RuntimeError("cudaErrorMemoryAllocation")
        self.calls.append(("malloc", n))
        ptr, self.top = self.base + self.top, self.top + n
        assert self.top <= self.mem.size
        return ptr

    def free(self, ptr: int) -> None:
        self.calls.append(("free", ptr))

    def streamCreateWithFlags(self, flags: int) -> int:
        self.calls.append(("stream", flags))
        return STREAM

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        self.calls.append(("memcpy", kind, stream, src, dst, n))
        ctypes.memmove(dst, src, n)

    def streamSynchronize(self, stream: int) -> None:
        self.calls.append(("sync", stream))

    def of(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


class FakeKernel:
    """Runs a kernel step as ``move_cuda`` would: reads the plan at ``plan``, each group's loads before its stores."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []
        self.prepared: list[int] = []

    def prepare(self, ws: int) -> None:
        self.prepared.append(ws)

    def launch(self, ws, buf, extent, plan, plan_len, k, ngroups, stream) -> None:
        self.launches.append((ws, k, ngroups, stream))
        assert plan_len >= 4 * k + 2 + ngroups
        p = at(plan, 4 * k + 2 + ngroups, np.int64)
        ps, pd, pn, starts = p[:k], p[k : 2 * k], p[2 * k : 3 * k], p[4 * k + 1 :]
        for g in range(ngroups):
            group = range(starts[g], starts[g + 1])
            assert all(0 <= ps[i] and ps[i] + pn[i] <= extent and 0 <= pd[i] and pd[i] + pn[i] <= extent for i in group)
            loaded = [(pd[i], at(buf + ws * ps[i], ws * pn[i]).copy()) for i in group]
            for d, b in loaded:
                at(buf + ws * d, b.size)[:] = b


class FakeBatch:
    def __init__(self, works: bool = True) -> None:
        self.works = works
        self.batches: list[int] = []
        self.calls = 0

    def __call__(self, dsts, srcs, sizes, stream) -> bool:
        assert stream == STREAM
        self.calls += 1
        if not self.works:
            return False
        self.batches.append(len(sizes))
        loaded = [(d, at(s, n).copy()) for d, s, n in zip(dsts, srcs, sizes)]  # no order within a batch
        for d, b in reversed(loaded):
            at(d, b.size)[:] = b
        return True


def mover(copy_min=256, batch=None):
    rt, kernel = FakeRuntime(), FakeKernel()
    return CudaMover(rt, kernel, batch, copy_min=copy_min), rt, kernel


def reference(buf: bytearray, moves) -> bytes:
    for s, d, n in moves:
        buf[d : d + n] = bytes(buf[s : s + n])
    return bytes(buf)


def run(m, rt, moves, data: bytes) -> bytes:
    rt.mem[: len(data)] = np.frombuffer(data, np.uint8)
    src, dst, n = (np.array([x[i] for x in moves], dtype=np.int64) + (rt.base if i < 2 else 0) for i in range(3))
    m.execute(src, dst, n)
    return rt.mem[: len(data)].tobytes()


SIZE = 4096


@st.composite
def move_lists(draw, unit=1):
    moves = []
    for _ in range(draw(st.integers(1, 12))):
        n = draw(st.integers(0, SIZE // 2 // unit)) * unit
        moves.append((draw(st.integers(0, (SIZE - n) // unit)) * unit, draw(st.integers(0, (SIZE - n) // unit)) * unit, n))
    return moves


@given(move_lists(), st.sampled_from([1, 8]), st.booleans(), st.integers(0, 2**32 - 1))
def test_moves_match_memmove_and_take_the_right_path(moves, unit, batched, seed):
    data = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    moves = [(s // unit * unit, d // unit * unit, n // unit * unit) for s, d, n in moves]
    m, rt, kernel = mover(batch=FakeBatch() if batched else None)
    assert run(m, rt, moves, data) == reference(bytearray(data), moves)
    for _, kind, stream, s, d, n in rt.of("memcpy"):
        assert stream == STREAM
        if kind == 3:  # device to device: a whole move, disjoint and long enough
            assert n >= 256 and (d + n <= s or s + n <= d)
    assert all(launch[3] == STREAM for launch in kernel.launches)
    last_sync = max(i for i, c in enumerate(rt.calls) if c == ("sync", STREAM))
    assert all(c[0] == "free" for c in rt.calls[last_sync + 1 :])  # done when it returns; scratch freed after


def test_a_large_disjoint_move_is_one_copy_and_a_slide_is_the_kernels():
    m, rt, kernel = mover()
    data = bytes(range(256)) * 16
    moves = [(1024, 0, 512), (2048, 2056, 1024), (3504, 3600, 64)]
    assert run(m, rt, moves, data) == reference(bytearray(data), moves)
    assert [(c[1], c[3] - rt.base, c[4] - rt.base, c[5]) for c in rt.of("memcpy") if c[1] == 3] == [(3, 1024, 0, 512)]
    assert len(kernel.launches) == 1 and kernel.launches[0][0] == 8  # words: every offset is a multiple of 8


def test_the_plan_goes_up_before_the_launch_on_the_same_stream():
    m, rt, kernel = mover()
    run(m, rt, [(0, 64, 8)], bytes(SIZE))
    up = rt.of("memcpy")
    assert len(up) == 1 and up[0][1:3] == (1, STREAM)  # host to device, on the mover's stream
    assert rt.calls.index(up[0]) < len(rt.calls) - 1 and kernel.launches == [(8, 1, 1, STREAM)]


def test_nothing_is_allocated_per_call_and_staging_grows_by_doubling():
    m, rt, _ = mover(copy_min=1 << 40)
    run(m, rt, [(0, 64, 8)], bytes(SIZE))
    assert rt.of("malloc") == [("malloc", 64 << 10)]
    for _ in range(3):
        run(m, rt, [(8 * i, 2048 + 8 * i, 8) for i in range(100)], bytes(SIZE))
    assert len(rt.of("malloc")) == 1 and not rt.of("free")
    n = 3000  # a plan of more than 64 KiB: one larger buffer, the old one given back
    moves = [(i % 256 * 8, 2048 + i % 256 * 8, 8) for i in range(n)]
    data = bytes(range(256)) * 16
    assert run(m, rt, moves, data) == reference(bytearray(data), moves)
    mallocs = rt.of("malloc")
    assert len(mallocs) == 2 and mallocs[1][1] == 1 << (mallocs[1][1] - 1).bit_length() > 64 << 10
    assert len(rt.of("free")) == 1
    run(m, rt, moves, data)
    assert len(rt.of("malloc")) == 2


def test_4096_moves_of_4_kib_are_one_launch_and_no_copy():
    m, rt, kernel = mover(copy_min=1 << 20)
    rt.mem = np.zeros(2 * 4096 * 4096 + 4 * ARENA, np.uint8)
    rt.base, rt.top = rt.mem.ctypes.data, 2 * 4096 * 4096
    k = np.arange(4096, dtype=np.int64)
    src, dst = rt.base + (2 * k + 1) * 4096, rt.base + k * 4096  # every other 4 KiB slot compacted
    rt.mem[: 2 * 4096 * 4096].reshape(-1, 4096)[:] = (np.arange(2 * 4096) % 251)[:, None]
    m.execute(src, dst, np.full(4096, 4096, np.int64))
    assert len(kernel.launches) == 1 and [c for c in rt.of("memcpy") if c[1] == 3] == []
    assert (rt.mem[: 4096 * 4096].reshape(-1, 4096)[:, 0] == (2 * k + 1) % 251).all()


def test_batched_copies_and_the_fallback_when_the_driver_refuses():
    moves = [(i * 512, 2048 + i * 512, 512) for i in range(BATCH_MIN)]  # independent: one batch
    data = bytes(range(256)) * 16
    batch = FakeBatch()
    m, rt, _ = mover(batch=batch)
    assert run(m, rt, moves, data) == reference(bytearray(data), moves)
    assert batch.batches == [BATCH_MIN] and not [c for c in rt.of("memcpy") if c[1] == 3]
    refused = FakeBatch(works=False)
    m, rt, _ = mover(batch=refused)
    assert run(m, rt, moves, data) == reference(bytearray(data), moves)
    assert len([c for c in rt.of("memcpy") if c[1] == 3]) == BATCH_MIN
    run(m, rt, moves, data)
    assert refused.calls == 1  # and not tried again


def test_prepare_compiles_both_element_sizes_and_launches_them():
    m, rt, kernel = mover()
    m.prepare()
    assert kernel.prepared == [8, 1] and [launch[0] for launch in kernel.launches] == [8, 1]


def test_scratch_is_kept_from_call_to_call_and_a_full_device_chunks_instead():
    data = bytes(range(256)) * 16
    moves = [(0, 8, 2048)]  # a long slide by one word: through scratch
    m, rt, _ = mover()
    assert run(m, rt, moves, data) == reference(bytearray(data), moves)
    assert ("malloc", 2048) in rt.calls and not rt.of("free")
    before = len(rt.calls)
    assert run(m, rt, moves, data) == reference(bytearray(data), moves)
    assert not [c for c in rt.calls[before:] if c[0] in ("malloc", "free")]  # kept: nothing per call
    m, rt, kernel = mover()
    run(m, rt, [(0, 64, 8)], data)  # the staging buffer, no scratch
    rt.full = True
    assert run(m, rt, moves, data) == reference(bytearray(data), moves)
    assert kernel.launches[-1][2] == 256  # chunked by the distance: 256 groups


def test_after_prepare_no_call_allocates_even_a_slide_through_scratch():
    # The GPU run of 2026-11-28: a slide over itself took cudaMalloc + cudaFree of scratch on every call.
    m, rt, _ = mover()
    m.prepare()
    before = len(rt.calls)
    data = bytes(range(256)) * 16
    for moves in ([(0, 8, 2048)], [(8, 0, 2048)], [(0, 64, 8)]):
        assert run(m, rt, moves, data) == reference(bytearray(data), moves)
    assert not [c for c in rt.calls[before:] if c[0] in ("malloc", "free")]


def fake_driver(with_batch=True):
    calls = []

    class Attrs:
        def __init__(self):
            self.srcLocHint, self.dstLocHint = SimpleNamespace(), SimpleNamespace()

    def cuMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, idxs, nattrs, stream):
        calls.append((dsts, srcs, sizes, count, attrs, idxs, nattrs, stream))
        return (0,)

    drv = SimpleNamespace(
        CUmemcpyAttributes=Attrs, CUdeviceptr=lambda v: ("ptr", v),
        CUmemcpySrcAccessOrder=SimpleNamespace(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM="stream-order"),
        CUmemLocationType=SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE="device"),
        CUresult=SimpleNamespace(CUDA_SUCCESS=0),
    )
    if with_batch:
        drv.cuMemcpyBatchAsync = cuMemcpyBatchAsync
    return drv, calls


def test_the_driver_batch_call_is_built_as_the_bindings_expect():
    drv, calls = fake_driver()
    batch = batch_copy_over(drv, 3)
    assert batch([10, 20], [1, 2], [5, 6], STREAM)
    ((dsts, srcs, sizes, count, attrs, idxs, nattrs, stream),) = calls
    assert dsts == [("ptr", 10), ("ptr", 20)] and srcs == [("ptr", 1), ("ptr", 2)] and sizes == [5, 6]
    assert (count, idxs, nattrs, stream) == (2, [0], 1, STREAM)
    (a,) = attrs
    assert a.srcAccessOrder == "stream-order"
    assert (a.srcLocHint.type, a.srcLocHint.id, a.dstLocHint.type, a.dstLocHint.id) == ("device", 3, "device", 3)
    assert batch_copy_over(fake_driver(with_batch=False)[0], 0) is None


@pytest.mark.parametrize("failure", [RuntimeError("boom"), TypeError("wrong argument")])
def test_a_batch_call_that_raises_falls_back_too(failure):
    def batch(*args):
        raise failure

    moves = [(i * 512, 2048 + i * 512, 512) for i in range(BATCH_MIN)]
    data = bytes(range(256)) * 16
    m, rt, _ = mover(batch=batch)
    assert run(m, rt, moves, data) == reference(bytearray(data), moves)
    assert len([c for c in rt.of("memcpy") if c[1] == 3]) == BATCH_MIN


# --------------------------------------------------------------------------- GPU
class CountingRuntime:
    """``cupy.cuda.runtime`` with its allocations counted."""

    def __init__(self, rt):
        self._rt, self.mallocs = rt, 0
        self.CUDARuntimeError = rt.CUDARuntimeError

    def malloc(self, n):
        self.mallocs += 1
        return self._rt.malloc(n)

    def __getattr__(self, name):
        return getattr(self._rt, name)


@needs_gpu
def test_on_the_gpu_nothing_is_allocated_per_call_and_both_paths_move_right():
    import cupy

    from cupool.device.cuda_moves import NumbaMoveKernel, driver_batch_copy

    rt = CountingRuntime(cupy.cuda.runtime)
    m = CudaMover(rt, NumbaMoveKernel(0), driver_batch_copy(0))
    m.prepare()
    size = 64 << 20
    base = cupy.cuda.runtime.malloc(size)
    try:
        data = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
        cupy.cuda.runtime.memcpy(base, data.ctypes.data, size, 1)
        moves = [(k * (4 << 20) + (2 << 20), (40 << 20) + k * (2 << 20), 2 << 20) for k in range(8)]  # copies
        moves += [(k * 8192, (60 << 20) + k * 4096, 4096) for k in range(64)] + [(0, 4096, 1 << 20)]  # kernel
        before = rt.mallocs
        for _ in range(3):
            src, dst, n = (np.array([x[i] for x in moves], dtype=np.int64) + (base if i < 2 else 0) for i in range(3))
            m.execute(src, dst, n)
        assert rt.mallocs == before
        expected = bytearray(data.tobytes())
        for _ in range(3):
            reference(expected, moves)
        out = np.empty(size, np.uint8)
        cupy.cuda.runtime.memcpy(out.ctypes.data, base, size, 2)
        assert out.tobytes() == bytes(expected)
    finally:
        cupy.cuda.runtime.free(base)


@needs_gpu
def test_the_drivers_batched_copy_is_accepted_and_copies():
    import cupy

    from cupool.device.cuda_moves import driver_batch_copy

    batch = driver_batch_copy(0)
    if batch is None:
        pytest.skip("cuda-bindings without cuMemcpyBatchAsync: the mover copies move by move")
    a = cupy.arange(1 << 20, dtype=cupy.uint8)
    b = cupy.zeros(1 << 20, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    q = 1 << 18
    assert batch([b.data.ptr + i * q for i in range(4)], [a.data.ptr + (3 - i) * q for i in range(4)], [q] * 4,
                 stream.ptr)
    stream.synchronize()
    assert (b.reshape(4, q) == a.reshape(4, q)[::-1]).all()


# ------------------------------------------------- the Numba launch, with Numba's CUDA calls stood in for
class FakeCompiled:
    def __init__(self, sig, raw_ok, log):
        self.sig, self.raw_ok, self.log = sig, raw_ok, log

    def max_cooperative_grid_blocks(self, threads):
        assert threads == 512
        return 264

    def launch(self, args, griddim, blockdim, stream):
        if "CPointer" in self.sig and not self.raw_ok:
            raise NotImplementedError("(uint64*, 5)")  # what Numba's own numba.cuda says for a pointer
        self.log.append((self.sig, args, griddim, blockdim, stream))


@pytest.fixture
def numba_stand_ins(monkeypatch):
    import contextlib

    import numba.cuda

    import cupool.kernels.move as move

    state = SimpleNamespace(raw_ok=True, compiled=[], launches=[])

    class Dispatcher:
        def compile(self, sig):
            state.compiled.append(sig)
            return FakeCompiled(sig, state.raw_ok, state.launches)

    monkeypatch.setattr(move, "move_cuda", Dispatcher())
    monkeypatch.setattr(numba.cuda, "gpus", {0: contextlib.nullcontext()})
    monkeypatch.setattr(numba.cuda, "external_stream", lambda handle: ("stream", handle))
    monkeypatch.setattr(numba.cuda, "from_cuda_array_interface",
                        lambda desc, owner, sync: ("view", desc["data"][0], desc["shape"], desc["typestr"]))
    return state


def test_the_kernel_is_launched_on_raw_pointers_without_the_dispatcher(numba_stand_ins):
    from cupool.device.cuda_moves import NumbaMoveKernel

    k = NumbaMoveKernel(0)
    k.prepare(8)
    for _ in range(2):
        k.launch(8, 4096, 100, 8192, 50, 7, 2, STREAM)
    k.launch(1, 4096, 800, 8192, 50, 7, 2, STREAM)
    assert numba_stand_ins.compiled == ["void(CPointer(uint64), CPointer(int64), int64, int64)",
                                        "void(CPointer(uint8), CPointer(int64), int64, int64)"]  # once per size
    sig, args, grid, block, stream = numba_stand_ins.launches[0]
    assert (args, grid, block, stream) == ((4096, 8192, 7, 2), (264, 1, 1), (512, 1, 1), ("stream", STREAM))
    assert len(numba_stand_ins.launches) == 3


def test_a_numba_that_cannot_pass_pointers_gets_array_views(numba_stand_ins):
    from cupool.device.cuda_moves import NumbaMoveKernel

    numba_stand_ins.raw_ok = False
    k = NumbaMoveKernel(0)
    k.launch(8, 4096, 100, 8192, 50, 7, 2, STREAM)
    k.launch(1, 4096, 800, 8192, 50, 7, 2, STREAM)
    assert numba_stand_ins.compiled == ["void(CPointer(uint64), CPointer(int64), int64, int64)",
                                        "void(uint64[::1], int64[::1], int64, int64)",
                                        "void(uint8[::1], int64[::1], int64, int64)"]  # pointers never tried again
    views = [launch[1][:2] for launch in numba_stand_ins.launches]
    assert views == [(("view", 4096, (100,), "<u8"), ("view", 8192, (50,), "<i8")),
                     (("view", 4096, (800,), "|u1"), ("view", 8192, (50,), "<i8"))]
