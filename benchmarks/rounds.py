"""Interleaved rounds, as the hook benchmarks measure: every variant once per round, in a rotating order.

Imported by the ``bench_*.py`` scripts beside it (run as ``python benchmarks/bench_x.py``, which
puts this folder on ``sys.path``).  On a shared machine drift hits all variants alike this way,
and ratios taken round by round (``paired``) cancel most of it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable


def interleaved(measures: dict[str, Callable[[int], float]], rounds: int, number: int) -> dict[str, list[float]]:
    """Each ``measures[name](number)`` (a per-call time) once per round, after one warm-up of a tenth as
    many calls; round ``r`` starts at variant ``r`` of the list, so none always runs first."""
    names = list(measures)
    for measure in measures.values():
        measure(max(number // 10, 1))  # warm: segments made, stacks filled, code compiled or cached
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(measures[name](number))
    return samples


def paired(samples: dict[str, list[float]], name: str, base: str) -> float:
    """The median of ``name``'s per-round ratios to ``base``."""
    return statistics.median(a / b for a, b in zip(samples[name], samples[base]))


def print_medians(samples: dict[str, list[float]], base: str, against: str, width: int) -> None:
    """One line per variant: its median and minimum, and beside all but ``base`` its ratio to it
    (``against`` names ``base`` in the text), of medians and paired."""
    med = {k: statistics.median(v) for k, v in samples.items()}
    for name, values in samples.items():
        line = f"  {name:{width}s} median {med[name]:6.3f} us  (min {min(values):.3f})"
        if name != base:
            line += (f"  ratio to {against}: {med[name] / med[base]:.3f}x of medians, "
                     f"{paired(samples, name, base):.3f}x paired")
        print(line)
