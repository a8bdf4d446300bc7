"""Replaying through the compiled twin of the pool (the "numba" engine; see ``cupool.replay.driver``)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..core.sizes import PAGE
from ..trace import Trace
from . import engine as eng
from .calls import program_calls
from .config import pool_capacity, ran_with, sim_pool, uses_movables
from .engine_layout import SEG_ALLOCS, SEG_FREES, config_array
from .result import ReplayResult, progress_bar
from .seed import ALLOC, EMPTY, FREE, FREE_MOVABLE, MOVABLE, has_history, seed_count, seed_program, seeded_blocks

#: Events per compiled call while a progress bar shows (without one, the whole trace is one call).
CHUNK = 1 << 16
#: The seed program's operations as the engine's event kinds (positions in ``engine.CODES``; EMPTY: none).
_SEED_KINDS = {ALLOC: 0, FREE: 1, MOVABLE: 3, FREE_MOVABLE: 4, EMPTY: len(eng.CODES)}


def replay_numba(
    trace: Trace, cfg: dict[str, Any], n: int, timeline: bool, progress: bool, given: dict[str, Any] | None = None,
) -> tuple[ReplayResult, dict]:
    """Replay through the compiled engine; returns the result and the engine's state (for ``layout``)."""
    probe = sim_pool(cfg, trace, given)  # validates the settings exactly as Pool does and resolves them to bytes
    sizes = trace.size
    if len(sizes) and int(sizes.max()) > probe.limit:
        # A request past the limit is refused whatever its size (the pool does not round
        # it first); capped, it cannot overflow the engine's int64 rounding either.
        sizes = np.minimum(sizes, probe.limit + PAGE)
    capacity = pool_capacity(probe)
    limit, threshold, initial = probe.limit, probe.release_threshold, probe.config["initial_size"]
    engine_cfg = config_array(probe.config)  # every engine setting's slot, as the pool resolved it
    settings = ran_with(cfg, probe)
    del probe
    seeded = seed_count(trace, n)
    tl_res = np.zeros(n if timeline else 0, np.int64)
    tl_alloc = np.zeros(n if timeline else 0, np.int64)
    tl_oom = np.zeros(n if timeline else 0, np.int64)
    codes = np.array([trace.code(k) for k in eng.CODES], np.int64)
    empties = program_calls(trace, n, seeded)  # the numba engine empties its cache at either call
    streams = int(trace.stream.max()) + 1 if len(trace) else 1
    with eng.compile_notice():
        state = eng.new_state(streams, engine_cfg)
        if seeded:
            _seed(state, seed_program(trace, seeded, limit, initial, threshold))
        # An empty range with the real arguments: compiles (or loads) the very signature the
        # replay uses, so that the time below is the replay's alone.
        eng.run_range(state, trace.kind, trace.addr, sizes, trace.stream, empties, seeded, seeded, codes,
                      tl_res, tl_alloc, tl_oom)
    bar = progress_bar(n - seeded, progress, "replay (numba engine)")
    step = CHUNK if bar is not None else max(n - seeded, 1)
    t0 = time.perf_counter()
    for lo in range(seeded, n, step):
        hi = min(n, lo + step)
        eng.run_range(state, trace.kind, trace.addr, sizes, trace.stream, empties, lo, hi, codes, tl_res, tl_alloc,
                      tl_oom)
        if bar is not None:
            bar.update(hi - lo)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    st, fst = state["E"].st, state["E"].fst
    if timeline and seeded:
        tl_res[:seeded], tl_alloc[:seeded] = state["seeded_books"]
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
        config=settings, engine="numba", events=n, replayed=n - seeded,
        peak_reserved=int(st[eng.PEAK_RES]), peak_allocated=int(st[eng.PEAK_ALLOC]),
        max_fragmentation=float(fst[eng.F_MAX]),
        mean_fragmentation=float(fst[eng.F_SUM] / samples) if samples else 0.0,
        fragmentation_at_peak=float(fst[eng.F_PEAK]),
        ooms=int(st[eng.OOMS]), peak_segments=int(st[eng.PEAK_SEG]),
        segment_allocs=int(st[SEG_ALLOCS]), segment_frees=int(st[SEG_FREES]),
        device_allocs=int(st[eng.DEV_ALLOCS]), device_frees=int(st[eng.DEV_FREES]),
        unmatched_frees=int(st[eng.UNMATCHED]), seeded_blocks=seeded_blocks(trace, seeded),
        history=has_history(trace), capacity=capacity, seconds=seconds, warnings=warnings,
        peak_oversubscribed=max(0, int(st[eng.PEAK_RES]) - capacity),  # managed memory past the device
        timeline={"reserved": tl_res, "allocated": tl_alloc, "ooms": tl_oom} if timeline else None,
    )
    return result, state


