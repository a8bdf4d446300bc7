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
either).  Frees of
addresses the replay does not hold (an allocation the replay could not serve, a
foreign trace with no seed) are skipped and counted; an ``alloc`` at an address
still held frees the old block first (the trace missed that free).

Two engines:

* ``"numba"``: the compiled twin of the pool in ``cupool.replay.engine``; millions of
  events per second.  It models raw allocations exactly (``tests/test_replay.py``
  holds it equal to the pool engine) and movable buffers' exact-size growth, but
  not compaction or spilling: for traces with movable buffers it follows the
  recorded moves and spills and says, in ``ReplayResult.warnings``, that its
  reserved memory may differ from the recording's.
* ``"pool"``: the real ``Pool`` on a fresh ``SimDevice``; slow, but it is the pool
  itself, it takes every ``Pool`` argument, and it reproduces compaction (and,
  with the recorded spill settings, spilling) on its own: movable buffers are
  replayed through ``pool.movable()``, so the recorded moves and spills only tell
  it which buffer a later event means.  The replay never holds an array over a
  buffer, so a buffer the recorded run kept leased (and so could not move) may
  move in the replay; ``workloads.weight_streaming(movable=True)`` leases only
  while it fills or checks a layer, and replays exactly.

The default engine is ``"pool"`` for traces with movable buffers and ``"numba"``
otherwise.
"""

from __future__ import annotations

import collections
import inspect
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .._units import MAX_DEVICE_BYTES
from ..core.sizes import LARGE, PAGE, SMALL
from ..device.sim import SimDevice
from ..errors import OutOfMemoryError
from ..pool import Pool
from ..trace import Trace
from ..trace.importers import sized_capacity
from .calls import COMPACT, EMPTY_CACHE, program_calls

#: Settings both engines model; the pool engine also takes any other ``Pool`` argument.
CONFIG_KEYS = ("capacity", "initial_size", "max_size", "memory_fraction", "release_threshold")
#: Recorded settings that only the pool engine models (through movable buffers, or virtual memory).
POOL_KEYS = ("defrag_threshold", "spill", "spill_policy", "expandable_segments", "stitch")
#: Settings of virtual memory (expandable segments), which only the pool engine models.
VMM_KEYS = ("expandable_segments", "stitch")
#: Events that only pools with movable buffers emit.
MOVABLE_KINDS = ("alloc_movable", "free_movable", "move_out", "move_in", "compact", "spill", "restore")
ENGINES = ("numba", "pool")
#: What max/mean fragmentation are, for the CLI and the report.
FRAGMENTATION_NOTE = "after each alloc/free while anything is allocated"
_CHUNK = 1 << 20
_PROGRESS_MIN = 2_000_000


@dataclass
class ReplayResult:
    """What a replay found.

    ``max_fragmentation`` / ``mean_fragmentation`` are (reserved - allocated) /
    reserved sampled after every event the replay acts on, but only while
    something is allocated: a pool that holds nothing but cache has
    fragmentation 1.0 by that formula, which says nothing about placement and
    would make every run's maximum 1.0 at its teardown.
    ``fragmentation_at_peak`` is taken after the event that set peak reserved,
    where fragmentation costs the most.  ``seeded_blocks`` counts the blocks
    alive before the recording started, which the replay began from (see
    ``cupool.trace.load_torch_snapshot``); ``history`` is False for a still
    picture, a snapshot with no events to replay.  ``warnings`` says what the
    engine could not model for this trace.
    """

    config: dict[str, Any]
    engine: str
    events: int
    peak_reserved: int
    peak_allocated: int
    max_fragmentation: float
    mean_fragmentation: float
    fragmentation_at_peak: float
    ooms: int
    peak_segments: int
    segment_allocs: int
    segment_frees: int
    unmatched_frees: int
    seeded_blocks: int
    history: bool
    capacity: int
    seconds: float
    warnings: list[str] = field(default_factory=list)
    timeline: dict[str, np.ndarray] | None = field(default=None, repr=False)

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else math.inf

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timeline")
        return d


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
    """``"pool"`` for traces with movable buffers or recorded on virtual memory, and where a
    configuration turns virtual memory on (``expandable_segments``, ``stitch``: the numba engine
    models plain segments only); else the fast ``"numba"``."""
    vmm = trace.config.get("expandable_segments") or any(c and any(c.get(k) for k in VMM_KEYS) for c in configs)
    return "pool" if uses_movables(trace) or vmm else "numba"


def recorded_config(trace: Trace, engine: str = "numba") -> dict[str, Any]:
    """The recording pool's settings, as replay arguments (empty for foreign traces)."""
    rec = trace.config
    cfg = {k: rec[k] for k in CONFIG_KEYS if rec.get(k) is not None}
    if "capacity" not in cfg and rec.get("limit"):
        # Recorded on a GPU: the sim device gets the pool's limit as its size.  The
        # limit already applies max_size and memory_fraction; applying them again
        # to a device that small would shrink the pool twice.
        cfg["capacity"] = rec["limit"]
        cfg.pop("max_size", None)
        cfg.pop("memory_fraction", None)
    if "capacity" not in cfg:
        sized = trace_capacity(trace)
        if sized is not None:
            cfg["capacity"] = sized[0]
    if engine == "pool":
        cfg.update({k: rec[k] for k in POOL_KEYS if k in rec})
        if cfg.get("spill") is not None:
            # Whatever tier the recorded run spilled to, a replay spills to host
            # memory: a trace file must never choose where a replay writes.
            cfg["spill"] = "host"
    return cfg


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


