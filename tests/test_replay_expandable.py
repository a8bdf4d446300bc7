"""The numba engine models expandable segments and stitching: it agrees with the pool engine (issue 19 part 2)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import cupool
from engines import engines_agree, synthetic


def _agree(trace, config):
    fast = engines_agree(trace, config)
    assert fast.fragmentation_at_peak <= fast.max_fragmentation  # the peak's is one of the samples
    return fast


_OPS = st.lists(st.tuples(st.booleans(), st.one_of(st.integers(0, 1 << 20), st.integers(1 << 20, 30 << 20)),
                          st.integers(0, 2), st.integers(0, 99)), max_size=120)
_VMM = st.sampled_from([
    {"capacity": "64MiB", "expandable_segments": True, "stitch": False},
    {"capacity": "64MiB", "expandable_segments": True, "stitch": True},
    {"capacity": "48MiB", "expandable_segments": True, "stitch": True, "release_threshold": "8MiB"},
    {"capacity": "128MiB", "expandable_segments": True, "stitch": True, "max_size": "40MiB", "initial_size": "6MiB"},
    {"capacity": "64MiB", "expandable_segments": True, "stitch": False, "release_threshold": 0},
    {"capacity": "64MiB", "expandable_segments": True, "stitch": True, "memory_fraction": 0.77},
    {"capacity": "64MiB", "memory_fraction": 0.77, "expandable_segments": False},  # a limit off the page, plain
    {"capacity": "64MiB"},  # Pool's defaults: each engine resolves them (expandable, stitched on the sim device)
])


@settings(max_examples=60, deadline=None)
@given(_OPS, _VMM)
def test_engines_agree_on_expandable_segments_and_stitching(ops, config):
    _agree(synthetic(ops), config)


def test_stitching_under_pressure_is_modelled():
    """Holes of freed 8 MiB blocks between live ones: a 24 MiB request is served by stitching them, and
    without stitching by the ladder's release step, which unmaps them (``release_cuts_holes``): both
    engines, alike.  Before issue 25 the pool without stitching failed the request."""
    ops = [(True, 8 << 20, 0, 0) for _ in range(7)]
    ops += [(False, 0, 0, 0), (False, 0, 0, 1), (False, 0, 0, 2)]  # frees blocks 1, 3 and 5 of the 7 left
    ops += [(True, 24 << 20, 0, 0)]
    trace = synthetic(ops)
    plain = _agree(trace, {"capacity": "64MiB", "expandable_segments": True, "stitch": False})
    stitched = _agree(trace, {"capacity": "64MiB", "expandable_segments": True, "stitch": True})
    assert plain.ooms == stitched.ooms == 0
    assert (plain.device_allocs, plain.device_frees) == (stitched.device_allocs, stitched.device_frees) == (8, 3)


def test_a_recorded_expandable_pool_replays_alike_on_both_engines():
    """The recording's virtual addresses were the kernel's (ties in best fit break by them), so a replay
    need not match it block for block; both engines replay it alike, on the recorded settings."""
    pool = cupool.Pool("sim", capacity="96MiB", expandable_segments=True, stitch=True, release_threshold="16MiB")
    rec = pool.record()
    rec.start()
    live = []
    for i in range(200):
        if live and i % 3 == 0:
            live.pop((i * 7) % len(live)).free()
        else:
            try:
                live.append(pool.malloc(((i * 2654435761) % (12 << 20)) + 1, stream=i % 2))
            except cupool.OutOfMemoryError:
                pass
    rec.stop()
    trace = rec.trace()
    r = _agree(trace, None)
    assert r.config["expandable_segments"] and r.config["stitch"] and not r.warnings
    assert r.peak_allocated == pool.stats()["allocated_bytes.all.peak"]
    del live
