"""``cupool replay`` and ``cupool report``: the command-line side of ``cupool.replay``.

Kept out of the driver and the report so that those stay plain library code;
``cupool.cli`` registers these next to its own commands.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._units import format_bytes
from .._words import count
from .. import settings
from ..device import split_device
from ..device.kinds import AUTO
from ..trace import Trace, load_trace
from ..trace.importers import CAPACITY_HEADROOM, recorded_peak_allocated
from .config import accepted_keys, check_settings, recorded_keys, recorded_peak_reserved_of, recorded_segments
from .driver import (
    ENGINES,
    FRAGMENTATION_NOTE,
    ReplayResult,
    default_engine,
    layout,
    parse_config,
    replay,
    trace_capacity,
)
from .report import oom_caveat, plot_report
from .seed import has_history, seed_count, seeded_blocks


#: ``--compare``'s names of whole configurations: the recording allocator's settings, and cupool's defaults.
RECORDED, CUPOOL = "recorded", "cupool"

REPLAY_DESCRIPTION = (
    "Replay a trace's allocations and frees on a fresh pool over the sim device (no GPU needed), and report peak "
    "reserved and allocated memory, fragmentation, OOMs and segments.  By default a trace replays under the "
    "recorded allocator's settings: a cupool trace's own, a PyTorch snapshot's kind of segments (plain, or "
    "expandable without stitching).  --config changes settings over those; --compare replays once per "
    "configuration and prints one row each ('--compare recorded cupool': the recorded allocator beside cupool's "
    "defaults on the same device).  Every result names the settings it ran with.")
REPORT_DESCRIPTION = (
    "Replay a trace as 'cupool replay' does (the same settings give the same figures) and plot memory over "
    "time, fragmentation over time and a segment map at the peak reserved moment, into one image.")


def add_commands(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``replay`` and ``report`` through ``add_parser`` (a subparsers object's ``add_parser``)."""
    p = add_parser("replay", help="replay a trace on the sim device and report peak memory and fragmentation",
                   description=REPLAY_DESCRIPTION)
    p.add_argument("trace", help="cupool HDF5 trace, PyTorch memory snapshot pickle, or RMM log CSV")
    p.add_argument("--config", default=None, metavar="K=V,...",
                   help="pool settings over the recorded ones (upstream=managed replays on managed memory, which "
                        f"may hold more than the device: the rows say how much more); {_keys()}")
    _add_capacity(p)
    p.add_argument("--compare", nargs="+", default=None, metavar="CFG",
                   help="replay once per configuration (each K=V,... with the keys --config takes, over --config "
                        "and the recorded settings; 'recorded' for those alone; 'cupool' for cupool's defaults, "
                        "expandable segments with stitching, on the recorded device, with --config over them); "
                        "every configuration is checked before the first replay, and rows print as each replay "
                        "finishes")
    p.add_argument("--device", default="auto", metavar="DEVICE",
                   help="which device of a multi-device PyTorch snapshot: its index (1), as torch takes one, or "
                        "named as 'cupool info' names one (cuda:1, or sim:1); auto (the default): the one with the "
                        "most events")
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help="numba (fast) or pool (the real Pool, slow, takes any Pool argument, models compaction "
                        "and spilling); default: pool for traces with movable buffers or settings only it "
                        "takes, else numba")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: on for long traces on a terminal)")
    p.add_argument("--json", action="store_true",
                   help="print each configuration's results as one JSON object per line, and nothing else")
    p.set_defaults(func=_cmd_replay)
    p = add_parser("report", help="plot memory, fragmentation and a segment map of a trace",
                   description=REPORT_DESCRIPTION)
    p.add_argument("trace", help="cupool HDF5 trace, PyTorch memory snapshot pickle, or RMM log CSV")
    p.add_argument("-o", "--output", default="report.png",
                   help="image to write (default report.png; a folder, one that exists or a name ending in '/', "
                        "gets report.png in it, a name without an extension gets .png), '-' for standard output; "
                        "a device or FIFO is written into")
    p.add_argument("--config", default=None, metavar="K=V,...",
                   help=f"pool settings over the recorded ones: {', '.join(accepted_keys('numba'))}; a trace with "
                        "movable buffers also takes "
                        f"{', '.join(k for k in accepted_keys('pool') if k not in accepted_keys('numba'))}")
    _add_capacity(p)
    p.set_defaults(func=_cmd_report)


