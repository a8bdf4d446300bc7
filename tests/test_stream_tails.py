"""A stream's fresh tail goes to every stream once that stream's epochs are known done (Note [Streams]).

Memory a stream grows and does not use stays tagged with that stream (epoch 0).  The streams'
settle used to answer only the events completed in that very call, so a stream that freed
nothing since its last event kept such a tail for good, and other streams grew beside it.
Found on issue 35's small/4s/0 (docs/benchmarks.md, "Why small/4s/0 maps a fifth granule").
"""

from __future__ import annotations

import math

import numpy as np

import cupool
from cupool.testing.programs import run_calls

MiB = 1 << 20


def small_four_streams() -> list[tuple[int, int, int]]:
    """Issue 35's small/4s/0 (``bench_random_programs.program(4000, 1500, 512, 1 MiB, 120, 4)``)."""
    rng = np.random.default_rng(4000)
    ops, live = [], 0
    for _ in range(1500):
        if live == 0 or (live < 120 and rng.random() < 0.5):
            ops.append((0, int(math.exp(rng.uniform(math.log(512), math.log(MiB)))), int(rng.integers(4))))
            live += 1
        else:
            ops.append((1, int(rng.integers(1 << 30)), 0))
            live -= 1
    return ops


def test_another_stream_takes_a_tail_its_grower_left_unused():
    ops = small_four_streams()
    pool = cupool.Pool("sim", capacity="16GiB")
    _, live = run_calls(pool, ops[:1208])
    assert pool.stats()["reserved_bytes.all.current"] == 8 * MiB
    # Call 1,208 asks 343 KiB on stream 1: no free block of stream 1's or anyone's fits, and
    # 1,074 KiB of stream 2's region is free, never used: stream 2's epochs are done (it has
    # settled before and freed nothing since), so it is anyone's, and the pool does not grow.
    assert ops[1208] == (0, 351263, 1)
    live.append(pool.malloc(351263, stream=1))
    assert pool.stats()["reserved_bytes.all.current"] == 8 * MiB
    pool.check()
    for a in live:
        a.free()
    pool.close()
