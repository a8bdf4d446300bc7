"""PyTorch's CUDA tensors from cupool's pool: ``cupool.install(torch=True)``, or by hand::

    import cupool.torch, torch
    torch.cuda.memory.change_current_allocator(cupool.torch.allocator())  # before the first CUDA tensor

Torch then shares the pool CuPy and Numba use on each device (or the one given
to ``use(pool)``).  This module imports without torch; only ``allocator()``
and ``install`` import it.  How the shim works, and how an out-of-memory
reaches the torch caller as an error rather than a tensor at address 0: Note
[Torch's allocator] (cupool/hooks/torch.py).

Under a pluggable allocator ``torch.cuda.memory_stats()`` and its helpers read
nothing, so this module has ``torch.cuda.memory``'s, under torch's names, from
cupool's books: ``memory_allocated``, ``max_memory_allocated``,
``memory_reserved``, ``max_memory_reserved``, ``reset_peak_memory_stats``,
``mem_get_info``, ``empty_cache``, ``memory_stats`` and ``memory_summary``, and
``record_memory_history`` / ``dump_snapshot`` for torch's
``_record_memory_history`` / ``_dump_snapshot``.  Each answers for the pool
serving torch on the device (``serving_pool``: the one ``use`` gave, else the
device's default pool, made if need be), with whatever CuPy and Numba hold there
too.  ``device`` is as torch takes it: None (the current device), an index,
``"cuda:N"`` (``"cuda"``: the current device) or a ``torch.device``; a device
is torch's device N whatever kind serves it, so on a machine without a GPU
``"cuda:1"`` is sim device 1, the one the shim serves torch's device 1 from
(``"sim:N"`` is read too).  The cupool-wide helpers (``cupool.memory_allocated``
and so on) answer for the pool CuPy and Numba allocate from on this thread
instead, and check a name's kind against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from .core.books import Stat
from .hooks.routing import current_device
from .hooks.torch import (
    Shim,
    allocator,
    last_error,
    live_blocks,
    serving_pool,
    serving_pools,
    shim,
    shim_status,
    use,
)
from .observe.memory import device_index, pool_mem_get_info
from .observe.snapshot import export_snapshot
from .observe.summary import memory_summary as _summary_of
from .pool import Pool
from .trace import EventRecorder

__all__ = [
    "Shim",
    "allocator",
    "dump_snapshot",
    "empty_cache",
    "last_error",
    "live_blocks",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "memory_summary",
    "record_memory_history",
    "reset_peak_memory_stats",
    "shim",
    "shim_status",
    "use",
]

#: What names a device here: None, an index, ``"cuda:N"`` or a ``torch.device`` (typed loosely: torch is optional).
Device = Any
#: The recorders ``record_memory_history`` started, by device index.
_recorders: dict[int, EventRecorder] = {}


def memory_allocated(device: Device = None) -> int:
    """``torch.cuda.memory_allocated``: bytes held by live allocations in the pool serving torch on ``device``."""
    return _stat(device, "memory_allocated", "allocated_bytes").current


def max_memory_allocated(device: Device = None) -> int:
    """``torch.cuda.max_memory_allocated``: the peak of ``memory_allocated`` since ``reset_peak_memory_stats``."""
    return _stat(device, "max_memory_allocated", "allocated_bytes").peak


def memory_reserved(device: Device = None) -> int:
    """``torch.cuda.memory_reserved``: bytes the pool holds from the device, in use or cached."""
    return _stat(device, "memory_reserved", "reserved_bytes").current


def max_memory_reserved(device: Device = None) -> int:
    """``torch.cuda.max_memory_reserved``: the peak of ``memory_reserved`` since ``reset_peak_memory_stats``."""
    return _stat(device, "max_memory_reserved", "reserved_bytes").peak


def _stat(device: Device, what: str, name: str) -> Stat:
    """One figure of the pool serving torch on ``device``, read under its lock: one read, not
    ``stats()``' walk over every block (a training loop may log one a step)."""
    with _pool(device, what).hold() as view:
        return view.books.stat(name)


