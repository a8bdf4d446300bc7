"""Threaded stress of a pool's books: movables dropped, freed and collected at random while others compact and spill.

    python benchmarks/stress.py [--seconds 60] [--threads 4] [--seed 0] [--configs plain expandable]
                                [--check-every 0.5] [--eager-gc | --no-eager-gc] [--background]

Issue 21's "done when": several threads, each with its own seeded schedule, make
raw allocations (small and large) and movable buffers (a zero-byte one now and
then), write known bytes into them, lease them, and let them go in the three ways
a program does (``free()``, dropping the last reference, dropping a reference
cycle that only the garbage collector frees), while the same threads compact,
spill to host memory, empty the cache and collect garbage.  A pool is ``plain``
or ``expandable`` (``expandable_segments=True, stitch=True``); both spill to
``"host"`` and have a limit well below what the threads would like to hold, so
the reclaim ladder runs (spill, compact, stitch).

Every ``--check-every`` seconds the threads stop between operations and the
checker holds the pool to account against the handles the threads still hold:

* ``pool.check()`` (the heaps' invariants, and the books against the heaps);
* the books' allocations (``allocation.all.current`` in ``stats()``) are the live
  raw allocations plus the live movables on the device, their allocated bytes
  the sum of those handles' blocks, their requested bytes the sum of their sizes;
* no two handles share a block, and every handle's block is allocated;
* every live handle's bytes are what its thread wrote (a CRC32 of the whole buffer
  for movables, which move and spill; of the first 4 KiB for raw allocations).

At the end every handle is released, and the pool must hold no allocation.  A
thread that raises anything but ``OutOfMemoryError`` (an honest answer under a
limit), a finalizer that fails (``sys.unraisablehook``), or threads that do not
reach the checkpoint within ``--hang-seconds`` (their stacks are printed) fail
the run.  Prints what it did and checked; exit status 1 on any failure.
``tests/test_stress.py`` runs it for a few seconds.
"""

from __future__ import annotations

import argparse
import bisect
import faulthandler
import gc
import sys
import threading
import time
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import cupool

KiB, MiB = 1 << 10, 1 << 20
#: The pools a run can stress, by name.
CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "expandable": {"expandable_segments": True, "stitch": True},
}
_RAW_CHECKED = 4 * KiB  # raw blocks never move: the head of each is enough to see it overwritten
#: Each step's operation: a uniform draw below a bound picks the first operation whose bound it is
#: below (so "release" takes 22% of the steps, "malloc" 8%, ...).
_MIX_TABLE = (
    (0.22, "release"), (0.30, "malloc"), (0.52, "movable"), (0.60, "lease"), (0.68, "unlease"),
    (0.76, "verify"), (0.86, "compact"), (0.93, "spill"), (0.97, "empty_cache"), (1.0, "collect"),
)
_MIX_BOUNDS = [bound for bound, _ in _MIX_TABLE[:-1]]
_MIX = [op for _, op in _MIX_TABLE]


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).data)


@dataclass
class Report:
    """What one run did and found; ``failures`` empty means the books held throughout."""

    config: str
    seconds: float = 0.0
    ops: Counter = field(default_factory=Counter)
    checks: int = 0
    handles_checked: int = 0
    bytes_checksummed: int = 0
    max_live: int = 0
    cycles_collected: int = 0
    compactions: int = 0
    bytes_moved: int = 0
    spills: int = 0
    bytes_spilled: int = 0
    ooms: int = 0  # requests refused (an honest answer under the limit) and checks put off for want of room
    failures: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items()))
        return [
            f"[{self.config}] {self.seconds:.1f} s, {sum(self.ops.values())} operations: {ops}",
            f"[{self.config}] {self.checks} checkpoints: pool.check(), allocation count, allocated and "
            f"requested bytes against the live handles, {self.handles_checked} handle checks "
            f"({cupool.format_bytes(self.bytes_checksummed)} checksummed); at most {self.max_live} handles alive",
            f"[{self.config}] {self.compactions} compactions moved {cupool.format_bytes(self.bytes_moved)}; "
            f"{self.spills} spills ({cupool.format_bytes(self.bytes_spilled)}); {self.cycles_collected} objects "
            f"in cycles collected at checkpoints; {self.ooms} out-of-memory answers",
            f"[{self.config}] " + ("OK: the books held" if not self.failures else f"FAILED: {len(self.failures)} problem(s)"),
            *(f"  - {f}" for f in self.failures[:20]),
        ]


