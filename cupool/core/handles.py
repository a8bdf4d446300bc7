"""The handles of movable buffers: ``Movable`` and the ``Lease`` of an array over one.

(``Allocation``, the hot handle, lives in ``cupool.core.fast``.)  Handles talk to
their owner (``cupool.core.movables.Movables``) through a small protocol, never
to ``Pool``.  The attributes without an underscore that are not documented for
users (``block``, ``kind``, ``leases``, ``spilled``) belong to that owner: read
them if you must, never write them (Note [Movable lifecycle]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .fast import refuse_copy

if TYPE_CHECKING:
    from .heap import Block


class DeviceArray(Protocol):
    """What a pool's arrays have, whichever library made them: numpy's on the sim device and for
    pinned memory, CuPy's on a GPU (``Pool.empty``, ``Movable.array``)."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def ndim(self) -> int: ...
    def __getitem__(self, key: Any, /) -> Any: ...
    def __setitem__(self, key: Any, value: Any, /) -> None: ...
    def __len__(self) -> int: ...
    def fill(self, value: Any, /) -> None: ...


class Owner(Protocol):
    """What a handle needs from the lifecycle that made it."""

    def finalize_later(self, h: Movable | Lease) -> None: ...
    def lease(self, m: Movable, shape: Any, dtype: Any) -> DeviceArray: ...
    def unlease(self, m: Movable) -> int: ...
    def free_movable(self, m: Movable) -> None: ...
    def drop_movable(self, m: Movable) -> int: ...


class Movable:
    """Device memory the pool may relocate (compaction) or spill whenever no array views it.

    Every array handed out by ``array()`` owns a ``Lease``; while any lease is
    alive the buffer is pinned, so a live array never sees its memory move: that
    makes compaction safe by construction instead of by convention.  A buffer that
    was moved or spilled bumps ``generation`` and, if given, calls
    ``on_move(movable, old_ptr, new_ptr)`` (``new_ptr`` None when spilled), so code
    that cached a pointer can tell.
    """

    __slots__ = (
        "owner", "size", "stream", "block", "kind", "leases", "freed", "spilled",
        "generation", "on_move", "last_used", "seq", "__weakref__",
    )

    def __init__(
        self,
        owner: Owner,
        block: Block,
        size: int,
        stream: Any,
        kind: int,
        on_move: Callable[[Movable, int, int | None], None] | None,
        seq: int,
        now: int,
    ) -> None:
        self.owner = owner
        self.size = size
        self.stream = stream
        self.block: Block | None = block
        self.kind = kind
        self.leases = 0
        self.freed = False
        # Where the bytes are while off the device: the handle a spill tier returned
        # (``load() -> np.ndarray``, ``discard()``).
        self.spilled: Any = None
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
        b = self.block
        return None if b is None else b.addr

    @property
    def on_device(self) -> bool:
        return self.block is not None

    @property
    def leased(self) -> bool:
        return self.leases > 0

    def array(self, shape: int | tuple[int, ...] | None = None, dtype: Any = np.uint8) -> DeviceArray:
        """A view of the buffer (numpy on sim, CuPy on CUDA) that pins it while alive.

        A spilled buffer is brought back to the device first.  ``shape`` defaults to
        as many ``dtype`` items as fit.
        """
        return self.owner.lease(self, shape, dtype)

    def free(self) -> None:
        """Return the memory now, or, while arrays still view it, when the last one dies."""
        self.owner.free_movable(self)

    def finalize_locked(self) -> int:
        if self.freed:
            return 0
        self.freed = True
        return self.owner.drop_movable(self)

    def __del__(self) -> None:
        if not self.freed:
            self.owner.finalize_later(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        refuse_copy(self)

    def __repr__(self) -> str:
        where = "freed" if self.freed else f"ptr={self.ptr:#x}" if self.block is not None else "spilled"
        return f"<cupool.Movable {self.size} bytes {where} leases={self.leases} gen={self.generation}>"


class Lease:
    """The memory owner of one array over a Movable: pins the buffer until it dies."""

    __slots__ = ("movable",)

    def __init__(self, movable: Movable) -> None:
        self.movable = movable

    def finalize_locked(self) -> int:
        return self.movable.owner.unlease(self.movable)

    def __del__(self) -> None:
        self.movable.owner.finalize_later(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        refuse_copy(self)


def as_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints, or a TypeError/ValueError naming it."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a tuple of ints, got {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"shape must contain ints, got {shape!r}")
        if d < 0:
            raise ValueError(f"shape must not contain negative dimensions, got {shape!r}")
    return tuple(int(d) for d in dims)


def array_nbytes(shape: tuple[int, ...], dtype: Any) -> tuple[np.dtype, int]:
    """The dtype and byte count of an array, refusing object dtypes (they cannot live on a device)."""
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"dtype {dt} holds Python objects, which cannot live in device memory")
    n = 1
    for d in shape:
        n *= d
    return dt, n * dt.itemsize
