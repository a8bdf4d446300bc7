"""The compiled fast path against the same code uncompiled (``CUPOOL_PURE_PYTHON=1``), in one run.

Each figure is measured in a fresh interpreter per path, the two paths interleaved
round after round so that drift on a shared machine hits both alike; medians of
the rounds are compared.  Figures (CPU time per operation, ``time.process_time``,
which a loaded machine disturbs less than wall time):

- ``pair``: ``pool.malloc(1000).free()`` with 1,000 blocks live (issue 18: compiled
  <= 0.4x pure);
- ``churn``: free a random one of 100,000 live blocks, allocate a random small size
  (issue 18: <= 0.6x);
- ``hook``: ``cupy.empty((256,), float32)`` + drop through ``cupool.cupy_allocator``
  and, in the same interpreter, through the floor allocator (a fixed pointer):
  their ratio is ``bench_hooks.py``'s (issue 18: <= 1.25x compiled).  Needs CuPy.

    python benchmarks/bench_paths.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_MEASURE = r"""
import json, sys, time
import numpy as np
import cupool
from cupool.core import build_info

def per_op(loop, n, repeats=5):
    loop(n // 10)
    out = []
    for _ in range(repeats):
        t0 = time.process_time(); loop(n); out.append((time.process_time() - t0) / n * 1e9)
    return min(out)  # the least disturbed repeat of this round; rounds are then compared by median

pool = cupool.Pool("sim", capacity="4GiB", defrag_threshold=None)
malloc = pool.malloc
keep = [malloc(1000) for _ in range(1000)]
def pair(n):
    for _ in range(n):
        malloc(1000).free()
res = {"path": build_info()["fast_path"], "pair": per_op(pair, 50_000)}
rng = np.random.default_rng(0)
live = [malloc(int(s)) for s in rng.choice([256, 512, 1000, 4096, 20_000], size=100_000)]
victims = rng.integers(0, len(live), size=200_000).tolist()
sizes = rng.choice([256, 512, 1000, 4096, 20_000], size=200_000).tolist()
pos = [0]
def churn(n):
    i = pos[0]
    for k in range(i, i + n):
        v = victims[k % 200_000]
        live[v].free()
        live[v] = malloc(sizes[k % 200_000])
    pos[0] = i + n
res["churn"] = per_op(churn, 20_000)
try:
    import cupy
except ImportError:
    cupy = None
if cupy is not None:
    arena = np.zeros(1 << 20, np.uint8)
    fixed, owner = arena.ctypes.data, object()
    pointer, unowned = cupy.cuda.MemoryPointer, cupy.cuda.UnownedMemory
    def floor_alloc(nbytes):
        return pointer(unowned(fixed, nbytes, owner, 0), 0)
    empty, f32 = cupy.empty, np.float32
    def hook(n):
        for _ in range(n):
            empty((256,), f32)
    cupy.cuda.set_allocator(floor_alloc)
    floor = per_op(hook, 20_000)
    cupy.cuda.set_allocator(cupool.cupy_allocator(pool))
    res["hook"] = per_op(hook, 20_000)
    res["hook_floor"] = floor
    cupy.cuda.set_allocator()
pool.check()
print(json.dumps(res))
"""


def _run(pure: bool) -> dict[str, float]:
    env = dict(os.environ, CUPOOL_PURE_PYTHON="1" if pure else "0")
    out = subprocess.run([sys.executable, "-c", _MEASURE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per path")
    args = ap.parse_args()
    rounds: dict[str, list[dict[str, float]]] = {"compiled": [], "pure": []}
    for _ in range(args.rounds):
        for pure in (False, True):
            r = _run(pure)
            rounds["pure" if pure else "compiled"].append(r)
    if rounds["compiled"][0]["path"] != "compiled":
        sys.exit("the compiled fast path is not built here (cupool info says why): nothing to compare")
    med = {p: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "path"} for p, rs in rounds.items()}
    print(f"{'figure':<12} {'compiled (ns)':>14} {'pure (ns)':>10} {'ratio':>7}   target")
    targets = {"pair": 0.4, "churn": 0.6}
    for k in ("pair", "churn"):
        c, p = med["compiled"][k], med["pure"][k]
        print(f"{k:<12} {c:>14.0f} {p:>10.0f} {c / p:>6.2f}x   <= {targets[k]}x")
    if "hook" in med["compiled"]:
        for path in ("compiled", "pure"):
            h, f = med[path]["hook"], med[path]["hook_floor"]
            print(f"hook {path:<8}: cupy.empty+drop {h:.0f} ns, floor {f:.0f} ns: {h / f:.2f}x the floor"
                  + ("   (target <= 1.25x)" if path == "compiled" else ""))


if __name__ == "__main__":
    main()
