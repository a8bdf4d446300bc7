"""Spill tiers: where a movable buffer's bytes wait while it is off the device.

The tier protocol (``Tier``) is small, so that ``Pool(spill=MyTier())`` works for
a user's own tier: ``store(device, ptr, nbytes)`` copies device bytes into the
tier's own storage and returns a handle with ``load() -> np.ndarray`` (uint8) and
``discard()``; ``describe()`` names the storage in messages; ``name`` is what a
trace records.  ``store`` runs *before* the device block is freed, so when it
fails (an unwritable path, a full disk, no host memory) nothing is lost: the
buffer simply stays where it was.  It should raise ``SpillError`` for that.
``device.read_into(ptr, out)`` is the copy a tier wants: no intermediate buffer,
and no wait (the scheduler synchronizes once per spill).

* ``HostTier`` keeps the bytes in host memory: page-locked buffers from a
  ``PinnedPool`` (copies to and from the GPU run at full DMA speed and the pool
  caches the slow cudaHostAlloc calls), or ordinary numpy memory when the pinned
  pool is full.
* ``HDF5Tier`` writes chunked datasets through h5py with a configured chunk cache,
  for working sets larger than host memory.  It creates its file on first use,
  marks it as a cupool spill file, refuses to overwrite any other file, and
  deletes it when the tier is collected.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .._units import format_bytes, parse_size
from ..device import Device
from ..errors import OutOfMemoryError

log = logging.getLogger("cupool")

#: Attribute that marks a file as one cupool created for spilling (and may overwrite).
_MARK = "cupool_spill_file"


class SpillError(Exception):
    """A tier could not take a buffer's bytes; the buffer is still on the device."""


class SpillHandle(Protocol):
    def load(self) -> np.ndarray: ...
    def discard(self) -> None: ...


@runtime_checkable
class Tier(Protocol):
    """What a pool needs from a spill tier."""

    name: str

    def store(self, device: Device, ptr: int, nbytes: int) -> SpillHandle: ...
    def describe(self) -> str: ...


class _Claim:
    """A tier serves one live pool: its pool's lock is what serialises the tier's state."""

    _owner: weakref.ref | None = None

    def claim(self, owner: object) -> None:
        if self._owner is not None and self._owner() is not None:
            raise ValueError(f"this {type(self).__name__} already serves another live pool; make one per pool")
        self._owner = weakref.ref(owner)


# ---------------------------------------------------------------------- host
class _HostHandle:
    __slots__ = ("_data", "_owner", "_tier")

    def __init__(self, data: np.ndarray, owner: Any, tier: HostTier) -> None:
        self._data = data
        self._owner = owner  # the pinned allocation behind data, if any
        self._tier = tier

    def load(self) -> np.ndarray:
        return self._data

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
        except BaseException as e:
            # Whatever failed, the pinned block goes back and the count with it: a
            # leaked count would push every later spill to pageable memory.
            if owner is not None:
                self._pinned_held -= owner.nbytes
                owner.free()
            if isinstance(e, MemoryError):
                raise SpillError(f"no host memory for {format_bytes(nbytes)}: {e}") from e
            raise
        return _HostHandle(data, owner, self)

    def describe(self) -> str:
        return "host memory (pinned pool)" if self.pinned is not None else "host memory"


# ---------------------------------------------------------------------- HDF5
class _H5Handle:
    __slots__ = ("_tier", "_name", "_nbytes")

    def __init__(self, tier: HDF5Tier, name: str, nbytes: int) -> None:
        self._tier = tier
        self._name = name
        self._nbytes = nbytes

    def load(self) -> np.ndarray:
        out = np.empty(self._nbytes, dtype=np.uint8)
        if self._nbytes:
            self._tier._file[self._name].read_direct(out)
        return out

    def discard(self) -> None:
        if self._name is not None:
            self._tier._delete(self._name)
            self._name = None


#: HDF5 refuses chunks of 4 GiB or more.
_MAX_CHUNK = (1 << 32) - 1


