"""The markdown report: the environment, an overview, and one section per check.

Its headings start at level 2, so the whole report pastes under the title of
docs/gpu-validation.md as one dated section.
"""

from __future__ import annotations

import platform
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import cupool

from .._units import format_bytes
from .records import FAILED, PASSED, SKIPPED, Result, Table

#: Distributions whose versions the report names, under the name a reader knows them by.
_DISTRIBUTIONS = (
    ("cupy", ("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy")),
    ("numba", ("numba",)),
    ("numba-cuda", ("numba-cuda",)),
    ("cuda-bindings", ("cuda-bindings", "cuda-python")),
    ("h5py", ("h5py",)),
    ("numpy", ("numpy",)),
    ("rmm", ("rmm-cu12", "rmm-cu13", "rmm")),
)

_MARK = {PASSED: "passed", FAILED: "**FAILED**", SKIPPED: "skipped"}


def default_report_path(day: datetime) -> Path:
    return Path(f"gpu-validation-{day:%Y-%m-%d}.md")


def probe_gpu() -> str | None:
    """None when a CUDA GPU is usable through CuPy; otherwise why not, in words for the report."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no CuPy, no driver, no device: each is an answer
        return f"no usable CUDA GPU ({type(e).__name__}: {str(e).strip() or 'no detail'})"
    return None if count > 0 else "no usable CUDA GPU (the CUDA runtime sees 0 devices)"


def environment(gpu_problem: str | None) -> dict[str, str]:
    """Versions, and the device when there is one: what a reader needs to trust or compare the figures."""
    env = {"python": platform.python_version(), "cupool": cupool.__version__}
    for label, dists in _DISTRIBUTIONS:
        for dist in dists:
            try:
                env[label] = f"{version(dist)} ({dist})" if dist != label else version(dist)
                break
            except PackageNotFoundError:
                continue
        else:
            env[label] = "not installed"
    if gpu_problem is not None:
        env["device"] = gpu_problem
        return env
    try:
        env |= _device()
    except Exception as e:  # noqa: BLE001 - the report must still be written
        env["device"] = f"a GPU, whose properties could not be read ({type(e).__name__}: {e})"
    return env


def _device() -> dict[str, str]:
    import cupy

    env: dict[str, str] = {}
    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    free, total = rt.memGetInfo()
    name = props["name"]
    env["device"] = name.decode() if isinstance(name, bytes) else str(name)
    env["device memory"] = f"{format_bytes(total)} ({format_bytes(free)} free at the start)"
    env["compute capability"] = f"{props['major']}.{props['minor']}, {props['multiProcessorCount']} SMs"
    env["CUDA driver / runtime"] = f"{_cuda_version(rt.driverGetVersion())} / {_cuda_version(rt.runtimeGetVersion())}"
    env["devices visible"] = str(rt.getDeviceCount())
    return env


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _number(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or float(v).is_integer() and abs(v) >= 1000:
        return f"{int(v):,}"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) >= 0.001 or v == 0 else f"{v:.2e}"


def _table(table: Table) -> list[str]:
    lines = ["| " + " | ".join(table.columns) + " |", "|" + " --- |" * len(table.columns)]
    lines += ["| " + " | ".join(_number(c) for c in row) + " |" for row in table.rows]
    return lines


def _overview(results: list[Result]) -> list[str]:
    counts = {s: sum(r.status == s for r in results) for s in (PASSED, FAILED, SKIPPED)}
    table = Table(("check", "status", "result", "seconds"))
    table.rows = [(r.title or r.name, _MARK[r.status], r.summary.replace("|", "/"), round(r.seconds, 1))
                  for r in results]
    return [f"{counts[PASSED]} passed, {counts[FAILED]} failed, {counts[SKIPPED]} skipped.", "", *_table(table)]


def render(
    results: list[Result],
    env: dict[str, str],
    started: datetime,
    seconds: float,
    command: str,
    gpu_problem: str | None,
    planned: int | None = None,
) -> str:
    """The report as markdown.  ``planned`` > len(results) marks a report written while checks still run."""
    device = env.get("device", "?")
    lines = [f"## GPU validation, {started:%Y-%m-%d} ({device if gpu_problem is None else 'no GPU'})", ""]
    lines.append(f"`{command}`, started {started:%Y-%m-%d %H:%M}, ran for {seconds:.0f} s.")
    if planned is not None and planned > len(results):
        lines.append(f"**Incomplete:** {len(results)} of {planned} checks had run when this was written.")
    if gpu_problem is not None:
        lines += ["", f"**Not run on a GPU:** {gpu_problem}. Every check that needs one is marked skipped."]
    lines += ["", "### Environment", "", *_table(Table(("component", "version or value"), list(env.items()))), ""]
    lines += ["### Overview", "", *_overview(results)]
    for r in results:
        if r.status == SKIPPED:  # the overview gives the reason
            continue
        lines += ["", f"### {r.title or r.name}: {_MARK[r.status]}", ""]
        if r.commands:
            lines += ["```bash", *r.commands, "```", ""]
        if r.details:
            lines += [r.details, ""]
        for t in r.tables:
            lines += [*_table(t), ""]
        if r.figures and not r.tables:  # a check with tables shows its figures there
            lines += [*_table(Table(("figure", "value"), list(r.figures.items()))), ""]
        while lines and not lines[-1]:
            lines.pop()
    return "\n".join(lines) + "\n"
