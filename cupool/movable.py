"""Movable buffers and leases.

A ``Movable`` is device memory the pool may relocate (compaction) or take off the
device (spilling) whenever no array views it.  Every array handed out by
``Movable.array()`` owns a ``_Lease``; while any lease is alive the buffer is
pinned, so a live array never sees its memory move.  That makes compaction safe
by construction instead of by convention.  Raw ``malloc``, CuPy and Numba
allocations are never moved.

A buffer that was moved or spilled bumps ``generation`` and, if given, calls
``on_move(movable, old_ptr, new_ptr)`` (``new_ptr`` is None when spilled), so code
that cached a pointer can tell.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .heap import Block
    from .pool import Pool


class Movable:
    __slots__ = (
        "_pool",
        "size",
        "stream",
        "_block",
        "_kind",
        "_leases",
        "_freed",
        "_spilled",
        "generation",
        "on_move",
        "last_used",
        "seq",
        "__weakref__",
    )

    def __init__(
        self,
        pool: Pool,
        block: Block,
        size: int,
        stream: Any,
        kind: int,
        on_move: Callable[[Movable, int, int | None], None] | None,
        seq: int,
        now: int,
    ) -> None:
        self._pool = pool
        self.size = size
        self.stream = stream
        self._block: Block | None = block
        self._kind = kind
        self._leases = 0
        self._freed = False
        # Where the bytes are while off the device: an object with load() -> np.ndarray
        # and discard(), provided by the spill tier that took them.
        self._spilled: Any = None
        self.generation = 0
        self.on_move = on_move
        self.last_used = now
        self.seq = seq

    @property
    def nbytes(self) -> int:
        return self.size

    @property
    def ptr(self) -> int | None:
        """The current device address, or None while the buffer is spilled or freed."""
        b = self._block
        return None if b is None else b.addr

    @property
    def on_device(self) -> bool:
        return self._block is not None

    @property
    def leased(self) -> bool:
        return self._leases > 0

    @property
    def freed(self) -> bool:
        return self._freed

    def array(self, shape: int | tuple[int, ...] | None = None, dtype: Any = np.uint8) -> Any:
        """A view of the buffer (numpy on sim, CuPy on CUDA) that pins it while alive.

        A spilled buffer is brought back to the device first.  ``shape`` defaults to
        as many ``dtype`` items as fit.
        """
        return self._pool._lease(self, shape, dtype)

    def free(self) -> None:
        """Return the memory now, or, while arrays still view it, when the last one dies."""
        self._pool._free_movable(self)

    def _finalize_locked(self) -> int:
        if self._freed:
            return 0
        self._freed = True
        return self._pool._drop_movable(self)

    def __del__(self) -> None:
        if not self._freed:
            self._pool._free_from_finalizer(self)

    def __repr__(self) -> str:
        where = (
            "freed" if self._freed else f"ptr={self.ptr:#x}" if self.on_device else "spilled"
        )
        return f"<cupool.Movable {self.size} bytes {where} leases={self._leases} gen={self.generation}>"


class _Lease:
    """The memory owner of one array over a Movable: pins the buffer until it dies."""

    __slots__ = ("movable",)

    def __init__(self, movable: Movable) -> None:
        self.movable = movable

    def _finalize_locked(self) -> int:
        return self.movable._pool._unlease(self.movable)

    def __del__(self) -> None:
        self.movable._pool._free_from_finalizer(self)
