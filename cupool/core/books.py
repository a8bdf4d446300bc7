# cython: language_level=3, annotation_typing=False
"""The books: PyTorch's ``Stat {current, peak, allocated, freed}`` for each figure and pool.

Kept apart from placement, as RMM keeps its statistics adaptor apart from its
resources: the arena changes them under its lock, readers see them through a
``BooksView``.  The fast path does not account each small hit and free here;
it appends to ``log`` and the books fold the log in, peaks exactly, before
anything reads or changes them (Note [Fast path], cupool/core/fast.py).

Note [Statistics]
~~~~~~~~~~~~~~~~~
``Pool.stats()`` carries every key of ``torch.cuda.memory_stats``, and ``cupool.memory_summary(pool)`` prints PyTorch's table
from them (``torch.cuda.memory.memory_summary`` reads them too). The figures the
pool changes on every call (``allocation``, ``allocated_bytes``, ``requested_bytes``,
``segment``, ``reserved_bytes``) are kept by the books, peaks exact across the fast
path's log. The rest are PyTorch's meanings in cupool's terms, and cost the hot
path nothing:

- ``active``, ``active_bytes`` are ``allocation``, ``allocated_bytes``. PyTorch's
  active blocks add those freed while a ``record_stream`` event is pending, which
  no stream may take yet; a block cupool frees is its stream's again at once
  (Note [Streams]).
- ``inactive_split``, ``inactive_split_bytes`` (non-releasable: free blocks in
  segments that still hold a live block) are counted by walking the heaps at each
  ``stats()``, since a parked free never reaches the heap. ``current`` is exact;
  ``peak``, ``allocated`` and ``freed`` count the changes seen between calls, so they
  are lower bounds.
- ``oversize_*`` are 0 and ``max_split_size`` is -1, PyTorch's values without a
  ``max_split_size``: cupool splits free blocks of any size.

Note [Segments]
~~~~~~~~~~~~~~~
A *segment* is a contiguous range of reserved device memory that the heap carves
blocks from, as in PyTorch.  On plain segments it is one device allocation.  On
expandable segments (Note [Virtual memory]) it is a mapped range: a region's mapped
prefix grows and shrinks at its end by map and unmap calls and stays one segment;
unmapping the granules under a free block in its middle splits it in two; a
stitched range is a segment of its own.  So a segment is a maximal run of mapped
addresses, and on expandable segments the calls are not the segments.  Each is
counted once, under one name, everywhere:

- segments: ``stats()``'s ``segment.{all,small_pool,large_pool}.{current,peak,allocated,freed}``
  (a split counts one allocated, a split that leaves nothing one freed), a
  replay's ``peak_segments``, ``segment_allocs``, ``segment_frees``, both engines
  alike, and ``cupool.replay.recorded_segments`` of a trace; the report's
  segment map and ``snapshot()`` draw the same ranges.
- device calls (``cudaMalloc``/``cudaFree``, or one map or unmap call each):
  ``stats()``'s ``num_device_alloc`` and ``num_device_free``, as PyTorch counts its
  expandable segments' maps, a replay's ``device_allocs`` and ``device_frees``,
  and a trace's ``segment_alloc``/``segment_free`` or ``segment_map``/``segment_unmap``
  events (PyTorch's names: one event per call, so on plain segments one per
  segment, and on expandable ones several per segment).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import compiled_module
from .fast import COMPILED, fold_log
from .sizes import ALIGNMENT, POOL_NAMES, SMALL

#: Rows of the tables, with the names ``stats()`` gives them.
ALLOCATIONS, SEGMENTS, ALLOCATED, RESERVED, REQUESTED = range(5)
STAT_NAMES = ("allocation", "segment", "allocated_bytes", "reserved_bytes", "requested_bytes")
#: Rows ``stats()`` samples rather than the hot path keeping them (``Books.sample_inactive``).
INACTIVE_SPLIT, INACTIVE_SPLIT_BYTES = range(len(STAT_NAMES), len(STAT_NAMES) + 2)
SAMPLED_NAMES = ("inactive_split", "inactive_split_bytes")
#: Rows of the tables in all (``books.pxd`` sizes them so).
ROWS = len(STAT_NAMES) + len(SAMPLED_NAMES)
#: Rows that mirror others: active blocks are the allocated ones (see ``Books.figures``).
MIRRORED = (("active", ALLOCATIONS), ("active_bytes", ALLOCATED))
#: PyTorch's ``max_split_size`` when unset (SIZE_MAX read as int64): cupool splits blocks of any size.
NO_MAX_SPLIT_SIZE = -1
#: Columns: small pool, large pool, all.
ALL = 2
COLUMNS = (*POOL_NAMES, "all")

# Below this many entries a fold is cheaper in plain Python than through numpy.
_FOLD_NUMPY_MIN = 64
# The fast path's log compiled: a C vector a hit without the GIL appends to (Note [Hits without the GIL]).
_park: Any = compiled_module("cupool.core.park")[0]  # compiled wherever this module is (listed before it)
_new_log: Any = _park.Log if COMPILED else list


def _fold_numpy(log: list[int]) -> tuple[int, ...]:
    """``fast.fold_log`` for a long log uncompiled, in numpy: the same ten figures."""
    v = np.array(log, dtype=np.int64)
    sign = np.sign(v)
    n = np.abs(v) - 1
    size = np.maximum(((n + ALIGNMENT - 1) // ALIGNMENT) * ALIGNMENT, ALIGNMENT)
    out = [int((sign > 0).sum())]
    for d in (sign, sign * size, sign * n):
        traj = np.cumsum(d)
        out += [int(traj[-1]), max(0, int(traj.max())), int(d[d > 0].sum())]
    return tuple(out)


@dataclass(frozen=True)
class Stat:
    """One figure, as PyTorch's allocator keeps it."""

    current: int
    peak: int
    allocated: int  # total ever added
    freed: int  # total ever removed


