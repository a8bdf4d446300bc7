"""The trace: pool events as parallel arrays, and cupool's HDF5 trace file, written and read.

Writer and reader live together so that the file's layout is stated once.  The
file is written for crashes and full disks (``Hdf5Writer`` says how): a scalar
``count`` is updated only after the rows it covers are written, so a writer killed
at any moment (SIGKILL included) leaves a file that plain HDF5 readers open, with
every event up to the last completed ``append``; columns may hold more rows than
``count`` (room reserved for later events).  Only plain numeric datasets are used
(stacks are stored as bytes plus end offsets).

Kinds are stored in the file by name (``kind_names``), indexed by the ``kind``
column: the names start as ``cupool.core.events.KINDS`` and a kind outside that
list is appended, so files written before a kind was added still read back
under their own names.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import resource
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.events import KINDS
from ..errors import TraceError

FORMAT = "cupool-trace"
VERSION = 1
#: The first bytes of every HDF5 file (how ``load_trace`` tells a cupool trace from the imported formats).
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_MAX_KINDS = 64
_KIND_WIDTH = 32
_COLUMNS = ("t_ns", "kind", "addr", "size", "stream")
_INT64_MAX = (1 << 63) - 1
_PAGE = 4096
#: A new trace file's room, in events and stack bytes (each full generation doubles it).
_FIRST_ROWS = 1 << 14
_FIRST_STACK_BYTES = 1 << 20


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


class _Image(io.RawIOBase):
    """A file in memory that keeps only the pages written to it: where HDF5 lays out a trace file.

    The event columns are reserved but never written by HDF5 (allocated early, no
    fill), so the image holds the metadata alone, however many events the file has
    room for; the rest of the file is a hole until cupool writes rows into it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pages: dict[int, bytearray] = {}
        self.size = 0
        self._pos = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset + (0, self._pos, self.size)[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: Any) -> int:
        out = memoryview(buf).cast("B")
        done = 0
        while done < len(out):
            page, at = divmod(self._pos + done, _PAGE)
            k = min(_PAGE - at, len(out) - done)
            src = self.pages.get(page)
            out[done : done + k] = src[at : at + k] if src is not None else bytes(k)
            done += k
        self._pos += done
        return done

    def write(self, buf: Any) -> int:
        data = memoryview(buf).cast("B")
        done = 0
        while done < len(data):
            page, at = divmod(self._pos + done, _PAGE)
            k = min(_PAGE - at, len(data) - done)
            self.pages.setdefault(page, bytearray(_PAGE))[at : at + k] = data[done : done + k]
            done += k
        self._pos += done
        self.size = max(self.size, self._pos)
        return done

    def truncate(self, size: int | None = None) -> int:
        self.size = self._pos if size is None else size
        return self.size


