"""What whole handles cost in memory, on the sim device: a GPU's way of mapping against the sim's.

    python benchmarks/bench_whole_handles.py [TRACES_FOLDER] [--quick] [--json]

On a GPU (``Capabilities.whole_handles``, Note [Virtual memory]) each grow, new
segment or stitch's fresh part is one handle, which goes back to the device only
whole, so a free tail inside a handle that still holds a live block stays mapped.
The sim device maps one chunk per granule, and every figure measured on it so
far is that.  ``SimWholeHandles`` is the sim device mapping as a GPU does; this
benchmark runs the same work on both, with the pool's defaults (expandable
segments) and with stitching off, and prints peak reserved over the live peak
(``allocated_bytes.all.peak``), and the map calls made:

* issue 35's **big program** and its **set** of 24 programs
  (``benchmarks/bench_random_programs.py``), each on a live pool of a 16 GiB device;
* each **trace** in TRACES_FOLDER (PyTorch snapshots, cupool traces, RMM logs),
  replayed through the real ``Pool`` (the "pool" engine) on a device of
  ``trace_capacity``, once on the sim device and once on ``SimWholeHandles`` (the
  replay makes its pool on ``cupool.replay.config.SimDevice``, which this script
  replaces for the second run: the replay has no setting for it);
* **the exactness of a replay of a GPU recording**: the big program recorded on
  ``SimWholeHandles`` (a GPU's way of mapping, on the CPU), replayed by both
  engines, which map as the sim does, against the same recording made on the sim
  device: peak reserved, peak segments, device calls and OOMs, recording vs replay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

from bench_random_programs import CAPACITY, big_program, program_set  # beside this script

import cupool
from cupool.device import SimDevice
from cupool.device.sim import SimWholeHandles
from cupool.testing.programs import Call, run_calls

DEVICES: dict[str, Callable[[int], SimDevice]] = {"per granule": SimDevice, "whole handles": SimWholeHandles}
SETTINGS: dict[str, dict[str, Any]] = {"defaults": {}, "no stitch": {"stitch": False}}


def live_run(make: Callable[[int], SimDevice], config: dict[str, Any], ops: list[Call],
             record: bool = False) -> dict[str, Any]:
    """Run ``ops`` on a fresh pool of ``make(CAPACITY)``: peaks, map calls, and the trace when ``record``."""
    pool = cupool.Pool(make(CAPACITY), **config)
    rec = pool.record() if record else None
    if rec is not None:
        rec.start()
    ooms, live = run_calls(pool, ops)
    if rec is not None:
        rec.stop()
    s = pool.stats()
    out = {"peak_reserved": s["reserved_bytes.all.peak"], "peak_allocated": s["allocated_bytes.all.peak"],
           "ratio": s["reserved_bytes.all.peak"] / s["allocated_bytes.all.peak"], "ooms": ooms,
           "maps": s["num_device_alloc"], "peak_segments": s["segment.all.peak"]}
    if rec is not None:
        out["trace"] = rec.trace()
    for a in live:
        a.free()
    pool.close()
    return out


def programs(quick: bool) -> dict[str, Any]:
    """The big program and the set, on each device and setting."""
    out: dict[str, Any] = {}
    the_set = program_set(600 if quick else 1500)
    for label, cfg in SETTINGS.items():
        for dev, make in DEVICES.items():
            big = live_run(make, cfg, big_program())
            ratios = [live_run(make, cfg, ops)["ratio"] for _, ops in the_set]
            out[f"{label} / {dev}"] = {"big": big["ratio"], "big_maps": big["maps"], "big_ooms": big["ooms"],
                                       "set_median": statistics.median(ratios), "set_max": max(ratios),
                                       "set": ratios}
    return out


def traces(folder: Path) -> dict[str, Any]:
    """Each trace of ``folder`` replayed through the pool on the sim device and on ``SimWholeHandles``."""
    from cupool.replay import config as replay_config
    from cupool.replay import replay
    from cupool.replay.driver import trace_capacity
    from cupool.trace import load_trace

    out: dict[str, Any] = {}
    for path in sorted(p for pat in ("*.pickle", "*.h5", "*.csv") for p in folder.glob(pat)):
        trace = load_trace(path)
        sized = trace_capacity(trace)
        base = {} if sized is None else {"capacity": sized[0]}
        for label, cfg in (("stitch", {"expandable_segments": True, "stitch": True}),
                           ("no stitch", {"expandable_segments": True, "stitch": False})):
            for dev, make in DEVICES.items():
                with mock.patch.object(replay_config, "SimDevice", make):
                    r = replay(trace, {**base, **cfg}, engine="pool", progress=False)
                out[f"{path.name}: {label} / {dev}"] = {
                    "ratio": r.peak_reserved / max(r.peak_allocated, 1), "peak_reserved": r.peak_reserved,
                    "peak_allocated": r.peak_allocated, "ooms": r.ooms, "device_calls": r.device_allocs}
    return out


def exactness() -> dict[str, Any]:
    """The big program recorded on each device, replayed by both engines (which map per granule)."""
    from cupool.replay import replay

    out: dict[str, Any] = {}
    for dev, make in DEVICES.items():
        rec = live_run(make, {}, big_program(), record=True)
        want = (rec["peak_reserved"], rec["peak_segments"], rec["maps"], rec["ooms"])
        row: dict[str, Any] = {"recorded": want}
        for engine in ("numba", "pool"):
            r = replay(rec["trace"], engine=engine, progress=False)
            got = (r.peak_reserved, r.peak_segments, r.device_allocs, r.ooms)
            row[engine] = {"replayed": got, "exact": got == want}
        out[dev] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="?", type=Path, help="a folder of traces (the pickles in shared/traces)")
    ap.add_argument("--quick", action="store_true", help="the set's programs 600 operations long, not 1,500")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = {"programs": programs(args.quick), "exactness": exactness()}
    if args.traces is not None:
        res["traces"] = traces(args.traces)
    if args.json:
        print(json.dumps(res, default=str))
        return 0
    print("peak reserved / live peak (the set: median, max of 24 programs); device calls (num_device_alloc) of the big program")
    for k, v in res["programs"].items():
        base = res["programs"][k.replace("whole handles", "per granule")]["set"]
        worse = sum(w > b + 1e-9 for w, b in zip(v["set"], base))
        print(f"  {k:28s} big {v['big']:.3f} ({v['big_maps']} device calls)  set {v['set_median']:.3f}, "
              f"{v['set_max']:.3f}" + (f"  (higher than per granule in {worse} of {len(base)})" if v["set"] is not base
                                       else ""))
    for k, v in res.get("traces", {}).items():
        print(f"  {k:60s} {v['ratio']:.3f}  ({v['peak_reserved'] >> 20} MiB / {v['peak_allocated'] >> 20} MiB, "
              f"{v['ooms']} OOMs, {v['device_calls']} device calls)")
    print("replay of the big program's recording: (peak reserved, peak segments, device calls, OOMs)")
    for dev, row in res["exactness"].items():
        print(f"  recorded on {dev}: {row['recorded']}")
        for engine in ("numba", "pool"):
            print(f"    {engine:5s} {row[engine]['replayed']}  exact: {row[engine]['exact']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
