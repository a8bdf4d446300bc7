"""The run as JSON, beside the markdown report: every check's status and figures, and the issue's targets.

A machine reads this one (``docs/gpu-validation.json`` holds the latest GPU run's):
each check with its status, summary, seconds, commands, figures and tables; and
the targets of issue 18, each pulled from the figure of the check that measures
it, with its bound and whether it was met.  A target whose check did not run (or
was skipped) says why, with ``value`` null: a run without a GPU still lists them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .records import FAILED, PASSED, SKIPPED, Result

#: Bumped when a reader of an older file would misread this one.
SCHEMA = 1


@dataclass(frozen=True)
class Target:
    name: str
    check: str
    figure: str
    op: str  # "<=", ">=", or "" for a figure reported without a bound
    bound: float | None = None


TARGETS = (
    Target("cp.empty + drop: cupool / CuPy MemoryPool (x)", "hook-paths", "cupool / CuPy MemoryPool (x)", "<=", 1.2),
    Target("cp.empty + drop: cupool / RMM rmm_cupy_allocator on a pool (x)", "hook-paths", "cupool / RMM (x)", "<=",
           1.0),
    Target("cp.empty + drop: floor Python allocator / CuPy MemoryPool (x)", "hook-paths",
           "floor / CuPy MemoryPool (x)", ""),
    Target("raw malloc + free: cupool / CuPy MemoryPool malloc (x)", "malloc-free",
           "cupool malloc+free / CuPy malloc+drop at 1,000 live (x)", "<=", 1.5),
    Target("compaction, 128 MiB in 32 moves: moves / CuPy copy (x)", "compaction-moves",
           "128 MiB in 32 moves: copy/moves (x)", ">=", 0.8),
    Target("compaction, 1 GiB in 32 moves: moves / CuPy copy (x)", "compaction-moves",
           "1 GiB in 32 moves: copy/moves (x)", ">=", 0.9),
    Target("4,096 moves of 4 KiB (ms)", "compaction-moves", "4,096 moves of 4 KiB: moves (ms)", "<=", 0.5),
    Target("pool.compact(), moves only / CuPy copy (x)", "compaction-bandwidth", "moves / copy (x)", ">=", 0.8),
)


def target_rows(results: list[Result]) -> list[dict[str, Any]]:
    """Each target with the value this run measured, or null and why not."""
    by_name = {r.name: r for r in results}
    rows = []
    for t in TARGETS:
        row: dict[str, Any] = {"name": t.name, "check": t.check, "figure": t.figure,
                               "target": f"{t.op} {t.bound}" if t.op else None, "value": None, "met": None}
        r = by_name.get(t.check)
        if r is None:
            row["why_not"] = f"the check {t.check} did not run"
        elif r.status == SKIPPED:
            row["why_not"] = f"the check {t.check} was skipped: {r.summary}"
        elif t.figure not in r.figures:
            row["why_not"] = f"the check {t.check} {r.status} without this figure"
        else:
            v = float(r.figures[t.figure])
            row["value"] = v
            if t.op and t.bound is not None:
                row["met"] = v <= t.bound if t.op == "<=" else v >= t.bound
        rows.append(row)
    return rows


def to_json(
    results: list[Result],
    env: dict[str, str],
    started: datetime,
    seconds: float,
    command: str,
    gpu_problem: str | None,
    planned: int | None = None,
) -> str:
    """The run as a JSON document (see the module's doc); ``planned`` > len(results) marks it incomplete."""
    doc = {
        "schema": SCHEMA,
        "started": started.isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "command": command,
        "complete": planned is None or planned <= len(results),
        "gpu": gpu_problem is None,
        "gpu_problem": gpu_problem,
        "environment": env,
        "counts": {s: sum(r.status == s for r in results) for s in (PASSED, FAILED, SKIPPED)},
        "targets": target_rows(results),
        "checks": [_check(r) for r in results],
    }
    return json.dumps(doc, indent=2, default=str) + "\n"


def _check(r: Result) -> dict[str, Any]:
    d = dataclasses.asdict(r)
    d["seconds"] = round(r.seconds, 2)
    d["tables"] = [{"columns": list(t.columns), "rows": [list(row) for row in t.rows]} for t in r.tables]
    return d
