"""Benchmarks side by side in one run: cupool against CuPy's ``MemoryPool`` (and RMM where importable).

Every figure is a median over interleaved samples (variant A, B, C, A, B, C...),
so drift in clocks or in the machine hits all variants alike, and every ratio is
taken between figures of the same run.
"""

from __future__ import annotations

import statistics
import time
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np

from ..hooks import cupy_allocator
from ..hooks.cupy import PATHS, memory_path
from ..pool import Pool
from .records import PASSED, Context, Result, Table

#: ``cp.empty`` + drop through cupool, as a multiple of CuPy's own pool: the goal of issue 14.
HOOK_TARGET = 1.2
_SIZES = (256, 512, 1000, 4096, 20_000)
_PAIR_LABELS = {"free": "cupool malloc+free", "drop": "cupool malloc+drop", "cupy": "CuPy malloc+drop"}


def interleaved_medians(variants: dict[str, Callable[[], float]], repeat: int) -> dict[str, float]:
    """Call each variant (one sample: seconds per operation) ``repeat`` times in turn; the median of each."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeat):
        for name, sample in variants.items():
            samples[name].append(sample())
    return {name: statistics.median(v) for name, v in samples.items()}


def fastest_passing(medians: dict[str, float], passing: tuple[str, ...]) -> str | None:
    """The quickest of the variants named in ``passing`` (those that gave the right results), if any."""
    timed = [name for name in passing if name in medians]
    return min(timed, key=medians.__getitem__) if timed else None


def _per_op(loop: Callable[[], Any], number: int) -> Callable[[], float]:
    return lambda: timeit.timeit(loop, number=number) / number


# ----------------------------------------------------------- malloc + free, live blocks
def malloc_free(ctx: Context) -> Result:
    """A 1000-byte malloc and its free among 1k and 100k live blocks, cupool beside CuPy's ``MemoryPool``."""
    import cupy as cp

    number, repeat = (2000, 3) if ctx.quick else (20_000, 7)
    table = Table(("live blocks", "cupool malloc+free", "cupool malloc+drop", "CuPy MemoryPool malloc+drop",
                   "cupool (drop) / CuPy"))
    figures: dict[str, float] = {}
    for live in (1_000, 100_000):
        rng = np.random.default_rng(0)
        sizes = [int(n) for n in rng.choice(_SIZES, size=live)]
        pool = Pool(ctx.device, defrag_threshold=None)
        mp = cp.cuda.MemoryPool()
        held = [pool.malloc(n) for n in sizes], [mp.malloc(n) for n in sizes]
        med = interleaved_medians(_pair_loops(pool, mp, number), repeat)
        pool.check()
        del held
        ratio = med["drop"] / med["cupy"]
        table.rows.append((f"{live:,}", _us(med["free"]), _us(med["drop"]), _us(med["cupy"]), f"{ratio:.2f}x"))
        for key, label in _PAIR_LABELS.items():
            figures[f"{label} at {live:,} live (us)"] = med[key] * 1e6
        figures[f"cupool/CuPy at {live:,} live (x)"] = ratio
        figures[f"cupool malloc+free / CuPy malloc+drop at {live:,} live (x)"] = med["free"] / med["cupy"]
    flat = figures["cupool malloc+free at 100,000 live (us)"] / figures["cupool malloc+free at 1,000 live (us)"]
    cupy_flat = figures["CuPy malloc+drop at 100,000 live (us)"] / figures["CuPy malloc+drop at 1,000 live (us)"]
    figures["cupool 100k/1k (x)"] = flat
    figures["CuPy 100k/1k (x)"] = cupy_flat
    return Result(
        PASSED,
        summary=f"100k/1k live: cupool {flat:.2f}x, CuPy {cupy_flat:.2f}x; "
        f"cupool/CuPy at 100k: {figures['cupool/CuPy at 100,000 live (x)']:.2f}x",
        details=f"medians of {repeat} interleaved samples of {number:,} operations; sizes drawn from {list(_SIZES)}",
        commands=["python -m cupool.validate --only malloc-free"],
        figures=figures,
        tables=[table],
    )


def _pair_loops(pool: Pool, mp: Any, number: int) -> dict[str, Callable[[], float]]:
    """One sample of each: cupool's malloc + free, its malloc + drop, and CuPy's malloc + drop."""
    malloc, cupy_malloc = pool.malloc, mp.malloc

    def pair() -> None:
        malloc(1000).free()

    def drop() -> None:
        malloc(1000)

    def cupy_drop() -> None:
        cupy_malloc(1000)

    return {"free": _per_op(pair, number), "drop": _per_op(drop, number), "cupy": _per_op(cupy_drop, number)}


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3f} us"


# ------------------------------------------------------------ cp.empty + drop per path
#: The cheapest possible Python allocator: one fixed device pointer, what any Python allocator costs CuPy at least.
FLOOR = "floor (fixed pointer)"
RMM = "RMM rmm_cupy_allocator"


