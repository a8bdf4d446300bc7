"""Test suites run in subprocesses: cupool's GPU tests, its conformance suites, and Numba's own tests.

Each suite runs under ``python -m pytest`` in a child process (a crash in CUDA
code then costs one check, not the run) and is read back from a JUnit XML file
rather than from pytest's console output, whose wording changes between
versions.  Suites run one after another: conformance tests compare the device's
free memory before and after, which another process allocating at the same time
would upset.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import cupool

from .records import FAILED, PASSED, Context, Result, Table, skipped

#: Numba's test modules that exercise memory: the EMM plugin interface, device
#: memory and its deallocation, device arrays, pinned and mapped host memory, IPC.
NUMBA_MODULES = (
    "numba.cuda.tests.cudadrv.test_emm_plugins",
    "numba.cuda.tests.cudadrv.test_cuda_memory",
    "numba.cuda.tests.cudadrv.test_deallocations",
    "numba.cuda.tests.cudadrv.test_cuda_ndarray",
    "numba.cuda.tests.cudadrv.test_array_attr",
    "numba.cuda.tests.cudadrv.test_cuda_array_slicing",
    "numba.cuda.tests.cudadrv.test_host_alloc",
    "numba.cuda.tests.cudadrv.test_pinned",
    "numba.cuda.tests.cudadrv.test_reset_device",
    "numba.cuda.tests.cudapy.test_array",
    "numba.cuda.tests.cudapy.test_array_methods",
    "numba.cuda.tests.cudapy.test_cuda_array_interface",
    "numba.cuda.tests.cudapy.test_ipc",
)

NUMBA_ENV = "NUMBA_CUDA_MEMORY_MANAGER"

#: A skip reason that says the test wants a GPU ("needs a CUDA GPU", "no GPU", ...): wrong on a GPU machine.
_WANTS_GPU = re.compile(r"\b(no|needs?|without|requires?)\b[^.;]*\b(GPU|CUDA)\b", re.IGNORECASE)

_OUTCOMES = ("passed", "failed", "errors", "skipped")
_CHILD = {"failure": "failed", "error": "errors", "skipped": "skipped"}
_RANK = {"passed": 0, "skipped": 1, "failed": 2, "errors": 3}


@dataclass
class SuiteRun:
    """One pytest process: its outcome per test id (``module::class::test``), and what it printed last."""

    command: str
    returncode: int | None  # None: killed at the time limit
    outcomes: dict[str, str] = field(default_factory=dict)
    tail: str = ""
    seconds: float = 0.0
    skip_reasons: dict[str, str] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        c = Counter(self.outcomes.values())
        return {k: c.get(k, 0) for k in _OUTCOMES}

    def ids(self, *outcomes: str) -> list[str]:
        return sorted(t for t, o in self.outcomes.items() if o in outcomes)

    def describe(self) -> str:
        c = self.counts
        text = ", ".join(f"{c[k]} {k}" for k in _OUTCOMES)
        if self.returncode is None:
            text += " (killed at the time limit)"
        return text


def read_junit(path: Path) -> dict[str, str]:
    """Each test case's outcome (passed, failed, errors, skipped) from pytest's xunit1 JUnit XML.

    Test ids are ``module::class::test`` with the module named by its folder and
    file (``cudadrv.test_emm_plugins``): with ``--pyargs`` pytest leaves the
    module out of the class name.  A case reported twice (a teardown error)
    keeps its worse outcome.
    """
    out: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = _case_id(case)
        outcome = max((_CHILD.get(child.tag, "passed") for child in case), key=_RANK.__getitem__, default="passed")
        if _RANK[outcome] >= _RANK[out.get(test_id, "passed")]:
            out[test_id] = outcome
    return out


def _case_id(case: ET.Element) -> str:
    file = Path(case.get("file") or "")
    module = ".".join(file.with_suffix("").parts[-2:]) if file.name else ""
    # The class name starts with the module's dotted path, or (--pyargs) with a bare ".".
    parts = case.get("classname", "").split(".")
    if file.stem in parts:
        parts = parts[len(parts) - parts[::-1].index(file.stem):]
    return "::".join(p for p in (module, ".".join(filter(None, parts)), case.get("name", "")) if p)


def read_skip_reasons(path: Path) -> dict[str, str]:
    """Each skipped test case's reason, by the test ids ``read_junit`` gives."""
    reasons: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        skip = case.find("skipped")
        if skip is not None:
            reasons[_case_id(case)] = skip.get("message", "")
    return reasons


