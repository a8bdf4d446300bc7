"""A program's own ``empty_cache()`` and ``compact()`` are recorded as events of their own and replayed there.

Before, a replay inferred them from what they left behind (a burst of segment
frees, a ``compact`` event): an ``empty_cache()`` that released nothing left no
trace, and a free that dropped its own segment could pass for one (issue 19).
"""

from __future__ import annotations

import numpy as np

import cupool
from cupool.replay import replay
from cupool.replay.calls import COMPACT, EMPTY_CACHE, program_calls

MiB = 1 << 20


def _record(program, **config):
    pool = cupool.Pool("sim", capacity="256MiB", **config)
    rec = pool.record()
    rec.start()
    program(pool)
    rec.stop()
    return rec.trace(), pool.stats()


def _phases(pool):
    a = [pool.malloc(30 * MiB) for _ in range(3)]
    pool.empty_cache()  # releases nothing: all three are alive
    del a
    pool.empty_cache()
    b = [pool.malloc(45 * MiB) for _ in range(2)]
    del b


def test_every_call_is_an_event_even_one_that_released_nothing():
    trace, _ = _record(_phases, expandable_segments=False)
    counts = trace.counts()
    assert counts["call:empty_cache"] == 2
    marks = program_calls(trace, len(trace), 0)
    where = np.flatnonzero(marks == EMPTY_CACHE)
    assert [trace.kinds[int(trace.kind[i])] for i in where] == ["call:empty_cache"] * 2


def test_the_recorded_calls_replay_to_the_recorded_peaks():
    for config in ({"expandable_segments": False}, {}):
        trace, stats = _record(_phases, **config)
        for engine in ("numba", "pool"):
            r = replay(trace, engine=engine)
            assert r.peak_reserved == stats["reserved_bytes.all.peak"], (config, engine)
            assert (r.device_allocs, r.device_frees) == (stats["num_device_alloc"], stats["num_device_free"])
            assert (r.segment_allocs, r.segment_frees) == (stats["segment.all.allocated"], stats["segment.all.freed"])


def test_a_compact_call_is_an_event_and_marked():
    def program(pool):
        ms = [pool.movable(3 * MiB) for _ in range(4)]
        ms[1].free()
        pool.compact()
        pool.compact()  # nothing left to move: still the program's call
        del ms

    trace, _ = _record(program)
    assert trace.counts()["call:compact"] == 2
    marks = program_calls(trace, len(trace), 0)
    assert (marks == COMPACT).sum() == 2