class HDF5Tier(_Claim):
    """Spill to chunked HDF5 datasets, one per spilled buffer.

    ``chunk_bytes`` bounds each dataset's chunks: HDF5 reads and writes whole
    chunks, and its chunk cache works in them.  ``rdcc_nbytes`` sizes h5py's chunk
    cache (per open dataset); ``rdcc_nslots`` defaults to a prime near 100 slots
    per chunk that fits, as the HDF5 documentation advises.  Both accept sizes
    such as ``"4MiB"``.  Pass the tier as ``Pool(spill=HDF5Tier(path, ...))``;
    ``Pool(spill="file.h5")`` uses the defaults.  A tier serves one pool.

    The file is created on first use, marked as a cupool spill file, and removed
    when the tier is collected; an existing file without the mark is never
    overwritten.  Discarded datasets are unlinked; HDF5 reuses their space for
    later spills while the file stays open.
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
        self.path = Path(path)
        self.chunk_bytes = chunk
        self.rdcc_nbytes = cache
        self.rdcc_nslots = chunk_cache_slots(cache, chunk) if rdcc_nslots is None else rdcc_nslots
        self._file: Any = None
        self._names = itertools.count()

    def store(self, device: Device, ptr: int, nbytes: int) -> _H5Handle:
        """Write ``nbytes`` at ``ptr`` (device synchronized by the caller) to a new dataset."""
        f = self._open()
        name = f"b{next(self._names)}"
        try:
            if nbytes:
                if device.capabilities.host_accessible:
                    # Host memory already (the sim arena, pinned memory): write from it.
                    host = np.asarray(device.as_array(ptr, (nbytes,), np.dtype(np.uint8), None))
                else:
                    host = np.empty(nbytes, dtype=np.uint8)
                    device.read_into(ptr, host)
                ds = f.create_dataset(name, shape=(nbytes,), dtype=np.uint8, chunks=(min(nbytes, self.chunk_bytes),))
                ds.write_direct(host)
            else:
                f.create_dataset(name, shape=(0,), dtype=np.uint8)
            f.flush()
        except (OSError, ValueError, RuntimeError, MemoryError) as e:
            if name in f:
                self._delete(name)
            raise SpillError(f"writing {format_bytes(nbytes)} to {self.path} failed: {e}") from e
        return _H5Handle(self, name, nbytes)

    def describe(self) -> str:
        return f"HDF5 file {self.path}"

    def _open(self) -> Any:
        if self._file is not None:
            return self._file
        import h5py

        try:
            if self.path.exists():
                with h5py.File(self.path, "r") as old:
                    ours = bool(old.attrs.get(_MARK, False))
                if not ours:
                    raise SpillError(f"{self.path} exists and is not a cupool spill file; refusing to overwrite it")
            f = h5py.File(self.path, "w", rdcc_nbytes=self.rdcc_nbytes, rdcc_nslots=self.rdcc_nslots)
        except SpillError:
            raise
        except OSError as e:
            raise SpillError(f"cannot create the spill file {self.path}: {e}") from e
        try:
            f.attrs[_MARK] = True
        except BaseException as e:
            # Unmarked, the file could never be reused by a later tier: take it away.
            _close_and_remove(f, self.path)
            if isinstance(e, (OSError, RuntimeError)):
                raise SpillError(f"cannot mark the spill file {self.path}: {e}") from e
            raise
        self._file = f
        weakref.finalize(self, _close_and_remove, f, self.path)
        return f

    def _delete(self, name: str) -> None:
        f = self._file
        if f is None or not f.id.valid:
            return  # closed at interpreter exit, and the file removed with it
        try:
            del self._file[name]
        except (KeyError, OSError, ValueError) as e:  # the bytes are gone either way; only space is lost
            log.warning("cupool spill: could not delete dataset %s from %s: %s", name, self.path, e)


def chunk_cache_slots(cache_bytes: int, chunk_bytes: int) -> int:
    """A prime near 100 slots per chunk that fits in the cache, as the HDF5 docs advise."""
    n = max(101, 100 * max(1, cache_bytes // max(1, chunk_bytes)))
    while any(n % p == 0 for p in range(2, int(n**0.5) + 1)):
        n += 1
    return n


def _close_and_remove(f: Any, path: Path) -> None:
    try:
        f.close()
    finally:
        try:
            path.unlink()
        except OSError:
            pass


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