def check_config(config: dict[str, Any], engine: str) -> None:
    """Refuse an unknown engine or a setting ``engine`` does not model, before any replay runs."""
    if engine not in ENGINES:
        raise ValueError(f"unknown replay engine {engine!r} (choose {' or '.join(ENGINES)})")
    pool_keys = [p for p in inspect.signature(Pool).parameters if p != "device"]
    for key in config:
        if key in CONFIG_KEYS:
            continue
        if key in pool_keys:
            if engine == "pool":
                continue
            raise ValueError(f"configuration key {key!r} is only modelled by the exact engine: use --engine pool")
        raise ValueError(f"unknown configuration key {key!r} (known: {', '.join(CONFIG_KEYS)})")


def _sim_pool(config: dict[str, Any], trace: Trace) -> Pool:
    """The replay's pool; its reclaim ladder skips ``gc.collect()``, since a replay holds no Python garbage
    (the recorded program's collections are already in the trace, as frees)."""
    try:
        pool = Pool("sim", **config)
    except (OutOfMemoryError, ValueError, TypeError) as e:
        where = f"{trace.source}: " if trace.source else ""
        raise ValueError(f"{where}cannot make a sim pool with {config}: {e}") from None
    pool.scheduler.collect_garbage = False
    return pool


def _capacity(pool: Pool) -> int:
    """The capacity of a replay's pool: its device is a sim device."""
    device = pool.device
    assert isinstance(device, SimDevice), "replays run on the sim device"
    return device.capacity


def replay(
    trace: Trace,
    config: dict[str, Any] | None = None,
    engine: str | None = None,
    timeline: bool = False,
    progress: bool | None = None,
    stop: int | None = None,
) -> ReplayResult:
    """Replay ``trace`` on a fresh sim pool with ``config`` (default: the recorded settings).

    ``engine`` None picks ``default_engine(trace)``.  ``timeline`` keeps
    reserved/allocated bytes after every event; ``progress`` shows a tqdm bar
    (default: on long traces, when stderr is a terminal); ``stop`` replays only
    the first ``stop`` events.
    """
    engine = default_engine(trace, config) if engine is None else engine
    cfg = {**recorded_config(trace, engine), **(config or {})}
    check_config(cfg, engine)
    n = len(trace) if stop is None else max(0, min(stop, len(trace)))
    if progress is None:
        progress = n >= _PROGRESS_MIN and sys.stderr.isatty()
    if engine == "pool":
        return _replay_pool(trace, cfg, n, timeline, progress)[0]
    return _replay_numba(trace, cfg, n, timeline, progress)[0]