def run_pytest(args: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> SuiteRun:
    """Run ``python -m pytest -q ARGS`` in ``cwd`` and read back every test's outcome."""
    changed = {k: v for k, v in (env or {}).items() if os.environ.get(k) != v}
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in changed.items())
    command = prefix + shlex.join(["python", "-m", "pytest", "-q", *args])
    with tempfile.TemporaryDirectory(prefix="cupool-validate-") as tmp:
        xml = Path(tmp) / "junit.xml"
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
                f"--junitxml={xml}", *args]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
            returncode: int | None = proc.returncode
            output = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            returncode = None
            output = _text(e.stdout) + _text(e.stderr)
        seconds = time.perf_counter() - t0
        outcomes = read_junit(xml) if xml.exists() else {}
        reasons = read_skip_reasons(xml) if xml.exists() else {}
    tail = "\n".join(output.rstrip().splitlines()[-15:])
    return SuiteRun(command, returncode, outcomes, tail, seconds, reasons)


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def suite_result(run: SuiteRun) -> Result:
    """On a GPU machine no test may skip for want of a GPU: such a skip means a GPU condition is wrong.

    A test that skips for another reason (a check that means something only on the
    sim device, say) is listed, and does not fail the check.
    """
    c = run.counts
    bad = run.ids("failed", "errors")
    problems = []
    if run.returncode is None:
        problems.append("the run was killed at its time limit")
    elif not run.outcomes:
        problems.append(f"no test ran (pytest exited with {run.returncode})")
    elif run.returncode != 0 and not bad:
        problems.append(f"pytest exited with {run.returncode}")
    if bad:
        problems.append("failing: " + ", ".join(bad[:20]) + (f" and {len(bad) - 20} more" if len(bad) > 20 else ""))
    skips = run.ids("skipped")
    wrong = [t for t in skips if _WANTS_GPU.search(run.skip_reasons.get(t, "")) or t not in run.skip_reasons]
    if wrong:
        problems.append("skipped for want of a GPU on a GPU machine: " + ", ".join(wrong[:20]))
    details = "; ".join(problems)
    if problems:
        details += f"\n\nLast lines of its output:\n\n```\n{run.tail}\n```"
    elsewhere = [f"{t} ({run.skip_reasons[t]})" for t in skips if t not in wrong]
    if elsewhere:
        details += ("\n\n" if details else "") + "skipped where they do not apply: " + "; ".join(elsewhere[:20])
    return Result(
        FAILED if problems else PASSED,
        summary=run.describe(),
        details=details,
        commands=[run.command],
        figures={k: c[k] for k in _OUTCOMES} | {"seconds": round(run.seconds, 1)},
    )


def find_tests(given: Path | None = None) -> Path | None:
    """The test suite's folder: ``given``, else the ``tests`` beside a source checkout of cupool."""
    if given is not None:
        return given if (given / "conftest.py").exists() else None
    here = Path(cupool.__file__).resolve().parent.parent / "tests"
    return here if (here / "conformance" / "test_device_conformance.py").exists() else None


def no_tests() -> Result:
    return skipped(
        "the test suite is not available: cupool was installed without its tests "
        "(run from a source checkout, or pass --tests PATH)"
    )


def gpu_tests(ctx: Context) -> Result:
    """Every test of the suite that needs a GPU (see ``cupool.validate.gpu_only``); on a GPU none may skip."""
    if ctx.tests is None:
        return no_tests()
    # The conformance suites run whole in their own check.
    args = ["-p", "cupool.validate.gpu_only", f"--ignore={ctx.tests.name}/conformance", ctx.tests.name]
    run = run_pytest(args, ctx.tests.parent, ctx.timeout)
    return suite_result(run)


