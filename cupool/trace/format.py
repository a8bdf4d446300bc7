"""The trace: pool events as parallel arrays, and cupool's HDF5 trace file, written and read.

Writer and reader live together so that the file's layout is stated once.  The
file is written for crashes: a scalar ``count`` is updated only after the rows it
covers are on disk, so a writer killed at any moment (SIGKILL included) leaves a
file that ``read_hdf5`` opens, with every event up to the last completed
``append``.  Only plain numeric datasets are used (stacks are stored as bytes
plus end offsets), because variable-length strings do not survive a killed SWMR
writer reliably.

Kinds are stored in the file by name (``kind_names``), indexed by the ``kind``
column: the names start as ``cupool.core.events.KINDS`` and a kind outside that
list is appended, so files written before a kind was added still read back
under their own names.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.events import KINDS

FORMAT = "cupool-trace"
VERSION = 1
#: The first bytes of every HDF5 file (how ``load_trace`` tells a cupool trace from the imported formats).
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_MAX_KINDS = 64
_KIND_WIDTH = 32
_COLUMNS = ("t_ns", "kind", "addr", "size", "stream")
_INT64_MAX = (1 << 63) - 1


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


class Hdf5Writer:
    """Appends event batches to resizable chunked datasets of a SWMR-mode HDF5 file.

    ``append`` does all the file I/O of a batch and raises whatever h5py raises;
    the recorder decides what a failure means for the pool.
    """

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


def read_hdf5(p: Path) -> Trace:
    """A cupool HDF5 trace; a ``TraceError`` names the file and what is wrong with it."""
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
