"""``python -m cupool.validate``: every check in one run, and a dated markdown report with a JSON twin.

GPU minutes are scarce, so the run never stops at the first problem: a check
that raises is recorded as failed with its traceback and the next one runs, and
the report is rewritten after every check, so a run killed at its time limit
still leaves what it found.  The test suites run first, one subprocess at a
time; the benchmarks run later in this process, with nothing else on the GPU.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ..device.kinds import KINDS, auto_kind, one_of
from . import bench, extras, memory, moves, numba_bench, suites, torch_checks, upstreams, workload
from .records import FAILED, Context, Result, skipped
from .report import default_report_path, environment, probe_gpu, render
from .results import to_json


@dataclass(frozen=True)
class Check:
    name: str
    title: str
    run: Callable[[Context], Result]
    #: Whether it means something on the sim device too (``--device sim`` runs it there).
    on_sim: bool = False


CHECKS = (
    Check("gpu-tests", "The test suite's GPU tests", suites.gpu_tests),
    Check("conformance", "Conformance suites, cuda parameters included", suites.conformance),
    Check("numba-tests", "Numba's EMM and device-array tests: cupool.numba beside Numba's default", suites.numba_tests),
    Check("expandable", "Expandable segments on the GPU: smoke test, state machine, driver aliasing", extras.expandable),
    Check(
        "cupy-workload", "CuPy workload, bit for bit against CuPy's pool, per hook path", workload.cupy_workload_check
    ),
    Check("move-kernel", "Move kernel against memmove", memory.move_kernel, on_sim=True),
    Check(
        "compaction-bandwidth", "Compaction bandwidth against a plain copy", memory.compaction_bandwidth, on_sim=True
    ),
    Check("compaction-moves", "Compaction's moves at the issue's sizes against a plain copy", moves.compaction_moves,
          on_sim=True),
    Check("vmm-latency", "bench_vmm.py: map/unmap latency beside cudaMalloc/cudaFree", extras.vmm_latency, on_sim=True),
    Check("torch-summary", "PyTorch's own memory_summary over pool.stats()", extras.torch_summary, on_sim=True),
    Check("malloc-free", "malloc + free among 1k and 100k live blocks, beside CuPy's MemoryPool", bench.malloc_free),
    Check("hook-paths", "cp.empty + drop through each CuPy hook path, beside CuPy's pool and RMM", bench.hook_paths),
    Check("numba-hooks", "device_array and memalloc + drop: cupool.numba beside Numba's default manager",
          numba_bench.numba_hooks),
    Check("pinned", "Pinned memory (PinnedPool)", memory.pinned, on_sim=True),
    Check("spill", "Spilling to host and to HDF5", memory.spill, on_sim=True),
    Check("trace", "A trace recorded here, replayed on the sim device", memory.trace, on_sim=True),
    Check("torch-cupy-shared", "A torch training loop and CuPy on one cupool pool, bit for bit against their own "
          "allocators", torch_checks.torch_cupy_shared),
    Check("torch-alloc-timing", "torch.empty + drop: cupool beside PyTorch's caching allocator and RMM's",
          torch_checks.torch_alloc_timing),
    Check("async-release", "The async upstream grows and trims without a device synchronization",
          upstreams.async_release, on_sim=True),
    Check("managed-streaming", "The managed upstream on a streaming working set below the free memory, with and "
          "without prefetch", upstreams.managed_streaming, on_sim=True),
)


def run_checks(
    ctx: Context,
    checks: Sequence[Check],
    gpu_problem: str | None,
    done: Callable[[Result], None] = lambda r: None,
) -> list[Result]:
    """Run ``checks`` in order (skipping, with the reason, what cannot run here); ``done`` hears of each result."""
    results = []
    for check in checks:
        t0 = time.perf_counter()
        if ctx.rehearsal and not check.on_sim:
            result = skipped(f"needs a GPU (this run is a rehearsal on the {ctx.device} device)")
        elif not ctx.rehearsal and gpu_problem is not None:
            result = skipped("no usable CUDA GPU")
        else:
            try:
                result = check.run(ctx)
            except Exception as e:  # noqa: BLE001 - one broken check must not cost the others their GPU time
                tb = "".join(traceback.format_exception(e)[-12:])
                result = Result(FAILED, summary=f"raised {type(e).__name__}: {e}"[:200], details=f"```\n{tb}```")
        result = result.named(check.name, check.title, time.perf_counter() - t0)
        results.append(result)
        done(result)
    return results


def _select(only: str | None, skip: str | None) -> list[Check]:
    names = {c.name for c in CHECKS}
    chosen = set(names)
    for flag, value in (("--only", only), ("--skip", skip)):
        if value is None:
            continue
        given = {v.strip() for v in value.split(",") if v.strip()}
        unknown = given - names
        if unknown:
            raise ValueError(
                f"{flag}: unknown check(s) {', '.join(sorted(unknown))}; "
                f"the checks are {', '.join(c.name for c in CHECKS)}"
            )
        chosen = chosen & given if flag == "--only" else chosen - given
    return [c for c in CHECKS if c.name in chosen]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cupool.validate",
        description="Run cupool's GPU checks in one go and write a dated markdown report (stdout and --out) "
        "and the same results as JSON beside it (--out's name with .json).",
        epilog="checks: " + ", ".join(c.name for c in CHECKS),
    )
    p.add_argument("--out", type=Path, default=None, help="report file (default: gpu-validation-YYYY-MM-DD.md here)")
    gpu, rehearse = (one_of((k.name for k in KINDS.values() if k.needs_gpu == g), quoted=False) for g in (True, False))
    p.add_argument("--device", choices=tuple(KINDS), default=auto_kind(True).name,
                   help=f"{gpu}: the GPU checks; {rehearse}: a rehearsal of the checks that mean something without a "
                        "GPU (default: %(default)s)")
    p.add_argument("--only", default=None, help="comma-separated check names to run")
    p.add_argument("--skip", default=None, help="comma-separated check names to leave out")
    p.add_argument("--tests", type=Path, default=None, help="the test suite's folder (default: beside cupool's source)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds allowed to each test-suite subprocess")
    p.add_argument("--quick", action="store_true", help="smaller benchmarks and buffers")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 0 when nothing failed (skips included: a machine without a GPU is not an error), else 1."""
    args = _parser().parse_args(argv)
    try:
        checks = _select(args.only, args.skip)
    except ValueError as e:
        print(f"python -m cupool.validate: error: {e}", file=sys.stderr)
        return 2
    started = datetime.now()
    out = args.out if args.out is not None else default_report_path(started)
    gpu_problem = probe_gpu()
    ctx = Context(
        device=args.device,
        workdir=out.resolve().parent,
        stem=out.stem,
        tests=suites.find_tests(args.tests),
        quick=args.quick,
        timeout=args.timeout,
    )
    env = environment(gpu_problem)
    command = shlex.join(["python", "-m", "cupool.validate", *(sys.argv[1:] if argv is None else argv)])
    t0 = time.perf_counter()
    results: list[Result] = []

    def write(planned: int | None) -> str:
        """The markdown report, and beside it the same run as JSON (``<report>.json``)."""
        seconds = time.perf_counter() - t0
        text = render(results, env, started, seconds, command, gpu_problem, planned)
        out.write_text(text)
        out.with_suffix(".json").write_text(to_json(results, env, started, seconds, command, gpu_problem, planned))
        return text

    def done(result: Result) -> None:
        results.append(result)
        progress = f"[{len(results)}/{len(checks)}] {result.name}: {result.status} ({result.seconds:.1f} s)"
        print(f"{progress} {result.summary}", file=sys.stderr, flush=True)
        write(len(checks))

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write(len(checks))  # a path that cannot be written fails now, not after the GPU time
    except OSError as e:
        print(f"python -m cupool.validate: error: cannot write the report to {out}: {e}", file=sys.stderr)
        return 2
    run_checks(ctx, checks, gpu_problem, done)
    print(write(None), end="")
    print(f"report written to {out} (and {out.with_suffix('.json').name} beside it)", file=sys.stderr)
    return 1 if any(r.status == FAILED for r in results) else 0