def floor_allocator(cp: Any) -> Callable[[int], Any]:
    """An allocator handing CuPy the same 1 MiB of device memory every time (``cp.empty((256,))`` fits)."""
    pool = cp.cuda.MemoryPool()
    fixed = pool.malloc(1 << 20)
    owner = (pool, fixed)  # CuPy's pool owns the memory behind ``fixed``: both stay alive with the allocator
    pointer, unowned, ptr, device = cp.cuda.MemoryPointer, cp.cuda.UnownedMemory, fixed.ptr, fixed.device_id

    def floor(nbytes: int) -> Any:
        return pointer(unowned(ptr, nbytes, owner, device), 0)

    return floor


def rmm_allocator() -> tuple[Callable[[int], Any] | None, str]:
    """RMM's ``rmm_cupy_allocator`` over a pool resource (as RMM's users run it), or None; and a note saying which."""
    try:
        import rmm

        try:
            from rmm.allocators.cupy import rmm_cupy_allocator
        except ImportError:
            from rmm import rmm_cupy_allocator
    except ImportError:
        return None, "RMM is not importable here, so it has no row"
    try:  # RMM's default resource calls cudaMalloc every time; compare with its pool
        rmm.mr.set_current_device_resource(rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), 1 << 28))
    except Exception as e:  # noqa: BLE001 - an RMM whose API moved costs its row, not the check
        return None, f"RMM could not be given a pool resource ({type(e).__name__}: {e}), so it has no row"
    return rmm_cupy_allocator, "RMM runs on a PoolMemoryResource (256 MiB to start) over cudaMalloc"


def hook_paths(ctx: Context) -> Result:
    """``cp.empty((256,), float32)`` + drop through CuPy's pool, each cupool path, and RMM."""
    import cupy as cp

    number, repeat = (2000, 3) if ctx.quick else (20_000, 15)
    allocators: dict[str, Callable[[int], Any]] = {"CuPy MemoryPool": cp.cuda.MemoryPool().malloc,
                                                   FLOOR: floor_allocator(cp)}
    for path in PATHS:
        allocators[path] = cupy_allocator(Pool(ctx.device), path=path)
    rmm, rmm_note = rmm_allocator()
    if rmm is not None:
        allocators[RMM] = rmm
    previous = cp.cuda.get_allocator()
    empty, f32 = cp.empty, cp.float32

    def loop() -> None:
        empty((256,), f32)

    def sample(allocator: Callable[[int], Any]) -> Callable[[], float]:
        def run() -> float:
            cp.cuda.set_allocator(allocator)
            try:
                return timeit.timeit(loop, number=number) / number
            finally:
                cp.cuda.set_allocator(previous)

        return run

    for allocator in allocators.values():  # warm each: first segments, CuPy's kernel cache
        sample(allocator)()
    t0 = time.perf_counter()
    med = interleaved_medians({name: sample(a) for name, a in allocators.items()}, repeat)
    base = med["CuPy MemoryPool"]
    table = Table(("allocator", "median per cp.empty + drop", "vs CuPy's pool", "passed the workload"))
    passing = ctx.passing_paths
    for name, m in med.items():
        ok = "yes (reference)" if name == "CuPy MemoryPool" else (
            "not run" if passing is None or name not in PATHS else ("yes" if name in passing else "no")
        )
        table.rows.append((name if name not in PATHS else f"cupool path={name!r}", _us(m), f"{m / base:.2f}x", ok))
    figures = {f"{name} (us)": m * 1e6 for name, m in med.items()}
    figures |= {f"{name} / CuPy (x)": m / base for name, m in med.items() if name != "CuPy MemoryPool"}
    if RMM in med:
        figures |= {f"{name} / RMM (x)": m / med[RMM] for name, m in med.items() if name in PATHS}
    best = fastest_passing(med, passing or ())
    chosen = best or "pointer"  # the default path, when no run of the workload chose one
    figures["cupool / CuPy MemoryPool (x)"] = med[chosen] / base
    figures["floor / CuPy MemoryPool (x)"] = med[FLOOR] / base
    if RMM in med:
        figures["cupool / RMM (x)"] = med[chosen] / med[RMM]
    if passing is None:
        verdict = "cupy-workload did not run before it, so no path is chosen"
    elif best is None:
        verdict = "no cupool path passed the workload in this run, so none is chosen"
    else:
        ratio = med[best] / base
        met = "met" if ratio <= HOOK_TARGET else "not met"
        verdict = (f"fastest path that passed the workload: {best!r}, {ratio:.2f}x CuPy's pool "
                   f"(target <= {HOOK_TARGET}x: {met})")
    memory, why = memory_path()
    notes = [verdict, f"medians of {repeat} interleaved samples of {number:,} calls ({time.perf_counter() - t0:.1f} s)",
             rmm_note, f"path='pointer' gives CuPy {memory} ({why}); path='unowned' gives UnownedMemory"]
    return Result(
        PASSED,
        summary=verdict,
        details="; ".join(notes),
        commands=["python -m cupool.validate --only cupy-workload,hook-paths"],
        figures=figures,
        tables=[table],
    )
