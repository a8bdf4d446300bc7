"""``cupool demo``: the weight-streaming workload, step by step, then a longer run and the streaming table.

Everything is computed before anything is printed, so that a bad argument or a
device too small for the demo is one line of error (with what would fit), not
half a report followed by a traceback.  On the sim device the demo first runs
each workload once at the given capacity (``fits``), silently, so that a
``--capacity`` below what the demo needs is one line, before any word of
progress and any run that writes its layers; that line names the least capacity
that fits, from the same search that fills the "smallest device" column.  On a
GPU, whose free memory is not known in advance, the refusal follows the run that
ran out of memory.

Three settings run both workloads (``SETTINGS``): plain segments without
compaction, as PyTorch's caching allocator works, which reproduces the source's
ten steps figure for figure; and cupool's defaults (expandable segments with
stitching where the device has virtual memory) with compaction off and on.

While it computes, the demo says so on stderr (``Progress``): a bar on a
terminal, after any notice (the fallback to the sim device is logged before the
bar starts, and log records during it are written above the bar), which leaves
nothing behind; elsewhere (a pipe, a log) one plain line per stage.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TextIO

from . import streaming, workloads
from ._units import format_bytes
from ._words import count
from .device import SimDevice, note_auto_fallback, resolve_device, split_device
from .device.kinds import AUTO
from .errors import OutOfMemoryError
from .pool import Pool

#: Pool settings of PyTorch's caching allocator: segments allocated whole from the device.
PLAIN: dict[str, Any] = {"expandable_segments": False, "stitch": False}
#: The settings both workloads run under: name, Pool settings, workload settings.  Compaction "off": plain
#: arrays, nothing may move; "on": the layers live in movable buffers and the pool compacts when fragmentation
#: passes its defrag_threshold (0.3).
SETTINGS: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    ("plain, off", PLAIN, {"movable": False}),
    ("off", {}, {"movable": False}),
    ("on", {}, {"movable": True}),
)
#: The granularity of capacities the demo searches (sim devices), as the "smallest device" column says.
STEP = 2 << 20


@dataclass
class MixedRow:
    """One setting's summary of the longer run."""

    name: str
    max_fragmentation: float
    mean_fragmentation: float
    peak_reserved: int
    device_allocs: int
    smallest: int | None = None  # sim only: the least capacity on which the run completes


@dataclass
class DemoResult:
    device: str
    sim: bool
    expandable: bool  # whether the defaults ("off", "on") use expandable segments on this device
    source: dict[str, list[workloads.Step]]  # the ten steps, by setting
    steps: int
    seed: int
    shapes: list[tuple[int, int]]
    peak_live: int
    rows: list[MixedRow]
    table: list[streaming.SettingRow]


