"""``cupool demo``: the weight-streaming workload, step by step, then a longer run and the streaming table.

Everything is computed before anything is printed, so that a bad argument or a
device too small for the demo is one line of error (with what would fit), not
half a report followed by a traceback.  ``needed_capacity`` is how much the
demo needs: the least sim capacity on which each of its runs completes, found
by running them, since it depends on ``--steps`` and ``--seed``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from . import streaming, workloads
from ._units import format_bytes
from .device import SimDevice, VirtualMemoryUnsupported
from .errors import OutOfMemoryError
from .pool import Pool

#: "off": plain arrays, nothing may move.  "on": the layers live in movable buffers
#: and the pool compacts when fragmentation passes its defrag_threshold (0.3).
MODES: dict[str, dict[str, Any]] = {"off": {"movable": False}, "on": {"movable": True}}
#: Pool settings of the longer run's plain-segment row (the defaults use expandable segments where the
#: device has virtual memory, as the sim device on Linux does).
PLAIN: dict[str, Any] = {"expandable_segments": False}
#: The longer run's rows: name, Pool settings, workload settings.
ROWS: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    ("off", {}, MODES["off"]), ("on", {}, MODES["on"]), ("off, plain", PLAIN, MODES["off"]),
)
#: The granularity of capacities the demo searches (sim devices), as the "smallest device" column says.
STEP = 2 << 20


@dataclass
class MixedRow:
    """One row of the longer run: a summary, or why the row could not run (``unavailable``)."""

    name: str
    max_fragmentation: float = 0.0
    mean_fragmentation: float = 0.0
    peak_reserved: int = 0
    device_allocs: int = 0
    smallest: int | None = None  # sim only: the least capacity that completes, None above 4x the live peak
    unavailable: str = ""


@dataclass
class DemoResult:
    device: str
    sim: bool
    source: dict[str, list[workloads.Step]]
    steps: int
    seed: int
    shapes: list[tuple[int, int]]
    peak_live: int
    rows: list[MixedRow]
    table: list[streaming.SettingRow]


def check_args(steps: int, seed: int) -> None:
    """Refuse what the demo cannot run, before it runs anything."""
    if steps < 1:
        raise ValueError(f"--steps must be at least 1 (layers in the longer run), got {steps}")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")


def run(device: str, capacity: str | None, steps: int, seed: int) -> DemoResult:
    """Every figure the demo prints.  Raises ``ValueError`` saying what would fit if the device is too small."""
    check_args(steps, seed)
    try:
        return _run(device, capacity, steps, seed)
    except OutOfMemoryError as e:
        refused = e
    need = needed_capacity(steps, seed)
    probe = Pool(device, capacity=capacity)
    if isinstance(probe.device, SimDevice):
        if need <= probe.device.capacity:  # not the device's size: a fault of the demo's own, to be seen whole
            raise refused
        raise ValueError(f"--capacity {format_bytes(probe.device.capacity)} is too small for the demo with "
                         f"--steps {steps} --seed {seed}: it needs at least {format_bytes(need)} "
                         f"(give --capacity {need >> 20}MiB or more)") from None
    free, total = probe.device.mem_info()
    raise ValueError(f"{probe.device.name} has {format_bytes(free)} free of {format_bytes(total)}, too little for "
                     f"the demo with --steps {steps} --seed {seed}: it needs about {format_bytes(need)} free "
                     "(what a sim device of that size completes on); free memory on the GPU, or run "
                     f"--device sim --capacity {need >> 20}MiB") from None


def _run(device: str, capacity: str | None, steps: int, seed: int) -> DemoResult:
    def make(**pool_kw: Any) -> Pool:
        return Pool(device, capacity=capacity, **pool_kw)

    with _progress(4 + len(ROWS)) as tick:
        first = make()
        sim = isinstance(first.device, SimDevice)
        source = {}
        for name, kw in MODES.items():
            source[name] = workloads.weight_streaming(first if name == "off" else make(), workloads.source_shapes(),
                                                      fill=True, **kw)
            tick()
        shapes = workloads.mixed_shapes(steps, seed=seed)
        peak_live = workloads.peak_live_bytes(shapes)
        rows = []
        for name, pool_kw, kw in ROWS:
            try:
                pool = make(**pool_kw)
            except VirtualMemoryUnsupported as e:
                rows.append(MixedRow(name, unavailable=f"n/a: {e}"))
                continue
            streamed = workloads.weight_streaming(pool, shapes, fill=True, **kw)
            fr = [s.fragmentation for s in streamed]
            row = MixedRow(name, max(fr), sum(fr) / len(fr), max(s.reserved for s in streamed),
                           int(pool.stats()["num_device_alloc"]))
            if sim:
                row.smallest = workloads.smallest_capacity(_sim(pool_kw), shapes, peak_live, 4 * peak_live, STEP, **kw)
            rows.append(row)
            tick()
        table = streaming.settings_table(device=device, capacity=capacity)
        tick()
    return DemoResult(first.device.name, sim, source, steps, seed, shapes, peak_live, rows, table)


def _sim(pool_kw: dict[str, Any]) -> Callable[[int], Pool]:
    return lambda c: Pool("sim", capacity=c, **pool_kw)


def needed_capacity(steps: int, seed: int) -> int:
    """The least sim capacity (a multiple of ``STEP``) on which every run of the demo completes.

    Success is monotone in the capacity (a deterministic pool and workload), so
    each run's least capacity is found by bisection, and the demo needs the
    largest of them.
    """
    need = STEP
    for shapes in (workloads.source_shapes(), workloads.mixed_shapes(steps, seed=seed)):
        live = workloads.peak_live_bytes(shapes)
        for _, pool_kw, kw in ROWS:
            try:
                found = workloads.smallest_capacity(_sim(pool_kw), shapes, live, 64 * live, STEP, **kw)
            except VirtualMemoryUnsupported:  # the demo shows this row as n/a
                continue
            assert found is not None, "64x the live peak always completes"
            need = max(need, found)
    return _streaming_capacity(need)


def _streaming_capacity(start: int) -> int:
    """The least capacity from ``start`` up (in ``STEP``s) on which the streaming table completes."""
    def fits(cap: int) -> bool:
        try:
            streaming.settings_table(device="sim", capacity=cap)
            return True
        except OutOfMemoryError:
            return False

    if fits(start):
        return start
    lo, hi = start, 2 * start
    while not fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > STEP:  # fits(hi), not fits(lo)
        mid = (lo + hi) // 2 // STEP * STEP
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


@contextmanager
def _progress(total: int) -> Iterator[Callable[[], None]]:
    """A bar on stderr while the demo computes (only on a terminal: pipes and logs get the results alone)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="cupool demo", unit="run", file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty())
    try:
        yield lambda: bar.update(1)
    finally:
        bar.close()


