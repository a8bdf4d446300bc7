"""The CuPy workload, run on CuPy's own pool and through every cupool hook path, compared bit for bit.

Memory handed out wrong shows up as wrong numbers: a block given to a second
stream while the first still writes it, a cuBLAS or cuFFT workspace that
overlaps an array, a block freed twice.  The workload therefore runs
elementwise kernels, reductions, matmul (cuBLAS workspaces), FFTs (cuFFT plans,
whose cache is emptied before and after each run so that every run allocates
its own work areas), sorts and random numbers with fixed seeds, on two streams
at once, and every result must equal, byte for byte, what the same code gives
on CuPy's ``MemoryPool``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np

from .._units import format_bytes
from ..hooks import cupy_allocator, install, uninstall
from ..hooks.cupy import PATHS
from ..pool import Pool
from .records import FAILED, PASSED, Context, Result, Table

Workload = Callable[[], list[np.ndarray]]


def compare_outputs(expected: list[np.ndarray], got: list[np.ndarray]) -> list[str]:
    """What differs between two runs' results, bit for bit (NaNs included); empty when they agree."""
    if len(expected) != len(got):
        return [f"{len(got)} results where {len(expected)} were expected"]
    out = []
    for i, (e, g) in enumerate(zip(expected, got)):
        if e.dtype != g.dtype or e.shape != g.shape:
            out.append(f"result {i}: {g.dtype}{list(g.shape)} where {e.dtype}{list(e.shape)} was expected")
            continue
        ebytes = np.ascontiguousarray(e).reshape(-1).view(np.uint8)
        gbytes = np.ascontiguousarray(g).reshape(-1).view(np.uint8)
        if not np.array_equal(ebytes, gbytes):
            n = int(np.count_nonzero(ebytes != gbytes))
            out.append(f"result {i} ({e.dtype}{list(e.shape)}): {n} of {ebytes.size} bytes differ")
    return out


def run_candidates(reference: Workload, candidates: dict[str, Workload]) -> dict[str, list[str]]:
    """Run ``reference`` once and each candidate after it; the differences of each (an exception is one)."""
    expected = reference()
    out = {}
    for name, candidate in candidates.items():
        try:
            out[name] = compare_outputs(expected, candidate())
        except Exception as e:  # noqa: BLE001 - a candidate that raises has failed; the others still run
            out[name] = [f"raised {type(e).__name__}: {e}"]
    return out


def cupy_workload(cp: Any) -> list[np.ndarray]:
    """The workload on whatever allocator CuPy has now; its results, on the host."""
    cache = cp.fft.config.get_plan_cache()
    cache.clear()
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    pending: list[tuple[Any, list[Any]]] = []
    for seed, stream in enumerate(streams, start=1):  # both streams are busy before either is read
        with stream:
            rs = cp.random.RandomState(seed)
            a = rs.standard_normal((512, 512), dtype=cp.float32)
            b = rs.random_sample((1 << 20,), dtype=cp.float64)  # 8 MiB: a large-pool block
            ints = rs.randint(0, 1 << 30, size=100_000, dtype=cp.int64)
            scratch = [cp.empty(n, cp.uint8) for n in (100, 3000, 1 << 20)]  # freed at once, reused below
            del scratch
            results = [
                cp.sin(a) * 2 + a**2,
                a.sum(axis=0),
                b.max(keepdims=True),
                b.mean(keepdims=True),
                cp.cumsum(b[:4096]),
                a @ a.T,
                cp.fft.fft2(a),
                cp.fft.rfft(b),
                cp.sort(ints),
                cp.argsort(a[:, 0]),
                rs.uniform(size=1000),
            ]
            pending.append((stream, results))
    out = []
    for stream, results in pending:
        with stream:
            out += [cp.asnumpy(r) for r in results]
        stream.synchronize()
    del pending
    cache.clear()
    return out


def cupy_workload_check(ctx: Context) -> Result:
    """The workload on CuPy's pool, then through ``cupool.install()`` and through each hook path."""
    import cupy as cp

    previous = cp.cuda.get_allocator()
    pools: dict[str, Pool] = {}

    def on(allocator: Callable[[int], Any]) -> Workload:
        def run() -> list[np.ndarray]:
            cp.cuda.set_allocator(allocator)
            try:
                return cupy_workload(cp)
            finally:
                cp.cuda.set_allocator(previous)

        return run

    def installed() -> list[np.ndarray]:
        install(pools["install()"], numba=False)
        try:
            return cupy_workload(cp)
        finally:
            uninstall()

    candidates: dict[str, Workload] = {"install()": installed}
    pools["install()"] = Pool(ctx.device)
    for path in PATHS:
        pools[path] = Pool(ctx.device)
        candidates[path] = on(cupy_allocator(pools[path], path=path))
    diffs = run_candidates(on(cp.cuda.MemoryPool().malloc), candidates)
    gc.collect()
    table = Table(("allocator", "results equal", "allocations", "peak allocated", "live after"))
    problems, notes = [], []
    for name, pool in pools.items():
        s = pool.stats()
        pool.check()
        table.rows.append((
            "cupool.install()" if name == "install()" else f"cupy_allocator(path={name!r})",
            "yes" if not diffs[name] else "no",
            s["allocation.all.allocated"],
            format_bytes(s["allocated_bytes.all.peak"]),
            s["allocation.all.current"],
        ))
        if diffs[name]:
            problems.append(f"{name}: " + "; ".join(diffs[name]))
        if s["allocation.all.current"]:  # CuPy may cache a workspace: worth a look, not a failure
            notes.append(f"{name}: {s['allocation.all.current']} allocation(s) still live after the workload")
    ctx.passing_paths = tuple(p for p in PATHS if not diffs[p])
    return Result(
        FAILED if problems else PASSED,
        summary=f"bit for bit equal to CuPy's pool: {', '.join(n for n in candidates if not diffs[n]) or 'none'}",
        details="\n".join(problems + notes),
        commands=["python -m cupool.validate --only cupy-workload"],
        tables=[table],
    )
