"""Instructions per warm ``pool.malloc(n).free()`` pair, counted by valgrind's callgrind: the steady figure.

CPU time on a shared machine moves by a third from run to run; the count of instructions
does not.  For each size the script runs a child process under callgrind twice, once
making ``--pairs`` warm pairs and once none (each beside ``--live`` live 4 KiB blocks on a
``Pool("sim", capacity="4GiB")``), and prints the difference per pair: Python's start,
the imports and the first allocation cancel out.  Run it from each checkout to compare
two versions (``PYTHONPATH=<checkout>``).  Needs ``valgrind`` on the PATH; each child
takes about 30 s.

``--shapes`` counts a loop with dynamic shapes instead (Note [Cold stacks]): each pass
allocates ``--recurring`` small sizes (odd multiples of 512 bytes, less 100), frees half,
allocates ``--new`` sizes no pass has asked for before (even multiples), then frees the
rest; printed per operation, with the loop's peak reserved (a run without valgrind).  ``--pairs`` / 20 passes, at most 1,000 new sizes in all.

    python benchmarks/bench_instructions.py [--sizes 4KiB,16MiB] [--pairs 20000] [--live 1000]
    python benchmarks/bench_instructions.py --shapes [--recurring 8] [--new 1] [--pairs 20000]
"""

from __future__ import annotations

import argparse
import os
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

SHAPES = """
import sys, cupool
passes, live, recurring, new = map(int, sys.argv[1:5])
pool = cupool.Pool("sim", capacity="4GiB")
keep = [pool.malloc(4096) for _ in range(live)]
sizes = [512 * (2 * i + 1) - 100 for i in range(recurring)]
novel = iter([512 * (2 * i + 2) - 100 for i in range(1000)])
def one():
    a = [pool.malloc(n) for n in sizes]
    for x in a[:recurring // 2]:
        x.free()
    b = [pool.malloc(next(novel)) for _ in range(new)]
    for x in a[recurring // 2:] + b:
        x.free()
for _ in range(3):  # warm: a size's third pass finds its blocks parked (Note [Cold stacks])
    one()
for _ in range(passes):
    one()
s = pool.stats()
print(s["reserved_bytes.all.peak"], s["allocated_bytes.all.peak"])
"""


def instructions(child: str, *args: int) -> int:
    """Instructions callgrind counts for ``child`` run with ``args``."""
    r = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", child,
         *map(str, args)],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "0"},  # same dicts each run
    )
    m = re.search(r"I\s+refs:\s+([\d,]+)", r.stderr)
    assert m is not None, r.stderr[-2000:]
    return int(m.group(1).replace(",", ""))


def main(argv: list[str] | None = None) -> dict[int, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4KiB,16MiB", help="comma-separated sizes (default: %(default)s)")
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--live", type=int, default=1000)
    ap.add_argument("--shapes", action="store_true", help="the dynamic-shapes loop, per operation")
    ap.add_argument("--recurring", type=int, default=8, help="--shapes: recurring sizes a pass")
    ap.add_argument("--new", type=int, default=1, help="--shapes: new sizes a pass")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_instructions: valgrind is not on the PATH")
    out = {}
    if args.shapes:
        passes = min(args.pairs // 20, 1000 // args.new - 3)
        shape = (args.live, args.recurring, args.new)
        per_op = (instructions(SHAPES, passes, *shape) - instructions(SHAPES, 0, *shape)) / (
            passes * 2 * (args.recurring + args.new))
        peaks = subprocess.run([sys.executable, "-c", SHAPES, str(passes), *map(str, shape)], capture_output=True,
                               text=True, check=True).stdout.split()
        print(f"dynamic shapes, {args.recurring} recurring and {args.new} new sizes a pass: "
              f"{per_op:,.0f} instructions per operation; peak reserved {format_bytes(int(peaks[0]))}, "
              f"{int(peaks[0]) / int(peaks[1]):.2f}x the live peak")
        return {0: per_op}
    for size in (parse_size(x) for x in args.sizes.split(",")):
        made = instructions(CHILD, size, args.pairs, args.live) - instructions(CHILD, size, 0, args.live)
        per_pair = made / args.pairs
        out[size] = per_pair
        print(f"{format_bytes(size):>8s}: {per_pair:,.0f} instructions per malloc + free pair")
    return out


if __name__ == "__main__":
    main()
