"""Replay a trace on the sim device, under the recorded or other pool settings.

Only ``alloc``, ``free`` and ``oom`` events drive a replay (an ``oom`` is a request that
was refused: the replay makes it too, and frees at once what it gets); the pool decides its own
segments, so the trace's ``segment_*`` events are what the replay is compared
against, not inputs.  Frees of addresses the replay does not hold (a trace that
starts mid-run, an allocation the replay could not serve) are skipped and
counted; an ``alloc`` at an address still held frees the old block first (the
trace missed that free).  Compaction ``move`` events are not followed.

Two engines give the same numbers (``tests/test_replay.py`` holds them to it):

* ``"numba"`` (default): the compiled twin of the pool in ``_replay_engine``;
  millions of events per second.
* ``"pool"``: the real ``Pool`` on a fresh ``SimDevice``, one ``malloc``/``free``
  per event; slow, but it is the pool itself, and it accepts every ``Pool``
  argument, not only the sizes the compiled engine models.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ._units import format_bytes
from .errors import OutOfMemoryError
from .pool import Pool
from .trace import Trace, load_trace

#: Settings both engines model; the pool engine also takes any other ``Pool`` argument.
CONFIG_KEYS = ("capacity", "initial_size", "max_size", "memory_fraction", "release_threshold")
ENGINES = ("numba", "pool")
_CHUNK = 1 << 20
_PROGRESS_MIN = 2_000_000


@dataclass
class ReplayResult:
    """What a replay found; ``fragmentation`` is sampled after every alloc and free."""

    config: dict[str, Any]
    engine: str
    events: int
    peak_reserved: int
    peak_allocated: int
    max_fragmentation: float
    mean_fragmentation: float
    ooms: int
    peak_segments: int
    segment_allocs: int
    segment_frees: int
    unmatched_frees: int
    seconds: float
    timeline: dict[str, np.ndarray] | None = field(default=None, repr=False)

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else math.inf

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timeline")
        return d


def parse_config(spec: str | None) -> dict[str, Any]:
    """``"max_size=1GiB,release_threshold=none"`` -> dict; values stay strings unless numeric."""
    out: dict[str, Any] = {}
    if not spec:
        return out
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ValueError(f"configuration {spec!r}: expected KEY=VALUE, got {item!r}")
        out[key] = _parse_value(value)
    return out


def _parse_value(v: str) -> Any:
    if v.lower() in ("none", "null"):
        return None
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def recorded_config(trace: Trace) -> dict[str, Any]:
    """The recording pool's settings, as replay arguments (empty for foreign traces)."""
    cfg = {k: trace.config[k] for k in CONFIG_KEYS if trace.config.get(k) is not None}
    if "capacity" not in cfg and trace.config.get("limit"):
        # Recorded on a GPU: the sim device gets the pool's limit as its size.
        cfg["capacity"] = int(trace.config["limit"])
    return cfg


def _check_keys(config: dict[str, Any], engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"unknown replay engine {engine!r} (choose {' or '.join(ENGINES)})")
    pool_keys = [p for p in inspect.signature(Pool).parameters if p != "device"]
    for key in config:
        if key in CONFIG_KEYS:
            continue
        if key in pool_keys:
            if engine == "pool":
                continue
            raise ValueError(f"configuration key {key!r} is only modelled by the exact engine: use --engine pool")
        raise ValueError(f"unknown configuration key {key!r} (known: {', '.join(CONFIG_KEYS)})")


def _sim_pool(config: dict[str, Any]) -> Pool:
    try:
        return Pool("sim", **config)
    except OutOfMemoryError as e:
        raise ValueError(f"configuration {config}: {e}") from None


def replay(
    trace: Trace,
    config: dict[str, Any] | None = None,
    engine: str = "numba",
    timeline: bool = False,
    progress: bool | None = None,
    stop: int | None = None,
) -> ReplayResult:
    """Replay ``trace`` on a fresh sim pool with ``config`` (default: the recorded settings).

    ``timeline`` keeps reserved/allocated bytes after every event (numba engine);
    ``progress`` shows a tqdm bar (default: on long traces, when stderr is a
    terminal); ``stop`` replays only the first ``stop`` events.
    """
    cfg = {**recorded_config(trace), **(config or {})}
    _check_keys(cfg, engine)
    n = len(trace) if stop is None else max(0, min(stop, len(trace)))
    if progress is None:
        progress = n >= _PROGRESS_MIN and sys.stderr.isatty()
    if engine == "pool":
        if timeline:
            raise ValueError("timeline=True needs the numba engine")
        return _replay_pool(trace, cfg, n, progress)
    return _replay_numba(trace, cfg, n, timeline, progress)[0]


