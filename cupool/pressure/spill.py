"""Spill tiers: where a movable buffer's bytes wait while it is off the device.

The tier protocol (``Tier``) is small, so that ``Pool(spill=MyTier())`` works for
a user's own tier: ``store(device, ptr, nbytes)`` copies device bytes into the
tier's own storage and returns a handle with ``load() -> np.ndarray`` (uint8) and
``discard()``; ``describe()`` names the storage in messages; ``name`` is what a
trace records.  ``store`` runs *before* the device block is freed, so when it
fails (an unwritable path, a full disk, no host memory) nothing is lost: the
buffer simply stays where it was.  It should raise ``SpillError`` for that.
``load`` runs before a device block is taken, so a handle whose bytes came back
damaged raises ``CorruptSpillError`` and the pool stays as it was.
``device.read_into(ptr, out)`` is the copy a tier wants: no intermediate buffer,
and no wait (the scheduler synchronizes once per spill).

* ``HostTier`` keeps the bytes in host memory: page-locked buffers from a
  ``PinnedPool`` (copies to and from the GPU run at full DMA speed and the pool
  caches the slow cudaHostAlloc calls), or ordinary numpy memory when the pinned
  pool is full.
* ``HDF5Tier`` writes chunked datasets through h5py with a configured chunk cache,
  for working sets larger than host memory.  Its file is created exclusively,
  written through a file object that keeps every failed write away from HDF5,
  and deleted when the last of its buffers is gone (see "Spill files" below).

Both tiers keep a CRC-32 of what they stored and check it on every load.

Spill files
-----------
The spill file is created at exactly the configured path with O_CREAT|O_EXCL and
O_NOFOLLOW: an existing file, a symbolic link (dangling or not) or another
process's spill file at the path is refused with a ``SpillError`` naming it, and
never opened, so two processes configured alike cannot truncate each other's
bytes even where HDF5's file locks are off (NFS, Lustre).  Give each process its
own path.  Exclusive creation rather than a per-process name beside the path:
the file is the one configured (what messages and ``describe()`` name), and a
clash says so at once instead of leaving a file per killed run behind.  On
removal the path is unlinked only if it is still the file created.

h5py (3.12-3.16) segfaults when it closes or touches a file whose write failed:
HDF5 leaves a half-closed dataset behind.  So HDF5 writes through ``_Disk``
(h5py's "fileobj" driver), which never reports a failure to HDF5: a write the
disk refuses (full disk, file-size limit, quota) and every write after it are
kept in memory, HDF5's view of the file stays whole, and the tier, seeing the
failure, retires that file at once (so what is kept is at most the failed
spill's bytes, briefly): the spill that hit it raises ``SpillError``, the file's
name is unlinked, and the next spill starts a fresh file.  Checking for room
before writing would not do: quotas and other writers make any check stale.
Buffers spilled to a retired file are read back from what did reach the disk, by
the chunk addresses recorded when they were stored; every load reads that way,
past HDF5, so one read path serves healthy and retired files alike.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .._units import format_bytes, parse_size
from ..device import Device
from ..errors import CorruptSpillError, OutOfMemoryError, SpillError

log = logging.getLogger("cupool")


class SpillHandle(Protocol):
    def load(self) -> np.ndarray: ...
    def discard(self) -> None: ...


@runtime_checkable
class Tier(Protocol):
    """What a pool needs from a spill tier."""

    name: str

    def store(self, device: Device, ptr: int, nbytes: int) -> SpillHandle: ...
    def describe(self) -> str: ...


def checksum(data: np.ndarray) -> int:
    """The CRC-32 a load must find again.

    CRC-32 rather than Adler-32: it catches every burst error of up to 32 bits and
    zlib computes it faster here (about 6 GB/s against 3.5); ``bench_spill.py``
    measures its share of a spill and a restore.
    """
    return zlib.crc32(data.data)  # its buffer (numpy's stub gives ndarray one only from Python 3.12)


def _verify(data: np.ndarray, want: int, what: str) -> None:
    got = checksum(data)
    if got != want:
        raise CorruptSpillError(
            f"{what} is damaged: its CRC-32 is {got:#010x}, {want:#010x} when it was spilled; "
            "the buffer stays spilled and the pool is unchanged (free it to drop it)"
        )


class _Claim:
    """A tier serves one live pool: its pool's lock is what serialises the tier's state."""

    _owner: weakref.ref | None = None

    def claim(self, owner: object) -> None:
        if self._owner is not None and self._owner() is not None:
            raise ValueError(f"this {type(self).__name__} already serves another live pool; make one per pool")
        self._owner = weakref.ref(owner)


# ---------------------------------------------------------------------- host
class _HostHandle:
    __slots__ = ("_crc", "_data", "_owner", "_tier")

    def __init__(self, data: np.ndarray, owner: Any, tier: HostTier) -> None:
        self._data: np.ndarray | None = data  # None once discarded
        self._owner = owner  # the pinned allocation behind data, if any
        self._tier = tier
        self._crc = checksum(data)

    def load(self) -> np.ndarray:
        data = self._data
        assert data is not None, "load() after discard()"
        what = f"the spilled copy of a {format_bytes(data.nbytes)} buffer in {self._tier.describe()}"
        _verify(data, self._crc, what)
        return data

    def discard(self) -> None:
        # Dropping the references frees the pinned block through its finalizer, which
        # is safe from any context (discard may run inside a finalizer itself).
        if self._owner is not None:
            self._tier._pinned_held -= self._owner.nbytes
        self._data = None
        self._owner = None


class HostTier(_Claim):
    """Spill to host memory: pinned when ``pinned`` (a ``PinnedPool``) has room, else pageable.

    ``Pool(spill="host")`` makes one with a pinned pool beside the device;
    ``Pool(spill=HostTier())`` spills to pageable memory only.  A tier serves one pool.
    """

    name = "host"

    def __init__(self, pinned: Any = None) -> None:
        self.pinned = pinned
        # Pinned bytes this tier holds.  The pinned pool is the tier's alone, so this
        # tells when a request cannot fit without asking, and running, the pinned
        # pool's reclaim ladder (whose gc.collect would cost more than the copy).
        self._pinned_held = 0

    def store(self, device: Device, ptr: int, nbytes: int) -> _HostHandle:
        """Copy ``nbytes`` at ``ptr`` (device synchronized by the caller) into host memory."""
        owner = None
        data = None
        if self.pinned is not None and nbytes and self._pinned_held + nbytes <= self.pinned.limit:
            try:
                owner = self.pinned.malloc(nbytes)
            except OutOfMemoryError:
                log.debug("cupool spill: pinned pool full, spilling %s to pageable memory", format_bytes(nbytes))
            else:
                self._pinned_held += owner.nbytes
        try:
            if owner is not None:
                data = self.pinned.device.as_array(owner.ptr, (nbytes,), np.dtype(np.uint8), owner)
            else:
                data = np.empty(nbytes, dtype=np.uint8)
            device.read_into(ptr, data)
            return _HostHandle(data, owner, self)
        except BaseException as e:
            # Whatever failed, the pinned block goes back and the count with it: a
            # leaked count would push every later spill to pageable memory.
            if owner is not None:
                self._pinned_held -= owner.nbytes
                owner.free()
            if isinstance(e, MemoryError):
                raise SpillError(f"no host memory for {format_bytes(nbytes)}: {e}") from e
            raise

    def describe(self) -> str:
        return "host memory (pinned pool)" if self.pinned is not None else "host memory"


# ---------------------------------------------------------------------- HDF5
class _Disk:
    """The file object HDF5 writes through (h5py's "fileobj" driver); it never fails a write.

    A write the disk refuses, and every write after it, is kept in ``kept`` and
    served back to HDF5's reads, so HDF5 sees a whole file and never reaches the
    error paths that crash h5py; ``failure`` tells the tier to retire the file.
    After a failure nothing more reaches the disk, so the bytes of buffers stored
    before it stay exactly where they were recorded.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pos = 0
        self.size = 0
        self.failure: OSError | None = None
        self.kept: list[tuple[int, bytes]] = []

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int) -> bytearray:
        # Past the end of the file HDF5 expects zeros, as from its own drivers.
        data = bytearray(os.pread(self.fd, n, self.pos).ljust(n, b"\0"))
        for off, b in self.kept:
            lo, hi = max(off, self.pos), min(off + len(b), self.pos + n)
            if lo < hi:
                data[lo - self.pos : hi - self.pos] = b[lo - off : hi - off]
        self.pos += n
        return data

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        if self.failure is None:
            try:
                while done < len(view):
                    done += os.pwrite(self.fd, view[done:], self.pos + done)
            except OSError as e:
                self.failure = _bare(e)
        if done < len(view):
            self.kept.append((self.pos + done, bytes(view[done:])))
        self.pos += len(view)
        self.size = max(self.size, self.pos)
        return len(view)

    def truncate(self, size: int) -> int:
        if self.failure is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as e:
                self.failure = _bare(e)
        self.kept = [(off, b[: size - off]) for off, b in self.kept if off < size]
        self.size = size
        return size

    def flush(self) -> None:
        """Nothing to do: writes go straight to the descriptor, and a spill file need not survive a crash."""

    def read_into(self, out: memoryview, offset: int) -> int:
        """Read ``len(out)`` bytes at ``offset`` into ``out``; fewer only at the end of the file."""
        done = 0
        while done < len(out):
            n = os.preadv(self.fd, [out[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done


def _bare(e: OSError) -> OSError:
    """``e`` without its traceback and context: their frames hold the spill file, which the
    file's finalizer (holding this ``_Disk``) would then keep alive."""
    return OSError(e.errno, e.strerror)


def _unlink_if_same(path: Path, ident: tuple[int, int]) -> None:
    """Remove ``path`` only if it is still the file created: never what replaced it."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(path)
    except OSError:
        pass


def _close_file(h5: Any, disk: _Disk, path: Path, ident: tuple[int, int]) -> None:
    try:
        h5.close()
    finally:
        _unlink_if_same(path, ident)
        os.close(disk.fd)


class _SpillFile:
    """One spill file: its h5py file (while it takes spills) and the descriptor its loads read.

    Handles hold it, so a retired file lives, unlinked, until its last buffer is
    restored or freed; then it closes and its space comes back.
    """

    def __init__(self, path: Path, rdcc_nbytes: int, rdcc_nslots: int) -> None:
        import h5py

        try:  # 0o600: the bytes are this process's device memory, nobody else's to read
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except FileExistsError:
            raise SpillError(_refusal(path)) from None
        except OSError as e:
            raise SpillError(f"cannot create the spill file {path}: {e}") from e
        st = os.fstat(fd)
        self.path = path
        self.ident = (st.st_dev, st.st_ino)
        self.disk = _Disk(fd)
        self.retired = False
        try:
            self.h5 = h5py.File(self.disk, "w", rdcc_nbytes=rdcc_nbytes, rdcc_nslots=rdcc_nslots)
        except BaseException as e:
            _unlink_if_same(path, self.ident)
            os.close(fd)
            if isinstance(e, (OSError, RuntimeError, ValueError)):
                raise SpillError(f"cannot create the spill file {path}: {e}") from e
            raise
        weakref.finalize(self, _close_file, self.h5, self.disk, path, self.ident)

    def write(self, name: str, host: np.ndarray, chunk_bytes: int) -> list[tuple[int, int]]:
        """Store ``host`` as dataset ``name``; returns where its bytes lie: (file offset, length) runs."""
        n = host.nbytes
        ds = self.h5.create_dataset(name, shape=(n,), dtype=np.uint8, chunks=(min(n, chunk_bytes),) if n else None)
        if n:
            ds.write_direct(host)
        self.h5.flush()
        if self.disk.failure is not None:
            raise SpillError(f"writing {format_bytes(n)} to {self.path} failed: {self.disk.failure}")
        runs: list[tuple[int, int]] = []
        for start in range(0, n, chunk_bytes):
            offset = ds.id.get_chunk_info_by_coord((start,)).byte_offset
            length = min(chunk_bytes, n - start)
            if runs and runs[-1][0] + runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)  # HDF5 lays chunks written in order end to end
            else:
                runs.append((offset, length))
        return runs

    def delete(self, name: str) -> None:
        if self.retired or not self.h5.id.valid:
            return  # retired: the whole file goes with its last buffer; closed at interpreter exit
        try:
            del self.h5[name]
        except (KeyError, OSError, ValueError) as e:  # the bytes are gone either way; only space is lost
            log.warning("cupool spill: could not delete dataset %s from %s: %s", name, self.path, e)

    def retire(self) -> None:
        """Take no more spills: close HDF5's side, free the path for a fresh file, keep the descriptor for loads."""
        self.retired = True
        try:
            self.h5.close()
        except (OSError, RuntimeError, ValueError) as e:
            # Only an exception raised inside HDF5 (a signal's, in a _Disk call) gets here;
            # the file is retired either way, and the caller's own error is the one to see.
            log.warning("cupool spill: closing the retired spill file %s: %s", self.path, e)
        self.disk.kept = []
        _unlink_if_same(self.path, self.ident)


def _refusal(path: Path) -> str:
    if path.is_symlink():
        return (
            f"cannot create the spill file {path}: it is a symbolic link (to {os.readlink(path)}); "
            "cupool never follows one, so that the file it removes is the file it created"
        )
    return (
        f"cannot create the spill file {path}: it already exists, and cupool never opens an existing file "
        "for spilling (it may be another process's live spill file, or one a killed process left behind: "
        "remove it if nothing uses it, or give each process its own path)"
    )


class _H5Handle:
    __slots__ = ("_crc", "_file", "_name", "_nbytes", "_runs")

    def __init__(self, file: _SpillFile, name: str, nbytes: int, runs: list[tuple[int, int]], crc: int) -> None:
        self._file: _SpillFile | None = file  # None once discarded
        self._name = name
        self._nbytes = nbytes
        self._runs = runs
        self._crc = crc

    def load(self) -> np.ndarray:
        f = self._file
        assert f is not None, "load() after discard()"
        what = f"spilled buffer {self._name} ({format_bytes(self._nbytes)}) in {f.path}"
        out = np.empty(self._nbytes, dtype=np.uint8)
        view = out.data  # memoryview(out) (numpy's stub gives ndarray a buffer only from Python 3.12)
        pos = 0
        for offset, length in self._runs:
            try:
                got = f.disk.read_into(view[pos : pos + length], offset)
            except OSError as e:
                raise SpillError(f"reading {what} failed: {e}; the buffer stays spilled") from e
            if got < length:
                raise CorruptSpillError(
                    f"{what} is damaged: the file ends at byte {offset + got}, its bytes reach {offset + length} "
                    "(truncated); the buffer stays spilled and the pool is unchanged (free it to drop it)"
                )
            pos += length
        _verify(out, self._crc, what)
        return out

    def discard(self) -> None:
        if self._file is not None:
            self._file.delete(self._name)
            self._file = None


#: HDF5 refuses chunks of 4 GiB or more.
_MAX_CHUNK = (1 << 32) - 1


class HDF5Tier(_Claim):
    """Spill to chunked HDF5 datasets, one per spilled buffer.

    ``chunk_bytes`` bounds each dataset's chunks: HDF5 writes whole chunks, and
    its chunk cache works in them.  ``rdcc_nbytes`` sizes h5py's chunk cache (per
    open dataset, used as the datasets are written); ``rdcc_nslots`` defaults to a
    prime near 100 slots per chunk that fits, as the HDF5 documentation advises.
    Both accept sizes such as ``"4MiB"``.  Pass the tier as
    ``Pool(spill=HDF5Tier(path, ...))``; ``Pool(spill="file.h5")`` uses the
    defaults.  A tier serves one pool.

    The file is created at ``path`` on first use, exclusively: an existing file or
    a symbolic link there is refused, never opened (see the module's "Spill
    files").  A path whose folder is missing or not writable is refused here, a
    ``ValueError`` naming it.  The file is removed when the tier and its last spilled buffer are gone.
    Discarded datasets are unlinked; HDF5 reuses their space for later spills.
    A write the disk refuses retires the file and the next spill starts a fresh
    one at the same path; buffers already in the retired file stay readable.
    """

    name = "hdf5"

    def __init__(
        self,
        path: str | os.PathLike,
        chunk_bytes: int | str = "4MiB",
        rdcc_nbytes: int | str = "64MiB",
        rdcc_nslots: int | None = None,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {path!r}")
        chunk = parse_size(chunk_bytes, name="chunk_bytes")
        cache = parse_size(rdcc_nbytes, name="rdcc_nbytes")
        if not 1 <= chunk <= _MAX_CHUNK:
            raise ValueError(f"chunk_bytes must be between 1 byte and 4 GiB - 1 (HDF5's limit), got {chunk_bytes!r}")
        if rdcc_nslots is not None:
            if isinstance(rdcc_nslots, bool) or not isinstance(rdcc_nslots, int):
                raise TypeError(f"rdcc_nslots must be an int or None, got {rdcc_nslots!r}")
            if rdcc_nslots < 1:
                raise ValueError(f"rdcc_nslots must be >= 1, got {rdcc_nslots}")
        self.path = _spill_path(Path(path))
        self.chunk_bytes = chunk
        self.rdcc_nbytes = cache
        self.rdcc_nslots = chunk_cache_slots(cache, chunk) if rdcc_nslots is None else rdcc_nslots
        self._file: _SpillFile | None = None
        self._names = itertools.count()

    def store(self, device: Device, ptr: int, nbytes: int) -> _H5Handle:
        """Write ``nbytes`` at ``ptr`` (device synchronized by the caller) to a new dataset."""
        f = self._writable()
        if device.capabilities.host_accessible:
            # Host memory already (the sim arena, pinned memory): write from it.
            host = np.asarray(device.as_array(ptr, (nbytes,), np.dtype(np.uint8), None))
        else:
            try:
                host = np.empty(nbytes, dtype=np.uint8)
            except MemoryError as e:
                raise SpillError(f"no host memory to stage {format_bytes(nbytes)} for {self.path}: {e}") from e
            device.read_into(ptr, host)
        crc = checksum(host)
        name = f"b{next(self._names)}"
        try:
            runs = f.write(name, host, self.chunk_bytes)
        except BaseException as e:
            self._retire(e)
            if isinstance(e, SpillError) or not isinstance(e, Exception):
                raise
            raise SpillError(f"writing {format_bytes(nbytes)} to {self.path} failed: {e}") from e
        return _H5Handle(f, name, nbytes, runs, crc)

    def describe(self) -> str:
        return f"HDF5 file {self.path}"

    def _writable(self) -> _SpillFile:
        if self._file is None:
            self._file = _SpillFile(self.path, self.rdcc_nbytes, self.rdcc_nslots)
        return self._file

    def _retire(self, why: BaseException) -> None:
        f, self._file = self._file, None
        assert f is not None, "only the file being written is retired"
        f.retire()
        log.warning(
            "cupool spill: retired the spill file %s (%s): the buffers in it stay readable, "
            "and the next spill starts a fresh file",
            f.path, why,
        )


def chunk_cache_slots(cache_bytes: int, chunk_bytes: int) -> int:
    """A prime near 100 slots per chunk that fits in the cache, as the HDF5 docs advise."""
    n = max(101, 100 * max(1, cache_bytes // max(1, chunk_bytes)))
    while any(n % p == 0 for p in range(2, int(n**0.5) + 1)):
        n += 1
    return n

def _spill_path(path: Path) -> Path:
    """``path`` if a spill file can be made there: its folder exists and this process may write in it.

    Checked when the tier is made, so that ``Pool(spill="/no/such/dir/x.h5")`` fails
    at once, naming the path, rather than at the first spill, under memory pressure,
    far from the line that configured it.  What only a write can tell (a full disk,
    a file that appears at the path later) still fails the spill, losing nothing.
    """
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"spill path {str(path)!r} is a folder; name a file in it, e.g. {str(path / 'spill.h5')!r}")
    if not folder.is_dir():
        why = "is not a folder" if folder.exists() else "does not exist"
        raise ValueError(f"spill path {str(path)!r}: its folder {str(folder)!r} {why}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"spill path {str(path)!r}: this process may not create files in {str(folder)!r}")
    return path


def make_tier(spill: Any, device: Device, host_pool: Callable[[], Any], owner: object) -> Tier | None:
    """Resolve ``Pool(spill=...)``: None, "host", a path ending in .h5 / .hdf5, or any ``Tier``.

    ``host_pool`` makes the pinned pool that ``"host"`` spills into (the pool layer
    knows how; this layer does not import it).  A built-in tier serves one live
    pool (``owner``): that pool's lock is what serialises the tier's stores, loads
    and discards (its h5py file and pinned count are not thread-safe).
    """
    if spill is None:
        return None
    if isinstance(spill, str) and spill == "host":
        tier: Any = HostTier(host_pool())
    elif isinstance(spill, (str, os.PathLike)):
        path = Path(spill)
        if path.suffix.lower() not in (".h5", ".hdf5"):
            raise ValueError(
                f"spill must be None, 'host', a path ending in .h5 or .hdf5, or a tier, got {spill!r}"
            )
        tier = HDF5Tier(path)
    elif callable(getattr(spill, "store", None)) and callable(getattr(spill, "describe", None)):
        tier = spill
    else:
        raise TypeError(
            "spill must be None, 'host', a path ending in .h5 or .hdf5, or a tier "
            f"(an object with store(device, ptr, nbytes) and describe()), got {spill!r}"
        )
    claim = getattr(tier, "claim", None)
    if callable(claim):
        claim(owner)
    return tier


def tier_name(tier: Any) -> str | None:
    """What a trace records for a tier: its ``name``, else its class's name."""
    if tier is None:
        return None
    name = getattr(tier, "name", None)
    return name if isinstance(name, str) and name else type(tier).__name__