class Hdf5Writer:
    """Appends event batches to a cupool trace file, so that neither a full disk nor a kill can hurt.

    HDF5 never touches the disk.  Each *generation* of the file (a capacity of
    rows) is laid out by h5py in memory (``_Image``), with contiguous columns that
    are reserved but unwritten, and cupool writes those bytes itself; after that
    the file's metadata never changes, and ``append`` writes rows and then the
    ``count`` that makes them visible with ``os.pwrite`` at the columns' offsets.
    So:

    * a failed write is an ordinary ``OSError`` that leaves the file as it was:
      h5py (3.12 and 3.16 do) segfaults when it closes or releases a file whose
      flush failed, and here it has no file open that could fail;
    * a process killed at any moment (SIGKILL included) leaves a file that any
      HDF5 reader opens without ``swmr`` or ``h5clear``, holding every event up to
      the last completed ``append``: HDF5 closed its image cleanly, rows are
      written before the count, and a full generation is replaced by the next
      (twice the rows, the rows so far copied over) only by ``os.replace`` (a
      kill before that leaves the next one's ``.NAME.*.tmp`` file beside it);
    * a generation never grows the file past the file-size limit
      (``RLIMIT_FSIZE``, whose SIGXFSZ would otherwise kill the process): it is
      made smaller to fit, and a batch that cannot fit is an ``OSError``.

    Kills, not power cuts: nothing is fsynced.  A growth copies the rows so far,
    inside the flush that needs it (about 16 ms per million events on the 2-core
    machine of ``docs/benchmarks.md``), once per doubling.  ``close`` writes a last
    generation of exactly the events recorded, so a finished trace has no unused rows.
    """

    def __init__(self, path: Path, stacks: bool) -> None:
        self.path = path
        self.stacks = stacks
        self._fd = -1
        self._attrs: dict[str, Any] = {}
        self._names = np.zeros(_MAX_KINDS, dtype=f"S{_KIND_WIDTH}")
        self._kinds: dict[str, int] = {}
        self._offsets: dict[str, int] = {}
        # The generation: its room for events and stack bytes, and its size.
        self._rows = 0
        self._stack_room = 0
        self._size = 0
        #: Events in the file (those ``count`` covers).
        self.count = 0
        self._stack_bytes = 0

    def open(self, config: dict[str, Any]) -> None:
        self._attrs = {"format": FORMAT, "version": VERSION, "config": json.dumps(config, default=str),
                       "created": time.time()}
        self._names[: len(KINDS)] = [k.encode() for k in KINDS]
        self._kinds = {k: i for i, k in enumerate(KINDS)}
        try:
            self._generation(0, 0, _FIRST_ROWS, _FIRST_STACK_BYTES if self.stacks else 0)
        except OSError as e:
            raise TraceError(self.path, f"cannot create the trace file ({e.strerror or e})") from None

    def append(self, events: list[tuple]) -> None:
        n0, n = self.count, len(events)
        cols = list(zip(*events))
        fresh = len(self._kinds)
        for k in dict.fromkeys(cols[1]):  # new kinds get codes in the order they first appear
            if k not in self._kinds:
                self._new_kind(k)
        kinds = np.fromiter(map(self._kinds.__getitem__, cols[1]), np.uint8, n)
        stacks = [s.encode() for s in cols[5]] if self.stacks else []
        blob = b"".join(stacks)
        if n0 + n > self._rows or self._stack_bytes + len(blob) > self._stack_room:
            self._generation(n0 + n, self._stack_bytes + len(blob), 2 * self._rows, 2 * self._stack_room)
        elif self._size > _fsize_limit():  # lowered since: a write past it would send SIGXFSZ
            raise OSError(errno.EFBIG, f"the file is larger than the file-size limit (RLIMIT_FSIZE) of "
                                       f"{_fsize_limit()} bytes")
        fd, at = self._fd, self._offsets
        if len(self._kinds) > fresh:
            _pwrite(fd, self._names[fresh:].tobytes(), at["kind_names"] + fresh * _KIND_WIDTH)
        _pwrite(fd, np.asarray(cols[0], "<i8").tobytes(), at["t_ns"] + 8 * n0)
        _pwrite(fd, kinds.tobytes(), at["kind"] + n0)
        for name, j in (("addr", 2), ("size", 3), ("stream", 4)):
            _pwrite(fd, np.asarray(cols[j], "<i8").tobytes(), at[name] + 8 * n0)
        if self.stacks:
            ends = self._stack_bytes + np.cumsum([len(s) for s in stacks], dtype="<i8")
            _pwrite(fd, ends.tobytes(), at["stack_end"] + 8 * n0)
            if blob:
                _pwrite(fd, blob, at["stack_bytes"] + self._stack_bytes)
        # Rows first, then the count that makes them visible: a kill between the two
        # loses this batch but never exposes half-written rows.
        _pwrite(fd, np.int64(n0 + n).astype("<i8").tobytes(), at["count"])
        self.count = n0 + n
        self._stack_bytes += len(blob)

    def _new_kind(self, kind: str) -> None:
        c = len(self._kinds)
        raw = kind.encode()
        if c >= _MAX_KINDS or len(raw) > _KIND_WIDTH:
            raise ValueError(f"trace {self.path}: cannot record event kind {kind!r} "
                             f"(at most {_MAX_KINDS} kinds of up to {_KIND_WIDTH} bytes)")
        self._names[c] = raw
        self._kinds[kind] = c

    def close(self) -> None:
        """Rewrite the file at exactly the events appended (no unused rows), and close it."""
        if self._fd < 0:
            return
        if (self._rows, self._stack_room) != (self.count, self._stack_bytes):
            self._generation(self.count, self._stack_bytes, self.count, self._stack_bytes)
        fd, self._fd = self._fd, -1
        os.close(fd)  # where a network file system reports a write it could not make

    def abandon(self) -> None:
        """Close the file as it stands, writing nothing more (after a failed write)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)

    def _generation(self, need: int, need_bytes: int, rows: int, stack_room: int) -> None:
        """Replace the file by one with room for ``rows`` events and ``stack_room`` stack bytes.

        Made in a temporary file beside it, with the rows so far copied over, and
        renamed over it: a kill at any point leaves the old file or the new one.
        While the file would pass the file-size limit, smaller ones are tried, down
        to room for ``need`` events and ``need_bytes`` stack bytes.
        """
        rows, stack_room, limit = max(rows, need), max(stack_room, need_bytes), _fsize_limit()
        while True:
            image, offsets = self._image(rows, stack_room)
            if image.size <= limit:
                break
            if (rows, stack_room) == (need, need_bytes):
                raise OSError(errno.EFBIG, f"{need} events would make the file larger than the file-size "
                                           f"limit (RLIMIT_FSIZE) of {limit} bytes")
            rows, stack_room = need + (rows - need) // 2, need_bytes + (stack_room - need_bytes) // 2
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:12]}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            for page, data in sorted(image.pages.items()):
                _pwrite(fd, data[: max(0, min(_PAGE, image.size - page * _PAGE))], page * _PAGE)
            os.ftruncate(fd, image.size)
            if self._fd >= 0:
                for name in (*_COLUMNS, *(("stack_end",) if self.stacks else ())):
                    width = 1 if name == "kind" else 8
                    _copy(self._fd, fd, width * self.count, self._offsets[name], offsets[name])
                if self.stacks:
                    _copy(self._fd, fd, self._stack_bytes, self._offsets["stack_bytes"], offsets["stack_bytes"])
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.abandon()
        self._fd, self._offsets, self._size = fd, offsets, image.size
        self._rows, self._stack_room = rows, stack_room

    def _image(self, rows: int, stack_room: int) -> tuple[_Image, dict[str, int]]:
        """The generation's bytes, laid out by HDF5 in memory, and each dataset's offset in them."""
        import h5py

        image = _Image()
        # Aligned to 8 bytes, so that no write of the count straddles two pages (a kill cannot tear it).
        with h5py.File(image, "w", libver="v108", alignment_threshold=8, alignment_interval=8) as f:
            for key, value in self._attrs.items():
                f.attrs[key] = value
            columns = [(name, np.uint8 if name == "kind" else "<i8", rows) for name in _COLUMNS]
            if self.stacks:
                columns += [("stack_end", "<i8", rows), ("stack_bytes", np.uint8, stack_room)]
            for name, dtype, n in columns:
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # reserved now, so the metadata never changes
                dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # and not written: a hole until rows come
                f.create_dataset(name, shape=(n,), dtype=dtype, dcpl=dcpl)
            f.create_dataset("kind_names", data=self._names)
            f.create_dataset("count", data=np.int64(self.count).astype("<i8"))
            offsets = {name: f[name].id.get_offset() for name in f}
        return image, offsets


def _fsize_limit() -> int:
    """The file-size limit (``RLIMIT_FSIZE``): a write past it fails, and sends SIGXFSZ, which kills by default."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return _INT64_MAX if soft == resource.RLIM_INFINITY else soft


