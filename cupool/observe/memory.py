"""PyTorch's one-call memory helpers, under torch's names, over the pool that serves a device.

Code written against ``torch.cuda`` asks ``memory_allocated()``,
``max_memory_allocated()``, ``memory_reserved()``, ``max_memory_reserved()``,
``mem_get_info()`` and ``reset_peak_memory_stats()``; the same calls on
``cupool`` answer for the pool that CuPy and Numba allocations of this thread go
to on that device: a ``using`` block's pool, else the ``install``-ed one, else
the device's default pool (``cupool.hooks.current_pool``).  The figures are the
pool's ``stats()`` keys that torch's helpers read (``allocated_bytes.all.current``
and so on), so the two agree by construction.

``device`` is as in torch: None (the current device), an index, or a string
``"cuda:N"`` / ``"sim:N"`` (``"cuda"`` / ``"sim"``: the current device), read
as ``Pool`` reads it (``cupool.device.split_device``: N in ASCII digits, a bad
string a ``DeviceNameError`` naming it; ``memory_summary`` reads it too).  The
string's kind must be the kind of device the pool lives on, so code that names
``"cuda:0"`` on a machine without a GPU is told, not silently answered for sim.

Like torch's before CUDA is initialised, the counters are 0 while no pool
exists for the device, and asking does not make one (a default pool made from
``CUPOOL_CONF`` may reserve ``initial_size`` at once).  ``mem_get_info`` does
make the default pool, as torch's initialises CUDA: its answer depends on the
pool's limit.
"""

from __future__ import annotations

from typing import Literal

from ..device import KINDS, split_device
from ..device.kinds import one_of
from ..errors import ClosedError, DeviceNameError
from ..hooks.routing import current_device, current_pool, existing_pool
from ..pool import Pool

__all__ = [
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "reset_peak_memory_stats",
]

DeviceLike = int | str | None
#: The figures the helpers read, by their ``stats()`` names.
_Figure = Literal[
    "allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current", "reserved_bytes.all.peak"
]


def memory_allocated(device: DeviceLike = None) -> int:
    """Bytes of the device's pool held by live allocations (``torch.cuda.memory_allocated``)."""
    return _stat(device, "allocated_bytes.all.current", "memory_allocated")


def max_memory_allocated(device: DeviceLike = None) -> int:
    """The peak of ``memory_allocated`` since the pool began or ``reset_peak_memory_stats``."""
    return _stat(device, "allocated_bytes.all.peak", "max_memory_allocated")


def memory_reserved(device: DeviceLike = None) -> int:
    """Bytes the device's pool holds from the device, in use or cached (``torch.cuda.memory_reserved``)."""
    return _stat(device, "reserved_bytes.all.current", "memory_reserved")


def max_memory_reserved(device: DeviceLike = None) -> int:
    """The peak of ``memory_reserved`` since the pool began or ``reset_peak_memory_stats``."""
    return _stat(device, "reserved_bytes.all.peak", "max_memory_reserved")


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    """Start every peak of the device's pool afresh from its current value (``Pool.reset_peak_stats``)."""
    pool = existing_device_pool(device, "reset_peak_memory_stats")
    if pool is not None:
        pool.reset_peak_stats()


def mem_get_info(device: DeviceLike = None) -> tuple[int, int]:
    """``(free, total)`` bytes, as ``torch.cuda.mem_get_info``, within the pool's limit.

    ``total`` is the pool's limit (the device's memory when the pool has none:
    ``max_size``, ``memory_fraction`` or ``CUPOOL_CONF`` set one), and ``free``
    what the pool may still reserve: the device's free memory, but no more than
    the limit leaves (managed memory: what the device and the host memory it
    pages out to have free, ``Pool.mem_info``).  As in torch, ``free`` leaves out the bytes the pool holds
    cached (``memory_reserved() - memory_allocated()``), which it also serves
    from; the Numba plugin's ``get_memory_info`` counts them in, as Numba asks.
    A closed pool (a ``using`` or ``install`` of a pool closed since) hands out
    nothing, so it is refused with ``ClosedError``, as allocating from it is.
    """
    pool = current_pool(device_index(device, "mem_get_info"))
    _check_kind(device, pool, "mem_get_info")
    return pool_mem_get_info(pool)


def pool_mem_get_info(pool: Pool) -> tuple[int, int]:
    """``mem_get_info``'s ``(free, total)`` of ``pool`` itself (``cupool.torch`` asks it of torch's pool)."""
    if pool.closed:
        raise ClosedError(f"cupool: mem_get_info() on a closed pool ({pool!r}): it hands out no memory")
    device_free, _ = pool.mem_info()
    reserved = pool.stats()["reserved_bytes.all.current"]
    return min(device_free, max(pool.limit - reserved, 0)), pool.limit


def _stat(device: DeviceLike, key: _Figure, caller: str) -> int:
    pool = existing_device_pool(device, caller)
    return 0 if pool is None else pool.stats()[key]


def existing_device_pool(device: DeviceLike, caller: str) -> Pool | None:
    """The pool that serves ``device`` (as the helpers read it), or None while there is none; makes none."""
    pool = existing_pool(device_index(device, caller))
    if pool is not None:
        _check_kind(device, pool, caller)
    return pool


def device_index(device: DeviceLike, caller: str) -> int | None:
    """The device index ``device`` names (None: the current device), or a clear error in ``caller``'s words."""
    if device is None or isinstance(device, bool) or not isinstance(device, str):
        return _checked_int(device, caller)
    index = _read(device, caller)[1]
    return current_device() if index is None else index


def _read(device: str, caller: str) -> tuple[str, int | None]:
    """``split_device``'s reading of a device string (the pool's own syntax), "auto" left out as torch has none."""
    try:
        kind, index = split_device(device)
    except DeviceNameError as e:
        raise DeviceNameError(f"{caller}(): {e}") from None
    if kind not in KINDS:
        forms = one_of(f"{k}:N" for k in KINDS)
        raise DeviceNameError(f"{caller}(): device must be an index or a name ({forms}), got {device!r}")
    return kind, index


def _checked_int(device: object, caller: str) -> int | None:
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"{caller}(): device must be None, an int or a str like 'cuda:0', got {device!r}")
    if device < 0:
        raise ValueError(f"{caller}(): a device index must be >= 0, got {device}")
    return device


def _check_kind(device: DeviceLike, pool: Pool, caller: str) -> None:
    """A ``"cuda:N"`` asked of a pool on sim (or the reverse) is refused, naming both."""
    if isinstance(device, str) and pool.device.name.partition(":")[0] != _read(device, caller)[0]:
        raise ValueError(
            f"{caller}(): asked about {device!r}, but device {pool.device.index}'s pool is on {pool.device.name}"
        )