def cupool_defaults(engine: str) -> dict[str, Any]:
    """``--compare cupool``: every recorded setting ``engine`` takes at cupool's default (the registry's), but
    the device's size, which stays the recorded one: what cupool would do with the recorded program.

    A PyTorch snapshot's recorded settings are its allocator's (plain segments, or
    expandable ones without stitching); cupool's defaults are expandable segments
    with stitching where the device has virtual memory, as the sim device has.
    """
    return {k: settings.BY_NAME[k].default for k in recorded_keys(engine) if k != "capacity"}


def _keys() -> str:
    """What ``--config`` takes, exactly (``check_config`` refuses anything else), from the settings registry."""
    return (f"the numba engine takes {', '.join(accepted_keys('numba'))}; the pool engine takes "
            f"{', '.join(accepted_keys('pool'))}")


def _snapshot_device(text: str) -> int | None:
    """``--device``: a PyTorch snapshot's device, named as ``info`` and ``demo`` name one (``split_device``'s
    syntax): ``cuda:1`` or ``sim:1`` (the sim device numbers its devices like GPUs) mean the snapshot's
    device 1, ``cuda`` its device 0, ``auto`` (None) the one with the most events; a bare index (``1``) is
    that device, as torch takes one.  No GPU is needed."""
    bare = text.strip()
    if bare.isascii() and bare.isdigit():
        return int(bare)
    try:
        kind, index = split_device(text)
    except ValueError as e:  # a DeviceNameError, naming the string: said as info and demo say it
        raise ValueError(f"--device {text}: {e}, or the index of a device of the snapshot, as in --device 1") from None
    return None if kind == AUTO else (0 if index is None else index)


def _add_capacity(p: argparse.ArgumentParser) -> None:
    p.add_argument("--capacity", default=None, metavar="SIZE",
                   help="the sim device's size (--config capacity=SIZE); default: the recorded one, else "
                        f"{float(CAPACITY_HEADROOM):g}x the trace's recorded peak reserved, else 4 GiB")


def _base_config(args: argparse.Namespace) -> dict[str, Any]:
    """``--config`` with ``--capacity`` folded in; saying the size twice is refused rather than guessed."""
    base = parse_config(args.config)
    if args.capacity is not None:
        if "capacity" in base:
            raise ValueError("give the capacity once: --capacity or --config capacity=..., not both")
        base["capacity"] = args.capacity
    return base


