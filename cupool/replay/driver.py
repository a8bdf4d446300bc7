"""Replay a trace on the sim device, under the recorded or other pool settings.

What drives a replay (the event contract is ``Pool.subscribe``'s):

* ``alloc`` / ``free``: raw allocations, replayed as ``malloc`` / ``free``;
* ``oom``: a request that was refused: the replay makes it too (the reclaim
  ladder's side effects shape what follows) and frees at once what it gets;
* ``alloc_movable`` / ``free_movable``: movable buffers, which grow the pool by
  exactly their size;
* ``move_out`` then ``move_in``: the block's identity moves from the first
  address to the second, so later events that name the second find it;
* ``spill`` / ``restore`` (after the matching ``free_movable`` / ``alloc_movable``):
  the buffer left the device and came back, so its identity is carried across.

The pool decides its own segments, so the trace's ``segment_*`` events are
what a replay is compared against, not inputs; the exception is a recording
that started on a pool already holding memory, whose first events (counted in
the trace's ``seed`` configuration) describe the segments and live blocks the
replay starts from.  A PyTorch snapshot whose recording window started mid-run
gets such a seed from its importer (the blocks older than the window), and one
with no history is its seed alone: a still picture (``ReplayResult.history``).
The program's own ``empty_cache()`` calls (and, in cupool traces,
``compact()`` calls), read from the trace by ``cupool.replay.calls``, are made
at the same points (the numba engine does what ``Pool.empty_cache`` does for
either).  Both engines start from the seed the same way (``cupool.replay.seed``).
Frees of addresses the replay does not hold (an allocation the replay could not serve, a
foreign trace with no seed) are skipped and counted; an ``alloc`` at an address
still held frees the old block first (the trace missed that free).

Two engines:

* ``"numba"``: the compiled twin of the pool in ``cupool.replay.engine``; millions of
  events per second.  It models raw allocations exactly, on plain segments and on
  expandable segments with or without stitching (``tests/test_replay.py`` and
  ``tests/test_replay_expandable.py`` hold it equal to the pool engine), and
  movable buffers' exact-size growth, but not compaction or spilling: for traces
  with movable buffers it follows the recorded moves and spills and says, in
  ``ReplayResult.warnings``, that its reserved memory may differ from the recording's.
* ``"pool"``: the real ``Pool`` on a fresh sim device (whose virtual ranges come
  first fit in address order, as every device's do and as the numba engine models
  them: Note [Address arena]); slow, but it is the pool
  itself, it takes every ``Pool`` argument, and it reproduces compaction (and,
  with the recorded spill settings, spilling) on its own: movable buffers are
  replayed through ``pool.movable()``, so the recorded moves and spills only tell
  it which buffer a later event means.  The replay never holds an array over a
  buffer, so a buffer the recorded run kept leased (and so could not move) may
  move in the replay; ``workloads.weight_streaming(movable=True)`` leases only
  while it fills or checks a layer, and replays exactly.

The default engine is ``"pool"`` for traces with movable buffers and ``"numba"``
otherwise.

Both replay the ``upstream`` setting (recorded, or given): ``"managed"`` memory
may hold more than the device, up to the sim device's address span, as
``SimDevice.malloc_managed`` allows, so a trace that runs out of memory on the
device can fit there; ``ReplayResult.peak_oversubscribed`` says by how much it
went past the device.  ``"async"`` places as ``"device"`` does (a replay enqueues
no work, so stream-ordered frees return at once).  Which settings a replay takes,
and which it reads from a trace, come from the settings registry
(``cupool.replay.config``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..core.sizes import SMALL
from ..trace import Trace, load_trace
from .config import (
    CONFIG_KEYS,
    ENGINES,
    MOVABLE_KINDS,
    POOL_ENGINE_KEYS,
    POOL_KEYS,
    VMM_KEYS,
    accepted_keys,
    check_config,
    default_engine,
    parse_config,
    plain_replay_warning,
    recorded_config,
    recorded_segments,
    replay_settings,
    trace_capacity,
    uses_movables,
)
from .pool_engine import replay_pool
from .result import FRAGMENTATION_NOTE, ReplayResult

__all__ = [
    "CONFIG_KEYS", "ENGINES", "FRAGMENTATION_NOTE", "MOVABLE_KINDS", "POOL_ENGINE_KEYS", "POOL_KEYS", "VMM_KEYS",
    "ReplayResult", "accepted_keys", "check_config", "default_engine", "layout", "parse_config", "recorded_config",
    "recorded_segments", "replay", "replay_settings", "trace_capacity", "uses_movables",
]

#: Traces this long show a progress bar by default (on a terminal).
PROGRESS_MIN = 2_000_000


def replay(
    trace: Trace | str | os.PathLike[str],
    config: dict[str, Any] | None = None,
    engine: str | None = None,
    timeline: bool = False,
    progress: bool | None = None,
    stop: int | None = None,
) -> ReplayResult:
    """Replay ``trace`` on a fresh sim pool with ``config`` (default: the recorded settings).

    ``trace`` is a ``Trace`` or a trace file's path (read by ``cupool.trace.load_trace``:
    a cupool HDF5 trace, a PyTorch memory snapshot or an RMM log).  ``engine`` None
    picks ``default_engine(trace, config)``: the pool engine for movable buffers or a
    setting only it models.  ``timeline`` keeps reserved/allocated bytes
    after every event, and the replay's own OOMs in each ("reserved", "allocated",
    "ooms"); ``progress`` shows a tqdm bar
    (default: on long traces, when stderr is a terminal); ``stop`` replays only
    the first ``stop`` events.
    """
    trace = _as_trace(trace, "replay")
    engine = default_engine(trace, config) if engine is None else engine
    cfg = replay_settings(trace, config, engine)
    check_config(cfg, engine)
    n = len(trace) if stop is None else max(0, min(stop, len(trace)))
    if progress is None:
        progress = n >= PROGRESS_MIN and sys.stderr.isatty()
    if engine == "pool":
        result = replay_pool(trace, cfg, n, timeline, progress, config)[0]
    else:
        from .numba_engine import replay_numba  # imports numba: only when it is used

        result = replay_numba(trace, cfg, n, timeline, progress, config)[0]
    warning = plain_replay_warning(trace, result.config, config)  # the settings the pool resolved
    if warning:
        result.warnings.append(warning)
    return result


def layout(
    trace: Trace | str | os.PathLike[str], config: dict[str, Any] | None = None, stop: int | None = None, engine: str | None = None,
) -> list[dict[str, Any]]:
    """Segments and their blocks after replaying the first ``stop`` events.

    Each segment: ``{"address", "size", "kind" ("small"/"large"), "blocks": [(offset, size, allocated)]}``.
    ``trace`` is as ``replay``'s.
    """
    trace = _as_trace(trace, "layout")
    engine = default_engine(trace, config) if engine is None else engine
    cfg = replay_settings(trace, config, engine)
    check_config(cfg, engine)
    n = len(trace) if stop is None else max(0, min(stop, len(trace)))
    out = []
    if engine == "pool":
        _, pool, live = replay_pool(trace, cfg, n, False, False, config)
        segments = pool.snapshot()["segments"]  # while the replay's handles live: dropped, they free their blocks
        del live
        for seg in segments:
            base = seg["address"]
            out.append({"address": base, "size": seg["total_size"], "kind": seg["segment_type"],
                        "blocks": [(b["address"] - base, b["size"], b["state"] != "inactive")
                                   for b in seg["blocks"]]})
    else:
        from .numba_engine import replay_numba, segments_of

        _, state = replay_numba(trace, cfg, n, False, False, config)
        for base, size, kind, blocks in segments_of(state):
            out.append({"address": base, "size": size, "kind": "small" if kind == SMALL else "large",
                        "blocks": blocks})
    out.sort(key=lambda seg: seg["address"])
    return out


def _as_trace(trace: object, caller: str) -> Trace:
    """``trace`` itself, or the trace file at that path; anything else is a ``TypeError`` naming its type."""
    if isinstance(trace, Trace):
        return trace
    if isinstance(trace, (str, os.PathLike)):
        return load_trace(os.fspath(trace))
    raise TypeError(
        f"{caller}() takes a Trace (cupool.load_trace(path)) or a trace file's path, got {type(trace).__name__}"
    )
