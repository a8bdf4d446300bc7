"""PyTorch's CUDA tensors from cupool's pool: ``cupool.install(torch=True)``, or by hand::

    import cupool.torch, torch
    torch.cuda.memory.change_current_allocator(cupool.torch.allocator())  # before the first CUDA tensor

Torch then shares the pool CuPy and Numba use on each device (or the one given
to ``use(pool)``).  This module imports without torch; only ``allocator()``
and ``install`` import it.  How the shim works, and how an out-of-memory
reaches the torch caller as an error rather than a tensor at address 0: Note
[Torch's allocator] (cupool/hooks/torch.py).

Under a pluggable allocator ``torch.cuda.memory_stats()`` is empty, so
``memory_stats`` and ``memory_summary`` here give torch's figures, under torch's
names, from cupool's books: the pool serving the device, with whatever CuPy and
Numba hold there too.
"""

from __future__ import annotations

from typing import Any

from .hooks.routing import current_device
from .hooks.torch import Shim, allocator, last_error, live_blocks, serving_pool, shim, shim_status, use
from .observe.summary import memory_summary as _summary_of

__all__ = [
    "Shim",
    "allocator",
    "last_error",
    "live_blocks",
    "memory_stats",
    "memory_summary",
    "shim",
    "shim_status",
    "use",
]


def memory_stats(device: int | None = None) -> dict[str, Any]:
    """``torch.cuda.memory_stats`` from cupool's books: the serving pool's ``stats()``, sorted by name.

    ``device`` is an index (None: the current device); the device's default
    pool is made if torch has not been served there yet.
    """
    return dict(sorted(serving_pool(_device(device)).stats().items()))


def memory_summary(device: int | None = None, abbreviated: bool = False) -> str:
    """``torch.cuda.memory_summary``'s table for the pool serving ``device`` (``cupool.memory_summary``)."""
    return _summary_of(serving_pool(_device(device)), abbreviated)


def _device(device: object) -> int:
    if device is None:
        return current_device()
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise TypeError(f"cupool.torch: device must be None or an index >= 0, got {device!r}")
    return device
