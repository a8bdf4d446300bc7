"""Pool events: an in-memory ring buffer, crash-safe HDF5 traces, and reading them back.

The recorder hangs on ``Pool.subscribe``, so a pool nobody records pays only the
one truth test ``_emit`` callers already make.  A recording pool pays one Python
call per event that stores the event tuple in a ring slot (see
``benchmarks/bench_recorder.py`` for the measured cost).

HDF5 traces are written for crashes: all file I/O happens in ``flush`` (every
``batch`` events, or when an event arrives ``flush_interval`` seconds after the
last flush), the file is in SWMR mode, and a scalar ``count`` is updated only
after the rows it covers are on disk.  A process killed at any moment (SIGKILL
included) leaves a file that ``load_trace`` opens, with every event up to the
last completed flush.  Only plain numeric datasets are used (stacks are stored
as bytes plus end offsets), because variable-length strings do not survive a
killed SWMR writer reliably.

A write that fails (disk full, file removed, a kind that does not fit) must not
hurt the pool whose lock the recorder runs under: the recorder stops writing,
keeps its ring buffer going, and raises the error, naming the file, at ``stop()``
(the end of the ``with`` block).

Every loader returns a ``Trace``: parallel numpy arrays, with streams renumbered
densely from 0 so that any trace replays on the sim device.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .pool import Pool

#: Event kinds known in advance (see ``Pool.subscribe``); recorders accept any other kind string too.
KINDS = ("alloc", "free", "alloc_movable", "free_movable", "move_out", "move_in", "segment_alloc",
         "segment_free", "compact", "spill", "restore", "oom")
FORMAT = "cupool-trace"
VERSION = 1
_MAX_KINDS = 64
_KIND_WIDTH = 32
_COLUMNS = ("t_ns", "kind", "addr", "size", "stream")
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_INT64_MAX = (1 << 63) - 1
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class TraceError(ValueError):
    """A trace file that cannot be used: unreadable, truncated, or of an unknown format.

    The message names the file and the problem; the CLI prints it and exits with 2.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self):
        return (type(self), (self.path, self.problem))


@dataclass
class Trace:
    """A sequence of pool events as parallel arrays (one row per event, in time order).

    ``kind`` holds indices into ``kinds``.  ``stream`` is renumbered densely from 0.
    ``config`` is the recording pool's configuration when known (cupool traces),
    so that a replay can use the same settings.
    """

    t_ns: np.ndarray
    kind: np.ndarray
    addr: np.ndarray
    size: np.ndarray
    stream: np.ndarray
    kinds: tuple[str, ...] = KINDS
    config: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    format: str = FORMAT
    stacks: list[str] | None = None

    def __len__(self) -> int:
        return len(self.t_ns)

    def code(self, kind: str) -> int:
        """The code of ``kind`` in this trace, or -1 when the trace has none."""
        return self.kinds.index(kind) if kind in self.kinds else -1

    def counts(self) -> dict[str, int]:
        """Events per kind."""
        n = np.bincount(self.kind, minlength=len(self.kinds))
        return {k: int(c) for k, c in zip(self.kinds, n) if c}

    @classmethod
    def from_events(
        cls,
        events: list[tuple],
        config: dict[str, Any] | None = None,
        source: str = "",
        format: str = FORMAT,
        stacks: list[str] | None = None,
    ) -> Trace:
        """Build a trace from ``(t_ns, kind, addr, size, stream)`` tuples (extra fields ignored).

        Kinds must be strings and the numbers int64 integers (sizes not negative):
        the compiled replay reads the columns as int64, so a value that does not
        fit is refused here, with the event's index, rather than wrapped around.
        """
        kinds = list(KINDS)
        codes = {k: i for i, k in enumerate(kinds)}
        kind = np.empty(len(events), np.uint8)
        for i, ev in enumerate(events):
            c = codes.get(ev[1])
            if c is None:
                if not isinstance(ev[1], str):
                    raise ValueError(f"event {i}: the kind must be a string, got {ev[1]!r}")
                if len(kinds) >= _MAX_KINDS:
                    raise ValueError(f"event {i}: more than {_MAX_KINDS} event kinds")
                c = codes[ev[1]] = len(kinds)
                kinds.append(ev[1])
            kind[i] = c
            for j, name in ((0, "time"), (2, "address"), (3, "size"), (4, "stream")):
                v = ev[j]
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise ValueError(f"event {i}: the {name} must be an integer, got {v!r}")
                if not -_INT64_MAX - 1 <= v <= _INT64_MAX or (j == 3 and v < 0):
                    raise ValueError(f"event {i}: the {name} {v} is out of range"
                                     + (" (sizes cannot be negative)" if j == 3 and v < 0 else " (int64)"))
        cols = [np.fromiter((ev[j] for ev in events), np.int64, len(events)) for j in (0, 2, 3, 4)]
        return cls(
            cols[0], kind, cols[1], cols[2], dense_streams(cols[3]), tuple(kinds),
            dict(config or {}), source, format, stacks,
        )