class Progress:
    """Says on ``stream`` what the demo is computing: a bar on a terminal, else one line per stage.

    ``stage(what)`` announces the next stage (and counts the previous one done).
    The bar is tqdm's, cleared when it closes; while it shows, the ``cupool``
    logger's records are written above it rather than through it (``showing_progress``).
    """

    def __init__(self, stages: int, stream: TextIO) -> None:
        self.stream, self.total, self.started = stream, stages, 0
        self.bar: Any = None
        if stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=stages, file=stream, leave=False, dynamic_ncols=True,
                            bar_format="cupool demo: {desc} {bar} {n_fmt}/{total_fmt} [{elapsed}]")

    def stage(self, what: str) -> None:
        self.started += 1
        self.total = max(self.total, self.started)  # a stage not planned for (out of memory on a GPU)
        if self.bar is None:
            print(f"cupool demo [{self.started}/{self.total}]: {what}", file=self.stream, flush=True)
            return
        self.bar.total = self.total
        self.bar.set_description_str(what, refresh=False)
        self.bar.update(self.started - 1 - self.bar.n)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _AboveTheBar(logging.Handler):
    """Writes log records above a tqdm bar (``tqdm.write`` clears it, writes, and draws it again)."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self.progress.bar.write(self.format(record), file=self.progress.stream)


@contextmanager
def showing_progress(stages: int, stream: TextIO) -> Iterator[Progress]:
    """A ``Progress`` on ``stream``, closed at the end; while its bar shows, the ``cupool`` logger writes above it."""
    progress = Progress(stages, stream)
    log = logging.getLogger("cupool")
    handler = None if progress.bar is None else _AboveTheBar(progress)
    if handler is not None:
        log.addHandler(handler)
    try:
        yield progress
    finally:
        if handler is not None:
            log.removeHandler(handler)
        progress.close()


def check_args(steps: int, seed: int) -> None:
    """Refuse what the demo cannot run, before it runs anything."""
    if steps < 1:
        raise ValueError(f"--steps must be at least 1 (layers in the longer run), got {steps}")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")


def run(device: str, capacity: str | None, steps: int, seed: int) -> DemoResult:
    """Every figure the demo prints.  Raises ``ValueError`` saying what would fit if the device is too small."""
    check_args(steps, seed)
    kind, index = resolve_device(device, capacity, note_fallback=False)  # said below, unless refused
    fell_back = split_device(device)[0] == AUTO
    device = f"{kind.name}:{index}"
    first = Pool(device, capacity=capacity)

    def make(**pool_kw: Any) -> Pool:
        return Pool(device, capacity=capacity, **pool_kw)

    sim_device = first.device if isinstance(first.device, SimDevice) else None
    sim = sim_device is not None
    shapes = workloads.mixed_shapes(steps, seed=seed)
    peak_live = workloads.peak_live_bytes(shapes)
    if sim_device is not None and not fits(sim_device.capacity, shapes):  # before any word of progress
        # Only a bar, which leaves nothing behind, shows the search for what would fit: the refusal is one line.
        with showing_progress(len(SETTINGS), sys.stderr) if sys.stderr.isatty() else nullcontext() as searching:
            need = needed_capacity(steps, seed, searching)
        raise ValueError(_too_small(sim_device, need, steps, seed))
    if fell_back:
        note_auto_fallback(kind)  # no GPU: the sim device, said before the bar and the report
    with showing_progress((len(SETTINGS) if sim else 0) + 2 + len(SETTINGS), sys.stderr) as progress:
        smallest = smallest_devices(shapes, progress) if sim else {}
        progress.stage("the source's ten steps, each setting")
        try:
            source = ten_steps(make)
            rows = []
            for name, pool_kw, kw in SETTINGS:
                progress.stage(f"{steps} mixed layers, {name}")
                rows.append(mixed_run(make(**pool_kw), name, shapes, kw))
                rows[-1].smallest = smallest.get(name)
            progress.stage("the streaming table, four cache settings")
            table = streaming.settings_table(device=device, capacity=capacity)
        except OutOfMemoryError:
            if sim:  # the device is big enough for the demo: a fault of the demo's own, to be seen whole
                raise
            progress.stage("ran out of memory: finding what would fit (sim)")
            raise ValueError(_too_small(first.device, needed_capacity(steps, seed), steps, seed)) from None
    return DemoResult(first.device.name, sim, bool(first.config["expandable_segments"]), source, steps, seed,
                      shapes, peak_live, rows, table)


def _too_small(device: Any, need: int, steps: int, seed: int) -> str:
    if isinstance(device, SimDevice):
        return (f"--capacity {format_bytes(device.capacity)} is too small for the demo with --steps {steps} "
                f"--seed {seed}: it needs at least {format_bytes(need)} (give --capacity {need >> 20}MiB or more)")
    free, total = device.mem_info()
    return (f"{device.name} has {format_bytes(free)} free of {format_bytes(total)}, too little for the demo with "
            f"--steps {steps} --seed {seed}: it needs about {format_bytes(need)} free (what a sim device of that "
            f"size completes on); free memory on the GPU, or run --device sim --capacity {need >> 20}MiB")


def ten_steps(make: Callable[..., Pool]) -> dict[str, list[workloads.Step]]:
    """The source's ten steps under each setting, each on a fresh pool from ``make(**pool_settings)``."""
    return {name: workloads.weight_streaming(make(**pool_kw), workloads.source_shapes(), fill=True, **kw)
            for name, pool_kw, kw in SETTINGS}


