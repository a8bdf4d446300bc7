"""Replaying traces on the sim device, under the recorded or other pool settings.

* ``driver``: ``replay`` and ``layout``, over either engine (see its docstring
  for what a replay models and the two engines' differences);
* ``config``, ``result``, ``seed``, ``calls``: settings, results, the state a replay
  starts from, and the program's own ``empty_cache()``/``compact()`` calls;
* ``pool_engine``, ``numba_engine``: the two engines' drivers; ``device``: the
  replay's sim device;
* ``engine`` (with ``engine_layout``, ``engine_heap``, ``engine_memory``): the
  numba-compiled twin of the pool that the fast engine runs;
* ``report``: ``plot_report``, the three-panel figure drawn from a replay;
* ``commands``: ``cupool replay`` and ``cupool report``.

Reading traces is ``cupool.trace``.
"""

from .driver import (
    CONFIG_KEYS,
    ENGINES,
    FRAGMENTATION_NOTE,
    MOVABLE_KINDS,
    POOL_KEYS,
    ReplayResult,
    check_config,
    default_engine,
    layout,
    parse_config,
    recorded_config,
    recorded_segments,
    replay,
    uses_movables,
)
from .report import plot_report

__all__ = [
    "CONFIG_KEYS",
    "ENGINES",
    "FRAGMENTATION_NOTE",
    "MOVABLE_KINDS",
    "POOL_KEYS",
    "ReplayResult",
    "check_config",
    "default_engine",
    "layout",
    "parse_config",
    "plot_report",
    "recorded_config",
    "recorded_segments",
    "replay",
    "uses_movables",
]
