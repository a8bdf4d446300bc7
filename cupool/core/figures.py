"""The flat statistics dict of ``Pool.stats()``: PyTorch's ``memory_stats`` names, then cupool's own.

Kept apart from the pool because it reads only mechanism (the books, the heaps,
the segment source) and is long; the pool holds the lock around it (Note [Statistics]).
"""

from __future__ import annotations

from .arena import Arena


def figures(arena: Arena, limit: int) -> dict[str, int | float]:
    """Every figure, read under the arena's lock (the caller holds it, the fast path drained)."""
    books = arena.books
    # Non-releasable free memory: free blocks in segments that still hold a live block.
    inactive, inactive_n = [0, 0], [0, 0]
    for kind, heap in enumerate(arena.heaps):
        for seg in heap.segments.values():
            if seg.used:
                for b in seg.blocks():
                    if b.free:
                        inactive[kind] += b.size
                        inactive_n[kind] += 1
    books.sample_inactive((inactive_n[0], inactive_n[1]), (inactive[0], inactive[1]))
    out: dict[str, int | float] = dict(books.figures())
    out["num_compactions"] = books.compactions
    out["compaction_bytes_moved"] = books.bytes_moved
    out["movable.all.current"] = books.movables
    out["num_alloc_retries"] = books.retries
    out["num_sync_all_streams"] = books.syncs
    out["num_ooms"] = books.ooms
    out["num_device_alloc"] = books.device_allocs
    out["num_device_free"] = books.device_frees
    out["num_releases_before_split"] = books.releases_before_split
    out["fragmentation"] = arena.fragmentation()
    out["largest_free_block"] = arena.largest_free()
    n = books.hits + books.misses
    out["cache_hit_rate"] = books.hits / n if n else 0.0
    out["limit"] = limit
    out.update(arena.segments.stats())
    return out