def _pwrite(fd: int, data: bytes | bytearray, offset: int) -> None:
    view = memoryview(data)
    while view:
        # A short write (the disk just filled up) is retried, so that the error comes out.
        n = os.pwrite(fd, view, offset)
        if not n:
            raise OSError(errno.EIO, f"no byte could be written at offset {offset}")
        view, offset = view[n:], offset + n


def _copy(src: int, dst: int, nbytes: int, src_offset: int, dst_offset: int) -> None:
    """Copy a byte range between two files, a mebibyte at a time (a column of the previous generation)."""
    done = 0
    while done < nbytes:
        data = os.pread(src, min(nbytes - done, 1 << 20), src_offset + done)
        if not data:
            raise OSError(errno.EIO, f"the trace file ends before its offset {src_offset + done}")
        _pwrite(dst, data, dst_offset + done)
        done += len(data)


def read_hdf5(p: Path) -> Trace:
    """A cupool HDF5 trace; a ``TraceError`` names the file and what is wrong with it."""
    import h5py

    try:
        try:
            f = h5py.File(p, "r")
        except OSError as e:
            # Earlier cupools wrote in SWMR mode, and a killed one left the "open for writing"
            # flag set; a SWMR reader ignores it (h5clear would otherwise be needed).  Only
            # then: a SWMR reader retries damaged metadata for a long time instead of failing.
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
            for c in (*_COLUMNS, "count", "kind_names"):
                if not isinstance(f[c], h5py.Dataset):
                    raise TraceError(
                        p, f"cupool trace is corrupted: {c!r} is an HDF5 {type(f[c]).__name__.lower()}, not a dataset"
                    )
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
