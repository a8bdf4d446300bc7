"""The split of a move list between the copy path and the kernel, and the order across the two (issue 18).

``plan_moves`` is run on the CPU; its copy steps are executed with numpy copies
(in reverse order within a step, or all loads first: a batched copy promises no
order), its kernel steps with the sim device's ``@njit`` twin on the step's pieces
group by group, and the result compared with a bytearray memmove of the list.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from cupool.kernels.move import move_cpu
from cupool.kernels.plan import COPY, KERNEL, MAX_PHASES, plan_moves

SIZE = 512
TILE = 4
COPY_MIN = 24  # in elements: moves this long or longer that do not overlap themselves use the copy path


def reference(buf: bytearray, moves) -> bytes:
    for s, d, n in moves:
        buf[d : d + n] = bytes(buf[s : s + n])  # bytes() copies first: memmove semantics
    return bytes(buf)


def arrays(moves):
    return tuple(np.array([m[i] for m in moves], dtype=np.int64) for i in range(3))


def plan(moves, copy_min=COPY_MIN, scratch=-1, window=0):
    return plan_moves(*arrays(moves), scratch, window, TILE, copy_min)


def steps_of(planned):
    """Each step as (kind, [(src, dst, n), ...] per group)."""
    steps, copies, packed = planned
    out = []
    for kind, a, b, c in steps.tolist():
        if kind == COPY:
            out.append((COPY, [[tuple(int(v) for v in copies[:, i]) for i in range(a, a + b)]]))
        else:
            k, ng = b, c
            ps, pd, pn = packed[a : a + k], packed[a + k : a + 2 * k], packed[a + 2 * k : a + 3 * k]
            tiles = packed[a + 3 * k : a + 4 * k + 1]
            starts = packed[a + 4 * k + 1 : a + 4 * k + 2 + ng]
            assert tiles[0] == 0 and all(tiles[p + 1] - tiles[p] == -(-pn[p] // TILE) for p in range(k))
            assert starts[0] == 0 and starts[-1] == k and (np.diff(starts) > 0).all()
            out.append((KERNEL, [[(int(ps[p]), int(pd[p]), int(pn[p])) for p in range(starts[g], starts[g + 1])]
                                 for g in range(ng)]))
    return out


def assert_race_free(group):
    for i, (s, d, n) in enumerate(group):
        assert n > 0 and (d + n <= s or s + n <= d), "a piece overlaps itself"
        for j, (s2, d2, n2) in enumerate(group):
            if i != j:
                assert d + n <= d2 or d2 + n2 <= d, "two pieces of a group write the same bytes"
                assert d + n <= s2 or s2 + n2 <= d, "a piece writes what another of its group reads"


def execute(data: bytes, planned, loads_first: bool) -> bytes:
    """Copy steps with numpy copies in an order a batch may take; kernel steps with the @njit twin, group by group."""
    arr = np.frombuffer(bytearray(data), dtype=np.uint8).copy()
    for kind, groups in steps_of(planned):
        for group in groups:
            assert_race_free(group)
            if kind == KERNEL:
                s, d, n = arrays(group[::-1] if not loads_first else group)
                move_cpu(arr, s, d, n)
            elif loads_first:
                loaded = [(d, arr[s : s + n].copy()) for s, d, n in group]
                for d, b in loaded:
                    arr[d : d + b.size] = b
            else:
                for s, d, n in reversed(group):
                    np.copyto(arr[d : d + n], arr[s : s + n])
    return arr.tobytes()


@st.composite
def move_lists(draw, most=12):
    moves = []
    for _ in range(draw(st.integers(0, most))):
        n = draw(st.integers(0, SIZE // 2))
        moves.append((draw(st.integers(0, SIZE - n)), draw(st.integers(0, SIZE - n)), n))
    return moves


@given(move_lists(), st.binary(min_size=SIZE, max_size=SIZE), st.booleans())
def test_the_split_plan_matches_memmove_across_both_paths(moves, data, loads_first):
    planned = plan(moves)
    assert execute(data, planned, loads_first) == reference(bytearray(data), moves)


@given(move_lists(most=40), st.binary(min_size=SIZE, max_size=SIZE))
def test_many_alternating_moves_stay_within_the_phase_cap(moves, data):
    planned = plan(moves, copy_min=8)
    kinds = [k for k, _ in steps_of(planned)]
    switches = sum(1 for a, b in zip(kinds, kinds[1:]) if a != b)
    assert switches < MAX_PHASES
    assert execute(data, planned, loads_first=True) == reference(bytearray(data), moves)


def test_large_disjoint_moves_are_copies_and_the_rest_kernel_pieces():
    moves = [(100, 0, 30), (200, 300, 10), (40, 44, 30)]  # disjoint and long; disjoint but short; a slide
    steps = steps_of(plan(moves))
    copied = [p for kind, groups in steps if kind == COPY for g in groups for p in g]
    kernel = [p for kind, groups in steps if kind == KERNEL for g in groups for p in g]
    assert copied == [(100, 0, 30)]
    assert (200, 300, 10) in kernel and sum(n for _, _, n in kernel) == 10 + 30  # the slide, chunked
    assert [k for k, _ in steps] == [COPY, KERNEL]  # nothing depends across them: one switch


def test_a_copy_waits_for_the_kernel_move_that_writes_its_source():
    # a small move fills [0, 8); a long copy then reads [0, 40); then a small move reads what the copy wrote
    moves = [(400, 0, 8), (0, 100, 40), (100, 300, 8)]
    steps = steps_of(plan(moves))
    assert [k for k, _ in steps] == [KERNEL, COPY, KERNEL]
    data = bytes(range(256)) * 2
    assert execute(data, plan(moves), loads_first=True) == reference(bytearray(data), moves)


def test_a_copy_never_overwrites_bytes_an_earlier_kernel_move_has_yet_to_read():
    moves = [(0, 300, 8), (100, 0, 40)]  # the kernel reads [0, 8) before the copy overwrites it
    assert [k for k, _ in steps_of(plan(moves))] == [KERNEL, COPY]
    data = bytes(range(256)) * 2
    assert execute(data, plan(moves), loads_first=False) == reference(bytearray(data), moves)


def test_independent_steps_share_a_phase_whatever_their_order_in_the_list():
    # small, long, small, long, all independent: one kernel step and one copy step, not four
    moves = [(0, 256, 8), (32, 300, 40), (16, 264, 8), (80, 350, 40)]
    kinds = [k for k, _ in steps_of(plan(moves))]
    assert sorted(kinds) == [COPY, KERNEL]


def test_everything_to_the_kernel_when_copy_min_exceeds_every_move():
    moves = [(100, 0, 50), (300, 200, 50), (0, 400, 10)]
    steps = steps_of(plan(moves, copy_min=1 << 62))
    assert steps == [(KERNEL, [[(100, 0, 50), (300, 200, 50)], [(0, 400, 10)]])]
    assert plan([(5, 5, 16), (0, 9, 0)])[0].shape == (0, 4)  # nothing to do


def test_4096_small_moves_are_one_kernel_step():
    n = 4096
    src = np.arange(n, dtype=np.int64) * 1024 + 512  # 4 KiB moves as 512 words, every other slot compacted
    steps, copies, _ = plan_moves(src, src - 512 * (np.arange(n) + 1), np.full(n, 512, np.int64), -1, 0, 2048,
                                  (1 << 20) // 8)
    assert steps.tolist() == [[KERNEL, 0, n, steps[0, 3]]] and copies.shape == (3, 0)