def _seed(trace: Trace) -> dict[str, Any]:
    """The trace's ``seed`` configuration, checked (empty when the recording started on an empty pool).

    It comes from the file, so every field is checked before use: a malformed
    one is an error naming the trace and the field, not a TypeError deep in a replay.
    """
    seed = trace.config.get("seed")
    if seed is None:
        return {}

    def corrupted(why: str) -> ValueError:
        return ValueError(f"{trace.source}: the trace's seed configuration is corrupted: {why}")

    if not isinstance(seed, dict):
        raise corrupted(f"it must be a mapping, got {seed!r:.100}")
    count = seed.get("events", 0)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(trace):
        raise corrupted(f"'events' must be a count of events from 0 to {len(trace)}, got {count!r:.100}")
    for key in ("small_segments", "kept_segments"):
        addrs = seed.get(key, [])
        if not isinstance(addrs, list) or not all(isinstance(a, int) and not isinstance(a, bool) for a in addrs):
            raise corrupted(f"{key!r} must be a list of segment addresses, got {addrs!r:.100}")
    return seed


def _seed_count(trace: Trace, n: int) -> int:
    """How many leading events describe the live state a recording started from (0 if none)."""
    return min(_seed(trace).get("events", 0), n)


def _seeded_blocks(trace: Trace, seeded: int) -> int:
    """Blocks among the first ``seeded`` events: those alive when the recording started."""
    codes = [c for c in (trace.code("alloc"), trace.code("alloc_movable")) if c >= 0]
    return int(np.isin(trace.kind[:seeded], codes).sum())


def _history(trace: Trace) -> bool:
    """Whether the trace has events beyond its seed (a snapshot without history has none)."""
    snapshot = trace.config.get("snapshot")
    if isinstance(snapshot, dict) and "history" in snapshot:
        return bool(snapshot["history"])
    return len(trace) > _seed(trace).get("events", 0)