class _Entry:
    """One handle a thread holds, with the checksum of what it wrote."""

    __slots__ = ("handle", "movable", "crc", "checked", "lease")

    def __init__(self, handle: Any, movable: bool, crc: int, checked: int) -> None:
        self.handle = handle
        self.movable = movable
        self.crc = crc
        self.checked = checked  # bytes the crc covers
        self.lease: Any = None  # an array that pins a movable, held for a while


class _Worker:
    """One thread's seeded schedule of operations on the shared pool."""

    def __init__(self, stress: Stress, seed: int) -> None:
        self.s = stress
        self.rng = np.random.default_rng(seed)
        self.live: list[_Entry] = []
        self.ops: Counter = Counter()

    # -- making ---------------------------------------------------------------
    def _bytes(self, n: int) -> np.ndarray:
        return np.frombuffer(self.rng.bytes(n), np.uint8)

    def malloc(self) -> None:
        rng = self.rng
        n = int(rng.integers(1, MiB)) if rng.random() < 0.6 else int(rng.integers(MiB, 6 * MiB))
        a = self.s.pool.malloc(n)
        head = self._bytes(min(n, _RAW_CHECKED))
        self.s.pool.device.from_host(a.ptr, head)
        self.live.append(_Entry(a, False, _crc(head), head.size))

    def movable(self) -> None:
        rng = self.rng
        n = 0 if rng.random() < 0.02 else int(rng.integers(1, 4 * MiB))
        m = self.s.pool.movable(n)
        data = self._bytes(n)
        if n:
            m.array()[:] = data
        self.live.append(_Entry(m, True, _crc(data), n))

    # -- using ------------------------------------------------------------------
    def lease(self) -> None:
        movables = [e for e in self.live if e.movable]
        if movables:
            e = movables[int(self.rng.integers(len(movables)))]
            e.lease = e.handle.array()  # pins it until released below

    def unlease(self) -> None:
        for e in self.live:
            if e.lease is not None and self.rng.random() < 0.5:
                e.lease = None

    def verify(self) -> None:
        if self.live:
            self.s.verify(self.live[int(self.rng.integers(len(self.live)))])

    # -- letting go ---------------------------------------------------------------
    def release(self) -> None:
        """Let one handle go: freed, dropped, or dropped inside a reference cycle that only gc frees."""
        if not self.live:
            return
        e = self.live.pop(int(self.rng.integers(len(self.live))))
        how = self.rng.random()
        if how < 0.4:
            e.lease = None
            e.handle.free()
            self.ops["free"] += 1
        elif how < 0.7:
            self.ops["drop"] += 1
        else:
            cycle: list[Any] = [e.handle, e.lease]
            cycle.append(cycle)
            self.ops["drop_in_cycle"] += 1
        del e  # the handle dies here (dropped) or at the next collection (cycle)

    # -- the loop -----------------------------------------------------------------
    def step(self) -> None:
        s, rng = self.s, self.rng
        raw = sum(not e.movable for e in self.live)
        op = _MIX[bisect.bisect_right(_MIX_BOUNDS, rng.random())]
        if len(self.live) >= s.max_live:
            op = "release"
        elif op == "malloc" and raw >= s.max_raw:
            op = "movable"
        try:
            if op == "compact":
                s.pool.compact(max_bytes=int(rng.integers(1, 32)) * MiB)
            elif op == "spill":
                s.pool.spill(int(rng.integers(1, 16)) * MiB)
            elif op == "empty_cache":
                s.pool.empty_cache()
            elif op == "collect":
                gc.collect(1)  # the young generations, where this run's cycles are: a full pass takes 0.2 s
            else:
                getattr(self, op)()
        except cupool.OutOfMemoryError:
            self.ops["oom"] += 1
            return
        self.ops[op] += 1

    def run(self) -> None:
        s = self.s
        try:
            while not s.stop.is_set():
                if s.pause.is_set():
                    s.checkpoint()
                    continue
                self.step()
        except threading.BrokenBarrierError:
            pass  # the checker gave up on a hang and says so
        except BaseException as e:  # noqa: BLE001 - any error is the run's finding
            s.fail(f"a worker raised {type(e).__name__}: {e}")


