"""P1 in instructions: ``cupy.empty((256,), float32)`` + drop through each of ``bench_hooks.py``'s allocators.

CPU time on a shared machine moves by a third from run to run; valgrind's count of
instructions does not.  For each variant of ``bench_hooks.py`` (the do-nothing floor,
cupool's ``PoolMemory``, its ``UnownedMemory`` fallback) a child process runs under
callgrind twice, once making ``--calls`` warm ``cupy.empty`` + drop pairs and once none,
and the difference per call is printed with its ratio to the floor's: Python's start,
the imports and the first allocations cancel out.  The children run with
``PYTHONHASHSEED=0`` and one BLAS thread, so that two runs of one tree count the same
to the instruction; run it from each checkout to compare two versions
(``PYTHONPATH=<checkout>``).  Needs ``valgrind`` on the PATH; each child takes about 30 s.

The time ratio ``bench_hooks.py`` prints is higher than this one (1.52x where this
counted 1.38x on the same tree): an instruction of the pool's costs more time than
one of CuPy's, on average.  Both are reported; the target is the time ratio.

    python benchmarks/bench_hook_instructions.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = """
import sys
sys.path.insert(0, sys.argv[1])  # benchmarks/, for bench_hooks and its rounds module
import cupy, numpy as np
from bench_hooks import variants
name, calls = sys.argv[2], int(sys.argv[3])
cupy.cuda.set_allocator(variants()[name])
empty, f32 = cupy.empty, np.float32
for _ in range(200):  # warm: the pool's first block, CuPy's caches, the shells
    empty((256,), f32)
for _ in range(calls):
    empty((256,), f32)
"""


def instructions(variant: str, calls: int) -> int:
    """Instructions callgrind counts for a child making ``calls`` allocations through ``variant``."""
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    r = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", CHILD,
         str(HERE), variant, str(calls)],
        capture_output=True, text=True, check=True, env=env,
    )
    m = re.search(r"I\s+refs:\s+([\d,]+)", r.stderr)
    assert m is not None, r.stderr[-2000:]
    return int(m.group(1).replace(",", ""))


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_hook_instructions: valgrind is not on the PATH")
    sys.path.insert(0, str(HERE))
    from bench_hooks import FLOOR, variants

    out: dict[str, float] = {}
    for name in variants():
        out[name] = (instructions(name, args.calls) - instructions(name, 0)) / args.calls
        ratio = f"  {out[name] / out[FLOOR]:.3f}x the floor" if name != FLOOR else ""
        print(f"  {name:22s} {out[name]:8,.0f} instructions per cupy.empty((256,), float32) + drop{ratio}")
    return out


if __name__ == "__main__":
    main()
