"""Random programs nobody tuned for: peak reserved against the live peak, the defaults against eager release.

    python benchmarks/bench_random_programs.py [--quick] [--json] [--big-only | --set-only]
    python benchmarks/bench_random_programs.py --monotone N [--streams S] [--engine numba|pool|live]
    python benchmarks/bench_random_programs.py --scan N [--mix small|large|mixed] [--streams S]

Issue 35's two workloads, each run through a live ``Pool`` on the sim device
(the sim runs the pool's own code; its figures reproduced an H200 run to the byte):

* **the big program**: 3,000 operations, sizes log-uniform from 4 KiB to 64 MiB,
  at most 300 live blocks, one stream (seed 0);
* **the set**: 24 seeded programs, three size mixes (small: 512 B-1 MiB; large:
  1-64 MiB; mixed: 4 KiB-64 MiB, all log-uniform) times 1 or 4 streams times 4 seeds,
  1,500 operations each (``--quick``: 600), at most 120 live.

Every program allocates with probability one half (always when nothing is live,
never at the live cap) and otherwise frees a live block chosen uniformly, on a
device large enough that nothing fails (16 GiB).  For each setting it prints the
peak reserved over the live peak (``allocated_bytes.all.peak``), and the driver
calls per 1,000 operations: virtual-memory ``map`` / ``unmap`` / ``set_access``
calls counted on the pool's ``VirtualMemory``, and cudaMalloc / cudaFree (device
allocations and frees of plain segments), with the H200's per-call costs
(``COSTS``, from ``cupool.device.costs``: 18.9 us a map, 38.8 us an unmap, 51.6 us a
set_access, 51.5 / 40.8 us a cudaMalloc / cudaFree) turned into microseconds per
1,000 operations.  The sim device maps one chunk per granule, so its map counts are
what a GPU would make with 2 MiB handles; on a GPU cupool maps one handle per grow
(Note [Virtual memory]), so fewer.

``--monotone N`` scans N random 400-operation programs (40% of requests under 1 MiB,
40% 1-10 MiB, 20% 10-80 MiB, at most 60 live, as ``docs/benchmarks.md``'s earlier
scan) with the defaults: every 2 MiB capacity from the live peak to 1.3x it, counting
the programs with a failing capacity above the smallest that works.  ``--engine``:
``numba`` or ``pool`` replay the program's trace (recorded once on a large device),
``live`` runs the program itself on a fresh pool at each capacity.

``--scan N`` runs N more seeded programs of one mix (the set's shape, seeds 50,000 on) and
counts where the defaults reserve less than eager release, as much, or more (win / tie /
lose), with the median of the defaults' peak reserved over the live peak: a set of 24
moves by one granule here and there; 200 show a trend (Note [Cold stacks]).

"eager release" is the simplest policy there is: plain segments, each free one
given back at once (``expandable_segments=False, release_threshold=0``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import cupool
from cupool.device.costs import H200
from cupool.testing.programs import Call, run_calls

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CAPACITY = 16 * GiB
SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "eager release": {"expandable_segments": False, "release_threshold": 0},
    "plain caching": {"expandable_segments": False},
}
MIXES = {"small": (512, 1 * MiB), "large": (1 * MiB, 64 * MiB), "mixed": (4 * KiB, 64 * MiB)}
#: Per-call costs in microseconds: the H200's (Note [Per-call costs], ``cupool.device.costs``).
COSTS = {call: H200[name].seconds * 1e6 for call, name in (
    ("map", "cuMemMap"), ("unmap", "cuMemUnmap"), ("set_access", "cuMemSetAccess"), ("malloc", "malloc"),
    ("free", "free"))}

Op = Call  # (0, size, stream): malloc; (1, index, 0): free live[index % len(live)] (run_calls)


def program(seed: int, n_ops: int, lo: int, hi: int, max_live: int, streams: int) -> list[Op]:
    """A seeded random program: sizes log-uniform in [lo, hi], allocating with probability one half."""
    rng = np.random.default_rng(seed)
    ops: list[Op] = []
    live = 0
    for _ in range(n_ops):
        if live == 0 or (live < max_live and rng.random() < 0.5):
            size = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
            ops.append((0, size, int(rng.integers(streams))))
            live += 1
        else:
            ops.append((1, int(rng.integers(1 << 30)), 0))
            live -= 1
    return ops


def big_program() -> list[Op]:
    """Issue 35's random CuPy program: 3,000 operations, 4 KiB-64 MiB log-uniform, at most 300 live."""
    return program(0, 3000, 4 * KiB, 64 * MiB, 300, 1)


