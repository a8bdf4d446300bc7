"""The suites that define cupool's behaviour, run on the other fast path too.

The main test run takes whichever path this install runs (``cupool.core.build_info()``):
compiled after ``pip install -e ".[test,cuda12]"`` on a machine with a C compiler.
This module runs the conformance suites, the state machines and the CuPy hook a
second time (CuPy's memory is cupool's compiled ``PoolMemory`` where the fast path
is compiled, ``UnownedMemory`` where it is not), in a fresh interpreter, on the other path: uncompiled (``CUPOOL_PURE_PYTHON=1``) when the
main run is compiled, compiled (``CUPOOL_PURE_PYTHON=0``) when the main run was
forced uncompiled.  So the README's one test command proves both, and only these
suites (about a minute), not the whole suite, run twice.

Where the compiled path cannot run the test says why and skips: no C compiler, or
a build older than its source.  Where it cannot run because the source does not
compile or the built module does not import, that is a defect, and the test fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cupool.core import PURE_ENV, build_info

ROOT = Path(__file__).resolve().parent.parent

#: The conformance suites and the state machines: what the two paths must agree on.
SUITES = (
    "tests/conformance",
    "tests/test_pool_machine.py",
    "tests/test_hooks_machine.py",
    "tests/test_expandable.py::TestExpandableMachine",
    "tests/test_testing.py",
    "tests/test_fold.py",  # the log's two folds: fold_log compiled, numpy uncompiled
    "tests/test_lifetimes.py",  # finalizers, re-entrancy and interrupts through the fast path
    "tests/test_cold_stacks.py",  # which parked blocks a new size sees: C stacks compiled, DictParking not
    "tests/test_reads_park_nothing.py",  # reads leave the stacks alone, on both kinds of stacks
    "tests/test_cupy_hook.py",  # CuPy on cupool: PoolMemory compiled, UnownedMemory uncompiled
    "tests/test_cupy_memory.py",  # the memory object itself, and its fallback
)

#: Reasons the compiled path does not run that are defects, not circumstances.
_DEFECTS = ("Cython could not compile", "the C compiler failed on this module", "does not import")

#: In the other interpreter: say which path runs, and if it is the one asked for, run the suites on it.
_RERUN = r"""
import json, sys
import pytest
import cupool.core
info = cupool.core.build_info()
print(json.dumps(info), flush=True)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[2:]]) if info["fast_path"] == sys.argv[1] else 0)
"""


def _compiled_does_not_run(reason: str) -> None:
    if any(d in reason for d in _DEFECTS):
        pytest.fail(f"the compiled fast path does not run, and it should: {reason}")
    pytest.skip(f"the compiled fast path cannot run here, so the suites ran uncompiled only: {reason}")


def test_the_conformance_suites_and_state_machines_pass_on_the_other_path():
    here = build_info()
    if here["fast_path"] == "pure" and f"{PURE_ENV}=" not in here["reason"]:
        _compiled_does_not_run(here["reason"])
    other = "pure" if here["fast_path"] == "compiled" else "compiled"
    env = {**os.environ, PURE_ENV: "1" if other == "pure" else "0"}
    r = subprocess.run([sys.executable, "-c", _RERUN, other, *SUITES], cwd=ROOT, env=env,
                       check=False, capture_output=True, text=True, timeout=900)
    ran = json.loads(r.stdout.splitlines()[0]) if r.stdout.startswith("{") else None
    assert ran is not None, r.stdout[-3000:] + r.stderr[-3000:]
    if ran["fast_path"] != other:
        _compiled_does_not_run(ran["reason"])
    assert r.returncode == 0, f"the suites fail on the {other} path:\n{r.stdout[-6000:]}{r.stderr[-2000:]}"