class Stress:
    def __init__(self, config: str, threads: int, seed: int, limit: str, hang_s: float, eager_gc: bool) -> None:
        self.config = config
        self.pool = cupool.Pool("sim", capacity="256MiB", max_size=limit, spill="host", **CONFIGS[config])
        self.pool.malloc(32 * MiB).free()  # a cached segment that the first movables share
        self.workers = [_Worker(self, seed * 1000 + i) for i in range(threads)]
        self.max_live = 24
        self.max_raw = 5
        self.stop = threading.Event()
        self.pause = threading.Event()
        self.hang_s = hang_s
        self.barrier = threading.Barrier(threads + 1, timeout=hang_s)
        self.report = Report(config)
        self.eager_gc = eager_gc
        self._lock = threading.Lock()

    def fail(self, what: str) -> None:
        with self._lock:
            self.report.failures.append(what)
        self.stop.set()
        if threading.current_thread() is not threading.main_thread():
            self.barrier.abort()  # a worker failed: nobody waits for it at the checkpoint

    # -- the checkpoint -------------------------------------------------------------
    def checkpoint(self) -> None:
        """A worker's side: wait here while the checker reads the pool."""
        self.barrier.wait()  # every worker has arrived
        self.barrier.wait()  # the checker is done

    def verify(self, e: _Entry) -> None:
        h = e.handle
        if e.movable:
            got = _crc(np.asarray(h.array())) if h.size else zlib.crc32(b"")
        else:
            head = np.empty(e.checked, np.uint8)
            self.pool.device.read_into(h.ptr, head)
            got = _crc(head)
        if got != e.crc:
            self.fail(f"{h!r}: its bytes changed (crc32 {got:#x}, written {e.crc:#x})")
        self.report.handles_checked += 1
        self.report.bytes_checksummed += e.checked

    def audit(self) -> None:
        """The checker's side, with every worker waiting: the books against the live handles."""
        r = self.report
        r.cycles_collected += gc.collect()  # handles dropped in cycles die now; finalizers free them
        live = [e for w in self.workers for e in w.live]
        r.max_live = max(r.max_live, len(live))
        pool = self.pool
        try:
            pool.check()
        except AssertionError as e:
            self.fail(f"pool.check(): {e}")
            return
        # One hold for the layout, the books and the handles' addresses: a background compaction
        # may move buffers between two holds.
        with pool.hold() as view:
            blocks = {b.addr: b.size for seg in view.segments() for b in seg.blocks if not b.free}
            books = {"allocations": view.books.allocations, "allocated bytes": view.books.allocated,
                     "requested bytes": view.books.requested}
            on_device = [(e.handle, e.handle.ptr) for e in live if e.handle.ptr is not None]
        ptrs = Counter(ptr for _, ptr in on_device)
        shared = [hex(p) for p, n in ptrs.items() if n > 1]
        if shared:
            self.fail(f"handles share blocks at {', '.join(shared[:5])}")
        missing = [h for h, ptr in on_device if ptr not in blocks]
        if missing:
            self.fail(f"{len(missing)} live handle(s) point where the heap has no allocated block: {missing[0]!r}")
            return
        expect = {
            "allocations": len(on_device),
            "allocated bytes": sum(blocks[ptr] for _, ptr in on_device),
            "requested bytes": sum(h.size for h, _ in on_device),
        }
        for key, want in expect.items():
            if books[key] != want:
                self.fail(f"the books' {key} are {books[key]}, the live handles hold {want}")
        for entry in live:
            try:
                self.verify(entry)
            except cupool.OutOfMemoryError:
                r.ooms += 1  # a spilled buffer with no room to come back: checked at a later checkpoint
        r.checks += 1

    # -- the run --------------------------------------------------------------------
    def run(self, seconds: float, check_every: float) -> Report:
        r = self.report
        unraisable: list[str] = []
        gc.collect()  # what dies now is not this run's: only this run's finalizers are heard below
        hook, thresholds = sys.unraisablehook, gc.get_threshold()
        sys.unraisablehook = lambda u: unraisable.append(
            f"{u.exc_type.__name__}: {u.exc_value} (in {u.object!r}); at "
            + " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                          for f in reversed(traceback.extract_tb(u.exc_traceback)[-6:]))
        )
        if self.eager_gc:
            gc.set_threshold(50)  # the collector runs inside pool operations, at any allocation
        threads = [threading.Thread(target=w.run, name=f"stress-{i}", daemon=True) for i, w in enumerate(self.workers)]
        t0 = time.perf_counter()
        try:
            for t in threads:
                t.start()
            while not self.stop.is_set() and time.perf_counter() - t0 < seconds:
                time.sleep(min(check_every, max(0.0, seconds - (time.perf_counter() - t0))))
                if self.stop.is_set():
                    break
                self.pause.set()
                try:
                    self.barrier.wait()
                except threading.BrokenBarrierError:
                    if not self.stop.is_set():  # else a worker failed and broke the barrier itself
                        self._hang()
                    break
                try:
                    self.audit()
                finally:
                    self.pause.clear()
                    self.barrier.wait()
            self.stop.set()
            for t in threads:
                t.join(self.hang_s)
            if any(t.is_alive() for t in threads):
                self._hang()
            else:
                self._drain()
        finally:
            r.seconds = time.perf_counter() - t0
            sys.unraisablehook = hook
            gc.set_threshold(*thresholds)
        r.failures.extend(f"a finalizer failed: {u}" for u in unraisable[:10])
        for w in self.workers:
            r.ops.update(w.ops)
        r.ooms += r.ops.pop("oom", 0)
        stats = self.pool.stats()
        r.compactions, r.bytes_moved = int(stats["num_compactions"]), int(stats["compaction_bytes_moved"])
        r.spills, r.bytes_spilled = self.pool.scheduler.spills, self.pool.scheduler.bytes_spilled
        return r

    def _hang(self) -> None:
        self.report.failures.append(f"threads did not reach the checkpoint within {self.hang_s} s (a hang); their stacks:")
        self.barrier.abort()
        faulthandler.dump_traceback(sys.stderr, all_threads=True)

    def _drain(self) -> None:
        """Last checkpoint, then everything goes, and the pool must hold nothing."""
        if self.report.failures:
            return
        self.audit()
        for w in self.workers:
            for e in w.live:
                e.lease = None
                e.handle.free()
            w.live.clear()
        gc.collect()
        self.pool.check()
        left = self.pool.stats()["allocation.all.current"]
        if left:
            self.fail(f"{left} allocation(s) left after every handle was freed")


