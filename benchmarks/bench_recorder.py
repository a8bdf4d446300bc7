"""Cost of recording: malloc+free pairs with no recorder, a ring buffer, an HDF5 trace, and stacks.

    python benchmarks/bench_recorder.py [--pairs 200000] [--repeat 5]

Each pair emits two events (alloc, free).  Prints the median time per pair and
the added cost per event against the same run's unrecorded loop.  The no-op
subscriber row separates what the pool pays once anyone listens (it leaves its
small-block fast path) from what the recorder itself adds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import cupool


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
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


if __name__ == "__main__":
    main()
