"""Real traces against the allocator that recorded them: peak reserved and the smallest device that works.

    python benchmarks/bench_real_traces.py FOLDER [--engine numba|pool] [--json] [--window N]

For each trace in FOLDER (PyTorch snapshots ``*.pickle``, cupool ``*.h5`` traces,
RMM logs ``*.csv``) it prints: the events and the live (allocated) peak; the
recorded allocator's peak reserved, reconstructed from the snapshot
(``recorded_peak_reserved``; PyTorch snapshots only); cupool's peak reserved with
each setting of ``SETTINGS`` (Pool's defaults, plain segments with and without
``release_threshold=0`` and without release before split, expandable segments,
with stitching, and with both) on two devices: one sized from the trace
(``trace_capacity``: 1.25x the recorded peak reserved) and one of exactly the
recorded peak reserved (``at_recorded``: the snapshots do not record the
device's size, and the recording fitted in that much); for each setting, the
smallest device on which the replay has zero OOMs, and how many capacities
above it still have OOMs; and whether issue 19's and issue 25's targets are
met (peak reserved no more than the recording's on the recorded device;
smallest device within 1.02x the live peak or 4 MiB above it; no capacity
above it with OOMs).

The smallest device is searched in 2 MiB steps.  OOMs are not monotone in
capacity (a caching allocator given more room caches more, and the cache it
holds can be in the wrong place later), so bisection alone can land on a
capacity above a smaller one that works, or on one with a failing capacity
above it.  The search bisects to a working capacity, then replays every
capacity below it down to the live peak (below which nothing can work), so the
answer is the true smallest zero-OOM device, however far below the bisection
it lies; then every capacity above the bisection's answer up to the sized
device (or ``--window`` steps, if given), counting those with OOMs
("non-monotone": ``failing_above``).  A snapshot with no history is a still
picture: its peaks are the picture, and its smallest device is the one that
holds its live blocks.

The numba engine is the default (about 10 ms a replay on a 15k-event trace);
``--engine pool`` replays through the real ``Pool`` (slower, same numbers on
raw allocations).  ``--json`` prints one JSON object per trace.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

PAGE = 2 << 20
PATTERNS = ("*.pickle", "*.h5", "*.csv")
SETTINGS = {
    # Pool's defaults, whatever they are ({} would be the trace's recorded settings: a PyTorch snapshot's own
    # kind of segments, a cupool trace's own settings).
    "defaults": {"expandable_segments": None, "stitch": None},
    "plain": {"expandable_segments": False},
    "plain, release_threshold=0": {"expandable_segments": False, "release_threshold": 0},
    "plain, release_before_split=False": {"expandable_segments": False, "release_before_split": False},
    "expandable": {"expandable_segments": True, "stitch": False},
    "expandable+stitch": {"expandable_segments": True, "stitch": True},
    "expandable+stitch+rt=0": {"expandable_segments": True, "stitch": True, "release_threshold": 0},
}
#: The targets of issue 19: the smallest zero-OOM device within this much of the live peak ...
LIVE_RATIO = 1.02
#: ... or this many bytes above it (small traces, where 2 MiB granules dominate).
LIVE_SLACK = 4 << 20


@dataclass
class Search:
    """The smallest zero-OOM capacity found, and what the scan around it saw."""

    smallest: int | None  # bytes; None when no capacity up to the search's ceiling works
    bisected: int | None  # the bisection's answer, before the scan
    non_monotone: bool  # some capacity above ``smallest`` in the scanned range had OOMs
    failing_above: list[int]  # those capacities (bytes)
    window: tuple[int, int]  # the scanned capacities, lowest and highest
    replays: int


def smallest_device(ooms: Callable[[int], int], lo: int, hi: int, window: int | None = None,
                    step: int = PAGE) -> Search:
    """Smallest capacity (a multiple of ``step``) with ``ooms(capacity) == 0``: bisected, then scanned.

    ``lo`` is a capacity known to fail (below the live peak every capacity
    does), never replayed; ``hi`` a first guess that works (doubled until it
    does, at most 20 times).  Bisection keeps ``ooms(lo) > 0`` and
    ``ooms(hi) == 0``; then every capacity from the bisection's answer down to
    just above ``lo`` is replayed (OOMs are not monotone: a smaller one may
    work), and above it up to the first guess ``hi`` (or ``window`` steps above
    the answer, when given); the smallest zero-OOM capacity seen is the answer,
    and those above it that failed say the OOMs are not monotone.
    """
    calls = 0
    results: dict[int, int] = {}

    def f(p: int) -> int:
        nonlocal calls
        if p not in results:
            calls += 1
            results[p] = ooms(p * step)
        return results[p]

    lo_p = floor_p = max(lo // step, 0)
    hi_p = guess_p = max(math.ceil(hi / step), lo_p + 1)
    for _ in range(20):
        if f(hi_p) == 0:
            break
        lo_p, hi_p = hi_p, hi_p * 2
    else:
        return Search(None, None, False, [], (lo_p * step, hi_p * step), calls)
    while hi_p - lo_p > 1:
        mid = (lo_p + hi_p) // 2
        if f(mid) == 0:
            hi_p = mid
        else:
            lo_p = mid
    first = max(1, floor_p + 1)
    last = hi_p + window if window is not None else max(hi_p, guess_p)
    for p in range(hi_p, last + 1):
        f(p)
    for p in range(hi_p - 1, first - 1, -1):  # down to the floor: the true smallest may lie far below
        f(p)
    best = min(p for p in range(first, last + 1) if results[p] == 0)
    failing = [p * step for p in range(best + 1, last + 1) if results[p] > 0]
    return Search(best * step, hi_p * step, bool(failing), failing, (first * step, last * step), calls)


def trace_row(path: Path, engine: str = "numba", window: int | None = None) -> dict:
    """Every figure of the table for one trace file."""
    from cupool.replay import replay
    from cupool.replay.driver import CONFIG_KEYS, trace_capacity
    from cupool.trace import load_trace
    from cupool.trace.importers import recorded_peak_allocated, recorded_peak_reserved

    t0 = time.perf_counter()
    trace = load_trace(path)
    sized = trace_capacity(trace)
    recorded = recorded_peak_reserved(trace)
    row: dict = {"trace": path.name, "events": len(trace), "engine": engine,
                 "recorded_peak_reserved": recorded, "recorded_peak_allocated": recorded_peak_allocated(trace)}
    base = {} if sized is None else {"capacity": sized[0]}
    row["capacity"] = None if sized is None else int(sized[0])
    row["capacity_source"] = "the sim device's default" if sized is None else sized[1]
    # A device no larger than the recording's peak reserved: whole 2 MiB pages, as the sim's are.
    row["recorded_capacity"] = None if recorded is None else recorded // PAGE * PAGE
    for label, cfg in SETTINGS.items():
        eng = engine if all(k in CONFIG_KEYS for k in cfg) else "pool"  # both engines model all of them
        r = replay(trace, {**base, **cfg}, engine=eng, progress=False)
        row.setdefault("history", r.history)
        row.setdefault("seeded_blocks", r.seeded_blocks)
        row.setdefault("peak_allocated", r.peak_allocated)
        row.setdefault("unmatched_frees", r.unmatched_frees)
        row.setdefault("capacity_used", r.capacity)
        row[label] = {"peak_reserved": r.peak_reserved, "ooms": r.ooms, "segments": r.peak_segments}

        def ooms(cap: int, cfg=cfg, eng=eng) -> int:
            return replay(trace, {"capacity": cap, **cfg}, engine=eng, progress=False).ooms

        if row["recorded_capacity"]:
            at = replay(trace, {**cfg, "capacity": row["recorded_capacity"]}, engine=eng, progress=False)
            row[label]["at_recorded"] = {"peak_reserved": at.peak_reserved, "ooms": at.ooms}
        # Below the live peak every capacity fails; the replay is not asked about those (a
        # device smaller than a seeded snapshot's segments is not a question it answers).
        floor = max(r.peak_allocated, 1) - 1
        s = smallest_device(ooms, floor, r.capacity, window=window)
        row[label]["smallest_device"] = asdict(s)
    row["seconds"] = time.perf_counter() - t0
    return row


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / (1 << 20):,.1f} MiB"


def _ratio(a: int | None, b: int | None) -> str:
    return "—" if not a or not b else f"{a / b:.4f}×"


def meets(row: dict, label: str) -> dict[str, bool]:
    """Whether ``label``'s figures meet issue 19's and 25's targets on this trace.

    Peak reserved is judged on a device of the recorded peak reserved (where it
    cannot be above it): the target is met when the replay runs there with
    zero OOMs.  Without a recorded peak there is nothing to compare.
    """
    x, live = row[label], row["peak_allocated"]
    at = x.get("at_recorded")
    smallest = x["smallest_device"]["smallest"]
    return {
        "reserved": at is None or (at["ooms"] == 0 and at["peak_reserved"] <= row["recorded_peak_reserved"]),
        "device": smallest is not None and (smallest <= live * LIVE_RATIO or smallest <= live + LIVE_SLACK),
        "monotone": not x["smallest_device"]["non_monotone"],
    }


def failing_summary(s: dict) -> str:
    """How many capacities above the smallest zero-OOM one, of those scanned, have OOMs, and where."""
    if s["smallest"] is None:
        return "—"
    scanned = (s["window"][1] - s["smallest"]) // PAGE
    if not s["non_monotone"]:
        return f"0 of {scanned}"
    f = s["failing_above"]
    return f"{len(f)} of {scanned} ({_gib(min(f))}–{_gib(max(f))})"


def table(rows: list[dict]) -> str:
    """One line per trace and setting: peak reserved against the recording's, smallest device against the live peak."""
    lines = [
        "| trace | events | live peak | recorded peak reserved | setting | "
        "on the recorded device: peak reserved (OOMs) | on the sized device: peak reserved (OOMs) | / recorded | "
        "smallest zero-OOM device | / live peak | capacities above it with OOMs | targets met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        events = f"{r['events']:,}" + ("" if r["history"] else " (still picture)")
        for label in SETTINGS:
            x = r[label]
            s = x["smallest_device"]
            at = x.get("at_recorded")
            on_recorded = "—" if at is None else f"{_gib(at['peak_reserved'])} ({at['ooms']})"
            ok = meets(r, label)
            met = "all" if all(ok.values()) else "not " + ", ".join(k for k, v in ok.items() if not v)
            lines.append(
                f"| {r['trace']} | {events} | {_gib(r['peak_allocated'])} | {_gib(r['recorded_peak_reserved'])} | "
                f"{label} | {on_recorded} | {_gib(x['peak_reserved'])} ({x['ooms']}) | "
                f"{_ratio(x['peak_reserved'], r['recorded_peak_reserved'])} | {_gib(s['smallest'])} | "
                f"{_ratio(s['smallest'], r['peak_allocated'])} | {failing_summary(s)} | {met} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="folder of traces (*.pickle, *.h5, *.csv)")
    ap.add_argument("--engine", choices=("numba", "pool"), default="numba")
    ap.add_argument("--json", action="store_true", help="one JSON object per trace")
    ap.add_argument("--window", type=int, default=None,
                    help="2 MiB steps scanned above the bisection's answer (default: every step up to the sized "
                         "device); below it, every step down to the live peak is scanned")
    args = ap.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"{folder}: not a folder", file=sys.stderr)
        return 2
    paths = sorted({p for pat in PATTERNS for p in folder.glob(pat)})
    if not paths:
        print(f"{folder}: no traces (*.pickle, *.h5, *.csv)", file=sys.stderr)
        return 2
    rows = []
    for p in paths:
        row = trace_row(p, args.engine, args.window)
        rows.append(row)
        if args.json:
            print(json.dumps(row))
    if not args.json:
        above = "up to the sized device" if args.window is None else f"{args.window} steps above"
        print(f"engine {args.engine}; the recorded device holds the recorded peak reserved, the sized one 1.25x "
              f"it; smallest device: bisection, then every 2 MiB step down to the live peak and {above}")
        print(table(rows))
        for r in rows:
            print(f"{r['trace']}: sized {_gib(r['capacity'])} ({r['capacity_source']}); recorded device "
                  f"{_gib(r['recorded_capacity'])}; {r['seeded_blocks']} seeded blocks, {r['unmatched_frees']} "
                  "unmatched frees; replays: " + " + ".join(str(r[k]["smallest_device"]["replays"]) for k in SETTINGS)
                  + f"; {r['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
