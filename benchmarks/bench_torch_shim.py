"""PyTorch's path into cupool on sim: the shim's alloc + free (called through ctypes) against ``malloc_key`` + free.

Four variants, each an allocation of ``--size`` bytes freed at once:

- ``pool``: ``a = pool.malloc_key(size, 0); a.free()`` from Python, the pool's own cost;
- ``shim``: ``cupool_torch_alloc(size, 0, NULL)`` then ``cupool_torch_free(...)``, each
  a ctypes call from Python;
- ``ctypes``: two calls of ``cupool_torch_free(NULL, ...)``, which returns at once: what
  ctypes alone costs for the two calls;
- ``compiled``: the same two ctypes functions called from a loop that Numba compiled with
  ``nogil=True``: a C caller that has released the GIL, as torch's C++ calls them
  (torch's Python bindings release the GIL before they allocate).

The target (issue 27) is the shim's alloc + free at most 1.5x ``pool``: ``shim / pool``
includes ctypes' own cost per call (about as much as the pool's whole work), so
``compiled / pool`` and ``(shim - ctypes) / pool`` say what the shim costs a C
caller.  CPU time of this thread (``time.thread_time``), rounds interleaving the
variants in a rotating order, medians of per-round ratios.

    python benchmarks/bench_torch_shim.py [--number 20000] [--rounds 15] [--size 4096]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import time
from collections.abc import Callable

from typing import TYPE_CHECKING

import cupool
from rounds import interleaved, paired  # benchmarks/rounds.py, beside this script

if TYPE_CHECKING:
    from cupool.torch import Shim


def cpu_per_round(body: Callable[[int], None], number: int) -> float:
    """Microseconds of this thread's CPU per iteration of ``body(number)``."""
    t0 = time.thread_time()
    body(number)
    return (time.thread_time() - t0) / number * 1e6


def variants(pool: cupool.Pool, size: int) -> dict[str, Callable[[int], None]]:
    import cupool.torch

    s = cupool.torch.shim()
    lib = ctypes.CDLL(s.path)
    alloc = getattr(lib, s.alloc)
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = getattr(lib, s.free)
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    malloc_key = pool.malloc_key

    def through_pool(n: int) -> None:
        for _ in range(n):
            a = malloc_key(size, 0)
            a.free()

    def through_shim(n: int) -> None:
        for _ in range(n):
            ptr = alloc(size, 0, None)
            free(ptr, size, 0, None)

    def ctypes_alone(n: int) -> None:
        for _ in range(n):
            free(None, size, 0, None)
            free(None, size, 0, None)

    return {"pool": through_pool, "shim": through_shim, "ctypes": ctypes_alone, "compiled": compiled(s, size)}


def compiled(s: Shim, size: int) -> Callable[[int], None]:
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

    def body(n: int) -> None:
        assert loop(n, size) == 0

    return body


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--size", type=int, default=4096)
    args = ap.parse_args(argv)
    import cupool.torch  # after --help, which needs nothing

    pool = cupool.Pool("sim", capacity="256MiB")
    cupool.torch.use(pool)
    runs = variants(pool, args.size)
    names = list(runs)
    times = interleaved({k: functools.partial(cpu_per_round, b) for k, b in runs.items()}, args.rounds, args.number)
    pool.check()
    assert pool.stats()["allocated_bytes.all.current"] == 0 and cupool.torch.live_blocks() == 0
    ratios = {
        "shim / pool": paired(times, "shim", "pool"),
        "(shim - ctypes) / pool": statistics.median(
            (s - c) / p for s, c, p in zip(times["shim"], times["ctypes"], times["pool"])),
        "compiled / pool": paired(times, "compiled", "pool"),
    }
    for name in names:
        print(f"{name:10s} {statistics.median(times[name]):7.3f} us per alloc + free (median of {args.rounds})")
    for name, ratio in ratios.items():
        print(f"{name:24s} {ratio:5.2f}x")
    cupool.torch.use(None)
    return ratios


if __name__ == "__main__":
    main()