def program_set(n_ops: int) -> list[tuple[str, list[Op]]]:
    """The 24 seeded programs: 3 size mixes x (1, 4) streams x 4 seeds."""
    out = []
    for mix, (lo, hi) in MIXES.items():
        for streams in (1, 4):
            for seed in range(4):
                name = f"{mix}/{streams}s/{seed}"
                out.append((name, program(1000 * streams + seed, n_ops, lo, hi, 120, streams)))
    return out


def _counting(vm: Any, counts: dict[str, int]) -> None:
    """Count ``vm``'s map / unmap / set_access calls in ``counts`` (wrapping the instance's methods)."""
    for name in ("map", "unmap", "set_access"):
        inner = getattr(vm, name)

        def wrapped(*a: Any, _inner: Callable = inner, _name: str = name) -> Any:
            counts[_name] += 1
            return _inner(*a)

        setattr(vm, name, wrapped)


def run(config: dict[str, Any], ops: list[Op], capacity: int = CAPACITY) -> dict[str, Any]:
    """Run ``ops`` on a fresh sim pool with ``config``: peaks, OOMs and driver calls."""
    pool = cupool.Pool("sim", capacity=capacity, **config)
    counts = {"map": 0, "unmap": 0, "set_access": 0}
    vm = pool.device.virtual_memory() if config.get("expandable_segments", True) else None  # the pool's, shared
    if vm is not None:
        _counting(vm, counts)
    ooms, live = run_calls(pool, ops)
    s = pool.stats()
    for a in live:
        a.free()
    pool.close()
    k = 1000 / len(ops)
    calls = {
        "map": counts["map"] * k, "unmap": counts["unmap"] * k, "set_access": counts["set_access"] * k,
        "malloc": (0 if vm is not None else s["num_device_alloc"]) * k,
        "free": (0 if vm is not None else s["num_device_free"]) * k,
    }
    return {
        "peak_reserved": s["reserved_bytes.all.peak"], "peak_allocated": s["allocated_bytes.all.peak"],
        "ratio": s["reserved_bytes.all.peak"] / s["allocated_bytes.all.peak"], "ooms": ooms,
        "calls_per_1000": calls, "us_per_1000": sum(COSTS[c] * v for c, v in calls.items()),
    }


def scan_program(seed: int, streams: int) -> list[Op]:
    """One program of the monotone scan: 400 operations, 40% < 1 MiB, 40% 1-10 MiB, 20% 10-80 MiB, <= 60 live."""
    rng = np.random.default_rng(seed)
    ops: list[Op] = []
    live = 0
    for _ in range(400):
        if live == 0 or (live < 60 and rng.random() < 0.5):
            u = rng.random()
            lo, hi = (4 * KiB, MiB) if u < 0.4 else (MiB, 10 * MiB) if u < 0.8 else (10 * MiB, 80 * MiB)
            ops.append((0, int(rng.integers(lo, hi)), int(rng.integers(streams))))
            live += 1
        else:
            ops.append((1, int(rng.integers(1 << 30)), 0))
            live -= 1
    return ops


def _live_ooms(ops: list[Op], capacity: int) -> tuple[int, Any]:
    """Run ``ops`` on a defaults pool of ``capacity``, recording: (OOMs, the trace)."""
    pool = cupool.Pool("sim", capacity=capacity)
    rec = pool.record()
    rec.start()
    ooms, _ = run_calls(pool, ops)
    rec.stop()
    return ooms, (rec.trace(), pool.stats()["allocated_bytes.all.peak"])


