"""Cost of recording: malloc+free pairs with no recorder, a ring buffer, an HDF5 trace, and stacks; and of one flush.

    python benchmarks/bench_recorder.py [--pairs 200000] [--repeat 5] [--events 200000]

Each pair emits two events (alloc, free).  Prints the median time per pair and
the added cost per event against the same run's unrecorded loop.  The no-op
subscriber row separates what the pool pays once anyone listens (it leaves its
small-block fast path) from what the recorder itself adds.

The second table writes ``--events`` events to a trace file in batches (as the
recorder's flushes do, from the event that fills a batch or from its timer)
through cupool's writer (rows written with ``os.pwrite`` into a file HDF5 laid
out in memory, so that a full disk or a kill cannot hurt) and through the h5py
SWMR writer cupool used before, which a failed write could crash and a kill
left unreadable without ``swmr=True``: the median time per flush and per event.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import cupool
from cupool.core.events import KINDS
from cupool.trace.format import Hdf5Writer


def _loop(pool: cupool.Pool, pairs: int) -> float:
    t0 = time.perf_counter()
    for _ in range(pairs):
        pool.malloc(4096).free()
    return time.perf_counter() - t0


class _Noop:
    """A subscriber that does nothing: what the pool itself pays once anyone listens."""

    def __init__(self, pool: cupool.Pool) -> None:
        self.pool = pool

    def start(self) -> None:
        self._unsubscribe = self.pool.subscribe(lambda ev: None)

    def stop(self) -> None:
        self._unsubscribe()


class _SwmrWriter:
    """The writer cupool had before (chunked columns resized per batch, SWMR mode), as the baseline."""

    def __init__(self, path: Path, stacks: bool) -> None:
        self.path = path

    def open(self, config: dict) -> None:
        import h5py

        self._f = f = h5py.File(self.path, "w", libver="latest")
        for name in ("t_ns", "kind", "addr", "size", "stream"):
            f.create_dataset(name, shape=(0,), maxshape=(None,), chunks=(1 << 14,),
                             dtype=np.uint8 if name == "kind" else np.int64)
        f.create_dataset("count", data=np.int64(0))
        f.swmr_mode = True
        self._codes = {k: i for i, k in enumerate(KINDS)}

    def append(self, events: list[tuple]) -> None:
        f, n = self._f, len(events)
        n0 = f["t_ns"].shape[0]
        cols = list(zip(*events))
        data = {"t_ns": cols[0], "kind": [self._codes[k] for k in cols[1]], "addr": cols[2], "size": cols[3],
                "stream": cols[4]}
        for name, values in data.items():
            ds = f[name]
            ds.resize((n0 + n,))
            ds[n0:] = np.asarray(values, ds.dtype)
        f.flush()
        f["count"][()] = n0 + n
        f.flush()

    def close(self) -> None:
        self._f.close()


def _flushes(writer: type, path: Path, events: list[tuple], batch: int) -> list[float]:
    w = writer(path, stacks=False)
    w.open({})
    times = []
    for i in range(0, len(events), batch):
        t0 = time.perf_counter()
        w.append(events[i : i + batch])
        times.append(time.perf_counter() - t0)
    w.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--events", type=int, default=200_000, help="events per file in the flush table")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    pool = cupool.Pool("sim", capacity="256MiB")
    _loop(pool, 1000)
    modes = {
        "off": lambda i: None,
        "no-op subscriber": lambda i: _Noop(pool),
        "ring buffer": lambda i: pool.record(),
        "HDF5 trace": lambda i: pool.record(tmp / f"t{i}.h5"),
        "HDF5 + stacks": lambda i: pool.record(tmp / f"s{i}.h5", stacks=True),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(args.repeat):
        for name, make in modes.items():  # interleaved, so drift hits every mode alike
            pairs = args.pairs if name != "HDF5 + stacks" else args.pairs // 10
            rec = make(i)
            if rec is not None:
                rec.start()
            times[name].append(_loop(pool, pairs) / pairs)
            if rec is not None:
                rec.stop()
    base = statistics.median(times["off"])
    print(f"{'mode':<18}{'per pair':>12}{'per event added':>18}{'ratio':>8}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<18}{med * 1e6:>10.2f}us{(med - base) / 2 * 1e9:>16.0f}ns{med / base:>8.2f}")

    events = [(i, KINDS[i % 2], 1 << 20 | i, 512 * (1 + i % 97), i % 3) for i in range(args.events)]
    writers = {"cupool (pwrite)": Hdf5Writer, "h5py SWMR (before)": _SwmrWriter}
    print(f"\n{'writer':<20}{'batch':>7}{'per flush (median)':>20}{'per flush (max)':>17}{'per event':>11}")
    for batch in (256, 4096):
        flush_times: dict[str, list[float]] = {w: [] for w in writers}
        for i in range(args.repeat):
            for name, writer in writers.items():
                flush_times[name] += _flushes(writer, tmp / f"f{batch}-{i}-{len(name)}.h5", events, batch)
        for name, ts in flush_times.items():
            med = statistics.median(ts)
            print(f"{name:<20}{batch:>7}{med * 1e6:>18.0f}us{max(ts) * 1e3:>15.1f}ms"
                  f"{sum(ts) / (args.repeat * len(events)) * 1e9:>9.0f}ns")


if __name__ == "__main__":
    main()
