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
from cupool.kernels.move import move_cpu, word_size
from cupool.kernels.plan import KERNEL, MAX_CHUNKS, plan_moves, scratch_needed


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


TILE = 4


def plan(moves, scratch=-1, window=0):
    """The kernel's plan for the moves, all of them sent to the kernel: (src, dst, length, tiles, group starts)."""
    src, dst, n = (np.array([m[i] for m in moves], dtype=np.int64) for i in range(3))
    steps, copies, packed = plan_moves(src, dst, n, scratch, window, TILE, 1 << 62)
    assert copies.shape == (3, 0) and len(steps) <= 1
    if not len(steps):
        return (np.zeros(0, np.int64),) * 3 + (np.zeros(1, np.int64),) * 2
    kind, a, k, ng = steps[0].tolist()
    assert kind == KERNEL
    return (packed[a : a + k], packed[a + k : a + 2 * k], packed[a + 2 * k : a + 3 * k],
            packed[a + 3 * k : a + 4 * k + 1], packed[a + 4 * k + 1 : a + 4 * k + 2 + ng])


def groups(ps, pd, pn, tiles, starts):
    """Each group's pieces as (src, dst, length) triples; checks the tile counts on the way."""
    assert tiles[0] == 0 and all(tiles[p + 1] - tiles[p] == -(-pn[p] // TILE) for p in range(len(pn)))
    return [[(int(ps[p]), int(pd[p]), int(pn[p])) for p in range(starts[g], starts[g + 1])]
            for g in range(len(starts) - 1)]


def run_plan(data: bytes, planned, loads_first: bool) -> bytes:
    """Execute a plan as the grid may: a group's pieces in reverse order, or all their loads before any store."""
    buf = bytearray(data)
    for group in groups(*planned):
        if loads_first:
            loaded = [(d, bytes(buf[s : s + n])) for s, d, n in group]
            for d, b in loaded:
                buf[d : d + len(b)] = b
        else:
            for s, d, n in reversed(group):
                buf[d : d + n] = buf[s : s + n]
    return bytes(buf)


def assert_groups_are_race_free(planned):
    for group in groups(*planned):
        for i, (s, d, n) in enumerate(group):
            assert n > 0 and (d + n <= s or s + n <= d), "a piece overlaps itself"
            for j, (s2, d2, n2) in enumerate(group):
                if i != j:
                    assert d + n <= d2 or d2 + n2 <= d, "two pieces of a group write the same bytes"
                    assert d + n <= s2 or s2 + n2 <= d, "a piece writes what another of its group reads"


def test_independent_moves_share_a_group_and_dependent_ones_do_not():
    # two independent moves, then one that reads what the first wrote
    assert groups(*plan([(100, 0, 50), (300, 200, 50), (0, 400, 10)])) == [
        [(100, 0, 50), (300, 200, 50)], [(0, 400, 10)]]
    assert groups(*plan([(0, 8, 16)])) == [[(8, 16, 8)], [(0, 8, 8)]]  # slides up: back to front
    assert groups(*plan([(5, 5, 16), (0, 9, 0)])) == []  # nothing to do


@given(move_lists(unit=1), st.binary(min_size=SIZE, max_size=SIZE), st.booleans())
def test_the_gpu_plan_matches_memmove_in_any_order_within_a_group(moves, data, loads_first):
    planned = plan(moves)
    assert_groups_are_race_free(planned)
    assert run_plan(data, planned, loads_first) == bytes(reference(bytearray(data), moves))


SCRATCH = 24


@given(st.integers(1, 3), st.integers(SIZE // 4, SIZE // 2), st.booleans(), st.binary(min_size=SIZE, max_size=SIZE))
def test_a_long_slide_by_a_little_goes_through_scratch_window_by_window(dist, n, down, data):
    moves = [(dist, 0, n)] if down else [(0, dist, n)]
    src, dst, cnt = (np.array([m[i] for m in moves], dtype=np.int64) for i in range(3))
    assert scratch_needed(src, dst, cnt) == n  # (n / dist > MAX_CHUNKS here)
    planned = plan(moves, scratch=SIZE, window=SCRATCH)
    assert_groups_are_race_free(planned)
    assert len(planned[4]) - 1 == 2 * -(-n // SCRATCH)  # two barriers per window, not n / dist
    out = run_plan(data + bytes(SCRATCH), planned, loads_first=True)[:SIZE]
    assert out == bytes(reference(bytearray(data), moves))
    assert len(plan(moves)[4]) - 1 == -(-n // dist) > MAX_CHUNKS  # without scratch: chunked by the distance


_CUDASIM_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    from numba import cuda
    from cupool.kernels.move import move_cuda
    from cupool.kernels.plan import plan_moves
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
        steps, _, packed = plan_moves(src, dst, cnt, -1, 0, 16, 1 << 62)  # all to the kernel; tiles of 4 x 4
        (kind, a, k, ngroups), = steps.tolist()
        move_cuda[1, 4](buf, cuda.to_device(packed[a:]), k, ngroups)  # arrays here, raw pointers on a GPU
        got = buf.copy_to_host()
        assert (got == ref).all(), (trial, moves)
    print("ok")
    """
)


def test_cuda_kernel_under_the_simulator():
    """The cuda.jit kernel itself, run by Numba's CUDA simulator (no GPU needed).

    One block of 4 threads: the simulator's grid.sync() only synchronizes the
    threads of one block (a real GPU's cooperative launch syncs the grid), so more
    blocks would test the simulator, not the kernel.
    """
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    r = subprocess.run([sys.executable, "-c", _CUDASIM_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


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


@needs_gpu
def test_copy_path_and_kernel_together_on_the_gpu_match_memmove():
    """Megabyte moves (the copy path) among small ones and slides (the kernel), dependent on each other."""
    pool = cupool.Pool("cuda", max_size="256MiB")
    size = 64 << 20
    a = pool.malloc(size)
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    pool.device.from_host(a.ptr, data)
    moves = []
    for _ in range(64):
        n = int(rng.choice([4096, 64 << 10, 1 << 20, 2 << 20, 3 << 20])) + 8 * int(rng.integers(0, 4))
        moves.append((8 * int(rng.integers(0, (size - n) // 8)), 8 * int(rng.integers(0, (size - n) // 8)), n))
    moves += [(0, 4 << 20, 8 << 20), (1 << 20, 0, 2 << 20)]  # slides the later moves depend on
    src, dst, n = (np.array([m[i] for m in moves], dtype=np.int64) for i in range(3))
    pool.device.execute_moves(src + a.ptr, dst + a.ptr, n)
    expected = bytearray(data.tobytes())
    reference(expected, moves)
    assert bytes(pool.device.to_host(a.ptr, size)) == bytes(expected)