def _replay_pool(trace: Trace, cfg: dict[str, Any], n: int, progress: bool) -> ReplayResult:
    pool = _sim_pool(cfg)
    a_code, f_code, o_code = trace.code("alloc"), trace.code("free"), trace.code("oom")
    kind, addr, size, stream = (trace.kind[:n].tolist(), trace.addr[:n].tolist(),
                                trace.size[:n].tolist(), trace.stream[:n].tolist())
    live: dict[int, Any] = {}
    unmatched = 0
    frag_sum = frag_max = 0.0
    samples = 0
    bar = _bar(n, progress, "replay (pool)")
    t0 = time.perf_counter()
    for i in range(n):
        k = kind[i]
        if k == a_code or k == f_code:
            a = live.pop(addr[i], None)
            if a is not None:
                pool.free(a)
            elif k == f_code:
                unmatched += 1
            if k == a_code:
                try:
                    live[addr[i]] = pool.malloc(size[i], stream[i])
                except OutOfMemoryError:
                    pass
        elif k == o_code:
            try:
                pool.malloc(size[i], stream[i]).free()
            except OutOfMemoryError:
                pass
        else:
            continue
        f = pool.fragmentation()
        frag_sum += f
        frag_max = max(frag_max, f)
        samples += 1
        if bar is not None and i % 65536 == 0:
            bar.update(min(65536, n - bar.n))
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    s = pool.stats()
    return ReplayResult(
        config=cfg, engine="pool", events=n,
        peak_reserved=int(s["reserved_bytes.all.peak"]), peak_allocated=int(s["allocated_bytes.all.peak"]),
        max_fragmentation=frag_max, mean_fragmentation=frag_sum / samples if samples else 0.0,
        ooms=int(s["num_ooms"]), peak_segments=int(s["segment.all.peak"]),
        segment_allocs=int(s["num_device_alloc"]), segment_frees=int(s["num_device_free"]),
        unmatched_frees=unmatched, seconds=seconds,
    )


def _replay_numba(trace: Trace, cfg: dict[str, Any], n: int, timeline: bool, progress: bool):
    from . import _replay_engine as eng

    probe = _sim_pool(cfg)  # validates the settings exactly as Pool does and resolves them to bytes
    state = eng.new_state(
        int(trace.stream.max()) + 1 if len(trace) else 1,
        probe.device.capacity, probe.limit, probe.release_threshold, probe.config["initial_size"],
    )
    del probe
    tl_res = np.zeros(n if timeline else 0, np.int64)
    tl_alloc = np.zeros(n if timeline else 0, np.int64)
    codes = (trace.code("alloc"), trace.code("free"), trace.code("oom"))
    arrays = [state[k] for k in ("B", "FB", "S", "FS", "IX")]
    ext = state["EXT"]
    bar = _bar(n, progress, "replay")
    t0 = time.perf_counter()
    for lo in range(0, n, _CHUNK if bar is not None else max(n, 1)):
        hi = min(n, lo + (_CHUNK if bar is not None else n))
        B, FB, S, FS, IX, ext = eng.run(
            trace.kind, trace.addr, trace.size, trace.stream, lo, hi, *codes,
            state["st"], state["fst"], state["cfg"], *arrays, state["TG"], state["DT"], ext,
            state["live"], tl_res, tl_alloc,
        )
        arrays = [B, FB, S, FS, IX]
        if bar is not None:
            bar.update(hi - lo)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    st, fst = state["st"], state["fst"]
    samples = int(st[eng.SAMPLES])
    result = ReplayResult(
        config=cfg, engine="numba", events=n,
        peak_reserved=int(st[eng.PEAK_RES]), peak_allocated=int(st[eng.PEAK_ALLOC]),
        max_fragmentation=float(fst[1]), mean_fragmentation=float(fst[0] / samples) if samples else 0.0,
        ooms=int(st[eng.OOMS]), peak_segments=int(st[eng.PEAK_SEG]),
        segment_allocs=int(st[eng.DEV_ALLOCS]), segment_frees=int(st[eng.DEV_FREES]),
        unmatched_frees=int(st[eng.UNMATCHED]), seconds=seconds,
        timeline={"reserved": tl_res, "allocated": tl_alloc} if timeline else None,
    )
    return result, arrays[0], arrays[2], st


