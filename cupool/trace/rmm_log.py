"""Writing a trace as an RMM log, so that RMM's tools read cupool's traces.

RMM's ``logging_resource_adaptor`` writes one CSV row per call,
``Thread,Time,Action,Pointer,Size,Stream``, and its tools (the
``REPLAY_BENCHMARK`` of ``benchmarks/utilities/log_parser.hpp``, pandas
scripts) read that.  Its parser takes the thread and stream as decimal
integers, the pointer as hexadecimal, and three actions: ``allocate``,
``free`` and ``allocate failure``.  So:

* ``alloc`` / ``free`` are ``allocate`` / ``free``; a refused request
  (``oom``) is ``allocate failure`` (pointer 0);
* movable buffers are blocks to RMM: ``alloc_movable`` / ``free_movable`` are
  an allocate / free, and a compaction move (``move_out`` then ``move_in``) is a
  free of the old address and an allocate of the new one, so a replay follows
  the block to where it went;
* segments are the upstream resource's business, which an RMM log does not
  show, and the annotations (``compact``, ``spill``, ``reclaim:*`` ...) have no
  row: their block events carry the memory;
* neither a cupool trace nor a PyTorch snapshot records which thread made a
  call: every row is thread 0 (RMM's parser groups rows by thread, so one
  thread is also the order the trace has);
* the time is what RMM writes, the time of day of spdlog's ``%H:%M:%S.%f``
  (``08:00:01.000250``): the trace's clock taken as nanoseconds since a
  midnight, cut to the microsecond, the hours wrapping at 24.

``load_rmm_log(write_rmm_log(trace))`` therefore gives back the trace's block
events, with movable kinds as plain ones, and their times to the microsecond
less a whole number of days (the reader counts a clock that goes back past
midnight as the next day, so a gap of 12 hours or more between two events is
lost, as in RMM's own logs; ``tests/test_rmm_export.py``).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator

from .._files import atomic_output
from .format import Trace
from .importers import RMM_COLUMNS

#: cupool's event kinds as RMM's actions (kinds not listed have no row).
ACTIONS = {
    "alloc": "allocate", "alloc_movable": "allocate", "move_in": "allocate",
    "free": "free", "free_movable": "free", "move_out": "free",
    "oom": "allocate failure",
}


def rmm_rows(trace: Trace) -> Iterator[tuple[int, str, str, str, int, int]]:
    """The trace's rows of an RMM log, in order: (thread, time, action, pointer, size, stream); thread is 0."""
    actions = [ACTIONS.get(k) for k in trace.kinds]
    for t, k, addr, size, stream in zip(trace.t_ns.tolist(), trace.kind.tolist(), trace.addr.tolist(),
                                        trace.size.tolist(), trace.stream.tolist()):
        action = actions[k]
        if action is not None:
            yield 0, _clock(t), action, hex(addr), size, stream


def write_rmm_log(trace: Trace, path: str | os.PathLike[str]) -> int:
    """Write ``trace`` as an RMM log CSV at ``path`` (whole or not at all); returns the rows written."""
    n = 0
    with atomic_output(path, "the RMM log", text=True) as fh:
        out = csv.writer(fh, lineterminator="\n")
        out.writerow(RMM_COLUMNS)
        for row in rmm_rows(trace):
            out.writerow(row)
            n += 1
    return n


def _clock(t_ns: int) -> str:
    """Nanoseconds as RMM's time of day, ``HH:MM:SS.ffffff`` (a clock before 0 counts back from midnight)."""
    us = t_ns // 1000 % (86_400 * 10**6)  # floor division: -1 ns is 23:59:59.999999
    seconds, us = divmod(us, 10**6)
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}:{seconds:02d}.{us:06d}"
