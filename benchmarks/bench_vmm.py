"""Virtual-memory latency: the driver calls behind expandable segments, and a pool's grow and unmap.

    python benchmarks/bench_vmm.py [--device sim|cuda] [--granules 1 8 64] [--repeats 20]

Per batch of N granules (one chunk each, as the pool makes them): create N chunks,
map each, one set_access over the run, unmap the run, release the chunks.  Then a
pool with ``expandable_segments=True``: a malloc that grows its segment by N
granules, and the ``empty_cache()`` that unmaps them.  Medians of ``--repeats``,
in microseconds, per batch and per granule.  On ``cuda`` this needs the ``vmm``
extra (``cuda-bindings``); on ``sim`` the granules are a memfd's pages (what the
tests run on), which says nothing about a GPU's costs.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("sim", "cuda"), default="cuda")
    ap.add_argument("--granules", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if args.device == "cuda":
        from cupool.device import CudaDevice

        vm = CudaDevice(0).virtual_memory()
    else:
        from cupool.device import SimVirtualMemory

        vm = SimVirtualMemory(f"{2 * max(args.granules) * 2 + 2}MiB")
    print(f"{vm!r}; medians of {args.repeats}; microseconds per batch (per granule)")
    print(f"{'granules':>8} {'create':>16} {'map':>16} {'set_access':>16} {'unmap':>16} {'release':>16} "
          f"{'pool grow':>16} {'pool unmap':>16}")
    for n in args.granules:
        d = driver_costs(vm, n, args.repeats)
        g, u = pool_costs(args.device, n, args.repeats)
        cells = [*d.values(), g, u]
        print(f"{n:>8} " + " ".join(f"{c * 1e6:>8.1f} ({c * 1e6 / n:>5.1f})" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
