"""Replay settings: which keys each engine takes, the recorded ones, and the pool they make.

Every list of settings here is read from the registry (``cupool.settings``) when
it is needed: the numba engine takes the ``engine`` settings, the pool engine every
``Pool`` argument but the device (a replay's is the sim device), and "recorded"
means the ``recorded`` ones a trace holds.  A setting added to the registry is a
``--config`` key, and a recorded one replays, without an edit here.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from .. import settings
from .._units import parse_size
from ..core.sizes import round_page
from ..device.sim import SimDevice
from ..errors import AddressSpaceExhausted, OutOfMemoryError
from ..pool import Pool
from ..trace import Trace
from ..trace.importers import recorded_peak_reserved, sized_capacity

#: Events that only pools with movable buffers emit.
MOVABLE_KINDS = ("alloc_movable", "free_movable", "move_out", "move_in", "compact", "spill", "restore")
ENGINES = ("numba", "pool")


def accepted_keys(engine: str) -> tuple[str, ...]:
    """The settings ``engine`` takes (``--config`` and ``--compare`` say exactly these), in the registry's order:
    the numba engine's are the registry's ``engine`` settings; the pool engine takes every ``Pool``
    argument but the device's kind (a replay's device is the sim device)."""
    if engine == "pool":
        return tuple(s.name for s in settings.SETTINGS if s.kind != "device")
    return settings.names(engine=True)


def recorded_keys(engine: str) -> tuple[str, ...]:
    """The recorded settings a replay on ``engine`` takes from a trace (the registry's ``recorded`` ones it models)."""
    taken = set(accepted_keys(engine))
    return tuple(k for k in settings.names(recorded=True) if k in taken)


def vmm_keys() -> tuple[str, ...]:
    """The settings of virtual memory: ``expandable_segments`` and the settings that follow it."""
    return ("expandable_segments",) + settings.names(follows="expandable_segments")


#: The keys as the registry had them at import (``accepted_keys`` reads it at each call): settings both
#: engines model, those only the pool engine models among the recorded ones, and virtual memory's.
CONFIG_KEYS = accepted_keys("numba")
POOL_ENGINE_KEYS = accepted_keys("pool")
POOL_KEYS = tuple(k for k in recorded_keys("pool") if k not in CONFIG_KEYS)
VMM_KEYS = vmm_keys()


def parse_config(spec: str | None) -> dict[str, Any]:
    """``"max_size=1GiB,release_threshold=none"`` -> dict; values stay strings unless numeric."""
    out: dict[str, Any] = {}
    if not spec:
        return out
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ValueError(f"configuration {spec!r}: expected KEY=VALUE, got {item!r}")
        out[key] = _parse_value(value)
    return out


def _parse_value(v: str) -> Any:
    if v.lower() in ("none", "null"):
        return None
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def uses_movables(trace: Trace) -> bool:
    """Whether the trace has movable buffers (whose compaction and spilling only the pool engine models)."""
    counts = trace.counts()
    return any(counts.get(k) for k in MOVABLE_KINDS)


def default_engine(trace: Trace, *configs: dict[str, Any] | None) -> str:
    """``"pool"`` for traces with movable buffers (whose compaction and spilling only the pool engine
    models) or where ``configs``, the settings to be replayed, name one that only it models (``spill``,
    ``defrag_threshold``); else the fast ``"numba"``.  A key neither takes is left to ``check_config`` to refuse."""
    numba, pool = accepted_keys("numba"), accepted_keys("pool")
    only_pool = any(k in pool and k not in numba for c in configs if c for k in c)
    return "pool" if only_pool or uses_movables(trace) else "numba"


def recorded_config(trace: Trace, engine: str = "numba") -> dict[str, Any]:
    """The recording allocator's settings, as replay arguments: the registry's ``recorded`` settings
    that ``engine`` models, as the trace holds them.

    A cupool trace's are the recording pool's, defaults resolved (``Pool.config``
    records what was in force).  A PyTorch snapshot's allocator ran on plain
    segments unless it says it used expandable ones (``recorded_on_vmm``), and
    PyTorch never stitches: replaying it on cupool's defaults instead would
    compare another allocator with the recording.  An RMM log says nothing.
    """
    rec = trace.config
    # A None recorded where the default is not None is a choice (defrag_threshold=None: never compact).
    cfg = {k: rec[k] for k in recorded_keys(engine)
           if k in rec and (rec[k] is not None or settings.BY_NAME[k].default is not None)}
    if trace.format == "torch":
        cfg["expandable_segments"], cfg["stitch"] = recorded_on_vmm(trace), False
    if "capacity" not in cfg and rec.get("limit"):
        # Recorded on a GPU: the sim device gets the pool's limit as its size.  The
        # limit already applies the settings that resolve to it (max_size and
        # memory_fraction); applying them again to a device that small would shrink
        # the pool twice.
        cfg["capacity"] = rec["limit"]
        for s in settings.SETTINGS:
            if s.engine_slot == "limit":
                cfg.pop(s.name, None)
    if "capacity" not in cfg:
        sized = trace_capacity(trace)
        if sized is not None:
            cfg["capacity"] = sized[0]
    if cfg.get("spill") is not None:
        # Whatever tier the recorded run spilled to, a replay spills to host
        # memory: a trace file must never choose where a replay writes.
        cfg["spill"] = "host"
    return cfg


def replay_settings(trace: Trace, config: dict[str, Any] | None, engine: str) -> dict[str, Any]:
    """``config`` over the recorded settings (``recorded_config``): what a replay is built with.

    A setting that follows another (``stitch`` follows ``expandable_segments``) is
    taken from the recording only while what it follows keeps its recorded value
    (``settings.resolve_derived``).  Given ``expandable_segments=false`` over a
    recording on the defaults, the recorded ``stitch=True`` no longer applies (it
    would be refused: stitching needs expandable segments); given
    ``expandable_segments=true`` over a plain recording, stitching follows the
    pool's default as it would in a fresh pool.
    """
    given = config or {}
    cfg = settings.resolve_derived(given, recorded_config(trace, engine))
    if "capacity" in given and "max_size" not in given and _past_the_device(cfg.get("max_size"), cfg["capacity"]):
        # A device given smaller than the recorded cap is the cap itself (as it was when the pool took the
        # smaller of the two); the pool now refuses a max_size past its device, which nobody gave here.
        del cfg["max_size"]
    return {k: v for k, v in cfg.items() if not (v is None and settings.BY_NAME[k].follows is not None)}


def _past_the_device(max_size: Any, capacity: Any) -> bool:
    """Whether a ``max_size`` is more than a sim device of ``capacity`` holds (False when either is unreadable:
    the pool refuses that in its own words)."""
    if max_size is None:
        return False
    try:
        total = round_page(parse_size(capacity, name="capacity"))
        return parse_size(max_size, total, "max_size") > total
    except (ValueError, TypeError):
        return False


def ran_with(cfg: dict[str, Any], pool: Pool) -> dict[str, Any]:
    """The settings a replay ran with: ``cfg`` with the pool's own resolution of what it left to defaults.

    The release rules (the engine settings the policy owns) and the kind of
    segments and where they come from (the segment source's engine settings
    that are not sizes: expandable, stitched, the upstream) are the pool's to
    decide; a result says what they came to, so that every row names the
    settings it really ran with.  Keys are in the registry's order.
    """
    decided = {s.name: pool.config[s.name] for s in settings.SETTINGS
               if s.engine and (s.owner == "policy" or (s.owner == "source" and s.kind != "size"))}
    resolved = {**cfg, **decided}
    order = [k for k in settings.names() if k in resolved] + [k for k in resolved if k not in settings.BY_NAME]
    return {k: resolved[k] for k in order}


def plain_replay_warning(trace: Trace, resolved: dict[str, Any], given: dict[str, Any] | None) -> str | None:
    """A warning when a recording on expandable segments is replayed on plain ones (``resolved``: the
    settings it ran with) that the caller did not ask for: ``given`` (the caller's settings) holding
    ``expandable_segments=False`` asked for plain segments, and is told nothing it does not know."""
    asked = given is not None and given.get("expandable_segments") is False
    if recorded_on_vmm(trace) and not resolved.get("expandable_segments") and not asked:
        upstream = resolved.get("upstream", "device")
        if upstream != "device":
            return (f"the recording ran on expandable segments; this replay uses plain segments from the {upstream} "
                    "upstream, which maps no virtual memory")
        return ("the recording ran on expandable segments; this replay uses plain segments "
                "(--config expandable_segments=true replays like with like)")
    return None


def trace_capacity(trace: Trace) -> tuple[int | str, str] | None:
    """The sim device a trace calls for, in bytes, and where that came from (None: the trace says nothing).

    cupool's own traces record their device (or, on a GPU, the pool's limit).
    A PyTorch snapshot does not, so its device is sized from its recorded peak
    reserved (``sized_capacity``): the sim device's fixed default (4 GiB) would
    run a 51 GiB program out of memory thousands of times and report its own
    size as the program's peak.
    """
    rec = trace.config
    recorded = rec.get("capacity") if rec.get("capacity") is not None else rec.get("limit")
    if recorded:
        return recorded, "recorded"
    return sized_capacity(trace)


def recorded_peak_reserved_of(trace: Trace) -> int | None:
    """The recorded allocator's peak reserved bytes (None: the trace has no segment events, as an RMM log).

    A PyTorch snapshot's comes from its importer (``recorded_peak_reserved``); a
    cupool trace's is the running sum of its segment events, its seed included.
    """
    if trace.format == "torch":
        return recorded_peak_reserved(trace)
    sign = np.zeros(len(trace.kinds), np.int64)
    for k, v in (("segment_alloc", 1), ("segment_map", 1), ("segment_free", -1), ("segment_unmap", -1)):
        if trace.code(k) >= 0:
            sign[trace.code(k)] = v
    if not sign.any() or not len(trace):
        return None
    peak = int(np.cumsum(sign[trace.kind] * trace.size).max())
    return peak if peak > 0 else None


def recorded_segments(trace: Trace) -> tuple[int, int, int] | None:
    """The recording's segments as ``Pool.stats()`` counts them: (peak, allocated, freed), read from its
    segment events (None: it has none, as an RMM log).

    Segment events are device calls (Note [Segments]).  On plain segments each
    ``segment_alloc`` is a segment and each ``segment_free`` one gone.  On
    expandable segments (``recorded_on_vmm``; a PyTorch snapshot's map events are
    imported under the plain names) a segment is a maximal run of mapped
    addresses: a map that extends a run or an unmap that trims one changes no
    count, an unmap in a run's middle splits it (one allocated), one that takes
    a run whole ends it (one freed), and a map that joins two runs ends one.
    """
    plus = [c for c in (trace.code("segment_alloc"), trace.code("segment_map")) if c >= 0]
    minus = [c for c in (trace.code("segment_free"), trace.code("segment_unmap")) if c >= 0]
    picked = np.flatnonzero(np.isin(trace.kind, plus + minus))
    if not len(picked):
        return None
    runs = _MappedRuns() if recorded_on_vmm(trace) else None
    current = peak = allocated = freed = 0
    for i, kind, addr, size in zip(picked.tolist(), trace.kind[picked].tolist(), trace.addr[picked].tolist(),
                                   trace.size[picked].tolist()):
        mapped = kind in plus
        delta = (1 if mapped else -1) if runs is None else (runs.map if mapped else runs.unmap)(addr, addr + size)
        current += delta
        allocated, freed = allocated + max(delta, 0), freed + max(-delta, 0)
        peak = max(peak, current)
    return peak, allocated, freed


class _MappedRuns:
    """Maximal runs of mapped addresses: their sorted starts, each start's end and each end's start."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.end: dict[int, int] = {}
        self.start_of: dict[int, int] = {}

    def map(self, lo: int, hi: int) -> int:
        """Map ``[lo, hi)``; the change in the number of runs (1, 0 or -1)."""
        left = self.start_of.pop(lo, None)  # the run that ends where this begins
        right = self.end.pop(hi, None)  # the end of the run that begins where this ends
        if right is not None:
            self.starts.remove(hi)
            del self.start_of[right]
        start = lo if left is None else left
        if left is None:
            bisect.insort(self.starts, lo)
        self.end[start] = hi if right is None else right
        self.start_of[self.end[start]] = start
        return 1 - (left is not None) - (right is not None)

    def unmap(self, lo: int, hi: int) -> int:
        """Unmap ``[lo, hi)``; the change in the number of runs (1, 0 or -1).  Addresses the trace never
        mapped (a window opened mid-run without its seed) change nothing."""
        j = bisect.bisect_right(self.starts, lo) - 1
        if j < 0 or self.end[self.starts[j]] < hi:
            return 0
        start = self.starts.pop(j)
        end = self.end.pop(start)
        del self.start_of[end]
        pieces = [(a, b) for a, b in ((start, lo), (hi, end)) if b > a]
        for a, b in pieces:
            bisect.insort(self.starts, a)
            self.end[a], self.start_of[b] = b, a
        return len(pieces) - 1


def recorded_on_vmm(trace: Trace) -> bool:
    """Whether the recording ran on expandable segments (cupool's setting, or PyTorch's ``segment_map`` events)."""
    snapshot = trace.config.get("snapshot")
    return bool(trace.config.get("expandable_segments")) or (
        isinstance(snapshot, dict) and bool(snapshot.get("expandable_segments")))


def check_config(config: dict[str, Any], engine: str) -> None:
    """Refuse an unknown engine or a setting ``engine`` does not model, before any replay runs."""
    if engine not in ENGINES:
        raise ValueError(f"unknown replay engine {engine!r} (choose {' or '.join(ENGINES)})")
    numba, pool = accepted_keys("numba"), accepted_keys("pool")
    for key in config:
        if key in (pool if engine == "pool" else numba):
            continue
        if key in pool:
            raise ValueError(f"configuration key {key!r} is only modelled by the pool engine: use --engine pool")
        raise ValueError(f"unknown configuration key {key!r} (the numba engine takes {', '.join(numba)}; "
                         f"the pool engine takes {', '.join(pool)})")


def check_settings(trace: Trace, config: dict[str, Any] | None, engine: str) -> None:
    """Refuse what a replay of ``trace`` with ``config`` on ``engine`` would refuse, without replaying:
    an unknown key, a key the engine does not model, or a value the pool refuses (made and closed at once)."""
    cfg = replay_settings(trace, config, engine)
    check_config(cfg, engine)
    sim_pool(cfg, trace, config).close()


def sim_pool(config: dict[str, Any], trace: Trace, given: dict[str, Any] | None = None) -> Pool:
    """The replay's pool; its reclaim ladder skips ``gc.collect()``, since a replay holds no Python garbage
    (the recorded program's collections are already in the trace, as frees).

    A setting the pool refuses is named by its error; the message adds the settings the
    caller gave (``given``), not the whole resolved configuration.
    """
    try:
        settings = {k: v for k, v in config.items() if k != "capacity"}
        pool = Pool(SimDevice(config.get("capacity", "4GiB")), **settings)
    except (OutOfMemoryError, AddressSpaceExhausted, ValueError, TypeError) as e:  # a setting's refusal
        where = f"{trace.source}: " if trace.source else ""
        mine = f" (given: {', '.join(f'{k}={v}' for k, v in given.items())})" if given else ""
        raise ValueError(f"{where}cannot make a sim pool for the replay: {e}{mine}") from None
    pool.scheduler.collect_garbage = False
    return pool


def replay_device(pool: Pool) -> SimDevice:
    """The device of a replay's pool: a sim device (``sim_pool``)."""
    device = pool.device
    assert isinstance(device, SimDevice), "replays run on the sim device"
    return device


def pool_capacity(pool: Pool) -> int:
    """The capacity of a replay's pool: its device is a sim device."""
    return replay_device(pool).capacity
