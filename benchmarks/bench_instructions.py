"""Instructions per warm ``pool.malloc(n).free()`` pair, counted by valgrind's callgrind: the steady figure.

CPU time on a shared machine moves by a third from run to run; the count of instructions
does not.  For each size the script runs a child process under callgrind twice, once
making ``--pairs`` warm pairs and once none (each beside ``--live`` live 4 KiB blocks on a
``Pool("sim", capacity="4GiB")``), and prints the difference per pair: Python's start,
the imports and the first allocation cancel out.  Run it from each checkout to compare
two versions (``PYTHONPATH=<checkout>``).  Needs ``valgrind`` on the PATH; each child
takes about 30 s.

    python benchmarks/bench_instructions.py [--sizes 4KiB,16MiB] [--pairs 20000] [--live 1000]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys

from cupool import format_bytes, parse_size

CHILD = """
import sys, cupool
size, pairs, live = map(int, sys.argv[1:4])
pool = cupool.Pool("sim", capacity="4GiB")
keep = [pool.malloc(4096) for _ in range(live)]
pool.malloc(size).free()
for _ in range(pairs):
    pool.malloc(size).free()
"""


def instructions(size: int, pairs: int, live: int) -> int:
    """Instructions callgrind counts for the child making ``pairs`` pairs of ``size`` bytes."""
    r = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", CHILD,
         str(size), str(pairs), str(live)],
        capture_output=True, text=True, check=True,
    )
    m = re.search(r"I\s+refs:\s+([\d,]+)", r.stderr)
    assert m is not None, r.stderr[-2000:]
    return int(m.group(1).replace(",", ""))


def main(argv: list[str] | None = None) -> dict[int, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4KiB,16MiB", help="comma-separated sizes (default: %(default)s)")
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--live", type=int, default=1000)
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_instructions: valgrind is not on the PATH")
    out = {}
    for size in (parse_size(x) for x in args.sizes.split(",")):
        per_pair = (instructions(size, args.pairs, args.live) - instructions(size, 0, args.live)) / args.pairs
        out[size] = per_pair
        print(f"{format_bytes(size):>8s}: {per_pair:,.0f} instructions per malloc + free pair")
    return out


if __name__ == "__main__":
    main()
