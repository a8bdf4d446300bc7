"""Replay throughput: the compiled engine in every configuration, against the real Pool; and its cold compile.

    python -m benchmarks.bench_replay [--events 2000000] [--repeat 5] [--live 2000] [--streams 2]
    python -m benchmarks.bench_replay --traces ../shared/traces [--repeat 21]
    python -m benchmarks.bench_replay --cold [--repeat 3]
    python -m benchmarks.bench_replay --floors [--events 300000] [--repeat 5]

(Run from the checkout's root with ``-m``, so that ``cupool`` is the checkout's.)

The trace mixes small (< 1 MiB) and large (1-64 MiB) requests.  It allocates
until ``--live`` blocks are live, then allocations and frees are equally likely
while the live count stays between half of ``--live`` and ``--live`` (the mean
is printed).  Throughput falls slowly as the live count grows: the compiled
engine keeps its free index in treaps per stream and size band, O(log free blocks
in a band) per insert, removal or best-fit search, and more live blocks mean more
cache misses.  Each
row of ``SETTINGS`` is replayed on the numba engine and named for what it runs
(``{}`` would be whatever the trace recorded, and for a synthetic trace the
pool's defaults, expandable segments with stitching).  Then each row runs on a
prefix (``--pool-events``) through both engines, the pool engine (the real
``Pool``) and the numba engine, for the same-run ratio numba / pool by CPU time.

With ``--traces FOLDER`` it replays each trace there (PyTorch snapshots, cupool
traces, RMM logs) instead, on its sized device, in every configuration of
``SETTINGS``, on both engines, and prints the median events per second of each
(events replayed, seeds left out).

With ``--cold`` it times the engine's first compile in a fresh process with an
empty Numba cache (``NUMBA_CACHE_DIR`` in a temporary folder), then a second
fresh process's load from the cache that run filled, ``--repeat`` times each on a
new empty cache, and prints each run and the medians (wall and CPU seconds).

With ``--floors`` it times what a replay driven from Python pays per event whatever
its allocator costs (docs/design.md, "Can the pool replay at 3 M events/s?"): the
driver's loop alone over the synthetic trace (a dict insert or pop per event), the
loop with one call into a C function per event, the loop calling ``pool.malloc(4096)``
/ ``free()`` on the pool's compiled fast path (parked blocks reused), and the same
with a do-nothing subscriber, which turns parking off as a replay must.

The ``max_size=80%`` rows cap the pool at 80% of the device: on a trace's sized
device (1.25x its recorded peak) that is its recorded peak, so the reclaim
ladder and its OOMs run; on the synthetic trace's roomy device they change nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from cupool.replay import replay
from cupool.trace import Trace


def synthetic(n: int, seed: int = 0, live_target: int = 2000, streams: int = 2) -> tuple[Trace, float]:
    """The trace and its mean number of live allocations."""
    rng = np.random.default_rng(seed)
    kind = np.empty(n, np.uint8)
    addr = np.empty(n, np.int64)
    size = np.empty(n, np.int64)
    stream = rng.integers(0, streams, n)
    live_sum = 0
    sizes = np.where(rng.random(n) < 0.8, rng.integers(1, 1 << 20, n), rng.integers(1 << 20, 64 << 20, n))
    coin = rng.random(n)
    live: list[tuple[int, int, int]] = []
    for i in range(n):
        n_live = len(live)
        if n_live >= live_target or (2 * n_live >= live_target and coin[i] < 0.5 and i >= live_target):
            j = int(coin[i] * 1e6) % len(live)
            a, s, strm = live[j]
            live[j] = live[-1]
            live.pop()
            kind[i], addr[i], size[i], stream[i] = 1, a, s, strm
        else:
            kind[i], addr[i], size[i] = 0, i + 1, sizes[i]
            live.append((i + 1, int(sizes[i]), int(stream[i])))
        live_sum += len(live)
    trace = Trace(np.arange(n, dtype=np.int64), kind, addr, size, stream.astype(np.int64))
    return trace, live_sum / max(n, 1)


#: Each configuration, named for what it runs.
SETTINGS = {
    "plain": {"expandable_segments": False},
    "plain, release_threshold=0": {"expandable_segments": False, "release_threshold": 0},
    "expandable": {"expandable_segments": True, "stitch": False},
    "expandable+stitch (the defaults)": {"expandable_segments": True, "stitch": True},
    "expandable+stitch, release_threshold=0": {"expandable_segments": True, "stitch": True, "release_threshold": 0},
    "plain, max_size=80%": {"expandable_segments": False, "max_size": "80%"},
    "expandable+stitch, max_size=80%": {"expandable_segments": True, "stitch": True, "max_size": "80%"},
}


def rates(trace: Trace, cfg: dict, repeat: int, engine: str = "numba",
          stop: int | None = None) -> tuple[float | None, float | None, Any]:
    """An engine's median events/s over ``repeat`` replays (of the first ``stop`` events), by wall clock
    and by CPU time; the last result.

    Wall clock is the result's own ``events_per_second`` (the engine's loop alone).  On a machine
    shared with other jobs it measures the load as much as the engine, so each replay is also
    timed by this thread's CPU time, less that of the same replay stopped before its first event
    (``stop=0``: settings, state and the compile check), run right after it.
    """
    walls, cpus, r = [], [], None
    for _ in range(repeat):
        c0 = time.thread_time()
        r = replay(trace, cfg, engine=engine, stop=stop, progress=False)
        c1 = time.thread_time()
        replay(trace, cfg, engine=engine, stop=0, progress=False)
        c2 = time.thread_time()
        if r.replayed:
            walls.append(r.events_per_second)
            cpus.append(r.replayed / max((c1 - c0) - (c2 - c1), 1e-9))
    if not walls:
        return None, None, r
    return statistics.median(walls), statistics.median(cpus), r


def real_traces(folder: Path, repeat: int) -> None:
    """Median events/s of each engine and setting on every trace in ``folder``."""
    from cupool.trace import load_trace

    paths = sorted(p for pat in ("*.pickle", "*.h5", "*.csv") for p in folder.glob(pat))
    for path in paths:
        trace = load_trace(path)
        for label, cfg in SETTINGS.items():
            wall, cpu, r = rates(trace, cfg, repeat)
            pwall, pcpu, _ = rates(trace, cfg, max(1, repeat // 4), engine="pool")
            if wall is None:
                shown = "nothing replayed"
            else:
                shown = (f"numba {cpu / 1e6:.2f} M events/s by CPU time, {wall / 1e6:.2f} by wall clock; "
                         f"pool {pcpu / 1e6:.3f} by CPU time, {pwall / 1e6:.3f} by wall clock; "
                         f"numba / pool {cpu / pcpu:.0f}x by CPU time")
            print(f"{path.name} [{label}]: {r.replayed} events replayed; median of {repeat}: {shown} "
                  f"(peak reserved {r.peak_reserved >> 20} MiB, {r.ooms} OOMs)", flush=True)


def floors(n: int, repeat: int) -> None:
    """Medians of ``repeat`` runs, µs per event by CPU time, of a Python-driven replay's floors (``--floors``)."""
    from cupool import Pool

    trace, _ = synthetic(n)
    kind, addr, size, stream = (trace.kind.tolist(), trace.addr.tolist(), trace.size.tolist(),
                                trace.stream.tolist())

    def loop(call: Any) -> None:
        live: dict[int, Any] = {}
        for i in range(n):
            if kind[i] == 0:
                live[addr[i]] = size[i] if call is None else call(size[i], stream[i])
            else:
                live.pop(addr[i], None)

    def fast_path(pool: Pool) -> None:
        live: dict[int, Any] = {}
        malloc = pool.malloc
        for i in range(n):
            if kind[i] == 0:
                live[addr[i]] = malloc(4096)
            else:
                held = live.pop(addr[i], None)
                if held is not None:
                    held.free()

    def timed(fn: Any, arg: Any) -> float:
        runs = []
        for _ in range(repeat):
            c = time.thread_time()
            fn(arg)
            runs.append(time.thread_time() - c)
        return 1e6 * statistics.median(runs) / n

    pool = Pool("sim", capacity="64GiB")
    print(f"driver loop alone: {timed(loop, None):.3f} us/event")
    print(f"driver loop + one call into C (max) per event: {timed(loop, max):.3f} us/event")
    print(f"driver loop + pool.malloc(4096)/free on the compiled fast path: {timed(fast_path, pool):.3f} us/event")
    unsubscribe = pool.subscribe(lambda ev: None)
    print(f"the same with a do-nothing subscriber (no parking): {timed(fast_path, pool):.3f} us/event")
    unsubscribe()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=Path, default=None, help="replay the traces in this folder instead")
    ap.add_argument("--cold", action="store_true", help="time the engine's cold compile and its cache load instead")
    ap.add_argument("--floors", action="store_true", help="time a Python-driven replay's per-event floors instead")
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--pool-events", type=int, default=100_000, help="events for the (slow) Pool engine")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--live", type=int, default=2000, help="most live allocations (default 2000)")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--capacity", default="64GiB",
                    help="sim device size; about 8 MiB per live allocation avoids OOMs (default 64GiB)")
    args = ap.parse_args()
    if args.cold:
        cold(args.repeat)
        return
    if args.floors:
        floors(args.events, args.repeat)
        return
    if args.traces is not None:
        replay(synthetic(1000)[0], stop=1000)  # load the compiled engine once
        real_traces(args.traces, args.repeat)
        return
    base = {"capacity": args.capacity}
    trace, mean_live = synthetic(args.events, live_target=args.live, streams=args.streams)
    print(f"trace: {args.events} events, {args.streams} stream(s), mean {mean_live:.0f} live allocations")
    replay(trace, base, stop=1000)  # load the compiled engine once
    for label, setting in SETTINGS.items():
        cfg = {**base, **setting}
        wall, cpu, r = rates(trace, cfg, args.repeat)
        print(f"numba engine [{label}]: {args.events} events, median of {args.repeat}: {cpu / 1e6:.2f} M events/s "
              f"by CPU time, {wall / 1e6:.2f} by wall clock "
              f"(peak reserved {r.peak_reserved >> 20} MiB, {r.ooms} OOMs)", flush=True)
    # The pool engine on a prefix (it is slow), and the numba engine on the same prefix, in one run.
    for label, setting in SETTINGS.items():
        cfg = {**base, **setting}
        wall, cpu, r = rates(trace, cfg, args.repeat, stop=args.pool_events)
        pwall, pcpu, p = rates(trace, cfg, args.repeat, engine="pool", stop=args.pool_events)
        same = all(getattr(r, k) == getattr(p, k) for k in ("peak_reserved", "peak_allocated", "peak_segments"))
        print(f"pool engine [{label}]: {args.pool_events} events, median of {args.repeat}: {pcpu / 1e6:.3f} M events/s "
              f"by CPU time ({1e6 / pcpu:.1f} us/event), {pwall / 1e6:.3f} by wall clock; numba on the same prefix "
              f"{cpu / 1e6:.2f} by CPU time; numba / pool {cpu / pcpu:.0f}x by CPU time, {wall / pwall:.0f}x by wall "
              f"clock; same peaks: {same}", flush=True)


def cold(repeat: int) -> None:
    """The engine's compile in a fresh process on an empty cache, and its load from that cache; medians."""
    import os
    import subprocess
    import sys
    import tempfile

    code = ("import time; t, c = time.perf_counter(), time.process_time(); "
            "from benchmarks.bench_replay import synthetic; "
            "from cupool.replay import replay; replay(synthetic(1000)[0], {'capacity': '64GiB'}); "
            "print(time.perf_counter() - t, time.process_time() - c)")
    root = Path(__file__).resolve().parents[1]
    whats = ("cold compile (empty cache)", "load from the cache")
    runs: dict[str, list[tuple[float, float]]] = {w: [] for w in whats}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "NUMBA_CACHE_DIR": cache}
            for what in whats:
                out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, check=True,
                                     capture_output=True, text=True).stdout
                wall, cpu = (float(x) for x in out.split()[-2:])
                runs[what].append((wall, cpu))
                print(f"{what}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
    for what in whats:
        walls, cpus = zip(*runs[what])
        print(f"{what}, median of {repeat}: {statistics.median(walls):.1f} s wall, {statistics.median(cpus):.1f} s CPU "
              "(import, synthetic trace and a 1000-event replay)")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"(total {time.perf_counter() - t0:.1f} s)")