def _spill_marks(trace: Trace, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Which ``free_movable`` events are spills and which ``alloc_movable`` events restores."""
    kind, addr = trace.kind[:n], trace.addr[:n]
    spills = np.zeros(n, bool)
    restores = np.zeros(n, bool)
    fm, am = trace.code("free_movable"), trace.code("alloc_movable")
    sp, rs = trace.code("spill"), trace.code("restore")
    for j in np.flatnonzero(kind == sp) if sp >= 0 else ():
        # The free_movable of a spill comes just before it, give or take a segment_free.
        for i in range(j - 1, max(-1, j - 8), -1):
            if kind[i] == fm and addr[i] == addr[j]:
                spills[i] = True
                break
    for j in np.flatnonzero(kind == rs) if rs >= 0 else ():
        if j and kind[j - 1] == am and addr[j - 1] == addr[j]:
            restores[j - 1] = True
    return spills, restores


class _Books:
    """Reserved and allocated bytes of a replay pool, kept from its own events.

    Subscribing also makes the replay pool run as the recorded one did: a pool
    with an observer does not park small frees on its fast path.
    """

    def __init__(self, pool: Pool) -> None:
        s = pool.stats()  # the preallocated segment came before any subscriber
        self.reserved = self.peak = int(s["reserved_bytes.all.current"])
        self.allocated = int(s["allocated_bytes.all.current"])

    def __call__(self, ev: tuple) -> None:
        kind, size = ev[1], ev[3]
        if kind == "segment_alloc" or kind == "segment_map":
            self.reserved += size
            if self.reserved > self.peak:
                self.peak = self.reserved
        elif kind == "segment_free" or kind == "segment_unmap":
            self.reserved -= size
        elif kind == "alloc" or kind == "alloc_movable":
            self.allocated += size
        elif kind == "free" or kind == "free_movable":
            self.allocated -= size


def _replay_pool(trace: Trace, cfg: dict[str, Any], n: int, timeline: bool, progress: bool):
    """Replay through a real Pool; returns the result, the pool and its live handles (for ``layout``)."""
    pool = _sim_pool(cfg, trace)
    books = _Books(pool)
    unsubscribe = pool.subscribe(books)
    code = {k: trace.code(k) for k in ("alloc", "free", "oom", "alloc_movable", "free_movable",
                                       "move_out", "move_in")}
    kind, addr, size, stream = (trace.kind[:n].tolist(), trace.addr[:n].tolist(),
                                trace.size[:n].tolist(), trace.stream[:n].tolist())
    spills, restores = _spill_marks(trace, n)
    seeded = _seed_count(trace, n)
    calls = program_calls(trace, n, seeded).tolist()
    live: dict[int, Any] = {}  # recorded address -> Allocation or Movable
    spilled: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
    moving = None
    unmatched = 0
    frag_sum = frag_max = 0.0
    frag_peak = 1.0 if books.reserved else 0.0  # the peak so far is the empty preallocated segment
    samples = 0
    tl_res = np.zeros(n if timeline else 0, np.int64)
    tl_alloc = np.zeros(n if timeline else 0, np.int64)
    bar = _bar(n, progress, "replay (pool)")
    t0 = time.perf_counter()
    for i in range(n):
        k = kind[i]
        peak0 = books.peak
        if k == code["alloc"] or k == code["free"]:
            held = live.pop(addr[i], None)
            if held is not None:
                held.free()
            elif k == code["free"]:
                unmatched += 1
            if k == code["alloc"]:
                try:
                    live[addr[i]] = pool.malloc(size[i], stream[i])
                except OutOfMemoryError:
                    pass
        elif k == code["alloc_movable"]:
            held = live.pop(addr[i], None)
            if held is not None:
                held.free()
            queue = spilled.get((size[i], stream[i])) if restores[i] else None
            if queue:
                # A restore: the buffer is back (the replay may never have spilled it),
                # and was viewed, as the recorded run did to bring it back.
                m = queue.popleft()
                live[addr[i]] = m
                try:
                    m.array()
                except OutOfMemoryError:
                    pass
            else:
                try:
                    live[addr[i]] = pool.movable(size[i], stream[i])
                except OutOfMemoryError:
                    pass
        elif k == code["free_movable"]:
            held = live.pop(addr[i], None)
            if held is None:
                unmatched += 1
            elif spills[i]:
                # Spilled in the recording: the replay pool spills (or not) by its own rules.
                spilled[(size[i], stream[i])].append(held)
            else:
                held.free()
        elif k == code["move_out"] or k == code["move_in"]:
            # A recorded move renames a buffer; the replay's books do not change (nor are they sampled).
            if k == code["move_out"]:
                moving = live.pop(addr[i], None)
            elif moving is not None:
                live[addr[i]], moving = moving, None
            if timeline:
                tl_res[i], tl_alloc[i] = books.reserved, books.allocated
            continue
        elif k == code["oom"]:
            try:
                pool.malloc(size[i], stream[i]).free()
            except OutOfMemoryError:
                pass
        else:
            if calls[i] == EMPTY_CACHE:
                pool.empty_cache()
            elif calls[i] == COMPACT:
                pool.compact()
            if timeline:
                tl_res[i], tl_alloc[i] = books.reserved, books.allocated
            continue
        if timeline:
            tl_res[i], tl_alloc[i] = books.reserved, books.allocated
        res, alloc = books.reserved, books.allocated
        f = (res - alloc) / res if res else 0.0
        if books.peak > peak0:
            frag_peak = f
        if alloc and i >= seeded:
            frag_sum += f
            frag_max = max(frag_max, f)
            samples += 1
        if bar is not None and i % 65536 == 0:
            bar.update(min(65536, n - bar.n))
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    unsubscribe()
    s = pool.stats()
    warnings = []
    kept = _seed(trace).get("kept_segments", [])
    if seeded > len(kept):
        warnings.append(f"the recording started on a pool already holding memory: the pool engine allocates its "
                        f"{seeded} seed events afresh, so segments can differ from the recording's at first "
                        "(the numba engine rebuilds them exactly)")
    result = ReplayResult(
        config=cfg, engine="pool", events=n,
        peak_reserved=int(s["reserved_bytes.all.peak"]), peak_allocated=int(s["allocated_bytes.all.peak"]),
        max_fragmentation=frag_max, mean_fragmentation=frag_sum / samples if samples else 0.0,
        fragmentation_at_peak=frag_peak,
        ooms=int(s["num_ooms"]), peak_segments=int(s["segment.all.peak"]),
        segment_allocs=int(s["num_device_alloc"]), segment_frees=int(s["num_device_free"]),
        unmatched_frees=unmatched, seeded_blocks=_seeded_blocks(trace, seeded), history=_history(trace),
        capacity=_capacity(pool), seconds=seconds, warnings=warnings,
        timeline={"reserved": tl_res, "allocated": tl_alloc} if timeline else None,
    )
    return result, pool, live


def _replay_numba(trace: Trace, cfg: dict[str, Any], n: int, timeline: bool, progress: bool):
    from . import engine as eng

    probe = _sim_pool(cfg, trace)  # validates the settings exactly as Pool does and resolves them to bytes
    sizes = trace.size
    if len(sizes) and int(sizes.max()) > probe.limit:
        # A request past the limit is refused whatever its size (the pool does not round
        # it first); capped, it cannot overflow the engine's int64 rounding either.
        sizes = np.minimum(sizes, probe.limit + PAGE)
    capacity = _capacity(probe)
    seeded = _seed_count(trace, n)
    tl_res = np.zeros(n if timeline else 0, np.int64)
    tl_alloc = np.zeros(n if timeline else 0, np.int64)
    codes = np.array([trace.code(k) for k in eng.CODES], np.int64)
    empties = program_calls(trace, n, seeded)  # the numba engine empties its cache at either call
    with eng.compile_notice():
        state = eng.new_state(
            int(trace.stream.max()) + 1 if len(trace) else 1,
            _capacity(probe), probe.limit, probe.release_threshold, probe.config["initial_size"],
        )
        del probe
        if seeded:
            _seed_numba(trace, seeded, state)
        arrays = [state[k] for k in ("B", "FB", "S", "FS", "IX", "EXT")]
        # An empty range with the real arguments: compiles (or loads) the very signature the
        # replay uses, so that the time below is the replay's alone.
        eng.run(trace.kind, trace.addr, sizes, trace.stream, empties, seeded, seeded, codes, state["st"],
                state["fst"], state["cfg"], *arrays[:5], state["TG"], state["DT"], arrays[5], state["live"],
                tl_res, tl_alloc)
    bar = _bar(n, progress, "replay")
    t0 = time.perf_counter()
    step = _CHUNK if bar is not None else max(n - seeded, 1)
    for lo in range(seeded, n, step):
        hi = min(n, lo + step)
        arrays = list(eng.run(
            trace.kind, trace.addr, sizes, trace.stream, empties, lo, hi, codes,
            state["st"], state["fst"], state["cfg"], *arrays[:5], state["TG"], state["DT"], arrays[5],
            state["live"], tl_res, tl_alloc,
        ))
        if bar is not None:
            bar.update(hi - lo)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if timeline and seeded:
        tl_res[:seeded], tl_alloc[:seeded] = state["seeded_books"]
    st, fst = state["st"], state["fst"]
    samples = int(st[eng.SAMPLES])
    warnings = []
    if uses_movables(trace):
        counts = trace.counts()
        warnings.append(
            f"this trace has movable buffers ({counts.get('alloc_movable', 0)} alloc_movable, "
            f"{counts.get('move_in', 0)} moves, {counts.get('compact', 0)} compactions, "
            f"{counts.get('spill', 0)} spills): the numba engine follows the recorded moves and spills but "
            "does not compact or spill by itself, so reserved memory and segments can differ from the "
            "recording's; the pool engine (--engine pool) reproduces them"
        )
    result = ReplayResult(
        config=cfg, engine="numba", events=n,
        peak_reserved=int(st[eng.PEAK_RES]), peak_allocated=int(st[eng.PEAK_ALLOC]),
        max_fragmentation=float(fst[1]), mean_fragmentation=float(fst[0] / samples) if samples else 0.0,
        fragmentation_at_peak=float(fst[2]),
        ooms=int(st[eng.OOMS]), peak_segments=int(st[eng.PEAK_SEG]),
        segment_allocs=int(st[eng.DEV_ALLOCS]), segment_frees=int(st[eng.DEV_FREES]),
        unmatched_frees=int(st[eng.UNMATCHED]), seeded_blocks=_seeded_blocks(trace, seeded),
        history=_history(trace), capacity=capacity, seconds=seconds, warnings=warnings,
        timeline={"reserved": tl_res, "allocated": tl_alloc} if timeline else None,
    )
    return result, arrays[0], arrays[2], st


def _seed_numba(trace: Trace, seeded: int, state: dict) -> None:
    """Rebuild the segments and live blocks a recording started from (its first ``seeded`` events).

    Each recorded segment becomes a segment of the same size and pool (small or
    large, from the seed configuration), with the live blocks at the same
    offsets; the preallocated segment is the replay pool's own.  The replay's
    addresses differ from the recording's, which only matters to the device's
    first-fit placement.
    """
    from . import engine as eng

    seed = _seed(trace)
    small, kept = set(seed.get("small_segments", [])), set(seed.get("kept_segments", []))
    seg_code = trace.code("segment_alloc")
    segs: list[list[int]] = []  # addr, size, heap, keep, stream
    blocks: list[list[int]] = []  # segment index, offset, size, stream, recorded address
    for i in range(seeded):
        k, a, n, strm = int(trace.kind[i]), int(trace.addr[i]), int(trace.size[i]), int(trace.stream[i])
        if n > MAX_DEVICE_BYTES:
            raise ValueError(f"{trace.source}: seed event {i} has size {n}, more than any device holds")
        if k == seg_code:
            segs.append([a, n, SMALL if a in small else LARGE, int(a in kept), strm])
            continue
        if not segs or not segs[-1][0] <= a < segs[-1][0] + segs[-1][1]:
            raise ValueError(f"{trace.source}: seed event {i} is not inside the segment before it")
        blocks.append([len(segs) - 1, a - segs[-1][0], n, strm, a])
    sg = np.array(segs, np.int64).reshape(-1, 5).T.copy()
    bk = np.array(blocks, np.int64).reshape(-1, 5).T.copy()
    eng.seed_state(state, sg, bk)
    state["seeded_books"] = (int(state["st"][eng.RES]), int(state["st"][eng.ALLOC]))


def layout(
    trace: Trace, config: dict[str, Any] | None = None, stop: int | None = None, engine: str | None = None,
) -> list[dict[str, Any]]:
    """Segments and their blocks after replaying the first ``stop`` events.

    Each segment: ``{"address", "size", "kind" ("small"/"large"), "blocks": [(offset, size, allocated)]}``.
    """
    from . import engine as eng

    engine = default_engine(trace, config) if engine is None else engine
    cfg = {**recorded_config(trace, engine), **(config or {})}
    check_config(cfg, engine)
    n = len(trace) if stop is None else max(0, min(stop, len(trace)))
    out = []
    if engine == "pool":
        _, pool, live = _replay_pool(trace, cfg, n, False, False)
        segments = pool.snapshot()["segments"]  # while the replay's handles live: dropped, they free their blocks
        del live
        for seg in segments:
            base = seg["address"]
            out.append({"address": base, "size": seg["total_size"], "kind": seg["segment_type"],
                        "blocks": [(b["address"] - base, b["size"], b["state"] != "inactive")
                                   for b in seg["blocks"]]})
    else:
        _, B, S, st = _replay_numba(trace, cfg, n, False, False)
        for s in range(int(st[eng.NS])):
            if not S[eng.S_ALIVE, s]:
                continue
            base = int(S[eng.S_ADDR, s])
            blocks = []
            b = int(S[eng.S_HEAD, s])
            while b >= 0:
                blocks.append((int(B[eng.ADDR, b]) - base, int(B[eng.SIZE, b]), not B[eng.FREE, b]))
                b = int(B[eng.NEXT, b])
            out.append({"address": base, "size": int(S[eng.S_SIZE, s]),
                        "kind": "small" if S[eng.S_KIND, s] == SMALL else "large", "blocks": blocks})
    out.sort(key=lambda seg: seg["address"])
    return out


def _bar(n: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=n, desc=desc, unit="ev", unit_scale=True, file=sys.stderr)
