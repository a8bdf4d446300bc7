"""Numba on cupool beside Numba's own memory manager, on a GPU: ``device_array`` + drop, ``memalloc`` + drop.

A memory manager is chosen when Numba makes its context, so each variant runs in
its own interpreter (``NUMBA_CUDA_MEMORY_MANAGER=cupool.numba``, or unset for
Numba's default), the two alternating round after round so that drift hits both
alike; medians of the rounds are compared.  Time is the CPU time of the calling
thread, as ``benchmarks/bench_numba.py`` measures the plugin's cost over the
pool's own ``malloc_key`` on the sim device.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from .records import FAILED, PASSED, Context, Result, Table
from .suites import NUMBA_ENV

#: In the other interpreter: seconds of CPU per call of each loop, and which manager ran.
_MEASURE = r"""
import json, sys, time
import numpy as np
from numba import cuda
number = int(sys.argv[1])
ctx = cuda.current_context()
def cpu(loop):
    loop(number // 10)  # warm: the first segments, Numba's caches
    t0 = time.thread_time()
    loop(number)
    return (time.thread_time() - t0) / number
def arrays(n):
    for _ in range(n):
        cuda.device_array(256, np.float32)
def mallocs(n):
    for _ in range(n):
        ctx.memalloc(1024)
manager = type(getattr(ctx, "memory_manager", None)).__name__
print(json.dumps({"device_array": cpu(arrays), "memalloc": cpu(mallocs), "manager": manager}))
"""

_FIGURES = {"device_array": "device_array(256, float32) + drop", "memalloc": "ctx.memalloc(1024) + drop"}


def numba_hooks(ctx: Context) -> Result:
    """``cuda.device_array`` and ``memalloc`` + drop under cupool.numba and under Numba's default manager."""
    number, rounds = (2000, 3) if ctx.quick else (20_000, 9)
    variants = {"Numba's default": None, "cupool.numba": "cupool.numba"}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    managers: dict[str, str] = {}
    for _ in range(rounds):
        for name, manager in variants.items():
            env = {k: v for k, v in os.environ.items() if k != NUMBA_ENV}
            if manager is not None:
                env[NUMBA_ENV] = manager
            proc = subprocess.run([sys.executable, "-c", _MEASURE, str(number)], env=env, capture_output=True,
                                  text=True, timeout=ctx.timeout, check=False)
            if proc.returncode:
                return Result(FAILED, summary=f"the {name} run failed (exit {proc.returncode})",
                              details=proc.stderr[-3000:])
            out = json.loads(proc.stdout.splitlines()[-1])
            managers[name] = out.pop("manager")
            samples[name].append(out)
    med = {name: {k: statistics.median(s[k] for s in ss) for k in _FIGURES} for name, ss in samples.items()}
    ours, theirs = med["cupool.numba"], med["Numba's default"]
    table = Table(("loop", "Numba's default (us)", "cupool.numba (us)", "cupool / default"))
    figures: dict[str, float] = {}
    for key, label in _FIGURES.items():
        ratio = ours[key] / theirs[key]
        table.rows.append((label, f"{theirs[key] * 1e6:.2f}", f"{ours[key] * 1e6:.2f}", f"{ratio:.2f}x"))
        figures |= {f"default {key} (us)": theirs[key] * 1e6, f"cupool.numba {key} (us)": ours[key] * 1e6,
                    f"cupool.numba / default {key} (x)": ours[key] / theirs[key]}
    summary = ", ".join(f"{key} {ours[key] / theirs[key]:.2f}x Numba's default" for key in _FIGURES)
    return Result(
        PASSED,
        summary=summary,
        details=f"medians of {rounds} alternating interpreters of {number:,} calls each; managers: {managers}",
        commands=["python -m cupool.validate --only numba-hooks"],
        figures=figures,
        tables=[table],
    )