def dense_streams(streams: np.ndarray) -> np.ndarray:
    """Renumber stream identities 0, 1, 2, ... in increasing order (so the default stream, 0, stays 0).

    The sim device names streams by small integers; CUDA streams are pointers.
    """
    return np.unique(np.asarray(streams, np.int64), return_inverse=True)[1].astype(np.int64).reshape(-1)


def _stack() -> str:
    # Drop the recorder's and the pool's own frames: the user wants their call site.
    frames = [f for f in traceback.extract_stack()[:-3] if not _in_package(f.filename)]
    return "".join(traceback.format_list(frames[-8:]))


@functools.lru_cache(maxsize=4096)
def _in_package(filename: str) -> bool:
    """Whether a frame's file is part of this installed package (not merely under some "cupool" folder)."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


# ------------------------------------------------------------------- recording
_active: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_active_lock = threading.Lock()


def active_recorder(pool: Pool) -> EventRecorder | None:
    """The most recently started recorder still attached to ``pool``, if any."""
    with _active_lock:
        recs = _active.get(pool)
        return recs[-1] if recs else None


class EventRecorder:
    """A ring buffer of the last ``capacity`` events of a pool, optionally streamed to HDF5.

    Use as a context manager (``with pool.record(): ...``) or call ``start``/``stop``.
    When started on a pool that already holds memory, the recorder first writes
    its current segments and live blocks as ``segment_alloc``/``alloc``/``alloc_movable``
    events, and notes in the trace's configuration (``"seed"``) how many events
    that is and which segments are small-pool or preallocated ones, so that a
    replay starts from the same segments and live set.  The live state is read
    and the recorder subscribed under one hold of the pool's lock, so no event
    falls between the two.

    If writing the file fails, recording to the file stops (the ring buffer goes
    on), the pool is unaffected, and ``stop()`` raises the ``TraceError``.
    """

    def __init__(
        self,
        pool: Pool,
        path: str | Path | None = None,
        capacity: int = 1 << 16,
        stacks: bool = False,
        batch: int = 4096,
        flush_interval: float = 1.0,
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= capacity:
            raise ValueError(f"batch must be an int in [1, capacity={capacity}], got {batch!r}")
        if not flush_interval > 0:
            raise ValueError(f"flush_interval must be > 0 seconds, got {flush_interval!r}")
        self.pool = pool
        self.capacity = capacity
        self.stacks = bool(stacks)
        self._ring: list[tuple | None] = [None] * capacity
        self._n = 0
        self._batch = batch
        self._interval_ns = int(flush_interval * 1e9)
        self._deadline = 0
        self._flushed = 0
        self._writer = None if path is None else _Hdf5Writer(Path(path), self.stacks)
        self._unsubscribe: Any = None
        self._config: dict[str, Any] = {}
        self.error: TraceError | None = None

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> EventRecorder:
        if self._unsubscribe is not None:
            raise RuntimeError("this recorder is already started")
        pool = self.pool
        self._config = recording_config(pool)
        # One hold of the pool's lock for reading the live state and subscribing:
        # Pool.snapshot() and Pool.subscribe() each take the lock, and an event
        # between them would be in neither.  So this reads the heaps itself, after
        # applying queued frees (_drain) exactly as snapshot() does, and appends to
        # the observer list that subscribe() appends to.
        with pool._lock:
            pool._drain()
            now = time.perf_counter_ns()
            seed, self._config["seed"] = _live_state(pool, now)
            if self._writer is not None:
                self._writer.open(self._config)  # a TraceError here leaves nothing subscribed
            self._deadline = now + self._interval_ns
            for ev in seed:
                self._on_event(ev)
            pool._observers.append(self._on_event)

        def unsubscribe() -> None:
            with pool._lock:
                if self._on_event in pool._observers:
                    pool._observers.remove(self._on_event)

        self._unsubscribe = unsubscribe
        with _active_lock:
            _active.setdefault(pool, []).append(self)
        return self

    def stop(self) -> None:
        """Detach from the pool, flush and close the file; raise the ``TraceError`` of a failed write."""
        if self._unsubscribe is None:
            return
        self._unsubscribe()
        self._unsubscribe = None
        with _active_lock:
            recs = _active.get(self.pool, [])
            if self in recs:
                recs.remove(self)
        if self._writer is not None:
            # Lock-free here: the pool no longer calls us, so nobody else touches the ring.
            if self.error is None:
                self._flush()
            try:
                self._writer.close()
            except Exception as e:  # noqa: BLE001 - reported below like any write failure
                if self.error is None:
                    self._fail(e)
        if self.error is not None:
            raise self.error

    def __enter__(self) -> EventRecorder:
        return self.start()

    def __exit__(self, et: type | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if ev is None:
            self.stop()
            return
        # The block already raised: that error stays the one reported, the trace's goes in a note.
        try:
            self.stop()
        except TraceError as e:
            ev.add_note(f"cupool: also, the trace was not fully written: {e}")

    # -- the hot path -----------------------------------------------------------
    def _on_event(self, ev: tuple) -> None:
        # Runs under the pool's lock, so the ring needs no lock of its own.
        if self.stacks:
            ev = (*ev, _stack())
        self._ring[self._n % self.capacity] = ev
        self._n += 1
        if self._writer is not None and (self._n - self._flushed >= self._batch or ev[0] >= self._deadline):
            if self.error is None:
                self._flush()

    def _flush(self) -> None:
        lo, hi = self._flushed, self._n
        if hi > lo:
            try:
                self._writer.append([self._ring[i % self.capacity] for i in range(lo, hi)])
            except Exception as e:  # noqa: BLE001 - see _fail
                self._fail(e)
                return
            self._flushed = hi
        self._deadline = time.perf_counter_ns() + self._interval_ns

    def _fail(self, e: BaseException) -> None:
        """Stop writing after a failed write, keeping the error for ``stop()``.

        Any exception is caught, not only OSError: this runs inside a pool
        operation holding the pool's lock, and an exception escaping here would
        abandon that operation half done (a block taken but never handed out, a
        free applied to the heap but not to the caller's handle).
        """
        reason = str(e) or type(e).__name__
        self.error = TraceError(
            self._writer.path,
            f"writing the trace failed after {self._flushed} events ({reason}); "
            "recording to the file stopped there (the pool was not affected)",
        )
        with contextlib.suppress(Exception):
            self._writer.close()

    # -- reading ----------------------------------------------------------------
    @property
    def n_events(self) -> int:
        """Events seen since start (including those the ring no longer holds)."""
        return self._n

    @property
    def dropped(self) -> int:
        """Events that fell out of the ring (they are still in the HDF5 file, if any)."""
        return max(0, self._n - self.capacity)

    def events(self) -> list[tuple]:
        """The retained events, oldest first, as ``(t_ns, kind, addr, size, stream[, stack])``."""
        with self.pool._lock if self._unsubscribe is not None else contextlib.nullcontext():
            lo = max(0, self._n - self.capacity)
            return [self._ring[i % self.capacity] for i in range(lo, self._n)]

    def trace(self) -> Trace:
        evs = self.events()
        stacks = [e[5] for e in evs] if self.stacks else None
        config = dict(self._config)
        if self.dropped:
            config.pop("seed", None)  # the ring no longer starts with the live state
        return Trace.from_events(evs, config, source="<memory>", stacks=stacks)

    @property
    def path(self) -> Path | None:
        return None if self._writer is None else self._writer.path


def recording_config(pool: Pool) -> dict[str, Any]:
    """The pool's configuration plus its spill settings, as stored with a trace.

    Any spill tier is recorded as ``"host"``: a replay must not write into the
    recorded run's spill file, and on the sim device where it costs device
    memory the same either way.
    """
    cfg = dict(pool.config)
    sched = getattr(pool, "scheduler", None)
    if sched is not None:
        cfg["spill"] = None if sched.tier is None else "host"
        cfg["spill_policy"] = sched.policy
    return cfg


def _live_state(pool: Pool, now: int) -> tuple[list[tuple], dict[str, Any]]:
    """The pool's segments and live blocks as events, and what a replay needs to rebuild them.

    The caller holds the pool's lock and has drained it.  A raw block's stream is
    not kept on the block, so it is reported as its segment's stream.
    """
    from .pool import SMALL

    events: list[tuple] = []
    small: list[int] = []
    kept: list[int] = []
    for heap_kind, heap in enumerate(pool._heaps):
        for seg in sorted(heap.segments.values(), key=lambda s: s.addr):
            stream = seg.stream or 0
            events.append((now, "segment_alloc", seg.addr, seg.size, stream))
            if heap_kind == SMALL:
                small.append(seg.addr)
            if seg.keep:
                kept.append(seg.addr)
            for b in seg.blocks():
                if b.free:
                    continue
                owner = b.payload() if isinstance(b.payload, weakref.ReferenceType) else None
                if owner is not None:
                    events.append((now, "alloc_movable", b.addr, b.size, owner.stream or 0))
                else:
                    events.append((now, "alloc", b.addr, b.size, stream))
    return events, {"events": len(events), "small_segments": small, "kept_segments": kept}


class _Hdf5Writer:
    """Appends event batches to resizable chunked datasets of a SWMR-mode HDF5 file."""

    def __init__(self, path: Path, stacks: bool) -> None:
        self.path = path
        self.stacks = stacks
        self._f = None
        self._kinds: dict[str, int] = {}

    def open(self, config: dict[str, Any]) -> None:
        import h5py

        try:
            f = h5py.File(self.path, "w", libver="latest")
        except OSError as e:
            raise TraceError(self.path, f"cannot create the trace file ({e})") from None
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
        f.attrs["config"] = json.dumps(config, default=str)
        f.attrs["created"] = time.time()
        chunk = 1 << 14
        for name in _COLUMNS:
            f.create_dataset(name, shape=(0,), maxshape=(None,), chunks=(chunk,),
                             dtype=np.uint8 if name == "kind" else np.int64)
        names = np.zeros(_MAX_KINDS, dtype=f"S{_KIND_WIDTH}")
        names[: len(KINDS)] = [k.encode() for k in KINDS]
        f.create_dataset("kind_names", data=names)
        self._kinds = {k: i for i, k in enumerate(KINDS)}
        if self.stacks:
            f.create_dataset("stack_end", shape=(0,), maxshape=(None,), chunks=(chunk,), dtype=np.int64)
            f.create_dataset("stack_bytes", shape=(0,), maxshape=(None,), chunks=(1 << 16,), dtype=np.uint8)
        f.create_dataset("count", data=np.int64(0))
        f.swmr_mode = True
        self._f = f

    def append(self, events: list[tuple]) -> None:
        f = self._f
        n0 = f["t_ns"].shape[0]
        n = len(events)
        cols = list(zip(*events))
        kinds = np.empty(n, np.uint8)
        for i, k in enumerate(cols[1]):
            c = self._kinds.get(k)
            if c is None:
                c = self._new_kind(k)
            kinds[i] = c
        data = {
            "t_ns": np.asarray(cols[0], np.int64),
            "kind": kinds,
            "addr": np.asarray(cols[2], np.int64),
            "size": np.asarray(cols[3], np.int64),
            "stream": np.asarray(cols[4], np.int64),
        }
        for name, arr in data.items():
            ds = f[name]
            ds.resize((n0 + n,))
            ds[n0:] = arr
        if self.stacks:
            blobs = [s.encode() for s in cols[5]]
            ends_ds, bytes_ds = f["stack_end"], f["stack_bytes"]
            b0 = int(ends_ds[-1]) if n0 else 0
            ends = b0 + np.cumsum([len(b) for b in blobs], dtype=np.int64)
            ends_ds.resize((n0 + n,))
            ends_ds[n0:] = ends
            bytes_ds.resize((int(ends[-1]),))
            if ends[-1] > b0:
                bytes_ds[b0:] = np.frombuffer(b"".join(blobs), np.uint8)
        # Rows first, then the count that makes them visible: a kill between the two
        # loses this batch but never exposes half-written rows.
        f.flush()
        f["count"][()] = n0 + n
        f.flush()

    def _new_kind(self, kind: str) -> int:
        c = len(self._kinds)
        raw = kind.encode()
        if c >= _MAX_KINDS or len(raw) > _KIND_WIDTH:
            raise ValueError(f"trace {self.path}: cannot record event kind {kind!r} "
                             f"(at most {_MAX_KINDS} kinds of up to {_KIND_WIDTH} bytes)")
        self._f["kind_names"][c] = raw
        self._kinds[kind] = c
        return c

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


# --------------------------------------------------------------------- loading
def load_trace(path: str | Path) -> Trace:
    """Read a trace: a cupool HDF5 trace, a PyTorch memory snapshot pickle or an RMM log CSV.

    The format is detected from the file's content, not its name.  Raises
    ``TraceError`` (a ``ValueError``) naming the file and the problem.
    """
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            head = fh.read(512)
    except OSError as e:
        raise TraceError(p, f"cannot read the file ({e.strerror or e})") from None
    if not head:
        raise TraceError(p, "the file is empty")
    if head.startswith(_HDF5_MAGIC):
        return _load_hdf5(p)
    from . import importers

    if head[:1] == b"\x80":
        return importers.load_torch_snapshot(p)
    first = head.split(b"\n", 1)[0].decode("utf-8", "replace").strip().replace(" ", "")
    if first.lower().startswith("thread,time,action,pointer,size"):
        return importers.load_rmm_log(p)
    raise TraceError(
        p,
        "not a trace cupool can read: expected a cupool HDF5 trace, a PyTorch memory snapshot "
        "pickle (torch.cuda.memory._snapshot()) or an RMM log CSV (Thread,Time,Action,Pointer,Size,Stream)",
    )


def _load_hdf5(p: Path) -> Trace:
    import h5py

    try:
        try:
            f = h5py.File(p, "r")
        except OSError as e:
            # A writer that was killed leaves the SWMR "open for writing" flag set; a SWMR
            # reader ignores it (h5clear would otherwise be needed).  Only then: a SWMR
            # reader retries damaged metadata for a long time instead of failing.
            if "already open for write" not in str(e) or _truncated(p):
                raise
            f = h5py.File(p, "r", libver="latest", swmr=True)
    except OSError as e:
        raise TraceError(p, f"HDF5 file is truncated or corrupted ({_h5_reason(e)})") from None
    try:
        with f:
            if f.attrs.get("format") != FORMAT:
                raise TraceError(p, f"an HDF5 file, but not a cupool trace (no format={FORMAT!r} attribute)")
            version = int(f.attrs.get("version", -1))
            if version != VERSION:
                raise TraceError(p, f"cupool trace version {version} is not supported (this cupool reads {VERSION})")
            missing = [c for c in (*_COLUMNS, "count", "kind_names") if c not in f]
            if missing:
                raise TraceError(p, f"cupool trace lacks dataset(s) {', '.join(missing)}")
            for c in (*_COLUMNS, "count"):
                if f[c].dtype.kind not in "iu":
                    raise TraceError(p, f"cupool trace is corrupted: dataset {c!r} holds {f[c].dtype}, not integers")
            if f["kind_names"].dtype.kind != "S":
                raise TraceError(p, f"cupool trace is corrupted: 'kind_names' holds {f['kind_names'].dtype}, "
                                    "not byte strings")
            n = int(f["count"][()])
            if n < 0 or any(f[c].shape[0] < n for c in _COLUMNS):
                raise TraceError(p, f"cupool trace is truncated: count says {n} events, datasets hold fewer")
            cols = {c: f[c][:n] for c in _COLUMNS}
            for c in _COLUMNS:
                if cols[c].dtype == np.uint64 and n and int(cols[c].max()) > _INT64_MAX:
                    raise TraceError(p, f"cupool trace is corrupted: dataset {c!r} holds values past int64")
                cols[c] = cols[c].astype(np.int64)
            names = [s.decode("utf-8", "replace") for s in f["kind_names"][:] if s]
            if n and (int(cols["kind"].min()) < 0 or int(cols["kind"].max()) >= len(names)):
                raise TraceError(p, "cupool trace is corrupted: an event kind has no name")
            cols["kind"] = cols["kind"].astype(np.uint8)
            if n and int(cols["size"].min()) < 0:
                i = int(np.argmax(cols["size"] < 0))
                raise TraceError(p, f"cupool trace is corrupted: event {i} has a negative size")
            stacks = None
            if "stack_end" in f:
                ends = f["stack_end"][:n]
                raw = f["stack_bytes"][: int(ends[-1]) if n else 0].tobytes()
                starts = np.concatenate(([0], ends[:-1]))
                stacks = [raw[a:b].decode("utf-8", "replace") for a, b in zip(starts, ends)]
            raw_config = f.attrs.get("config", "{}")
            try:
                config = json.loads(raw_config)
            except (TypeError, ValueError):
                raise TraceError(p, "cupool trace is corrupted: its 'config' attribute is not JSON text") from None
            if not isinstance(config, dict):
                raise TraceError(p, "cupool trace is corrupted: its 'config' attribute is not a JSON object")
    except TraceError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError, TypeError, IndexError) as e:
        # h5py reports damage through any of these, depending on which structure broke.
        raise TraceError(p, f"HDF5 file is truncated or corrupted ({_h5_reason(e)})") from None
    return Trace(cols["t_ns"], cols["kind"], cols["addr"], cols["size"], dense_streams(cols["stream"]),
                 tuple(names), config, str(p), FORMAT, stacks)


def _truncated(p: Path) -> bool:
    """Whether the file is shorter than its superblock (versions 2 and 3, which cupool writes) says."""
    with open(p, "rb") as fh:
        head = fh.read(48)
    if len(head) < 12 or head[8] not in (2, 3):
        return False
    o = head[9]
    end = int.from_bytes(head[12 + 2 * o : 12 + 3 * o], "little")
    return p.stat().st_size < end


def _h5_reason(e: BaseException) -> str:
    msg = str(e.args[0]) if e.args else str(e)
    return msg.replace("Unable to synchronously ", "unable to ")