def prepare(trace: Trace) -> None:
    """Compile (or load from the cache) the engine for ``trace``'s arrays, announcing a compile on stderr.

    A command calls it before it prints anything, so that the notice (and the
    wait) comes first instead of between a table's header and its first row.
    The signatures are the ones a replay of ``trace`` uses, its seed's included
    (same array types), so the replay then compiles nothing.
    """
    none = np.zeros(0, np.int64)
    codes = np.array([trace.code(k) for k in eng.CODES], np.int64)
    probe = sim_pool({"capacity": 4 * PAGE, "initial_size": PAGE, "expandable_segments": False}, trace)
    cfg = config_array(probe.config)  # initial_size: its function too
    probe.close()
    with eng.compile_notice():
        state = eng.new_state(1, cfg)
        eng.run_range(state, trace.kind, trace.addr, trace.size, trace.stream, np.zeros(len(trace), np.int8),
                      0, 0, codes, none, none, none)


def _seed(state: dict, ops: np.ndarray) -> None:
    """Run a seed program (``cupool.replay.seed``) through the engine, as the pool engine runs it on a Pool.

    The state it leaves is where the replay starts: its fragmentation is the peak's
    so far, and its samples do not count towards the replay's.  The seed is built
    with the pool's giving back switched off (the module ``seed``'s step 4).
    """
    cfg = state["E"].cfg
    rules = cfg[eng.C_THRESHOLD], cfg[eng.C_SPLIT]
    cfg[eng.C_THRESHOLD], cfg[eng.C_SPLIT] = -1, 0
    m = ops.shape[0]
    kind = np.array([_SEED_KINDS[c] for c in ops[:, 0].tolist()], np.uint8).reshape(m)
    empties = (ops[:, 0] == EMPTY).astype(np.int8)
    codes = np.arange(len(eng.CODES), dtype=np.int64)
    none = np.zeros(0, np.int64)
    eng.run_range(state, kind, ops[:, 1].copy(), ops[:, 2].copy(), ops[:, 3].copy(), empties, 0, m, codes,
                  none, none, none)
    cfg[eng.C_THRESHOLD], cfg[eng.C_SPLIT] = rules
    st, fst = state["E"].st, state["E"].fst
    fst[:] = 0.0
    st[eng.SAMPLES] = 0
    st[eng.PEAK_RES], st[eng.PEAK_ALLOC], st[eng.PEAK_SEG] = st[eng.RES], st[eng.ALLOC], st[eng.NSEG]
    st[eng.PEAK_SAMPLED] = 0
    if st[eng.ALLOC]:  # the starting state is the first sample, and the peak's so far
        frag = (st[eng.RES] - st[eng.ALLOC]) / st[eng.RES]
        fst[eng.F_SUM] = fst[eng.F_MAX] = fst[eng.F_PEAK] = frag
        st[eng.SAMPLES], st[eng.PEAK_SAMPLED] = 1, 1
    state["seeded_books"] = (int(st[eng.RES]), int(st[eng.ALLOC]))


def segments_of(state: dict) -> list[tuple[int, int, int, list[tuple[int, int, bool]]]]:
    """The engine's live segments: (address, size, heap, [(offset, size, allocated) of its blocks])."""
    B, S, st = state["E"].B, state["E"].S, state["E"].st
    out = []
    for s in range(int(st[eng.SEGMENT_IDS])):
        if not S[eng.S_ALIVE, s]:
            continue
        base = int(S[eng.S_ADDR, s])
        blocks = []
        b = int(S[eng.S_HEAD, s])
        while b >= 0:
            blocks.append((int(B[b, eng.ADDR]) - base, int(B[b, eng.SIZE]), not B[b, eng.FREE]))
            b = int(B[b, eng.NEXT])
        out.append((base, int(S[eng.S_SIZE, s]), int(S[eng.S_KIND, s]), blocks))
    return out