def mixed_run(pool: Pool, name: str, shapes: list[tuple[int, int]], kw: dict[str, Any]) -> MixedRow:
    """The longer run of ``shapes`` on ``pool`` (workload settings ``kw``), summarised."""
    streamed = workloads.weight_streaming(pool, shapes, fill=True, **kw)
    fr = [s.fragmentation for s in streamed]
    return MixedRow(name, max(fr), sum(fr) / len(fr), max(s.reserved for s in streamed),
                    int(pool.stats()["num_device_alloc"]))


def _sim(pool_kw: dict[str, Any]) -> Callable[[int], Pool]:
    return lambda c: Pool("sim", capacity=c, **pool_kw)


def _least(pool_kw: dict[str, Any], shapes: list[tuple[int, int]], kw: dict[str, Any]) -> int:
    """The least sim capacity (a multiple of ``STEP``) on which ``shapes`` stream to the end.

    Success is monotone in the capacity (a deterministic pool and workload), so
    it is found by bisection: up to 4x the live peak first, where every setting
    lands on the demo's workloads, then up to 64x, where any completes.
    """
    live = workloads.peak_live_bytes(shapes)
    found = workloads.smallest_capacity(_sim(pool_kw), shapes, live, 4 * live, STEP, **kw)
    if found is None:
        found = workloads.smallest_capacity(_sim(pool_kw), shapes, 4 * live, 64 * live, STEP, **kw)
    assert found is not None, "64x the live peak always completes"
    return found


def smallest_devices(shapes: list[tuple[int, int]], progress: Progress | None = None) -> dict[str, int]:
    """Each setting's least sim capacity for the longer run of ``shapes``, by name."""
    out = {}
    for name, pool_kw, kw in SETTINGS:
        if progress is not None:
            progress.stage(f"the smallest device for {len(shapes)} mixed layers, {name}")
        out[name] = _least(pool_kw, shapes, kw)
    return out


def _source_need() -> int:
    return max(_least(pool_kw, workloads.source_shapes(), kw) for _, pool_kw, kw in SETTINGS)


def fits(capacity: int, shapes: list[tuple[int, int]]) -> bool:
    """Whether every run of the demo completes on a sim device of ``capacity``, with the longer run's ``shapes``.

    Asked before the demo says anything, so that a device too small is refused in
    one line: a device under either workload's live peak is too small outright;
    else each setting runs each workload once at that size (without writing the
    layers, as the search for the smallest device runs them), then the streaming
    table, a few seconds in all.
    """
    if capacity < max(workloads.peak_live_bytes(shapes), workloads.peak_live_bytes(workloads.source_shapes())):
        return False
    return all(workloads.completes(_sim(pool_kw), workload, capacity, **kw)
               for _, pool_kw, kw in SETTINGS for workload in (workloads.source_shapes(), shapes)
               ) and _table_fits(capacity)


def _table_fits(capacity: int) -> bool:
    """Whether the streaming table completes on a sim device of ``capacity``."""
    try:
        streaming.settings_table(device="sim", capacity=capacity)
        return True
    except OutOfMemoryError:
        return False


def needed_capacity(steps: int, seed: int, progress: Progress | None = None) -> int:
    """The least sim capacity (a multiple of ``STEP``) on which every run of the demo completes."""
    need = max(_source_need(), *smallest_devices(workloads.mixed_shapes(steps, seed=seed), progress).values())
    return _streaming_capacity(need)


def _streaming_capacity(start: int) -> int:
    """The least capacity from ``start`` up (in ``STEP``s) on which the streaming table completes."""
    if _table_fits(start):
        return start
    lo, hi = start, 2 * start
    while not _table_fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > STEP:  # fits(hi), not fits(lo)
        mid = (lo + hi) // 2 // STEP * STEP
        lo, hi = (lo, mid) if _table_fits(mid) else (mid, hi)
    return hi


def _frag_segs(s: workloads.Step) -> str:
    return f"{s.fragmentation:>9.3f} {s.segments:>4}"


