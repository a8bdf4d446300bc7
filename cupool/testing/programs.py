"""Allocation programs: interleavings of pool operations as plain data, and their replay.

A program is a tuple of small frozen dataclasses rather than code, because
hypothesis shrinks data: a failing interleaving comes back as the shortest
program that still fails, which prints as Python and replays outside hypothesis
(``run_program(pool, program)``).  Frees name their victim by position among
the live allocations (modulo their number), so every program is valid whatever
the pool refused earlier, and shrinking never makes one meaningless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.fast import Allocation
from ..core.handles import Movable
from ..errors import OutOfMemoryError
from ..pool import Pool
from .ledger import Ledger

__all__ = [
    "Call", "Compact", "Free", "Malloc", "MallocMovable", "Op", "ProgramRun", "Spill", "SwitchStream", "run_calls",
    "run_program",
]


@dataclass(frozen=True)
class Malloc:
    """``pool.malloc(nbytes)`` on the current stream."""

    nbytes: int


@dataclass(frozen=True)
class MallocMovable:
    """``pool.movable(nbytes)`` on the current stream."""

    nbytes: int


@dataclass(frozen=True)
class Free:
    """Free the live allocation at ``index`` (modulo their number; nothing when none is live)."""

    index: int


@dataclass(frozen=True)
class Compact:
    """``pool.compact(max_moves=...)``."""

    max_moves: int | None = None


@dataclass(frozen=True)
class Spill:
    """``pool.spill(nbytes)`` (None: every buffer that may); nothing on a pool without a spill tier."""

    nbytes: int | None = None


@dataclass(frozen=True)
class SwitchStream:
    """Later allocations go to stream ``stream`` (an index into ``run_program``'s ``streams``)."""

    stream: int


Op = Malloc | MallocMovable | Free | Compact | Spill | SwitchStream


#: A program of ``run_calls``, as plain tuples: ``(0, nbytes, stream)`` allocates, ``(1, index, _)`` frees,
#: ``(2, _, _)`` is ``pool.empty_cache()``.
Call = tuple[int, int, int]


@dataclass
class ProgramRun:
    """What a replay did: counts per operation, and what is still alive (in the ledger).

    ``ooms`` counts refused allocations; ``unrestored`` spilled buffers that found
    no room to come back for the check before their free.
    """

    ledger: Ledger
    mallocs: int = 0
    movables: int = 0
    frees: int = 0
    ooms: int = 0
    unrestored: int = 0
    moves: int = 0
    spilled: int = 0
    live: list[Any] = field(default_factory=list)


def run_program(pool: Pool, program: Any, streams: Any = (0, 1, 2), check: bool = True) -> ProgramRun:
    """Replay ``program`` (an iterable of ``Op``) on ``pool``; with ``check``, verify it after every step.

    Every allocation is filled with a byte of its own; the checks are the
    pool's own (``pool.check()``), that live blocks never overlap, that their
    bytes are intact (a freed movable buffer's too, read back through a lease,
    after any spill), and that the books agree with what the program holds.
    An ``OutOfMemoryError`` is counted, not raised: a program may ask for more
    than the pool has.  ``streams`` maps ``SwitchStream`` indices to the pool's
    streams (integers on the sim device).  The checks expect ``pool`` to hold
    nothing but what the program allocates.
    """
    run = ProgramRun(Ledger(pool))
    ledger, live = run.ledger, run.live
    stream = streams[0]
    for op in program:
        if isinstance(op, (Malloc, MallocMovable)):
            try:
                h: Allocation | Movable = (
                    pool.malloc(op.nbytes, stream) if isinstance(op, Malloc) else pool.movable(op.nbytes, stream)
                )
            except OutOfMemoryError:
                run.ooms += 1
                continue
            ledger.track(h)
            live.append(h)
            if isinstance(op, Malloc):
                run.mallocs += 1
            else:
                run.movables += 1
        elif isinstance(op, Free):
            if live:
                h = live.pop(op.index % len(live))
                if check and isinstance(h, Movable):
                    try:
                        ledger.check_movable_bytes(h)
                    except OutOfMemoryError:
                        run.unrestored += 1
                ledger.forget(h)
                h.free()
                run.frees += 1
        elif isinstance(op, Compact):
            run.moves += pool.compact(max_moves=op.max_moves).moves
        elif isinstance(op, Spill):
            if pool.scheduler.tier is not None:
                run.spilled += pool.spill(op.nbytes)
        elif isinstance(op, SwitchStream):
            stream = streams[op.stream % len(streams)]
        else:
            raise TypeError(f"run_program: {op!r} is not an operation of cupool.testing.programs")
        if check:
            pool.check()
            ledger.check_spans()
            ledger.check_bytes()
            ledger.check_books()
    return run


def run_calls(pool: Pool, calls: Any) -> tuple[int, list[Allocation]]:
    """Replay ``calls`` (``Call`` tuples) on ``pool`` as fast as it goes: no fills, no checks.

    For programs too large for ``run_program``'s checks (the benchmarks' thousands of
    requests of up to 64 MiB): ``(0, nbytes, stream)`` is ``pool.malloc(nbytes, stream)``,
    an ``OutOfMemoryError`` counted; ``(1, index, _)`` frees the live allocation at
    ``index`` modulo their number (nothing when none is live); ``(2, _, _)`` calls
    ``pool.empty_cache()``.  Returns the refusals and the allocations still alive, in
    the order they were made.
    """
    live: list[Allocation] = []
    ooms = 0
    for call in calls:
        ooms += run_call(pool, live, call)
    return ooms, live


def run_call(pool: Pool, live: list[Allocation], call: Any) -> int:
    """One of ``run_calls``' calls on ``pool``, with ``live`` its allocations so far; 1 if it was refused, else 0.

    For a test that runs one program on several pools call by call, comparing them in between.
    """
    op, x, stream = call
    if op == 0:
        try:
            live.append(pool.malloc(x, stream=stream))
        except OutOfMemoryError:
            return 1
    elif op == 2:
        pool.empty_cache()
    elif live:
        live.pop(x % len(live)).free()
    return 0
