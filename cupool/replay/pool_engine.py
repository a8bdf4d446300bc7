"""Replaying through the real ``Pool`` on a fresh sim device (the "pool" engine; see ``cupool.replay.driver``)."""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np

from ..errors import OutOfMemoryError
from ..pool import Pool
from ..trace import Trace
from .calls import COMPACT, EMPTY_CACHE, program_calls
from .config import pool_capacity, ran_with, replay_device, sim_pool
from .result import ReplayResult, progress_bar
from .seed import ALLOC, EMPTY, MOVABLE, has_history, seed_count, seed_program, seeded_blocks

def spill_marks(trace: Trace, n: int) -> tuple[np.ndarray, np.ndarray]:
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
    with an observer does not park small frees on its fast path.  The allocated
    peak is kept here, not read from the pool's statistics, because it leaves out
    a recorded OOM's request that the replay served and freed at once: the
    program never held it (the numba engine leaves it out too).
    """

    def __init__(self, pool: Pool) -> None:
        s = pool.stats()  # the preallocated segment came before any subscriber
        self.reserved = self.peak = int(s["reserved_bytes.all.current"])
        self.allocated = self.allocated_peak = int(s["allocated_bytes.all.current"])
        self.seeded = (self.reserved, self.allocated)  # after the seed, the state the replay starts from
        self.ooms = 0  # the replay's own refusals
        self.device = replay_device(pool)
        #: The most bytes the device held past its capacity (managed memory paged to the host).
        self.peak_oversubscribed = self.device.oversubscribed

    def __call__(self, ev: tuple) -> None:
        kind, size = ev[1], ev[3]
        if kind == "segment_alloc" or kind == "segment_map":
            self.reserved += size
            if self.reserved > self.peak:
                self.peak = self.reserved
            self.peak_oversubscribed = max(self.peak_oversubscribed, self.device.oversubscribed)
        elif kind == "segment_free" or kind == "segment_unmap":
            self.reserved -= size
        elif kind == "alloc" or kind == "alloc_movable":
            self.allocated += size
            if self.allocated > self.allocated_peak:
                self.allocated_peak = self.allocated
        elif kind == "free" or kind == "free_movable":
            self.allocated -= size
        elif kind == "oom":
            self.ooms += 1


def replay_pool(
    trace: Trace, cfg: dict[str, Any], n: int, timeline: bool, progress: bool, given: dict[str, Any] | None = None,
) -> tuple[ReplayResult, Pool, dict[int, Any]]:
    """Replay through a real Pool; returns the result, the pool and its live handles (for ``layout``)."""
    pool = sim_pool(cfg, trace, given)
    books = _Books(pool)
    unsubscribe = pool.subscribe(books)
    seeded = seed_count(trace, n)
    live: dict[int, Any] = {}  # recorded address -> Allocation or Movable
    if seeded:
        seed_pool(pool, seed_program(trace, seeded, pool.limit, pool.config["initial_size"], pool.release_threshold),
                  live)
        pool.reset_peak_stats()  # the replay's peaks start from the state the seed leaves
        books.peak, books.allocated_peak = books.reserved, books.allocated
        books.peak_oversubscribed = books.device.oversubscribed
    books.seeded = (books.reserved, books.allocated)
    code = {k: trace.code(k) for k in ("alloc", "free", "oom", "alloc_movable", "free_movable",
                                       "move_out", "move_in")}
    kind, addr, size, stream = (trace.kind[:n].tolist(), trace.addr[:n].tolist(),
                                trace.size[:n].tolist(), trace.stream[:n].tolist())
    spills, restores = spill_marks(trace, n)
    calls = program_calls(trace, n, seeded).tolist()
    spilled: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
    moving = None
    unmatched = 0
    frag_sum = frag_max = 0.0
    samples = 0
    # Fragmentation is sampled after each event while something is allocated; the peak's is the
    # first sample at the present peak reserved.  The starting state (a seed) is the first sample.
    frag_peak, peak_sampled = 0.0, False
    if books.allocated:
        frag_peak = frag_sum = frag_max = (books.reserved - books.allocated) / books.reserved
        samples, peak_sampled = 1, True
    tl_res = np.zeros(n if timeline else 0, np.int64)
    tl_alloc = np.zeros(n if timeline else 0, np.int64)
    tl_oom = np.zeros(n if timeline else 0, np.int64)  # the replay's own OOMs in each event
    bar = progress_bar(n - seeded, progress, "replay (pool engine)")
    t0 = time.perf_counter()
    for i in range(seeded, n):
        k = kind[i]
        peak0, ooms0 = books.peak, books.ooms
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
            held = books.allocated_peak  # the program never held what a roomier pool hands out
            try:
                pool.malloc(size[i], stream[i]).free()
            except OutOfMemoryError:
                pass
            books.allocated_peak = held
        else:
            if calls[i] == EMPTY_CACHE:
                pool.empty_cache()
            elif calls[i] == COMPACT:
                pool.compact()
            if timeline:
                tl_res[i], tl_alloc[i] = books.reserved, books.allocated
            continue
        if timeline:
            tl_res[i], tl_alloc[i], tl_oom[i] = books.reserved, books.allocated, books.ooms - ooms0
        res, alloc = books.reserved, books.allocated
        f = (res - alloc) / res if res else 0.0
        if books.peak > peak0:
            frag_peak, peak_sampled = 0.0, False
        if alloc:
            frag_sum += f
            frag_max = max(frag_max, f)
            samples += 1
            if not peak_sampled and res == books.peak:
                frag_peak, peak_sampled = f, True
        if bar is not None and not i & 1023:
            bar.update(i - seeded - bar.n)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.update(n - seeded - bar.n)
        bar.close()
    if timeline and seeded:
        tl_res[:seeded], tl_alloc[:seeded] = books.seeded
    unsubscribe()
    s = pool.stats()
    warnings: list[str] = []
    result = ReplayResult(
        config=ran_with(cfg, pool), engine="pool", events=n, replayed=n - seeded,
        peak_reserved=int(s["reserved_bytes.all.peak"]), peak_allocated=books.allocated_peak,
        max_fragmentation=frag_max, mean_fragmentation=frag_sum / samples if samples else 0.0,
        fragmentation_at_peak=frag_peak,
        ooms=int(s["num_ooms"]), peak_segments=int(s["segment.all.peak"]),
        segment_allocs=int(s["segment.all.allocated"]), segment_frees=int(s["segment.all.freed"]),
        device_allocs=int(s["num_device_alloc"]), device_frees=int(s["num_device_free"]),
        unmatched_frees=unmatched, seeded_blocks=seeded_blocks(trace, seeded), history=has_history(trace),
        capacity=pool_capacity(pool), seconds=seconds, warnings=warnings,
        peak_oversubscribed=books.peak_oversubscribed,
        timeline={"reserved": tl_res, "allocated": tl_alloc, "ooms": tl_oom} if timeline else None,
    )
    return result, pool, live


def seed_pool(pool: Pool, ops: np.ndarray, live: dict[int, Any]) -> None:
    """Run a seed program (``cupool.replay.seed``) on ``pool``; its blocks go to ``live`` by recorded address.

    The seed is built with the pool's giving back switched off (the module ``seed``'s step 4).
    """
    rules = pool.release_threshold, pool.release_before_split
    pool.release_threshold, pool.release_before_split = None, False
    try:
        _run_seed(pool, ops, live)
    finally:
        pool.release_threshold, pool.release_before_split = rules


def _run_seed(pool: Pool, ops: np.ndarray, live: dict[int, Any]) -> None:
    for code, ident, size, stream in ops.tolist():
        if code == ALLOC or code == MOVABLE:
            try:
                live[ident] = pool.malloc(size, stream) if code == ALLOC else pool.movable(size, stream)
            except OutOfMemoryError:
                pass
        elif code == EMPTY:
            pool.empty_cache()
        else:
            held = live.pop(ident, None)
            if held is not None:
                held.free()
