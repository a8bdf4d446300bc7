"""The batched move kernels against a reference with memmove semantics."""

import os
import subprocess
import sys
import textwrap

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import cupool
from conftest import needs_gpu
from cupool.kernels.move import barriers, move_cpu, word_size


def reference(buf: bytearray, moves):
    for s, d, n in moves:
        buf[d : d + n] = bytes(buf[s : s + n])  # bytes() copies first: memmove semantics
    return buf


SIZE = 512


@st.composite
def move_lists(draw, unit=1):
    k = draw(st.integers(0, 8))
    moves = []
    for _ in range(k):
        n = draw(st.integers(0, SIZE // unit // 2)) * unit
        s = draw(st.integers(0, (SIZE - n) // unit)) * unit
        d = draw(st.integers(0, (SIZE - n) // unit)) * unit
        moves.append((s, d, n))
    return moves


def run_cpu(moves, data):
    arr = np.frombuffer(bytearray(data), dtype=np.uint8).copy()
    src, dst, n = (np.array([m[i] for m in moves], dtype=np.int64) for i in range(3))
    ws = word_size(src, dst, n)
    buf = arr.view(np.uint64) if ws == 8 else arr
    move_cpu(buf, src // ws, dst // ws, n // ws)
    return bytes(arr), ws


@given(move_lists(unit=1), st.binary(min_size=SIZE, max_size=SIZE))
def test_cpu_twin_matches_memmove_bytes(moves, data):
    out, _ = run_cpu(moves, data)
    assert out == bytes(reference(bytearray(data), moves))


@given(move_lists(unit=8), st.binary(min_size=SIZE, max_size=SIZE))
def test_cpu_twin_matches_memmove_words(moves, data):
    out, ws = run_cpu(moves, data)
    assert ws == 8
    assert out == bytes(reference(bytearray(data), moves))


def test_a_block_sliding_over_itself_both_ways():
    data = bytes(range(256)) * 2
    for moves in ([(8, 0, 400)], [(0, 8, 400)], [(100, 99, 300)], [(99, 100, 300)]):
        out, _ = run_cpu(moves, data)
        assert out == bytes(reference(bytearray(data), moves))


def test_barriers_only_between_dependent_moves():
    # two independent moves, then one that reads what the first wrote
    src = np.array([100, 300, 0])
    dst = np.array([0, 200, 400])
    n = np.array([50, 50, 10])
    assert barriers(src, dst, n).tolist() == [0, 1, 1]
    assert barriers(np.array([0]), np.array([8]), np.array([16])).tolist() == [1]


_CUDASIM_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    from numba import cuda
    from cupool.kernels.move import barriers, move_cuda
    rng = np.random.default_rng(0)
    for trial in range(6):
        size = 96
        words = rng.integers(0, 2**63, size=size, dtype=np.uint64)
        moves = []
        for _ in range(4):
            n = int(rng.integers(1, 30))
            moves.append((int(rng.integers(0, size - n)), int(rng.integers(0, size - n)), n))
        moves.append((10, 3, 40))   # slides down over itself
        moves.append((3, 13, 40))   # and back up over itself
        ref = words.copy()
        for s, d, n in moves:
            ref[d:d + n] = ref[s:s + n].copy()
        src, dst, cnt = (np.array([m[i] for m in moves], dtype=np.int64) for i in range(3))
        buf = cuda.to_device(words)
        move_cuda[1, 16](buf, src, dst, cnt, barriers(src, dst, cnt))
        got = buf.copy_to_host()
        assert (got == ref).all(), (trial, moves)
    print("ok")
    """
)


def test_cuda_kernel_under_the_simulator():
    """The cuda.jit kernel itself, run by Numba's CUDA simulator (no GPU needed).

    One block of 16 threads: the simulator's grid.sync() only synchronizes the
    threads of one block (a real GPU's cooperative launch syncs the grid), so more
    blocks would test the simulator, not the kernel.
    """
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    r = subprocess.run([sys.executable, "-c", _CUDASIM_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def _barriers_reference(src, dst, n):
    """The rule, stated plainly and quadratically."""
    out = [0] * len(src)
    reads, writes = [], []
    over = lambda a, b: a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]  # noqa: E731  (empty: none)
    for m in range(len(src)):
        r, w = (src[m], src[m] + n[m]), (dst[m], dst[m] + n[m])
        if any(over(w, x) for x in reads + writes) or any(over(r, x) for x in writes):
            out[m - 1] = 1
            reads, writes = [], []
        reads.append(r)
        writes.append(w)
    if len(src):
        out[-1] = 1
    return out


@given(move_lists(unit=1))
def test_barriers_match_the_plain_rule(moves):
    src, dst, n = ([m[i] for m in moves] for i in range(3))
    got = barriers(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.array(n, dtype=np.int64))
    assert got.tolist() == _barriers_reference(src, dst, n)


@needs_gpu
@given(move_lists(unit=8), st.binary(min_size=SIZE, max_size=SIZE))
def test_cuda_kernel_on_the_gpu_matches_memmove(moves, data):
    """Many blocks, cooperative launch: the real grid-wide barriers, through CudaDevice."""
    import cupy

    pool = cupool.Pool("cuda", max_size="64MiB")
    a = pool.malloc(SIZE)
    pool.device.from_host(a.ptr, np.frombuffer(data, dtype=np.uint8))
    src, dst, n = (np.array([m[i] for m in moves], dtype=np.int64) for i in range(3))
    pool.device.execute_moves(src + a.ptr, dst + a.ptr, n)
    cupy.cuda.runtime.deviceSynchronize()
    assert bytes(pool.device.to_host(a.ptr, SIZE)) == bytes(reference(bytearray(data), moves))


@needs_gpu
def test_cuda_kernel_moves_large_overlapping_blocks():
    """Megabytes sliding over themselves by a few words: many chunks, each behind a grid barrier."""
    pool = cupool.Pool("cuda", max_size="256MiB")
    size = 64 << 20
    a = pool.malloc(size)
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    pool.device.from_host(a.ptr, data)
    moves = [(4096, 0, 32 << 20), (0, 1 << 20, 48 << 20), (40 << 20, 8 << 20, 16 << 20)]
    src, dst, n = (np.array([m[i] for m in moves], dtype=np.int64) for i in range(3))
    pool.device.execute_moves(src + a.ptr, dst + a.ptr, n)
    expected = bytearray(data.tobytes())
    reference(expected, moves)
    assert bytes(pool.device.to_host(a.ptr, size)) == bytes(expected)
