"""Replays that say what happened: the ladder's costs, the program's own calls, the state a window starts from."""

from __future__ import annotations

import gc

import cupool
from cupool.replay import replay
from cupool.trace import Trace


def _oom_trace(n: int = 40) -> Trace:
    """Every other request of 30 MiB is refused on a 64 MiB device: the ladder runs each time."""
    events = [(0, "alloc", 1, 30 << 20, 0), (1, "alloc", 2, 30 << 20, 0)]
    events += [(2 + i, "alloc", 10 + i, 30 << 20, 0) for i in range(n)]
    return Trace.from_events(events)


def test_the_replay_pools_ladder_does_not_collect_garbage(monkeypatch):
    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or real(*a))
    for cfg in ({"capacity": "64MiB"}, {"capacity": "64MiB", "expandable_segments": True, "stitch": True}):
        r = replay(_oom_trace(), cfg, engine="pool")
        assert r.ooms == 40
    assert calls == []
    # An ordinary pool still collects: the step is off only for replays.
    pool = cupool.Pool("sim", capacity="64MiB")
    keep = [pool.malloc(30 << 20), pool.malloc(30 << 20)]
    try:
        pool.malloc(30 << 20)
    except cupool.OutOfMemoryError:
        pass
    assert calls
    del keep