def layout(trace: Trace, config: dict[str, Any] | None = None, stop: int | None = None) -> list[dict[str, Any]]:
    """Segments and their blocks after replaying the first ``stop`` events (numba engine).

    Each segment: ``{"address", "size", "kind" ("small"/"large"), "blocks": [(offset, size, allocated)]}``.
    """
    from . import _replay_engine as eng

    cfg = {**recorded_config(trace), **(config or {})}
    _check_keys(cfg, "numba")
    n = len(trace) if stop is None else max(0, min(stop, len(trace)))
    _, B, S, st = _replay_numba(trace, cfg, n, False, False)
    out = []
    for s in range(int(st[eng.NS])):
        if not S[eng.S_ALIVE, s]:
            continue
        base = int(S[eng.S_ADDR, s])
        blocks = []
        b = int(S[eng.S_HEAD, s])
        while b >= 0:
            blocks.append((int(B[eng.ADDR, b]) - base, int(B[eng.SIZE, b]), not B[eng.FREE, b]))
            b = int(B[eng.NEXT, b])
        out.append({"address": base, "size": int(S[eng.S_SIZE, s]),
                    "kind": "small" if S[eng.S_KIND, s] == 0 else "large", "blocks": blocks})
    out.sort(key=lambda seg: seg["address"])
    return out


def _bar(n: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=n, desc=desc, unit="ev", unit_scale=True, file=sys.stderr)


# ------------------------------------------------------------------- the CLI
def add_command(sub: argparse._SubParsersAction) -> None:
    """Register ``cupool replay``."""
    p = sub.add_parser("replay", help="replay a trace on the sim device and report peak memory and fragmentation")
    p.add_argument("trace", help="cupool HDF5 trace, PyTorch memory snapshot pickle, or RMM log CSV")
    p.add_argument("--config", default=None, metavar="K=V,...",
                   help=f"pool settings over the recorded ones ({', '.join(CONFIG_KEYS)})")
    p.add_argument("--compare", nargs="+", default=None, metavar="CFG",
                   help="replay once per configuration (each K=V,...; 'recorded' for the recorded settings)")
    p.add_argument("--engine", choices=ENGINES, default="numba",
                   help="numba (fast, default) or pool (the real Pool, slow, takes any Pool argument)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on for long traces on a terminal)")
    p.set_defaults(func=_cmd_replay)


def _cmd_replay(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    base = parse_config(args.config)
    specs = args.compare or [None]
    configs = [base if s in (None, "recorded") else {**base, **parse_config(s)} for s in specs]
    for c in configs:  # reject a bad key before spending time on any replay
        _check_keys({**recorded_config(trace), **c}, args.engine)
    counts = trace.counts()
    print(f"{args.trace}: {len(trace)} events ({trace.format}; "
          + ", ".join(f"{k} {v}" for k, v in counts.items()) + ")")
    results = [replay(trace, c, engine=args.engine, progress=args.progress) for c in configs]
    if args.compare is None:
        r = results[0]
        print(f"configuration      {_show_config(r.config)}")
        for label, value in (
            ("peak reserved", format_bytes(r.peak_reserved)),
            ("peak allocated", format_bytes(r.peak_allocated)),
            ("max fragmentation", f"{r.max_fragmentation:.3f}"),
            ("mean fragmentation", f"{r.mean_fragmentation:.3f}"),
            ("OOMs", str(r.ooms)),
            ("peak segments", str(r.peak_segments)),
            ("unmatched frees", str(r.unmatched_frees)),
            ("time", f"{r.seconds:.3f} s ({r.events_per_second / 1e6:.2f} M events/s, {r.engine})"),
        ):
            print(f"{label:<19}{value}")
        return 0
    head = f"{'configuration':<34} {'peak reserved':>13} {'peak alloc':>11} {'max frag':>8} {'mean frag':>9} {'OOMs':>5} {'time':>8}"
    print(head)
    for spec, r in zip(specs, results):
        name = spec or "recorded"
        print(f"{name[:34]:<34} {format_bytes(r.peak_reserved):>13} {format_bytes(r.peak_allocated):>11} "
              f"{r.max_fragmentation:>8.3f} {r.mean_fragmentation:>9.3f} {r.ooms:>5} {r.seconds:>7.3f}s")
    return 0


def _show_config(cfg: dict[str, Any]) -> str:
    return ", ".join(f"{k}={format_bytes(v) if isinstance(v, int) and k != 'memory_fraction' else v}"
                     for k, v in cfg.items()) or "defaults"