def _reproduces(steps: list[workloads.Step]) -> bool:
    """Whether ``steps`` show the source's fragmentation (as printed) and segment count at every step."""
    return all(f"{s.fragmentation:.3f}" == f"{frag:.3f}" and s.segments == segs
               for s, (_, _, frag, segs) in zip(steps, workloads.SOURCE_STEPS, strict=True))


def format_result(r: DemoResult) -> str:
    """The demo's report, as ``cupool demo`` prints it."""
    names = [name for name, _, _ in SETTINGS]
    plain = r.source["plain, off"]
    defaults = ("expandable segments with stitching\n(this device has virtual memory)" if r.expandable
                else "plain segments too\n(this device has no virtual memory)")
    out = [f"cupool demo: weight streaming on {r.device} (4 cached layers, 2 evicted at a time, float32)",
           "Layers are written when loaded and checked when evicted, so a corrupting move would fail the run.", "",
           "Settings: 'plain, off' is PyTorch's caching allocator's way: plain segments (expandable_segments=False,\n"
           "stitch=False), compaction off.  'off' and 'on' are cupool's defaults, " + defaults + ", compaction off "
           "(plain arrays) and on (movable buffers, compacted when\nfragmentation passes 0.3).", "",
           "The source's ten steps (PyTorch's caching allocator) beside cupool's three settings:",
           f"  {'step':>4}  {'action':<13} {'shape':<12} {'source':>12}" + "".join(f" {n:>14}" for n in names),
           f"  {'':>4}  {'':<13} {'':<12} {'frag segs':>12}" + f" {'frag segs':>14}" * len(names)]
    for i, (action, shape, sfrag, ssegs) in enumerate(workloads.SOURCE_STEPS):
        out.append(f"  {i + 1:>4}  {action:<13} {str(shape):<12} {sfrag:>7.3f} {ssegs:>4}"
                   + "".join(f" {_frag_segs(r.source[n][i])}" for n in names))
    frag = {n: [s.fragmentation for s in r.source[n]] for n in names}
    out += ["", f"  {'':<20} {'source':>8}" + "".join(f" {n:>11}" for n in names),
            f"  {'max fragmentation':<20} {workloads.SOURCE_MAX:>8.3f}" + "".join(f" {max(frag[n]):>11.3f}"
                                                                                  for n in names),
            f"  {'mean fragmentation':<20} {workloads.SOURCE_MEAN:>8.3f}"
            + "".join(f" {sum(frag[n]) / len(frag[n]):>11.3f}" for n in names),
            "", "'plain, off' " + ("reproduces the source's fragmentation and segments at every step."
                               if _reproduces(plain) else "differs from the source: see the steps above."), "",
            f"A longer run: {count(r.steps, 'layer')} of {count(len(set(r.shapes)), 'mixed shape')} (seed {r.seed}), "
            f"peak of live bytes {format_bytes(r.peak_live)}:",
            f"  {'setting':<12} {'max frag':>9} {'mean frag':>10} {'peak reserved':>19} {'device allocs':>14} "
            f"{'smallest device':>22}"]
    for row in r.rows:
        smallest = ("n/a on a GPU" if row.smallest is None
                    else f"{format_bytes(row.smallest)} ({row.smallest / r.peak_live:.2f}x)")
        reserved = f"{format_bytes(row.peak_reserved)} ({row.peak_reserved / r.peak_live:.2f}x)"
        out.append(f"  {row.name:<12} {row.max_fragmentation:>9.3f} {row.mean_fragmentation:>10.3f} "
                   f"{reserved:>19} {row.device_allocs:>14} {smallest:>22}")
    out += ["",
            "'smallest device': the least sim capacity (2 MiB steps) on which the run completes without running out "
            "of memory,\nas a multiple of the live peak; 1.00x is what a perfect allocator needs.  'device allocs': "
            "segments taken from\nthe device (with expandable segments: mappings); compaction gives emptied segments "
            "back, so it trades some\ndevice allocations for memory.", "",
            "Streaming a synthetic HDF5 model (the ten layer shapes, three passes) through cupool.streaming.LayerCache",
            "under the source's four cache settings (cupool's defaults), cupool's figures beside the source's:",
            streaming.format_table(r.table)]
    return "\n".join(out)
