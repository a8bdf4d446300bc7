"""CuPy's ``MemoryPool`` API on a cupool pool: what ``cupy.get_default_memory_pool()`` answers.

Code written for CuPy's pool (``used_bytes()``, ``free_all_blocks()``, ``get_limit()``, ...)
runs on a ``Pool`` unchanged (issue 36 #12).  Each method reads the pool's own figures,
layout or limit, or calls its own verb: nothing here keeps state.  ``set_limit(size=None,
fraction=None)`` is the pool's own, in CuPy's signature.  ``malloc`` is the one method
that differs: cupool's returns an ``Allocation``; CuPy is handed ``cupool.cupy_allocator``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol


class _PoolLike(Protocol):
    """What the methods read of the pool they are mixed into."""

    @property
    def limit(self) -> int: ...
    def stats(self) -> Any: ...
    def hold(self) -> AbstractContextManager[Any]: ...
    def empty_cache(self) -> int: ...


class CupyPoolMethods:
    """Mixed into ``Pool``, whose figures, layout, limit and ``empty_cache`` they read (``_PoolLike``)."""

    def get_limit(self: _PoolLike) -> int:
        """The cap on reserved bytes (CuPy's ``get_limit``; ``limit``)."""
        return self.limit

    def used_bytes(self: _PoolLike) -> int:
        """Bytes of blocks in use (CuPy's ``used_bytes``; ``allocated_bytes.all.current``)."""
        return self.stats()["allocated_bytes.all.current"]

    def total_bytes(self: _PoolLike) -> int:
        """Bytes held from the device, in use or cached (CuPy's ``total_bytes``; ``reserved_bytes.all.current``)."""
        return self.stats()["reserved_bytes.all.current"]

    def free_bytes(self: _PoolLike) -> int:
        """Bytes held but not in use (CuPy's ``free_bytes``): ``total_bytes() - used_bytes()``."""
        s = self.stats()
        return s["reserved_bytes.all.current"] - s["allocated_bytes.all.current"]

    def n_free_blocks(self: _PoolLike) -> int:
        """Free blocks in the pool's segments (CuPy's ``n_free_blocks``), as ``view.segments()`` shows them."""
        with self.hold() as view:
            return sum(b.free for seg in view.segments() for b in seg.blocks)

    def free_all_blocks(self: _PoolLike, stream: Any = None) -> None:
        """CuPy's ``free_all_blocks``: ``empty_cache()``.  With a ``stream`` too, it gives back every
        stream's free segments: more than CuPy would, never anything in use."""
        self.empty_cache()
