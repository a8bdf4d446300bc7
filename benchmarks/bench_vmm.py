"""Virtual-memory latency: the driver calls behind expandable segments, and a pool's grow and unmap.

    python benchmarks/bench_vmm.py [--device sim|cuda] [--granules 1 8 64] [--repeats 20] [--json]

Per batch of N granules (one chunk each, as the pool makes them): create N chunks,
map each, one set_access over the run, unmap the run, release the chunks.  Then a
pool with ``expandable_segments=True``: a malloc that grows its segment by N
granules, and the ``empty_cache()`` that unmaps them.  Beside them, what a plain
segment of the same bytes costs: the device's ``malloc`` and ``free``
(``cudaMalloc``/``cudaFree`` on ``cuda``).  Medians of ``--repeats``, in
microseconds, per batch and per granule; ``--json`` prints one JSON object instead
(seconds; ``python -m cupool.validate`` reads it).  On ``cuda`` this needs the ``vmm``
extra (``cuda-bindings``); on ``sim`` the granules are a memfd's pages (what the
tests run on), which says nothing about a GPU's costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

GRANULE = 2 << 20


def driver_costs(vm, n: int, repeats: int) -> dict[str, float]:
    """Median seconds of each step for a run of ``n`` granules."""
    base = vm.reserve(n * GRANULE)
    steps: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            chunks = [vm.create(GRANULE) for _ in range(n)]
            t1 = time.perf_counter()
            for i, c in enumerate(chunks):
                vm.map(base + i * GRANULE, c)
            t2 = time.perf_counter()
            vm.set_access(base, n * GRANULE)
            t3 = time.perf_counter()
            vm.unmap(base, n * GRANULE)
            t4 = time.perf_counter()
            for c in chunks:
                vm.release(c)
            t5 = time.perf_counter()
            for k, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                steps[k].append(dt)
    finally:
        vm.free_range(base)
    return {k: statistics.median(v) for k, v in steps.items()}


def pool_costs(device: str, n: int, repeats: int) -> tuple[float, float]:
    """Median seconds of a malloc that grows by ``n`` granules, and of the empty_cache that unmaps them."""
    import cupool

    kw = {"capacity": f"{max(64, 4 * n * 2)}MiB"} if device == "sim" else {}
    pool = cupool.Pool(device, expandable_segments=True, **kw)
    grow, unmap = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = pool.malloc(n * GRANULE)
        t1 = time.perf_counter()
        a.free()
        t2 = time.perf_counter()
        pool.empty_cache()
        t3 = time.perf_counter()
        grow.append(t1 - t0)
        unmap.append(t3 - t2)
    pool.close()
    return statistics.median(grow), statistics.median(unmap)


def malloc_costs(device, n: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the device's malloc of ``n`` granules' bytes, and of its free."""
    alloc, free = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ptr = device.malloc(n * GRANULE)
        t1 = time.perf_counter()
        device.free(ptr, n * GRANULE)
        t2 = time.perf_counter()
        alloc.append(t1 - t0)
        free.append(t2 - t1)
    return statistics.median(alloc), statistics.median(free)


COLUMNS = ("create", "map", "set_access", "unmap", "release", "pool grow", "pool unmap", "malloc", "free")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("sim", "cuda"), default="cuda")
    ap.add_argument("--granules", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="print one JSON object (seconds) instead of the table")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        from cupool.device import CudaDevice

        device = CudaDevice(0)
        vm = device.virtual_memory()
    else:
        from cupool.device import SimDevice

        device = SimDevice(f"{2 * max(args.granules) * 2 + 2}MiB")
        vm = device.virtual_memory()
    rows = []
    for n in args.granules:
        d = driver_costs(vm, n, args.repeats)
        rows.append({"granules": n, **dict(zip(COLUMNS, [*d.values(), *pool_costs(args.device, n, args.repeats),
                                                         *malloc_costs(device, n, args.repeats)]))})
    if args.json:
        print(json.dumps({"device": args.device, "vm": repr(vm), "repeats": args.repeats, "rows": rows}))
        return 0
    print(f"{vm!r}; medians of {args.repeats}; microseconds per batch (per granule)")
    print(f"{'granules':>8} " + " ".join(f"{c:>16}" for c in COLUMNS))
    for row in rows:
        n = row["granules"]
        print(f"{n:>8} " + " ".join(f"{row[c] * 1e6:>8.1f} ({row[c] * 1e6 / n:>5.1f})" for c in COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