class PeakWindow:
    """The highest allocated bytes since the window was last reset.

    For watchers such as ``BatchSizer`` that want the peak of *their* interval
    without resetting the pool's own peaks, and without subscribing to events
    (which would switch the fast path off).  Held weakly by the books.
    """

    __slots__ = ("peak", "__weakref__")

    def __init__(self, start: int) -> None:
        self.peak = start


class Books:
    """Counters of one pool.  Changed only with the pool's lock held."""

    def __init__(self) -> None:
        # Compiled, C arrays of ROWS x 3 (books.pxd), each figure a C integer: a miss's six
        # ``account`` calls do no Python arithmetic.  Read from outside through ``current``.
        self.cur = [[0, 0, 0] for _ in range(ROWS)]
        self.peak = [[0, 0, 0] for _ in range(ROWS)]
        self.total_in = [[0, 0, 0] for _ in range(ROWS)]
        self.total_out = [[0, 0, 0] for _ in range(ROWS)]
        # Fast path: +(requested + 1) per hit, -(requested + 1) per free.  Never rebound: the
        # fast path holds it too (a park.Log compiled, folded in C; a list uncompiled).
        self.log: Any = _new_log()
        self.hits = 0
        self.misses = 0
        self.retries = 0
        self.syncs = 0  # device-wide waits to settle streams: PyTorch's num_sync_all_streams
        self.ooms = 0
        self.device_allocs = 0
        self.device_frees = 0
        # Cached segments given back rather than split (Note [Release before split]).
        self.releases_before_split = 0
        self.compactions = 0
        self.bytes_moved = 0
        self.movables = 0
        self._windows: list[weakref.ref[PeakWindow]] = []
        # reset_peaks ran since the last sample_inactive, which then starts the sampled peaks afresh.
        self._sampled_peaks_reset = False

    def account(self, kind: int, row: int, delta: int) -> None:
        """Add ``delta`` to figure ``row`` of pool ``kind`` (and the all column), peaks and totals.

        Compiled, the tables are C arrays (``books.pxd``): index them, never alias a row
        (``r = self.cur[row]`` would be a copy there).
        """
        if self.log:
            self.fold()
        self.cur[row][kind] += delta
        self.cur[row][ALL] += delta
        if delta > 0:
            self.total_in[row][kind] += delta
            self.total_in[row][ALL] += delta
            if self.cur[row][kind] > self.peak[row][kind]:
                self.peak[row][kind] = self.cur[row][kind]
            if self.cur[row][ALL] > self.peak[row][ALL]:
                self.peak[row][ALL] = self.cur[row][ALL]
            if row == ALLOCATED and self._windows:
                self._raise_windows(self.cur[row][ALL])
        else:
            self.total_out[row][kind] -= delta
            self.total_out[row][ALL] -= delta

    def current(self, row: int, col: int = ALL) -> int:
        """Figure ``row``'s current value in column ``col``, the log folded: one C read compiled."""
        if self.log:
            self.fold()
        value: int = self.cur[row][col]
        return value

    def fold(self) -> None:
        """Apply the fast path's log to the tables, peaks included, exactly.

        All logged operations are on the small pool, and every other change folds
        first, so the small and the all column move by the same deltas over the
        log and each peak is the start value plus the highest prefix sum.
        """
        if not self.log:
            return
        if COMPILED:  # the C log's entries; fold_log is a C loop
            log = self.log.take()
        else:
            log = self.log[:]
            self.log.clear()  # in place: the arena's fast path holds this very list
        # plain Python for a short log uncompiled, numpy for a long one
        sums = fold_log(log) if COMPILED or len(log) < _FOLD_NUMPY_MIN else _fold_numpy(log)
        for k, row in enumerate((ALLOCATIONS, ALLOCATED, REQUESTED)):
            net, top, gained = sums[1 + 3 * k], sums[2 + 3 * k], sums[3 + 3 * k]
            self._fold_row(row, net, top, gained, gained - net)
        self.hits += sums[0]

    def _fold_row(self, row: int, net: int, top: int, gained: int, lost: int) -> None:
        if row == ALLOCATED and self._windows:
            self._raise_windows(self.cur[row][ALL] + top)
        for col in (SMALL, ALL):
            if self.cur[row][col] + top > self.peak[row][col]:
                self.peak[row][col] = self.cur[row][col] + top
            self.cur[row][col] += net
            self.total_in[row][col] += gained
            self.total_out[row][col] += lost

    def _raise_windows(self, value: int) -> None:
        alive = False
        for ref in self._windows:
            w = ref()
            if w is not None:
                alive = True
                if value > w.peak:
                    w.peak = value
        if not alive:
            self._windows = []

    def peak_window(self) -> PeakWindow:
        if self.log:
            self.fold()
        w = PeakWindow(self.cur[ALLOCATED][ALL])
        self._windows = [r for r in self._windows if r() is not None] + [weakref.ref(w)]
        return w

    def sample_inactive(self, blocks: tuple[int, int], nbytes: tuple[int, int]) -> None:
        """Bring the inactive-split rows to what a walk of the heaps found, per pool (small, large).

        PyTorch counts these as blocks split and merge; here a parked free (Note
        [Fast path]) never reaches the heap, so the hot path cannot know them.
        They change only here: their current values are exact as of this call,
        and peak, allocated and freed count only the changes seen between
        calls, so they are lower bounds of the true figures.
        """
        for row, new in ((INACTIVE_SPLIT, blocks), (INACTIVE_SPLIT_BYTES, nbytes)):
            deltas = [new[kind] - self.cur[row][kind] for kind in range(len(new))]
            # Decreases first: the all column then never passes the larger of its old and new values.
            for kind in sorted(range(len(deltas)), key=deltas.__getitem__):
                if deltas[kind]:
                    self.account(kind, row, deltas[kind])
            if self._sampled_peaks_reset:  # their last values are stale: the peak since is at least now's
                for col in range(len(COLUMNS)):
                    self.peak[row][col] = self.cur[row][col]
        self._sampled_peaks_reset = False

    def reset_peaks(self) -> None:
        if self.log:
            self.fold()
        for row in range(ROWS):
            for col in range(len(COLUMNS)):
                self.peak[row][col] = self.cur[row][col]
        self._sampled_peaks_reset = True

    def stat(self, row: int, col: int = ALL) -> Stat:
        if self.log:
            self.fold()
        return Stat(self.cur[row][col], self.peak[row][col], self.total_in[row][col], self.total_out[row][col])

    def figures(self) -> dict[str, int]:
        """The tables under ``stats()``'s names (``allocated_bytes.small_pool.peak``, ...).

        Every key of ``torch.cuda.memory_stats`` is here or in ``core.figures``
        (the counters), with PyTorch's meaning read in cupool's terms:

        * ``active`` / ``active_bytes`` equal ``allocation`` / ``allocated_bytes``.
          PyTorch's active blocks are the allocated ones plus those freed while a
          ``record_stream`` event is pending, which nobody, not even their own
          stream, may take yet.  cupool has no such state: a block freed on a
          stream is reusable on that stream at once, and only other streams wait
          (Note [Streams]), as they wait for any of PyTorch's cached blocks.
        * ``inactive_split`` / ``inactive_split_bytes``: see ``sample_inactive``.
        * ``oversize_allocations`` / ``oversize_segments`` are 0 and
          ``max_split_size`` is -1, PyTorch's values when ``max_split_size`` is
          unset: cupool splits free blocks of any size.
        """
        if self.log:
            self.fold()
        out: dict[str, int] = {}
        rows = [*enumerate((*STAT_NAMES, *SAMPLED_NAMES)), *((row, name) for name, row in MIRRORED)]
        for row, name in rows:
            for col, pname in enumerate(COLUMNS):
                base = f"{name}.{pname}"
                out[f"{base}.current"] = self.cur[row][col]
                out[f"{base}.peak"] = self.peak[row][col]
                out[f"{base}.allocated"] = self.total_in[row][col]
                out[f"{base}.freed"] = self.total_out[row][col]
        for name in ("oversize_allocations", "oversize_segments"):
            for metric in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{metric}"] = 0
        out["max_split_size"] = NO_MAX_SPLIT_SIZE
        return out


