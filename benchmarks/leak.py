"""Leaks of whole pools: make, use, record, monitor and drop pools in a loop, and watch the process stay flat.

    python benchmarks/leak.py [--pools 1000] [--warmup 20] [--every 50] [--kinds plain expandable]

Issue 21's leak test.  Each round makes one pool of each kind (``plain``, and
``expandable`` with ``expandable_segments=True, stitch=True``), both spilling to
``"host"``, and in it: a recording in memory started and never stopped (every
fourth round: it must end with its pool); a ``cupool.Monitor`` and a recording
to an HDF5 file (``with pool.record(path)``), both closed, around raw
allocations and movables written, compacted, spilled, read back and freed, and
``empty_cache``.  Then the pool is dropped (``del``, never ``close()``) and the
trace file deleted.

Every ``--every`` rounds, after ``gc.collect()``, it reads the process's resident
memory (``VmRSS``), open file descriptors (``/proc/self/fd``), OS threads
(``/proc/self/status``) and mappings (lines of ``/proc/self/maps``), and prints
the first (after ``--warmup`` rounds), last and largest of each, and a verdict:
``flat`` when none grew by more than its slack (RSS: 10 % and 16 MiB; fds,
threads: 0; mappings: 8), else ``GROWS``.  Exit status 1 when it grows.
``tests/test_stress.py`` runs 50 rounds.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import cupool

MiB = 1 << 20
KINDS: dict[str, dict[str, Any]] = {
    "plain": {},
    "expandable": {"expandable_segments": True, "stitch": True},
}
FIGURES = ("rss", "fds", "threads", "maps")


def sample() -> dict[str, int]:
    """The process now: resident bytes, open fds, OS threads and memory mappings."""
    status = Path("/proc/self/status").read_text().splitlines()
    field_of = {line.split(":")[0]: line.split(":")[1].split() for line in status if ":" in line}
    with open("/proc/self/maps", "rb") as f:
        maps = sum(1 for _ in f)
    return {
        "rss": int(field_of["VmRSS"][0]) * 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": int(field_of["Threads"][0]),
        "maps": maps,
    }


@dataclass
class Report:
    """The samples of one run and their verdict."""

    pools: int = 0
    seconds: float = 0.0
    samples: list[dict[str, int]] = field(default_factory=list)
    first: dict[str, int] = field(default_factory=dict)
    last: dict[str, int] = field(default_factory=dict)
    max: dict[str, int] = field(default_factory=dict)
    slack: dict[str, int] = field(default_factory=dict)
    verdict: str = ""

    def judge(self) -> None:
        self.first, self.last = dict(self.samples[0]), dict(self.samples[-1])  # the first: after the warm-up
        self.max = {k: max(s[k] for s in self.samples) for k in FIGURES}
        self.slack = {"rss": max(16 * MiB, self.first["rss"] // 10), "fds": 0, "threads": 0, "maps": 8}
        grew = [k for k in FIGURES if self.last[k] > self.first[k] + self.slack[k]]
        self.verdict = "flat" if not grew else "GROWS: " + ", ".join(grew)

    def lines(self) -> list[str]:
        def show(k: str, v: int) -> str:
            return cupool.format_bytes(v) if k == "rss" else str(v)

        out = [f"{self.pools} pools in {self.seconds:.1f} s ({len(self.samples) - 1} samples after the warm-up)"]
        out.append(f"{'':8}{'first':>12}{'last':>12}{'max':>12}{'slack':>12}")
        for k in FIGURES:
            out.append(f"{k:8}" + "".join(f"{show(k, d[k]):>12}" for d in (self.first, self.last, self.max, self.slack)))
        out.append(f"verdict: {self.verdict}")
        return out


def one_pool(kind: str, folder: Path, i: int) -> None:
    """Make a pool, use, record and monitor it, and drop it.

    Everything is freed inside the monitored block, so that no event follows the
    monitor's and the recording's closing (an event would prune their dead
    subscriptions and hide a pool that only they keep alive).
    """
    p = cupool.Pool("sim", capacity="64MiB", spill="host", **KINDS[kind])
    if i % 4 == 0:
        p.record().start()  # never stopped: it must end with the pool
    path = folder / f"{kind}-{i}.h5"
    with cupool.Monitor(p), p.record(path):
        raw = [p.malloc(n) for n in (100, 3 * MiB, 700 * 1024)]
        ms = [p.movable(n) for n in (MiB, 2 * MiB, 4096)]
        for j, m in enumerate(ms):
            m.array()[:] = j + 1
        raw[1].free()
        ms[0].free()
        p.compact()
        p.spill()
        if not all(np.all(m.array() == j + 2) for j, m in enumerate(ms[1:])):
            raise AssertionError(f"{kind} pool {i}: a movable's bytes changed")
        for a in raw[::2]:
            a.free()
        for m in ms[1:]:
            m.free()
        del raw, ms, m, a
        p.empty_cache()
    path.unlink()
    del p  # dropped, never closed


def run(pools: int = 1000, warmup: int = 20, every: int = 50, kinds: tuple[str, ...] = tuple(KINDS),
        progress: bool = False) -> Report:
    """``pools`` rounds (one pool of each of ``kinds`` per round); the report says whether anything grew."""
    r = Report()
    every = max(1, min(every, pools))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cupool-leak-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the recorders never stopped say so
        folder = Path(tmp)
        for i in range(warmup):
            for kind in kinds:
                one_pool(kind, folder, i)
        gc.collect()
        r.samples.append(sample())
        for i in range(pools):
            for kind in kinds:
                one_pool(kind, folder, warmup + i)
            if (i + 1) % every == 0 or i + 1 == pools:
                gc.collect()
                time.sleep(0.05)  # the threads of dropped recorders and monitors finish exiting
                r.samples.append(sample())
                if progress:
                    s = r.samples[-1]
                    print(f"  {i + 1:6} rounds: rss {cupool.format_bytes(s['rss'])}, fds {s['fds']}, "
                          f"threads {s['threads']} ({threading.active_count()} Python), maps {s['maps']}", flush=True)
    r.pools = pools * len(kinds)
    r.seconds = time.perf_counter() - t0
    r.judge()
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pools", type=int, default=1000, help="rounds; each makes one pool of each kind (default 1000)")
    ap.add_argument("--warmup", type=int, default=20, help="rounds before the first sample")
    ap.add_argument("--every", type=int, default=50, help="rounds between samples")
    ap.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    a = ap.parse_args(argv)
    if a.pools < 1 or a.warmup < 0 or a.every < 1:
        ap.error("--pools and --every must be >= 1, --warmup >= 0")
    r = run(a.pools, a.warmup, a.every, tuple(a.kinds), progress=True)
    print("\n".join(r.lines()))
    return 0 if r.verdict == "flat" else 1


if __name__ == "__main__":
    sys.exit(main())
