"""``cupool replay`` and ``cupool report``: the command-line side of ``cupool.replay``.

Kept out of the driver and the report so that those stay plain library code;
``cupool.cli`` registers these next to its own commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._units import format_bytes
from ..trace import load_trace
from .driver import (
    CONFIG_KEYS,
    ENGINES,
    FRAGMENTATION_NOTE,
    check_config,
    default_engine,
    parse_config,
    recorded_config,
    replay,
)
from .report import plot_report


def add_commands(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``replay`` and ``report`` through ``add_parser`` (a subparsers object's ``add_parser``)."""
    p = add_parser("replay", help="replay a trace on the sim device and report peak memory and fragmentation")
    p.add_argument("trace", help="cupool HDF5 trace, PyTorch memory snapshot pickle, or RMM log CSV")
    p.add_argument("--config", default=None, metavar="K=V,...",
                   help=f"pool settings over the recorded ones ({', '.join(CONFIG_KEYS)})")
    p.add_argument("--compare", nargs="+", default=None, metavar="CFG",
                   help="replay once per configuration (each K=V,...; 'recorded' for the recorded settings)")
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help="numba (fast) or pool (the real Pool, slow, takes any Pool argument, models compaction "
                        "and spilling); default: pool for traces with movable buffers, else numba")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on for long traces on a terminal)")
    p.set_defaults(func=_cmd_replay)
    p = add_parser("report", help="plot memory, fragmentation and a segment map of a trace")
    p.add_argument("trace", help="cupool HDF5 trace, PyTorch memory snapshot pickle, or RMM log CSV")
    p.add_argument("-o", "--output", default="report.png", help="image to write (default report.png)")
    p.add_argument("--config", default=None, metavar="K=V,...",
                   help=f"pool settings over the recorded ones ({', '.join(CONFIG_KEYS)})")
    p.set_defaults(func=_cmd_report)


def _cmd_replay(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    engine = args.engine or default_engine(trace)
    base = parse_config(args.config)
    specs = args.compare or [None]
    configs = [base if s in (None, "recorded") else {**base, **parse_config(s)} for s in specs]
    for c in configs:  # reject a bad key before spending time on any replay
        check_config({**recorded_config(trace, engine), **c}, engine)
    counts = trace.counts()
    print(f"{args.trace}: {len(trace)} events ({trace.format}; "
          + ", ".join(f"{k} {v}" for k, v in counts.items()) + ")")
    results = [replay(trace, c, engine=engine, progress=args.progress) for c in configs]
    for w in dict.fromkeys(w for r in results for w in r.warnings):
        print(f"warning: {w}")
    if args.compare is None:
        r = results[0]
        print(f"configuration      {_show_config(r.config)}")
        for label, value in (
            ("peak reserved", format_bytes(r.peak_reserved)),
            ("peak allocated", format_bytes(r.peak_allocated)),
            ("max fragmentation", f"{r.max_fragmentation:.3f} ({FRAGMENTATION_NOTE})"),
            ("mean fragmentation", f"{r.mean_fragmentation:.3f} (same samples)"),
            ("frag. at peak", f"{r.fragmentation_at_peak:.3f} (when reserved memory peaked)"),
            ("OOMs", str(r.ooms)),
            ("peak segments", str(r.peak_segments)),
            ("unmatched frees", str(r.unmatched_frees)),
            ("time", f"{r.seconds:.3f} s ({r.events_per_second / 1e6:.2f} M events/s, {r.engine})"),
        ):
            print(f"{label:<19}{value}")
        return 0
    head = (f"{'configuration':<34} {'peak reserved':>13} {'peak alloc':>11} {'max frag':>8} {'mean frag':>9} "
            f"{'frag@peak':>9} {'OOMs':>5} {'time':>8}")
    print(head)
    for spec, r in zip(specs, results):
        name = spec or "recorded"
        print(f"{name[:34]:<34} {format_bytes(r.peak_reserved):>13} {format_bytes(r.peak_allocated):>11} "
              f"{r.max_fragmentation:>8.3f} {r.mean_fragmentation:>9.3f} {r.fragmentation_at_peak:>9.3f} "
              f"{r.ooms:>5} {r.seconds:>7.3f}s")
    print(f"max/mean frag: {FRAGMENTATION_NOTE}; frag@peak: when reserved memory peaked ({engine} engine)")
    return 0


def _show_config(cfg: dict[str, Any]) -> str:
    sizes = ("capacity", "initial_size", "max_size", "release_threshold")
    return ", ".join(f"{k}={format_bytes(v) if k in sizes and isinstance(v, int) else v}"
                     for k, v in cfg.items()) or "defaults"


def _cmd_report(args: argparse.Namespace) -> int:
    out = _report_path(args.output)
    folder = out.resolve().parent
    if not folder.is_dir():  # before the replay, which can take a while
        raise OSError(f"cannot write the report {out}: the folder {folder} does not exist")
    trace = load_trace(args.trace)
    summary = plot_report(trace, out, parse_config(args.config))
    for w in summary["warnings"]:
        print(f"warning: {w}")
    print(f"wrote {out}: peak reserved {format_bytes(summary['peak_reserved'])}, "
          f"max fragmentation {summary['max_fragmentation']:.3f} ({FRAGMENTATION_NOTE}), "
          f"{summary['fragmentation_at_peak']:.3f} at peak reserved")
    return 0


def _report_path(output: str) -> Path:
    """The file the report goes to, so that the command names the file it writes.

    Given a folder, ``report.png`` in it; given a name without an extension,
    that name with ``.png`` (which matplotlib would add without a word).  An
    extension matplotlib cannot write is refused before the replay.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    out = Path(output)
    if out.is_dir():
        out = out / "report.png"
    elif not out.suffix:
        out = out.with_name(out.name + ".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise ValueError(f"cannot write the report {out}: {out.suffix!r} is not an image format matplotlib "
                         f"writes ({', '.join('.' + f for f in sorted(formats))})")
    return out