def format_result(r: DemoResult) -> str:
    """The demo's report, as ``cupool demo`` prints it."""
    out = [f"cupool demo: weight streaming on {r.device} (4 cached layers, 2 evicted at a time, float32)",
           "Layers are written when loaded and checked when evicted, so a corrupting move would fail the run.", "",
           "The source's ten steps (PyTorch's caching allocator) beside cupool:",
           f"  {'step':>4}  {'action':<13} {'shape':<12} {'source':>12} {'compaction off':>15} {'compaction on':>14}",
           f"  {'':>4}  {'':<13} {'':<12} {'frag segs':>12} {'frag segs':>15} {'frag segs':>14}"]
    for a, b in zip(r.source["off"], r.source["on"]):
        _, _, sfrag, ssegs = workloads.SOURCE_STEPS[a.step - 1]
        out.append(f"  {a.step:>4}  {a.action:<13} {str(a.shape):<12} {sfrag:>7.3f} {ssegs:>4} "
                   f"{a.fragmentation:>10.3f} {a.segments:>4} {b.fragmentation:>9.3f} {b.segments:>4}")
    frag = {k: [s.fragmentation for s in v] for k, v in r.source.items()}
    out += ["", f"  {'':<20} {'source':>8} {'off':>8} {'on':>8}",
            f"  {'max fragmentation':<20} {workloads.SOURCE_MAX:>8.3f} {max(frag['off']):>8.3f} "
            f"{max(frag['on']):>8.3f}",
            f"  {'mean fragmentation':<20} {workloads.SOURCE_MEAN:>8.3f} "
            f"{sum(frag['off']) / len(frag['off']):>8.3f} {sum(frag['on']) / len(frag['on']):>8.3f}", "",
            f"A longer run: {r.steps} layers of {len(set(r.shapes))} mixed shapes (seed {r.seed}), "
            f"peak of live bytes {format_bytes(r.peak_live)}:",
            f"  {'compaction':<16} {'max frag':>9} {'mean frag':>10} {'peak reserved':>15} {'device allocs':>14} "
            f"{'smallest device':>22}"]
    for row in r.rows:
        if row.unavailable:
            out.append(f"  {row.name:<16} {row.unavailable}")
            continue
        smallest = ("n/a on a GPU" if not r.sim else "> 4x" if row.smallest is None
                    else f"{format_bytes(row.smallest)} ({row.smallest / r.peak_live:.2f}x)")
        out.append(f"  {row.name:<16} {row.max_fragmentation:>9.3f} {row.mean_fragmentation:>10.3f} "
                   f"{format_bytes(row.peak_reserved):>9} ({row.peak_reserved / r.peak_live:.2f}x) "
                   f"{row.device_allocs:>14} {smallest:>22}")
    out += ["",
            "'smallest device': the least sim capacity (2 MiB steps) on which the run completes without running "
            "out of memory, as a multiple of the live peak; 1.00x is what a perfect allocator needs.\n"
            "'device allocs': segments taken from the device; compaction gives emptied segments back, "
            "so it trades some device allocations for memory.\n"
            "'off' and 'on' run the defaults: expandable segments with stitching where the device has virtual "
            "memory\n(granules mapped at a segment's end, free granules of holes remapped side by side for a request "
            "no free range fits;\n'device allocs' then counts mappings); 'off, plain': segments allocated whole from "
            "the device, as before.", "",
            "Streaming a synthetic HDF5 model (the ten layer shapes, three passes) through cupool.streaming.LayerCache",
            "under the source's four cache settings, cupool's figures beside the source's:",
            streaming.format_table(r.table)]
    return "\n".join(out)