def _cmd_replay(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace, device=_snapshot_device(args.device))
    base = _base_config(args)
    specs = args.compare or [None]
    engine = args.engine or default_engine(trace, base)  # one engine for every configuration compared
    configs = [base if s in (None, RECORDED) else {**cupool_defaults(engine), **base} if s == CUPOOL
               else {**base, **parse_config(s)} for s in specs]
    for c in configs:  # refuse a bad key or value before spending time on any replay
        check_settings(trace, c, engine)
    if engine == "numba":  # the compile notice goes out before the output, not between its lines
        from .numba_engine import prepare

        prepare(trace)
    recorded_peak = recorded_peak_allocated(trace)
    recorded_reserved = recorded_peak_reserved_of(trace)
    results = (replay(trace, c, engine=engine, progress=args.progress) for c in configs)  # one at a time
    if args.json:
        for spec, c, r in zip(specs, configs, results):
            print(json.dumps(_json_row(args.trace, spec or RECORDED, r, _capacity_source(trace, c, args),
                                       recorded_peak, recorded_reserved), default=str), flush=True)
        return 0
    counts = trace.counts()
    print(f"{args.trace}: {len(trace)} events ({trace.format}; "
          + ", ".join(f"{k} {v}" for k, v in counts.items()) + ")", flush=True)
    if args.compare is None:
        r = next(results)
        _warn(r)
        if not r.history:
            print(_still_note(r.seeded_blocks))
        print(f"configuration      {_show_config(r.config, r.capacity)}")
        recorded = "" if recorded_reserved is None else f" (recorded: {format_bytes(recorded_reserved)})"
        rate = r.events_per_second
        rows = [
            ("capacity", f"{format_bytes(r.capacity)} ({_capacity_source(trace, configs[0], args)})"),
            ("peak reserved", format_bytes(r.peak_reserved) + recorded),
            ("peak allocated", format_bytes(r.peak_allocated)
             + ("" if recorded_peak is None else f" (recorded: {format_bytes(recorded_peak)})")),
            ("max fragmentation", f"{r.max_fragmentation:.3f} ({FRAGMENTATION_NOTE})"),
            ("mean fragmentation", f"{r.mean_fragmentation:.3f} (same samples)"),
            ("frag. at peak", f"{r.fragmentation_at_peak:.3f} (when reserved memory peaked)"),
            ("OOMs", str(r.ooms)),
            ("upstream", _upstream_note(r)),
            ("peak segments", str(r.peak_segments) + _recorded_segments(trace)),
            ("device calls", f"{r.device_allocs} to allocate or map, {r.device_frees} to free or unmap"),
            ("seeded blocks", f"{r.seeded_blocks} (alive before the recording started; the replay starts from "
                              "them, at their recorded offsets)"),
            ("unmatched frees", str(r.unmatched_frees)),
            ("time", f"{r.seconds:.3f} s for {r.replayed} events ("
                     + (f"{rate / 1e6:.2f} M events/s, " if rate is not None else "")
                     + f"{r.engine} engine)"),
        ]
        if not r.history:
            rows[3:6] = [("layout", _still_layout(trace, configs[0], engine)),
                         ("fragmentation", f"{r.fragmentation_at_peak:.3f} ((reserved - allocated) / reserved)")]
            rows[-1] = ("time", f"{r.seconds:.3f} s (a still picture: no events replayed, {r.engine} engine)")
        for label, value in rows:
            print(f"{label:<19}{value}")
        return 0
    names = [spec or RECORDED for spec in specs]
    width = max(13, *map(len, names))
    if recorded_reserved is not None or recorded_peak is not None:
        print(f"recorded: peak reserved {format_bytes(recorded_reserved) if recorded_reserved else 'unknown'}, "
              f"peak allocated {format_bytes(recorded_peak) if recorded_peak is not None else 'unknown'}")
    if not has_history(trace):
        print(_still_note(seeded_blocks(trace, seed_count(trace, len(trace)))))
    print(f"{'configuration':<{width}} {'capacity':>10} {'peak reserved':>13} {'peak alloc':>11} {'max frag':>8} "
          f"{'mean frag':>9} {'frag@peak':>9} {'OOMs':>5} {'oversub':>10} {'seeded':>7} {'unmatched':>9} "
          f"{'time':>8}  ran with",
          flush=True)
    warned: set[str] = set()
    for name, r in zip(names, results):
        for w in r.warnings:
            if w not in warned:
                warned.add(w)
                print(f"warning: {w}")
        print(f"{name:<{width}} {format_bytes(r.capacity):>10} {format_bytes(r.peak_reserved):>13} "
              f"{format_bytes(r.peak_allocated):>11} {r.max_fragmentation:>8.3f} {r.mean_fragmentation:>9.3f} "
              f"{r.fragmentation_at_peak:>9.3f} {r.ooms:>5} {format_bytes(r.peak_oversubscribed):>10} "
              f"{r.seeded_blocks:>7} {r.unmatched_frees:>9} "
              f"{r.seconds:>7.3f}s  {_show_config(r.config, r.capacity, capacity_shown=False)}", flush=True)
    print(f"max/mean frag: {FRAGMENTATION_NOTE}; frag@peak: when reserved memory peaked; oversub: the most "
          "held past the device's capacity (upstream=managed); seeded: blocks alive before the recording "
          f"started; unmatched: frees of blocks the replay never held ({engine} engine)")
    return 0


def _recorded_segments(trace: Trace) -> str:
    """The recording's peak segments beside the replay's, counted as the pool counts them (Note [Segments])."""
    recorded = recorded_segments(trace)
    return "" if recorded is None else f" (recorded: {recorded[0]})"


def _upstream_note(r: ReplayResult) -> str:
    """Where the replay's segments came from, and on managed memory how far past the device they went."""
    if r.upstream != "managed":
        return r.upstream
    return (f"managed (peak oversubscribed {format_bytes(r.peak_oversubscribed)}: reserved past the device's "
            f"{format_bytes(r.capacity)}, which a GPU pages out to the host)")


def _still_note(blocks: int) -> str:
    return (f"no history to replay: the events above are only the {blocks} blocks alive when this snapshot was "
            "taken, and their segments; what follows is that still picture, allocated on a fresh pool.  It records "
            f"no request either: {oom_caveat()}")


def _warn(r: ReplayResult) -> None:
    for w in r.warnings:
        print(f"warning: {w}")


def _capacity_source(trace: Trace, config: dict[str, Any], args: argparse.Namespace) -> str:
    """Where the simulated device's size came from, as the output says it."""
    if "capacity" in config:
        return "from --capacity" if config["capacity"] == args.capacity else "from --config"
    sized = trace_capacity(trace)
    return "the sim device's default" if sized is None else sized[1]


