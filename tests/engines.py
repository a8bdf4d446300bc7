"""What the two replay engines must agree on, and the made-up traces the tests hold them to it with.

Shared by the replay tests (``test_replay``, ``test_replay_expandable``,
``test_release_before_split``, ``test_expandable``): one definition of
"the engines agree", so that no file checks less than the others.
"""

from __future__ import annotations

from typing import Any

from cupool.replay import replay
from cupool.trace import Trace

#: Peaks and counts: the numba engine must equal the pool engine on these for every trace.
COUNTS = ("peak_reserved", "peak_allocated", "peak_segments", "segment_allocs", "segment_frees", "device_allocs",
          "device_frees", "ooms", "unmatched_frees")
#: ... and on these too, wherever both lay blocks out alike (not where the numba engine follows
#: recorded moves that the pool engine, compacting by itself, makes its own way).
AGREED = (*COUNTS, "max_fragmentation", "mean_fragmentation", "fragmentation_at_peak")


def engines_agree(trace: Trace, config: dict[str, Any] | None = None, on: tuple[str, ...] = AGREED) -> Any:
    """Replay ``trace`` on both engines, assert they agree ``on`` those figures; the numba engine's result."""
    fast = replay(trace, config, engine="numba")
    exact = replay(trace, config, engine="pool")
    assert {k: getattr(fast, k) for k in on} == {k: getattr(exact, k) for k in on}
    return fast


def synthetic_events(ops: Any) -> list[tuple]:
    """Events from (is_alloc, size, stream, which) tuples, with made-up addresses; a free takes the
    live block ``which`` (modulo how many are live), and an alloc-less free allocates instead."""
    events, live, nxt = [], [], 0
    for t, (is_alloc, size, stream, which) in enumerate(ops):
        if is_alloc or not live:
            nxt += 1
            live.append((nxt, size, stream))
            events.append((t, "alloc", nxt, size, stream))
        else:
            a, s, strm = live.pop(which % len(live))
            events.append((t, "free", a, s, strm))
    return events


def synthetic(ops: Any) -> Trace:
    """``synthetic_events`` as a trace."""
    return Trace.from_events(synthetic_events(ops))