class BooksView:
    """A read-only view of a pool's books.

    Safe to read inside a subscriber and inside ``with pool.hold():`` (both run
    with the pool's lock held).  Each read folds the fast path's log first, so
    small blocks freed a moment ago count as freed.
    """

    __slots__ = ("_books",)

    def __init__(self, books: Books) -> None:
        self._books = books

    def stat(self, name: str, pool: str = "all") -> Stat:
        """``name`` one of ``STAT_NAMES``, ``pool`` one of small_pool, large_pool, all."""
        if name not in STAT_NAMES:
            raise ValueError(f"name must be one of {', '.join(STAT_NAMES)}, got {name!r}")
        if pool not in COLUMNS:
            raise ValueError(f"pool must be one of {', '.join(COLUMNS)}, got {pool!r}")
        return self._books.stat(STAT_NAMES.index(name), COLUMNS.index(pool))

    @property
    def allocated(self) -> int:
        return self._books.stat(ALLOCATED).current

    @property
    def reserved(self) -> int:
        return self._books.stat(RESERVED).current

    @property
    def requested(self) -> int:
        return self._books.stat(REQUESTED).current

    @property
    def segments(self) -> int:
        return self._books.stat(SEGMENTS).current

    @property
    def allocations(self) -> int:
        return self._books.stat(ALLOCATIONS).current

    @property
    def freed_bytes(self) -> int:
        """Bytes of allocations ever freed (``allocated_bytes.all.freed``)."""
        return self._books.stat(ALLOCATED).freed

    @property
    def fragmentation(self) -> float:
        """(reserved - allocated) / reserved: the share of reserved memory not in use."""
        b = self._books
        if b.log:
            b.fold()
        reserved = b.cur[RESERVED][ALL]
        return (reserved - b.cur[ALLOCATED][ALL]) / reserved if reserved else 0.0
