"""PyTorch's path into cupool on sim: the shim's alloc + free, from Python and from a C loop, at several sizes.

Variants, each an allocation freed at once:

- ``pool``: ``pool.malloc(4096).free()`` from Python, the yardstick issue 33 names;
- ``shim``: ``cupool_torch_alloc(size, 0, NULL)`` then ``cupool_torch_free(...)``, each
  a ctypes call from Python (at the first size only);
- ``ctypes``: two calls of ``cupool_torch_free(NULL, ...)``, which returns at once: what
  ctypes alone costs for the two calls (at the first size only);
- ``compiled <size>``: the shim's two functions called from a loop that Numba compiled
  with ``nogil=True``: a C caller that has released the GIL, as torch's C++ calls them
  (torch's Python bindings release the GIL before they allocate), once per size.

Targets (issue 33): ``compiled <size> / pool`` at most 0.35 at every size, and no size
costing more than 1.3x another (``spread``).  CPU time of this thread
(``time.thread_time``), rounds interleaving the variants in a rotating order,
medians of per-round ratios.

    python benchmarks/bench_torch_shim.py [--number 20000] [--rounds 15] [--sizes 4KiB,1MiB,16MiB,256MiB]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import time
from collections.abc import Callable

from typing import TYPE_CHECKING

import cupool
from cupool import format_bytes, parse_size
from rounds import interleaved, paired  # benchmarks/rounds.py, beside this script

if TYPE_CHECKING:
    from cupool.torch import Shim


def cpu_per_round(body: Callable[[int], None], number: int) -> float:
    """Microseconds of this thread's CPU per iteration of ``body(number)``."""
    t0 = time.thread_time()
    body(number)
    return (time.thread_time() - t0) / number * 1e6


def variants(pool: cupool.Pool, sizes: list[int]) -> dict[str, Callable[[int], None]]:
    import cupool.torch

    s = cupool.torch.shim()
    lib = ctypes.CDLL(s.path)
    alloc = getattr(lib, s.alloc)
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = getattr(lib, s.free)
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    malloc = pool.malloc
    size = sizes[0]

    def through_pool(n: int) -> None:
        for _ in range(n):
            malloc(4096).free()

    def through_shim(n: int) -> None:
        for _ in range(n):
            ptr = alloc(size, 0, None)
            free(ptr, size, 0, None)

    def ctypes_alone(n: int) -> None:
        for _ in range(n):
            free(None, size, 0, None)
            free(None, size, 0, None)

    runs: dict[str, Callable[[int], None]] = {"pool": through_pool, "shim": through_shim, "ctypes": ctypes_alone}
    loop = compiled(s)
    for nbytes in sizes:
        runs[f"compiled {format_bytes(nbytes)}"] = functools.partial(loop, size=nbytes)
    return runs


def compiled(s: Shim) -> Callable[..., None]:
    """The shim's two functions called from machine code with the GIL released (Numba, through ctypes)."""
    import numba

    lib = ctypes.CDLL(s.path)
    alloc = getattr(lib, s.alloc)  # pointers as size_t: Numba passes integers (the same registers on x86-64)
    alloc.restype = ctypes.c_size_t
    alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t]
    free = getattr(lib, s.free)
    free.restype = None
    free.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t]

    @numba.njit(nogil=True)
    def loop(n: int, size: int) -> int:
        refused = 0
        for _ in range(n):
            ptr = alloc(size, 0, 0)
            refused += ptr == 0
            free(ptr, size, 0, 0)
        return refused

    def body(n: int, size: int) -> None:
        assert loop(n, size) == 0

    return body


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--sizes", default="4KiB,1MiB,16MiB,256MiB", help="comma-separated sizes (default: %(default)s)")
    args = ap.parse_args(argv)
    import cupool.torch  # after --help, which needs nothing

    sizes = [parse_size(x) for x in args.sizes.split(",")]
    pool = cupool.Pool("sim", capacity="1GiB")
    cupool.torch.use(pool)
    runs = variants(pool, sizes)
    times = interleaved({k: functools.partial(cpu_per_round, b) for k, b in runs.items()}, args.rounds, args.number)
    pool.check()
    assert pool.stats()["allocated_bytes.all.current"] == 0 and cupool.torch.live_blocks() == 0
    ratios = {
        "shim / pool": paired(times, "shim", "pool"),
        "(shim - ctypes) / pool": statistics.median(
            (s - c) / p for s, c, p in zip(times["shim"], times["ctypes"], times["pool"])),
    }
    by_size = [k for k in runs if k.startswith("compiled ")]
    for name in by_size:
        ratios[f"{name} / pool"] = paired(times, name, "pool")
    medians = [statistics.median(times[k]) for k in by_size]
    ratios["spread (largest / smallest compiled)"] = max(medians) / min(medians)
    print(f"load average {os.getloadavg()[0]:.1f}")
    for name in runs:
        print(f"{name:16s} {statistics.median(times[name]):7.3f} us per alloc + free (median of {args.rounds})")
    for name, ratio in ratios.items():
        print(f"{name:38s} {ratio:5.2f}x")
    cupool.torch.use(None)
    return ratios


if __name__ == "__main__":
    main()
