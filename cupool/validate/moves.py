"""Compaction's moves at the issue's three sizes, against a plain copy of the same bytes (issue 18).

Each pattern is the compaction of every other slot: ``count`` blocks of ``size``
bytes at slots 1, 3, 5... slide down to slots 0, 1, 2... (each move writes where
the one before it read, so they must run in order), through
``device.execute_moves``, timed to the device's finish, median of several calls.
The baseline is one copy of ``count * size`` bytes: CuPy's device-to-device copy on
a GPU, numpy's within host memory on the sim device.  ``benchmarks/bench_compaction.py
--device cuda`` prints the same figures.

Targets (issue 18): 128 MiB in 32 moves >= 0.8x the copy, 1 GiB >= 0.9x, and 4,096
moves of 4 KiB in <= 0.5 ms.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._units import format_bytes
from ..device import Device, SimDevice
from .records import FAILED, PASSED, Context, Result, Table

MiB = 1 << 20


@dataclass(frozen=True)
class Pattern:
    label: str
    size: int  # bytes per move
    count: int  # moves
    #: the least ratio (copy time / move time) the issue asks for, or the most milliseconds
    min_ratio: float | None = None
    max_ms: float | None = None


PATTERNS = (
    Pattern("128 MiB in 32 moves", 4 * MiB, 32, min_ratio=0.8),
    Pattern("1 GiB in 32 moves", 32 * MiB, 32, min_ratio=0.9),
    Pattern("4,096 moves of 4 KiB", 4096, 4096, max_ms=0.5),
)
#: ``--quick`` and the sim device: the same shapes, smaller, so without the issue's targets.
QUICK = (
    Pattern("8 MiB in 32 moves", 256 << 10, 32),
    Pattern("32 MiB in 32 moves", MiB, 32),
    Pattern("512 moves of 4 KiB", 4096, 512),
)


def _device(ctx: Context, patterns: tuple[Pattern, ...]) -> Device:
    if ctx.rehearsal:
        return SimDevice(capacity=2 * max(p.size * p.count for p in patterns) + 64 * MiB)
    from ..device import CudaDevice

    return CudaDevice(0)


def _copy(device: Device, dst: Any, src: Any) -> None:
    """One copy of ``src`` into ``dst`` (arrays from ``device.as_array``), finished when it returns."""
    if device.capabilities.host_accessible:
        np.copyto(dst, src)
        return
    dst.data.copy_from_device(src.data, src.nbytes)
    device.synchronize()


def time_pattern(device: Device, p: Pattern, repeats: int) -> dict[str, float]:
    """Median seconds of the pattern's moves and of the copy; whether the first run moved every byte right."""
    total = p.size * p.count
    base = device.malloc(2 * total)
    try:
        arena = device.as_array(base, (2 * p.count, p.size), np.dtype(np.uint8), None)
        for slot in range(2 * p.count):
            arena[slot] = slot % 251
        k = np.arange(p.count, dtype=np.int64)
        src, dst, n = base + (2 * k + 1) * p.size, base + k * p.size, np.full(p.count, p.size, np.int64)
        device.prepare_moves()
        device.synchronize()
        device.execute_moves(src, dst, n)
        rows = arena[: p.count]
        firsts = rows[:, 0]
        uniform = bool((rows == rows[:, :1]).all())
        got = np.asarray(firsts.get() if hasattr(firsts, "get") else firsts)
        intact = uniform and bool((got == (2 * k + 1) % 251).all())
        moves, copies = [], []
        flat = device.as_array(base, (2 * total,), np.dtype(np.uint8), None)
        for _ in range(repeats):
            t0 = time.perf_counter()
            device.execute_moves(src, dst, n)
            moves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _copy(device, flat[total:], flat[:total])  # the first half into the second
            copies.append(time.perf_counter() - t0)
        del arena, rows, flat
    finally:
        device.synchronize()
        device.free(base, 2 * total)
    return {"moves": statistics.median(moves), "copy": statistics.median(copies), "intact": float(intact)}


def compaction_moves(ctx: Context) -> Result:
    """The issue's three move patterns through ``execute_moves``, against one copy of the same bytes."""
    patterns = QUICK if ctx.quick or ctx.rehearsal else PATTERNS
    repeats = 3 if ctx.quick else 9
    device = _device(ctx, patterns)
    baseline = "numpy copy in host memory" if ctx.rehearsal else "CuPy device-to-device copy"
    table = Table(("pattern", "moves", "copy", "copy time / move time", "target", "bytes"))
    figures: dict[str, float] = {}
    broken, missed = [], []
    for p in patterns:
        t = time_pattern(device, p, repeats)
        ratio = t["copy"] / t["moves"]
        ms = t["moves"] * 1e3
        if p.min_ratio is not None:
            target, met = f">= {p.min_ratio}x", ratio >= p.min_ratio
        elif p.max_ms is not None:
            target, met = f"<= {p.max_ms} ms", ms <= p.max_ms
        else:
            target, met = "-", True
        if not met:
            missed.append(p.label)
        if not t["intact"]:
            broken.append(p.label)
        table.rows.append((p.label, f"{ms:.3f} ms", f"{t['copy'] * 1e3:.3f} ms", f"{ratio:.2f}x",
                           f"{target}: {'met' if met else 'not met'}" if target != "-" else "-",
                           "intact" if t["intact"] else "WRONG"))
        figures[f"{p.label}: moves (ms)"] = ms
        figures[f"{p.label}: copy (ms)"] = t["copy"] * 1e3
        figures[f"{p.label}: copy/moves (x)"] = ratio
    summary = ", ".join(f"{p.label} {figures[f'{p.label}: copy/moves (x)']:.2f}x" for p in patterns)
    summary += f" a copy; {patterns[-1].label} {figures[f'{patterns[-1].label}: moves (ms)']:.3f} ms"
    if missed:
        summary += f" (targets not met: {', '.join(missed)})"
    details = (f"baseline: {baseline} of the same bytes; medians of {repeats} calls; every other slot of "
               f"{format_bytes(2 * patterns[0].size * patterns[0].count)} and up compacted, in order")
    if broken:
        details = f"moves left wrong bytes: {', '.join(broken)}\n\n" + details
    return Result(
        FAILED if broken else PASSED,
        summary=summary,
        details=details,
        commands=["python -m cupool.validate --only compaction-moves",
                  "python benchmarks/bench_compaction.py --device cuda"],
        figures=figures,
        tables=[table],
    )
