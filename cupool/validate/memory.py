"""Checks that move real bytes through a pool: the move kernel, compaction, pinned memory, spilling, traces.

Each runs on ``ctx.device``: on ``cuda`` it is the GPU check the issue asks for;
on ``sim`` the very same code runs against the simulated device, which is how
these checks are themselves tested on a machine without a GPU.  Bytes are
always compared on the host, through the device's own copies.
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .._units import format_bytes
from ..kernels.move import word_size
from ..pool import PinnedPool, Pool
from ..replay import replay
from ..trace import load_trace
from ..workloads import mixed_shapes, weight_streaming
from .records import FAILED, PASSED, Context, Result, Table

MiB = 1 << 20
Move = tuple[int, int, int]


def _pool(ctx: Context, size: int, **kw: Any) -> Pool:
    """A pool of ``size`` bytes: a sim device that big, or a cap of that much on the GPU."""
    if ctx.rehearsal:
        return Pool(ctx.device, capacity=size, **kw)
    return Pool(ctx.device, max_size=size, **kw)


def _at(ptr: int | None) -> int:
    """A movable buffer's address, which it has while it is on the device."""
    assert ptr is not None, "the buffer is on the device"
    return ptr


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


# ------------------------------------------------------------------ move kernel
def memmove_reference(data: np.ndarray, moves: list[Move]) -> np.ndarray:
    """``data`` after ``moves`` carried out in order, each as C's memmove would (on the host)."""
    out = data.copy()
    for s, d, n in moves:
        out[d : d + n] = out[s : s + n].copy()
    return out


