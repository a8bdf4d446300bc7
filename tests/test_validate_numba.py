"""The validation's Numba row (``numba-hooks``), driven here by a stand-in for its GPU interpreters."""

from __future__ import annotations

import json
import subprocess

from cupool.validate import numba_bench
from cupool.validate.records import FAILED, PASSED, Context
from cupool.validate.suites import NUMBA_ENV


def test_each_manager_runs_in_its_own_interpreter_alternating_and_the_ratios_are_of_medians(monkeypatch, tmp_path):
    runs = []
    per_call = {None: (4e-6, 20e-6), "cupool.numba": (3e-6, 2e-6)}  # (device_array, memalloc) seconds

    def fake_run(argv, env, **kwargs):
        manager = env.get(NUMBA_ENV)
        runs.append(manager)
        arrays, mallocs = per_call[manager]
        jitter = 1 + 0.1 * (len(runs) % 3)  # medians, not means, are compared
        out = {"device_array": arrays * jitter, "memalloc": mallocs * jitter,
               "manager": "CupoolMemoryManager" if manager else "NumbaCUDAMemoryManager"}
        return subprocess.CompletedProcess(argv, 0, stdout=json.dumps(out) + "\n", stderr="")

    monkeypatch.setenv(NUMBA_ENV, "something.else")  # the default's run must not inherit it
    monkeypatch.setattr(numba_bench.subprocess, "run", fake_run)
    r = numba_bench.numba_hooks(Context(workdir=tmp_path, quick=True))
    assert r.status == PASSED
    assert runs == [None, "cupool.numba"] * 3
    assert abs(r.figures["cupool.numba / default device_array (x)"] - 0.75) < 1e-9
    assert abs(r.figures["cupool.numba / default memalloc (x)"] - 0.1) < 1e-9
    assert [row[-1] for row in r.tables[0].rows] == ["0.75x", "0.10x"]
    assert "CupoolMemoryManager" in r.details


def test_a_failed_interpreter_fails_the_check_and_says_why(monkeypatch, tmp_path):
    def fake_run(argv, env, **kwargs):
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="CudaSupportError: no driver")

    monkeypatch.setattr(numba_bench.subprocess, "run", fake_run)
    r = numba_bench.numba_hooks(Context(workdir=tmp_path, quick=True))
    assert r.status == FAILED and "no driver" in r.details and "Numba's default" in r.summary