def monotone_scan(n: int, streams: int, engine: str) -> dict[str, Any]:
    """Issue 35's third target on ``n`` programs: how many have a failing capacity above the smallest that works."""
    from cupool.replay import replay

    bad, failed, scanned = [], 0, 0
    for seed in range(n):
        ops = scan_program(seed, streams)
        _, (trace, peak) = _live_ooms(ops, CAPACITY)
        lo = -(-peak // (2 * MiB)) * 2 * MiB
        caps = list(range(lo, int(peak * 1.3) + 1, 2 * MiB))
        if engine == "live":
            ooms = [_live_ooms(ops, c)[0] for c in caps]
        else:
            ooms = [replay(trace, {"capacity": c}, engine=engine, progress=False).ooms for c in caps]
        scanned += len(caps)
        ok = [i for i, o in enumerate(ooms) if o == 0]
        if ok:
            above = [caps[i] for i in range(ok[0], len(caps)) if ooms[i]]
            failed += len(above)
            if above:
                bad.append((seed, caps[ok[0]] >> 20, [c >> 20 for c in above]))
    return {"programs": n, "with_failing_above": len(bad), "failing": failed, "scanned": scanned, "bad": bad}


def scan(n: int, mix: str, streams: int) -> dict[str, Any]:
    """``n`` seeded programs of ``mix`` on ``streams`` streams: the defaults against eager release."""
    lo, hi = MIXES[mix]
    win = tie = lose = 0
    ratios = []
    for seed in range(n):
        ops = program(50_000 + 1000 * streams + seed, 1500, lo, hi, 120, streams)
        d, e = run(SETTINGS["defaults"], ops), run(SETTINGS["eager release"], ops)
        win += d["peak_reserved"] < e["peak_reserved"]
        tie += d["peak_reserved"] == e["peak_reserved"]
        lose += d["peak_reserved"] > e["peak_reserved"]
        ratios.append(d["ratio"])
    return {"programs": n, "win": win, "tie": tie, "lose": lose, "median": statistics.median(ratios)}


def _calls(r: dict[str, Any]) -> str:
    c = r["calls_per_1000"]
    if c["malloc"] or c["free"]:
        return f"{c['malloc']:.0f} malloc / {c['free']:.0f} free"
    return f"{c['map']:.0f} map / {c['unmap']:.0f} unmap / {c['set_access']:.0f} set_access"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="600 operations a program in the set (else 1,500)")
    ap.add_argument("--json", action="store_true", help="one JSON object per program and setting")
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--big-only", action="store_true")
    part.add_argument("--set-only", action="store_true")
    part.add_argument("--monotone", type=int, metavar="N", help="scan N random programs for non-monotone capacities")
    part.add_argument("--scan", type=int, metavar="N", help="N more seeded programs of one mix against eager release")
    ap.add_argument("--mix", choices=tuple(MIXES), default="small", help="the scan's size mix (default: %(default)s)")
    ap.add_argument("--streams", type=int, default=1, help="streams of the monotone scan's or the scan's programs")
    ap.add_argument("--engine", choices=("numba", "pool", "live"), default="numba")
    args = ap.parse_args(argv)
    out = sys.stdout
    if args.monotone:
        r = monotone_scan(args.monotone, args.streams, args.engine)
        out.write(f"{r['with_failing_above']} of {r['programs']} programs with a failing capacity above the smallest "
                  f"that works; {r['failing']} of {r['scanned']} capacities ({args.engine}, {args.streams} stream(s))\n")
        for seed, smallest, above in r["bad"]:
            out.write(f"  seed {seed}: smallest {smallest} MiB, failing above: {above}\n")
        return 0
    if args.scan:
        r = scan(args.scan, args.mix, args.streams)
        out.write(f"{r['programs']} {args.mix} programs, {args.streams} stream(s): the defaults reserve less than "
                  f"eager release / as much / more: {r['win']} / {r['tie']} / {r['lose']}; median {r['median']:.4f}x "
                  "the live peak\n")
        return 0
    if not args.set_only:
        ops = big_program()
        out.write("## the big program (3,000 operations, 4 KiB-64 MiB, <= 300 live)\n\n")
        out.write("| setting | peak reserved | live peak | / live peak | OOMs | driver calls / 1,000 ops | us / 1,000 ops |\n")
        out.write("| --- | --- | --- | --- | --- | --- | --- |\n")
        for name, config in SETTINGS.items():
            r = run(config, ops)
            if args.json:
                print(json.dumps({"program": "big", "setting": name, **r}), file=sys.stderr)
            out.write(f"| {name} | {r['peak_reserved']:,} | {r['peak_allocated']:,} | {r['ratio']:.4f}x | "
                      f"{r['ooms']} | {_calls(r)} | {r['us_per_1000']:,.0f} |\n")
        out.flush()
    if not args.big_only:
        n_ops = 600 if args.quick else 1500
        out.write(f"\n## the set (24 programs, {n_ops} operations each, <= 120 live)\n\n")
        out.write("| program | defaults | eager release | defaults <= eager | defaults: driver calls / 1,000 ops |\n")
        out.write("| --- | --- | --- | --- | --- |\n")
        ratios, wins, us = [], 0, []
        for name, ops in program_set(n_ops):
            d = run(SETTINGS["defaults"], ops)
            e = run(SETTINGS["eager release"], ops)
            if args.json:
                print(json.dumps({"program": name, "defaults": d, "eager": e}), file=sys.stderr)
            ok = d["peak_reserved"] <= e["peak_reserved"]
            wins += ok
            ratios.append(d["ratio"])
            us.append(d["us_per_1000"])
            out.write(f"| {name} | {d['ratio']:.4f}x | {e['ratio']:.4f}x | {'yes' if ok else 'no'} | {_calls(d)} |\n")
            out.flush()
        out.write(f"\ndefaults <= eager release on {wins} of 24; median {statistics.median(ratios):.4f}x, "
                  f"worst {max(ratios):.4f}x the live peak; driver time median {statistics.median(us):,.0f} us "
                  "per 1,000 operations\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