def random_moves(rng: np.random.Generator, size: int, count: int, unit: int) -> list[Move]:
    """``count`` moves of whole ``unit``s inside ``size`` bytes, overlapping one another and themselves."""
    moves = []
    for _ in range(count):
        n = int(rng.integers(0, size // unit // 2 + 1)) * unit
        s = int(rng.integers(0, (size - n) // unit + 1)) * unit
        d = int(rng.integers(0, (size - n) // unit + 1)) * unit
        moves.append((s, d, n))
    return moves


def mixed_moves(rng: np.random.Generator, size: int, count: int) -> list[Move]:
    """Word-aligned moves of 4 KiB to 3 MiB inside ``size`` bytes (the larger ones take the GPU's copy path),
    depending on one another, then two slides over themselves."""
    moves = []
    for _ in range(count):
        n = int(rng.choice([4096, 256 << 10, MiB, 2 * MiB, 3 * MiB])) + 8 * int(rng.integers(0, 4))
        moves.append((8 * int(rng.integers(0, (size - n) // 8)), 8 * int(rng.integers(0, (size - n) // 8)), n))
    return moves + [(0, size // 16, size // 8), (size // 64, 0, size // 32)]


def move_kernel(ctx: Context) -> Result:
    """Random move lists and large overlapping slides through ``device.execute_moves``, against memmove."""
    rng = np.random.default_rng(14)
    small = MiB
    big = (4 if ctx.quick else 64) * MiB
    cases: list[tuple[str, int, list[Move]]] = []
    for i in range(10 if ctx.quick else 40):
        unit = 8 if i % 2 else 1
        moves = random_moves(rng, small, int(rng.integers(1, 17)), unit)
        cases.append((f"random {unit}-byte moves #{i}", small, moves))
    for i in range(2 if ctx.quick else 6):  # both paths in one list: megabyte copies among small moves and slides
        cases.append((f"copies, small moves and slides #{i}", big, mixed_moves(rng, big, 24)))
    f = big // 64  # the large slides of tests/test_kernels.py, scaled to ``big``
    cases.append(("large overlapping slides", big, [(4096, 0, 32 * f), (0, f, 48 * f), (40 * f, 8 * f, 16 * f)]))
    pool = _pool(ctx, 2 * big)
    failures, moved, big_seconds = [], 0, 0.0
    for label, size, moves in cases:
        data = rng.integers(0, 256, size, dtype=np.uint8)
        a = pool.malloc(size)
        pool.device.from_host(a.ptr, data)
        src, dst, n = (np.array([m[k] for m in moves], dtype=np.int64) for k in range(3))
        pool.device.synchronize()
        t0 = time.perf_counter()
        pool.device.execute_moves(src + a.ptr, dst + a.ptr, n)
        pool.device.synchronize()
        seconds = time.perf_counter() - t0
        if not np.array_equal(pool.device.to_host(a.ptr, size), memmove_reference(data, moves)):
            failures.append(f"{label} (word size {word_size(src, dst, n)})")
        if size == big:
            moved, big_seconds = int(n.sum()), seconds
        a.free()
    pool.check()
    grid = ("the copy path (large disjoint moves) and one cooperative launch for the rest, as many blocks of 512 "
            "threads as stay resident")
    if ctx.rehearsal:
        grid = "the sim device's @njit twin"
    bandwidth = _gbps(moved, big_seconds)
    return Result(
        FAILED if failures else PASSED,
        summary=f"{len(cases) - len(failures)} of {len(cases)} move lists identical to memmove; "
        f"large slides {bandwidth:.1f} GB/s",
        details=(f"different from memmove: {', '.join(failures)}\n" if failures else "")
        + f"Moves ran on {grid}; the large case moves {format_bytes(moved)} over itself in chunks behind barriers.",
        commands=["python -m cupool.validate --only move-kernel"],
        figures={"move lists": len(cases), "different": len(failures), "large slides (GB/s)": bandwidth},
    )


# ------------------------------------------------------------------- compaction
def _copy_seconds(pool: Pool, nbytes: int) -> float:
    """A plain copy of ``nbytes`` within the device's memory: CuPy device to device on a GPU, numpy on sim."""
    if pool.device.capabilities.host_accessible:
        src = np.full(nbytes, 7, dtype=np.uint8)  # touched, like the arena's live bytes
        dst = np.ones(nbytes, dtype=np.uint8)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0
    import cupy as cp

    src = cp.full(nbytes, 7, dtype=cp.uint8)
    dst = cp.ones(nbytes, dtype=cp.uint8)
    cp.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    dst.data.copy_from_device(src.data, nbytes)
    cp.cuda.runtime.deviceSynchronize()
    return time.perf_counter() - t0


def compaction_bandwidth(ctx: Context) -> Result:
    """Every other movable buffer freed, then ``pool.compact()``: its moves against a plain copy of the same bytes."""
    buf, count, repeats = (MiB, 16, 2) if ctx.quick else (4 * MiB, 64, 5)
    move_bw, compact_bw, copy_bw, corrupt = [], [], [], 0
    for r in range(repeats + 1):  # the first round compiles or loads the kernel
        pool = _pool(ctx, 2 * count * buf + 64 * MiB, defrag_threshold=None)
        pool.movable(count * buf)  # dropped at once: one cached segment the buffers then share
        bufs = [pool.movable(buf) for _ in range(count)]
        for i, m in enumerate(bufs):
            m.array()[:] = i % 251
        for m in bufs[::2]:
            m.free()
        report = pool.compact()
        for i, m in enumerate(bufs[1::2]):
            if not (pool.device.to_host(_at(m.ptr), m.size) == (2 * i + 1) % 251).all():
                corrupt += 1
        if r == 0:
            continue
        moved = report.bytes_moved
        move_bw.append(_gbps(moved, report.move_seconds))
        compact_bw.append(_gbps(moved, report.seconds))
        copy_bw.append(_gbps(moved, _copy_seconds(pool, moved)))
    mv, cp_, co = (float(np.median(v)) for v in (move_bw, copy_bw, compact_bw))
    baseline = "numpy copy in host memory" if ctx.rehearsal else "CuPy device-to-device copy"
    table = Table(("what", "bandwidth", "vs copy"))
    table.rows += [
        (baseline, f"{cp_:.2f} GB/s", "1.00x"),
        ("compaction, moves only", f"{mv:.2f} GB/s", f"{mv / cp_:.2f}x"),
        ("compaction, end to end", f"{co:.2f} GB/s", f"{co / cp_:.2f}x"),
    ]
    met = "met" if mv / cp_ >= 0.8 else "not met"
    return Result(
        FAILED if corrupt else PASSED,
        summary=f"moves {mv / cp_:.2f}x a plain copy (target >= 0.8x: {met})",
        details=(f"{corrupt} buffer(s) came out of compaction with wrong bytes\n" if corrupt else "")
        + f"{count} buffers of {format_bytes(buf)}, every other one freed; medians of {repeats} rounds. "
        "End to end includes planning and giving emptied segments back.",
        commands=["python -m cupool.validate --only compaction-bandwidth"],
        figures={"copy (GB/s)": cp_, "moves (GB/s)": mv, "compaction (GB/s)": co, "moves / copy (x)": mv / cp_},
        tables=[table],
    )


# ----------------------------------------------------------------------- pinned
def pinned(ctx: Context) -> Result:
    """Pinned blocks to the device and back, beside pageable memory; on a GPU, CuPy's pinned allocator too."""
    n = (MiB if ctx.quick else 64 * MiB)
    pinned_pool = PinnedPool(ctx.device)
    pool = _pool(ctx, 4 * n)
    a = pool.malloc(n)
    data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    problems, figures = [], {}
    makers = {"pinned": lambda: pinned_pool.empty(n, np.uint8), "pageable": lambda: np.empty(n, np.uint8)}
    for label, make in makers.items():
        src, back = make(), make()
        src[:] = data
        pool.device.synchronize()
        t0 = time.perf_counter()
        pool.device.from_host(a.ptr, src)
        pool.device.synchronize()
        t1 = time.perf_counter()
        pool.device.read_into(a.ptr, back)
        pool.device.synchronize()
        t2 = time.perf_counter()
        if not np.array_equal(back, data):
            problems.append(f"bytes through {label} memory came back different")
        figures[f"{label} to device (GB/s)"] = _gbps(n, t1 - t0)
        figures[f"{label} from device (GB/s)"] = _gbps(n, t2 - t1)
        del src, back
    if not ctx.rehearsal:
        problems += _cupy_pinned_allocator(pinned_pool)
    gc.collect()
    left = pinned_pool.stats()["allocation.all.current"]
    if left:
        problems.append(f"{left} pinned allocation(s) still live after their arrays died")
    pinned_pool.check()
    return Result(
        FAILED if problems else PASSED,
        summary=f"round trips intact; to device {figures['pinned to device (GB/s)']:.1f} GB/s pinned, "
        f"{figures['pageable to device (GB/s)']:.1f} GB/s pageable",
        details="; ".join(problems) or f"{format_bytes(n)} each way, on {pinned_pool.device.name}",
        commands=["python -m cupool.validate --only pinned"],
        figures=figures,
    )


def _cupy_pinned_allocator(pinned_pool: PinnedPool) -> list[str]:
    """CuPy's pinned allocations (``alloc_pinned_memory``) served by the pool, and back when dropped."""
    import cupy as cp

    before = pinned_pool.stats()["allocation.all.current"]
    cp.cuda.set_pinned_memory_allocator(pinned_pool.cupy_allocator())
    try:
        mem = cp.cuda.alloc_pinned_memory(MiB)
        during = pinned_pool.stats()["allocation.all.current"]
        del mem
    finally:
        cp.cuda.set_pinned_memory_allocator(cp.get_default_pinned_memory_pool().malloc)
    after = pinned_pool.stats()["allocation.all.current"]
    if (during, after) != (before + 1, before):
        return [f"CuPy's pinned allocator: live allocations {before} -> {during} -> {after}, expected +1 then back"]
    return []


# ------------------------------------------------------------------------ spill
def spill(ctx: Context) -> Result:
    """Movable buffers spilled to host memory and to HDF5, then restored: bytes intact, throughput."""
    size, count = (256 * 1024, 4) if ctx.quick else (32 * MiB, 8)
    table = Table(("tier", "bytes", "spill", "restore", "bytes intact"))
    problems, figures = [], {}
    with tempfile.TemporaryDirectory(prefix="cupool-spill-") as tmp:
        for name, target in (("host", "host"), ("HDF5", str(Path(tmp) / "spill.h5"))):
            pool = _pool(ctx, 4 * size * count + 64 * MiB, spill=target, defrag_threshold=None)
            bufs = [pool.movable(size) for _ in range(count)]
            expected = [(np.arange(size, dtype=np.int64) * (i + 3) + i).astype(np.uint8) for i in range(count)]
            for m, data in zip(bufs, expected):
                pool.device.from_host(_at(m.ptr), data)
            t0 = time.perf_counter()
            spilled = pool.spill()
            t1 = time.perf_counter()
            still = sum(m.on_device for m in bufs)
            for m in bufs:
                m.array()  # brings it back; the lease dies at once
            pool.device.synchronize()
            t2 = time.perf_counter()
            intact = all(np.array_equal(pool.device.to_host(_at(m.ptr), size), d) for m, d in zip(bufs, expected))
            if spilled != size * count or still:
                problems.append(f"{name}: spilled {format_bytes(spilled)} with {still} buffer(s) left on the device")
            if not intact:
                problems.append(f"{name}: restored bytes differ")
            figures[f"{name} spill (GB/s)"] = _gbps(size * count, t1 - t0)
            figures[f"{name} restore (GB/s)"] = _gbps(size * count, t2 - t1)
            table.rows.append((name, format_bytes(size * count), f"{figures[f'{name} spill (GB/s)']:.2f} GB/s",
                               f"{figures[f'{name} restore (GB/s)']:.2f} GB/s", "yes" if intact else "no"))
            pool.check()
            del pool, bufs
            gc.collect()  # the HDF5 tier deletes its file with the pool, before the folder goes
    return Result(
        FAILED if problems else PASSED,
        summary="host and HDF5 round trips intact" if not problems else "; ".join(problems),
        details="; ".join(problems) or f"{count} buffers of {format_bytes(size)} per tier",
        commands=["python -m cupool.validate --only spill"],
        figures=figures,
        tables=[table],
    )


# ------------------------------------------------------------------------ trace
def trace(ctx: Context) -> Result:
    """A trace recorded on this device, saved beside the report, and replayed on the sim device at once."""
    path = ctx.file("-trace.h5")
    path.unlink(missing_ok=True)
    pool = _pool(ctx, 1 << 30)
    streams: list[Any] = [1, 2]
    if not ctx.rehearsal:
        import cupy as cp

        streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    with pool.record(path):
        weight_streaming(pool, mixed_shapes(20 if ctx.quick else 60, seed=14), fill=True, movable=True)
        rng = np.random.default_rng(14)
        held = []
        for i in range(200 if ctx.quick else 2000):
            held.append(pool.malloc(int(rng.choice([512, 4096, 100_000, 3 * MiB])), stream=streams[i % 2]))
            if len(held) > 20:
                held.pop(int(rng.integers(len(held)))).free()
        del held
        pool.device.synchronize()
        pool.empty_cache()
    s = pool.stats()
    result = replay(load_trace(path))
    recorded = (s["reserved_bytes.all.peak"], s["allocated_bytes.all.peak"])
    replayed = (result.peak_reserved, result.peak_allocated)
    same = recorded == replayed
    table = Table(("", "peak reserved", "peak allocated"))
    table.rows += [("recorded on " + pool.device.name, *map(format_bytes, recorded)),
                   (f"replayed on sim ({result.engine} engine)", *map(format_bytes, replayed))]
    why = "" if same else (
        " The replay's peaks differ from the recording's.  The replay treats every stream as idle, so a block "
        "freed on one stream is at once free for another, where on a GPU the pool waits for that stream's event "
        "and may grow instead: a difference here with two streams in the trace may be that, not a bug."
    )
    return Result(
        PASSED,
        summary=f"{result.events:,} events saved and replayed; "
        + ("the replay reproduces the peaks" if same else "**the replay's peaks differ**"),
        details=f"Saved as {path.name} beside this report; the command above replays it anywhere "
        f"(here it took {result.seconds:.2f} s).{why}",
        commands=[f"cupool replay {path.name}"],
        figures={"events": result.events, "replay (s)": result.seconds,
                 "recorded peak reserved": recorded[0], "replayed peak reserved": replayed[0]},
        tables=[table],
    )