def run(config: str = "plain", seconds: float = 60.0, threads: int = 4, seed: int = 0, check_every: float = 0.5,
        limit: str = "64MiB", hang_s: float = 30.0, eager_gc: bool = True, background: bool = False) -> Report:
    """One stressed pool for ``seconds``; the returned report's ``failures`` say what broke."""
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {', '.join(CONFIGS)}, got {config!r}")
    stress = Stress(config, threads, seed, limit, hang_s, eager_gc)
    if background:
        stress.pool.start_background_compaction(interval=0.01)
    try:
        return stress.run(seconds, check_every)
    finally:
        if background and not stress.report.failures:
            stress.pool.stop_background_compaction()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="per configuration (default 60)")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--check-every", type=float, default=0.5, help="seconds between checkpoints")
    ap.add_argument("--limit", default="64MiB", help="the pools' max_size (default 64MiB: the ladder runs)")
    ap.add_argument("--hang-seconds", type=float, default=30.0, help="a checkpoint not reached in this long is a hang")
    ap.add_argument("--eager-gc", action=argparse.BooleanOptionalAction, default=True,
                    help="collect garbage far more often, inside pool operations (default on)")
    ap.add_argument("--background", action="store_true", help="also compact in the background")
    a = ap.parse_args(argv)
    if a.threads < 1 or a.seconds <= 0 or a.check_every <= 0:
        ap.error("--threads must be >= 1, and --seconds and --check-every > 0")
    failed = False
    for config in a.configs:
        r = run(config, a.seconds, a.threads, a.seed, a.check_every, a.limit, a.hang_seconds, a.eager_gc, a.background)
        print("\n".join(r.lines()), flush=True)
        failed |= bool(r.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
