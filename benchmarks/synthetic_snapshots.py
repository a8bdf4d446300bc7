"""PyTorch memory snapshots written for issue 19's cases, every figure known: ``bench_real_traces.py`` reads them.

    python benchmarks/synthetic_snapshots.py FOLDER
    python benchmarks/bench_real_traces.py FOLDER

* ``mid_run.pickle``: a window opened mid-run on a cache: a 400 MiB segment
  holding one old 200 MiB block and a 600 MiB segment wholly free; the window
  allocates and frees 120 MiB and 500 MiB blocks.
* ``merged_196.pickle``: two 196 MiB blocks freed side by side in one 392 MiB
  segment, which PyTorch merged, then a 392 MiB request that the merged block serves.
* ``split_before_big.pickle``: a 1 GiB cached segment, a 12 MiB request that
  splits it, then a 1 GiB request: PyTorch maps a second 1 GiB segment.
* ``multi_device.pickle``: device 0 holds only a marker; device 1 runs a
  transformer-like step (weights, growing and shrinking activations, a cache
  emptied between phases); device 2 holds nothing.

The shapes are PyTorch's: ``device_traces`` of event dicts (``alloc``,
``free_requested``/``free_completed``, ``segment_alloc``/``segment_free``) and
the final ``segments`` with their blocks.
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

MiB = 1 << 20


def _ev(action: str, addr: int, size: int, t: int, stream: int = 0) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t, "frames": []}


def _free(addr: int, size: int, t: int) -> list[dict]:
    return [_ev("free_requested", addr, size, t), _ev("free_completed", addr, size, t)]


def mid_run() -> dict:
    a, c = 1 << 34, 1 << 35
    events = [_ev("alloc", a + 200 * MiB, 120 * MiB, 1), *_free(a + 200 * MiB, 120 * MiB, 2),
              _ev("alloc", c, 500 * MiB, 3), *_free(c, 500 * MiB, 4)]
    segments = [
        {"device": 0, "address": a, "total_size": 400 * MiB, "stream": 0, "segment_type": "large",
         "blocks": [{"address": a, "size": 200 * MiB, "requested_size": 200 * MiB, "state": "active_allocated"},
                    {"address": a + 200 * MiB, "size": 200 * MiB, "state": "inactive"}]},
        {"device": 0, "address": c, "total_size": 600 * MiB, "stream": 0, "segment_type": "large",
         "blocks": [{"address": c, "size": 600 * MiB, "state": "inactive"}]},
    ]
    return {"segments": segments, "device_traces": [events]}


def merged_196() -> dict:
    s = 1 << 34
    events = [_ev("segment_alloc", s, 392 * MiB, 1), _ev("alloc", s, 392 * MiB, 2), *_free(s, 392 * MiB, 3),
              _ev("alloc", s, 196 * MiB, 4), _ev("alloc", s + 196 * MiB, 196 * MiB, 5),
              *_free(s, 196 * MiB, 6), *_free(s + 196 * MiB, 196 * MiB, 7),
              _ev("alloc", s, 392 * MiB, 8), *_free(s, 392 * MiB, 9)]
    return {"segments": [], "device_traces": [events]}


def split_before_big() -> dict:
    s, t = 1 << 34, 1 << 35
    events = [_ev("segment_alloc", s, 1024 * MiB, 1), _ev("alloc", s, 1024 * MiB, 2), *_free(s, 1024 * MiB, 3),
              _ev("alloc", s, 12 * MiB, 4), _ev("segment_alloc", t, 1024 * MiB, 5), _ev("alloc", t, 1024 * MiB, 6),
              *_free(t, 1024 * MiB, 7), *_free(s, 12 * MiB, 8)]
    return {"segments": [], "device_traces": [events]}


def multi_device() -> dict:
    """Device 1: 24 layers of weights, then three steps whose activations grow and shrink; empty_cache between."""
    events, t, seg = [], 0, 1 << 36
    weights = []
    for layer in range(24):
        t += 1
        size = (40 + layer % 3 * 8) * MiB
        events += [_ev("segment_alloc", seg, size, t), _ev("alloc", seg, size, t)]
        weights.append(seg)
        seg += 1 << 30
    for step in range(3):
        acts = []
        for layer in range(24):
            t += 1
            size = (6 + (layer * 7 + step) % 11) * MiB + 4096 * layer
            events += [_ev("segment_alloc", seg, 20 * MiB, t), _ev("alloc", seg, size, t)]
            acts.append((seg, size))
            seg += 1 << 30
            if layer % 4 == 3:  # a temporary, freed at once
                t += 1
                events += [_ev("alloc", seg, 3 * MiB + 512, t), *_free(seg, 3 * MiB + 512, t)]
        for a, size in reversed(acts):  # backward: activations die in reverse
            t += 1
            events += _free(a, size, t)
        for a, _ in acts:  # the program's empty_cache(): every cached activation segment goes back
            t += 1
            events.append(_ev("segment_free", a, 20 * MiB, t))
    return {"segments": [], "device_traces": [[_ev("snapshot", 0, 0, 0)], events, []]}


SNAPSHOTS = {"mid_run": mid_run, "merged_196": merged_196, "split_before_big": split_before_big,
             "multi_device": multi_device}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    for name, make in SNAPSHOTS.items():
        path = args.folder / f"{name}.pickle"
        path.write_bytes(pickle.dumps(make()))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