def conformance(ctx: Context) -> Result:
    """The device and placement conformance suites; on a GPU their cuda parameters run like sim's."""
    if ctx.tests is None:
        return no_tests()
    folder = ctx.tests / "conformance"
    run = run_pytest([str(folder.relative_to(ctx.tests.parent))], ctx.tests.parent, ctx.timeout)
    return suite_result(run)


def available_modules(names: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """``names`` split into the modules this Numba ships and those it does not (found without importing them)."""
    found: list[str] = []
    missing: list[str] = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        (found if spec is not None else missing).append(name)
    return found, missing


def compare_numba(cupool_run: SuiteRun, default_run: SuiteRun) -> Result:
    """Pass counts side by side; a failure is a test that fails under cupool but not under Numba's own manager."""
    modules = sorted({t.split("::")[0] for t in (*cupool_run.outcomes, *default_run.outcomes)})
    table = Table(("module", "cupool.numba passed / failed / skipped", "Numba's default passed / failed / skipped"))

    def cell(run: SuiteRun, module: str) -> str:
        c = Counter(o for t, o in run.outcomes.items() if t.split("::")[0] == module)
        return f"{c['passed']} / {c['failed'] + c['errors']} / {c['skipped']}"

    for module in modules:
        table.rows.append((module, cell(cupool_run, module), cell(default_run, module)))
    worse = sorted(
        t for t in cupool_run.ids("failed", "errors") if default_run.outcomes.get(t) not in ("failed", "errors")
    )
    problems = []
    for label, run in (("with cupool.numba", cupool_run), ("with Numba's default", default_run)):
        if run.returncode is None:
            problems.append(f"the run {label} was killed at its time limit")
        elif not run.outcomes:
            problems.append(f"no test ran {label} (pytest exited with {run.returncode})\n\n```\n{run.tail}\n```")
    if default_run.outcomes and not default_run.counts["passed"]:
        problems.append(
            "no test passed even under Numba's own manager: Numba cannot run CUDA code here"
            f"\n\nLast lines of its output:\n\n```\n{default_run.tail}\n```"
        )
    if worse:
        problems.append("fail only under cupool.numba: " + ", ".join(worse[:30]))
    c, d = cupool_run.counts, default_run.counts
    return Result(
        FAILED if problems else PASSED,
        summary=f"cupool.numba: {cupool_run.describe()}; Numba's default: {default_run.describe()}",
        details="; ".join(problems),
        commands=[cupool_run.command, default_run.command],
        figures={f"{who} {k}": n[k] for who, n in (("cupool.numba", c), ("default", d)) for k in _OUTCOMES},
        tables=[table],
    )


def numba_tests(ctx: Context) -> Result:
    """Numba's memory tests under ``NUMBA_CUDA_MEMORY_MANAGER=cupool.numba`` and under its own manager."""
    found, missing = available_modules(NUMBA_MODULES)
    if not found:
        return skipped("this Numba ships none of its CUDA memory test modules (numba.cuda.tests)")
    base = {k: v for k, v in os.environ.items() if k != NUMBA_ENV}
    # The child runs away from any checkout, so it must find this cupool the way this process did.
    here = str(Path(cupool.__file__).resolve().parent.parent)
    base["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    if importlib.util.find_spec("filecheck") is None:
        return Result(
            FAILED,
            summary="Numba's CUDA tests cannot import here: they need the filecheck package",
            details="numba.cuda.testing imports filecheck, which this environment lacks: pip install filecheck",
        )
    # importlib: Numba's tests live in numba_cuda/numba/cuda, whose numba/ has no __init__.py, so the
    # default import mode names them cuda.tests.* and finds NVIDIA's cuda namespace package instead.
    args = ["-p", "cupool.validate.numba_shim", "--import-mode=importlib", "--pyargs", *found]
    with tempfile.TemporaryDirectory(prefix="cupool-numba-") as cwd:  # away from any project's pytest settings
        ours = run_pytest(args, Path(cwd), ctx.timeout, base | {NUMBA_ENV: "cupool.numba"})
        theirs = run_pytest(args, Path(cwd), ctx.timeout, base)
    result = compare_numba(ours, theirs)
    if missing:
        note = "not in this Numba, so not run: " + ", ".join(missing)
        result.details = f"{result.details}\n\n{note}" if result.details else note
    return result