def _still_layout(trace: Trace, config: dict[str, Any], engine: str) -> str:
    """Segments, live blocks and free space of a still picture, in one line."""
    segments = layout(trace, config, engine=engine)
    holes = [size for seg in segments for _, size, allocated in seg["blocks"] if not allocated]
    live = sum(allocated for seg in segments for *_, allocated in seg["blocks"])
    return (f"{len(segments)} segments, {live} live blocks, {len(holes)} free blocks "
            f"({format_bytes(sum(holes))}, the largest {format_bytes(max(holes, default=0))})")


def _json_row(path: str, label: str, r: ReplayResult, capacity_source: str,
              recorded_peak: int | None, recorded_reserved: int | None) -> dict[str, Any]:
    """One configuration's results for ``--json``: plain numbers, for scripts and CI."""
    return {
        "trace": path, "configuration": label, "settings": r.config, "engine": r.engine, "events": r.events,
        "history": r.history, "peak_reserved": r.peak_reserved, "peak_allocated": r.peak_allocated,
        "recorded_peak_allocated": recorded_peak, "recorded_peak_reserved": recorded_reserved,
        "replayed": r.replayed, "max_fragmentation": r.max_fragmentation,
        "mean_fragmentation": r.mean_fragmentation, "fragmentation_at_peak": r.fragmentation_at_peak,
        "ooms": r.ooms, "upstream": r.upstream, "peak_oversubscribed": r.peak_oversubscribed,
        "peak_segments": r.peak_segments, "segment_allocs": r.segment_allocs,
        "segment_frees": r.segment_frees, "device_allocs": r.device_allocs, "device_frees": r.device_frees,
        "seeded_blocks": r.seeded_blocks, "unmatched_frees": r.unmatched_frees,
        "capacity": r.capacity, "capacity_source": capacity_source, "seconds": r.seconds,
        "events_per_second": r.events_per_second, "warnings": r.warnings,
    }


def _show_config(cfg: dict[str, Any], capacity: int, *, capacity_shown: bool = True) -> str:
    """The settings a replay ran with; the capacity as the sim device has it (rounded to its 2 MiB page),
    or left out where a column already shows it."""
    sizes = settings.names(kind="size")
    shown = {**cfg, "capacity": capacity} if "capacity" in cfg else dict(cfg)
    if not capacity_shown:
        shown.pop("capacity", None)
    return ", ".join(f"{k}={format_bytes(v) if k in sizes and isinstance(v, int) else v}"
                     for k, v in shown.items()) or "defaults"


def _cmd_report(args: argparse.Namespace) -> int:
    from .._files import output_name, refuse_overwriting_input, status_stream

    out = _report_path(args.output)  # before the replay, which can take a while
    refuse_overwriting_input(out, args.trace, "report")
    trace = load_trace(args.trace)
    config = _base_config(args)
    summary = plot_report(trace, out, config)
    said = status_stream(out)  # not into the image, when that is standard output
    for w in summary["warnings"]:
        print(f"warning: {w}", file=said)
    print(f"wrote {output_name(out)}: peak reserved {format_bytes(summary['peak_reserved'])}, "
          f"max fragmentation {summary['max_fragmentation']:.3f} ({FRAGMENTATION_NOTE}), "
          f"{summary['fragmentation_at_peak']:.3f} at peak reserved", file=said)
    over = format_bytes(summary["peak_oversubscribed"])
    managed = f"; managed memory, peak oversubscribed {over}" if summary["config"].get("upstream") == "managed" else ""
    print(f"capacity {format_bytes(summary['capacity'])} ({_capacity_source(trace, config, args)}); "
          f"{count(summary['ooms'], 'OOM')}{managed}", file=said)
    print(f"settings {_show_config(summary['config'], summary['capacity'], capacity_shown=False)}", file=said)
    return 0


def _report_path(output: str) -> Path:
    """The file the report goes to, so that the command names the file it writes.

    Given a folder (one that exists, or a name ending in a slash: ``output_path``,
    as ``export`` reads it), ``report.png`` in it; given a name without an
    extension, that name with ``.png`` (which matplotlib would add without a
    word).  An extension matplotlib cannot write is refused before the replay.
    Standard output (``-``), a device or a FIFO is written as it is named (a PNG
    if the name has no extension).
    """
    from matplotlib.backend_bases import FigureCanvasBase

    from .._files import output_path, written_in_place

    out = output_path(output, "report.png", "report")
    in_place = written_in_place(output)
    if not out.suffix and not in_place:
        out = out.with_name(out.name + ".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if (out.suffix or not in_place) and out.suffix[1:].lower() not in formats:
        raise ValueError(f"cannot write the report {out}: {out.suffix!r} is not an image format matplotlib "
                         f"writes ({', '.join('.' + f for f in sorted(formats))})")
    return out