def reset_peak_memory_stats(device: Device = None) -> None:
    """``torch.cuda.reset_peak_memory_stats``: every peak of the pool starts afresh from its current value."""
    _pool(device, "reset_peak_memory_stats").reset_peak_stats()


def mem_get_info(device: Device = None) -> tuple[int, int]:
    """``torch.cuda.mem_get_info``: ``(free, total)`` within the pool's limit (``cupool.mem_get_info``'s rule)."""
    return pool_mem_get_info(_pool(device, "mem_get_info"))


def empty_cache(device: Device = None) -> int:
    """``torch.cuda.empty_cache``: give the cached, unused memory back to the device; returns the bytes given back.

    As torch's, with no ``device`` every pool serving torch is emptied (each device
    torch was served on, and each ``use`` named); with one, that device's pool.
    """
    pools = serving_pools().values() if device is None else [_pool(device, "empty_cache")]
    return sum(pool.empty_cache() for pool in pools)


def memory_stats(device: Device = None) -> dict[str, Any]:
    """``torch.cuda.memory_stats`` from cupool's books: the serving pool's ``stats()``, sorted by name."""
    return dict(sorted(_pool(device, "memory_stats").stats().items()))


def memory_summary(device: Device = None, abbreviated: bool = False) -> str:
    """``torch.cuda.memory_summary``'s table for the pool serving ``device`` (``cupool.memory_summary``)."""
    return _summary_of(_pool(device, "memory_summary"), abbreviated)


def record_memory_history(enabled: Literal["all", "state"] | None = "all", device: Device = None,
                          max_entries: int = 1 << 16, stacks: bool = False) -> None:
    """``torch.cuda.memory._record_memory_history`` for the pool serving torch on ``device``.

    ``"all"`` records the pool's events in a ring buffer of the last ``max_entries``
    (``pool.record(capacity=...)``; ``stacks=True`` keeps each event's Python stack),
    from now until called again: ``pool.snapshot()`` and ``dump_snapshot`` then carry
    them as ``device_traces``.  ``None`` (or ``"state"``: the pool's segments and
    blocks are in every snapshot anyway) stops the recording started here.
    """
    if enabled not in ("all", "state", None):
        raise ValueError(f"cupool.torch.record_memory_history(): enabled must be 'all', 'state' or None, "
                         f"got {enabled!r}")
    pool = _pool(device, "record_memory_history")
    index = pool.device.index
    rec = EventRecorder(pool, capacity=max_entries, stacks=stacks) if enabled == "all" else None  # checks first
    old = _recorders.pop(index, None)
    if old is not None:
        old.stop()
    if rec is not None:
        rec.start()
        _recorders[index] = rec


def dump_snapshot(filename: str | Path = "dump_snapshot.pickle", device: Device = None) -> int:
    """``torch.cuda.memory._dump_snapshot``: pickle the pool serving ``device`` in torch's snapshot format.

    Returns the events written: those of ``record_memory_history`` (or any other
    recording of the pool); without one the segments are written and a warning
    says why there are no events.  torch's writes every device; this, one pool.
    """
    return export_snapshot(_pool(device, "dump_snapshot"), filename)


def _pool(device: Device, caller: str) -> Pool:
    """The pool serving torch on the device ``device`` names, in ``caller``'s words if it names none."""
    return serving_pool(_index(device, f"cupool.torch.{caller}"))


def _index(device: Device, caller: str) -> int:
    """The device index of an index, a device string or a ``torch.device`` (None: the current device)."""
    kind = getattr(device, "type", None)
    if isinstance(kind, str) and not isinstance(device, str):  # a torch.device (torch itself is not imported)
        if kind != "cuda":
            raise ValueError(f"{caller}(): {device!r} is not a CUDA device; cupool serves torch's CUDA memory")
        index = device.index
    else:
        index = device_index(device, caller)
    return current_device() if index is None else index
