"""The checks for what the first GPU run left pending (docs/gpu-validation.md, "Pending"; issue 18).

* ``expandable``: the expandable-segment tests that need a GPU (the smoke test, the
  state machine on ``CudaVirtualMemory``, the driver's real aliasing), in a child pytest;
* ``vmm-latency``: ``benchmarks/bench_vmm.py --json`` on the device: the driver's
  create/map/set_access/unmap/release and a pool's grow and unmap, beside
  ``cudaMalloc``/``cudaFree`` of the same bytes;
* ``torch-summary``: PyTorch's own ``torch.cuda.memory.memory_summary`` reading a
  pool's ``stats()`` (where torch is importable), against ``cupool.memory_summary``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from typing import Any

from ..observe.summary import memory_summary
from ..pool import Pool
from .records import FAILED, PASSED, Context, Result, Table, skipped
from .suites import no_tests, run_pytest, suite_result

MiB = 1 << 20
#: The test files whose GPU tests ``expandable`` runs.
EXPANDABLE_TESTS = ("test_expandable.py", "test_vmm.py")


def has_bindings() -> bool:
    """Whether ``cuda.bindings`` (the ``vmm`` extra) is importable, without importing it."""
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ImportError:  # no ``cuda`` package at all
        return False


def expandable(ctx: Context) -> Result:
    """Expandable segments on the GPU: the suite's GPU tests of virtual memory; none may skip for want of a GPU."""
    if ctx.tests is None:
        return no_tests()
    if not has_bindings():
        return skipped("CUDA virtual memory needs NVIDIA's driver bindings: pip install 'cuda-bindings>=12' (or '.[vmm]' in cupool's checkout)")
    files = [f"{ctx.tests.name}/{f}" for f in EXPANDABLE_TESTS]
    return suite_result(run_pytest(["-m", "gpu", *files], ctx.tests.parent, ctx.timeout))


def vmm_latency(ctx: Context) -> Result:
    """``bench_vmm.py --json`` on the device: map/unmap latency beside cudaMalloc/cudaFree."""
    if ctx.tests is None:
        return no_tests()
    script = ctx.tests.parent / "benchmarks" / "bench_vmm.py"
    if not script.exists():
        return skipped(f"the benchmarks are not available ({script} is missing)")
    if not ctx.rehearsal and not has_bindings():
        return skipped("CUDA virtual memory needs NVIDIA's driver bindings: pip install 'cuda-bindings>=12' (or '.[vmm]' in cupool's checkout)")
    granules, repeats = (["1", "4"], "3") if ctx.quick else (["1", "8", "64"], "20")
    argv = [sys.executable, str(script), "--device", ctx.device, "--granules", *granules, "--repeats", repeats,
            "--json"]
    command = f"python benchmarks/bench_vmm.py --device {ctx.device} --granules {' '.join(granules)} --repeats {repeats}"
    proc = subprocess.run(argv, cwd=ctx.tests.parent, capture_output=True, text=True, timeout=ctx.timeout,
                          check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).rstrip().splitlines()[-15:])
        return Result(FAILED, summary=f"bench_vmm.py exited with {proc.returncode}",
                      details=f"```\n{tail}\n```", commands=[command])
    return vmm_result(json.loads(proc.stdout.strip().splitlines()[-1]), command)


def vmm_result(data: dict[str, Any], command: str) -> Result:
    """``bench_vmm.py --json``'s object as a result: microseconds per step, and map+unmap against malloc+free."""
    table = Table(("granules", "create", "map", "set_access", "unmap", "release", "pool grow", "pool unmap",
                   "malloc", "free", "(map+unmap) / (malloc+free)"))
    figures: dict[str, float] = {}
    for row in data["rows"]:
        n = row["granules"]
        ratio = (row["map"] + row["unmap"]) / (row["malloc"] + row["free"])
        table.rows.append((n, *(f"{row[c] * 1e6:.1f} us" for c in table.columns[1:-1]), f"{ratio:.2f}x"))
        for c in table.columns[1:-1]:
            figures[f"{c}, {n} granule(s) (us)"] = row[c] * 1e6
        figures[f"(map+unmap)/(malloc+free), {n} granule(s) (x)"] = ratio
    first = data["rows"][0]
    summary = (f"{first['granules']} granule: map {first['map'] * 1e6:.1f} us + unmap {first['unmap'] * 1e6:.1f} us, "
               f"malloc {first['malloc'] * 1e6:.1f} us + free {first['free'] * 1e6:.1f} us")
    return Result(PASSED, summary=summary, details=f"{data['vm']}; medians of {data['repeats']}",
                  commands=[command], figures=figures, tables=[table])


def torch_summary(ctx: Context) -> Result:
    """``torch.cuda.memory.memory_summary`` over ``pool.stats()``: PyTorch's own table from cupool's figures."""
    try:  # by name: torch is no dependency of cupool's, not even for the type checker
        torch_memory = importlib.import_module("torch.cuda.memory")
    except ImportError as e:
        return skipped(f"torch is not importable here ({e}): the check compares with PyTorch's own memory_summary")
    pool = Pool(ctx.device, capacity=64 * MiB) if ctx.rehearsal else Pool(ctx.device, max_size=64 * MiB)
    held = [pool.malloc(n) for n in (1000, 1 << 20, 3 << 20, 512)]
    held.pop(1).free()
    theirs = summary_through_torch(torch_memory, pool)
    ours = memory_summary(pool).splitlines()
    start = [i for i, line in enumerate(theirs) if "Metric" in line]
    body = theirs[start[0]:] if start else []
    same = bool(body) and body == ours[len(ours) - len(body):]
    del held
    pool.close()
    return Result(
        PASSED if same else FAILED,
        summary=("torch's memory_summary reads pool.stats(): its table equals cupool.memory_summary's" if same
                 else "torch's memory_summary over pool.stats() differs from cupool.memory_summary"),
        details="" if same else "torch's:\n\n```\n" + "\n".join(theirs) + "\n```\n\ncupool's:\n\n```\n"
        + "\n".join(ours) + "\n```",
        commands=["python -m cupool.validate --only torch-summary"],
    )


def summary_through_torch(torch_memory: Any, pool: Pool) -> list[str]:
    """``torch_memory.memory_summary(device=0)`` with its ``memory_stats`` answering ``pool.stats()``."""
    original = torch_memory.memory_stats
    torch_memory.memory_stats = lambda device=None: pool.stats()
    try:
        text: str = torch_memory.memory_summary(device=0)
    finally:
        torch_memory.memory_stats = original
    return text.splitlines()
