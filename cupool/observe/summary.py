"""``memory_summary``: the table ``torch.cuda.memory_summary`` prints, for a cupool pool.

PyTorch users read their allocator through that table; the same figures under
the same names (``Pool.stats`` follows ``torch.cuda.memory_stats``) let them
read cupool the same way.  It is built from the stats dict alone, so it needs
no torch, and ``torch.cuda.memory.memory_summary`` itself also accepts
``pool.stats()`` (the tests check both).  What each figure means in cupool's
terms: Note [Statistics] (cupool/core/books.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .._units import format_bytes
from ..core.figures import Stats
from ..device import kinds
from ..hooks.routing import current_device
from ..pool import Pool
from .memory import DeviceLike, device_index, existing_device_pool

WIDTH = 75

#: (stats prefix, label) per block of rows, in PyTorch's order: bytes, then counts.
_SIZES = (
    ("allocated_bytes", "Allocated memory"),
    ("active_bytes", "Active memory"),
    ("requested_bytes", "Requested memory"),
    ("reserved_bytes", "GPU reserved memory"),
    ("inactive_split_bytes", "Non-releasable memory"),
)
_COUNTS = (
    ("allocation", "Allocations"),
    ("active", "Active allocs"),
    ("segment", "GPU reserved segments"),
    ("inactive_split", "Non-releasable allocs"),
)
_POOL_ROWS = (("all", None), ("large_pool", "      from large pool"), ("small_pool", "      from small pool"))
_OVERSIZE = (("oversize_allocations", "Oversize allocations"), ("oversize_segments", "Oversize GPU segments"))
_METRICS = ("current", "peak", "allocated", "freed")


def memory_summary(
    device: Pool | Stats | Mapping[str, int | float] | DeviceLike = None, abbreviated: bool = False
) -> str:
    """A human-readable table of a pool's statistics, laid out as ``torch.cuda.memory_summary``'s.

    ``device`` is read as the other torch-style helpers read it (``cupool.memory_allocated``):
    None (the current device), an index, or ``"cuda:N"`` / ``"sim:N"``, for the
    pool that serves that device; while there is none, the table is all zeros,
    as torch's counters are before CUDA is initialised, and none is made.  It
    may also be a ``Pool`` (its ``stats()`` are read once) or a dict returned by
    ``Pool.stats()``.  ``abbreviated=True`` leaves out the per-pool (large/small)
    rows.  Returns the text; print it.
    """
    stats: Mapping[str, object]
    strict = True  # a figure missing from given stats is an error; a device without a pool has none yet
    if isinstance(device, Pool):
        stats, name = device.stats(), device.device.name
    elif isinstance(device, Mapping):
        stats, name = device, "-"
    elif device is None or isinstance(device, (int, str)):
        pool = existing_device_pool(device, "memory_summary")
        if pool is None:
            index = device_index(device, "memory_summary")
            stats, name, strict = {}, f"{current_device() if index is None else index} (no pool yet)", False
        else:
            stats, name = pool.stats(), pool.device.name
    else:
        raise TypeError(
            f"memory_summary() takes a device (None, an index or {kinds.one_of(f'{k}:N' for k in kinds.KINDS)}), "
            f"a cupool.Pool or its stats() dict, got {type(device).__name__}"
        )
    get = _reader(stats, strict)
    lines = [
        "=" * WIDTH,
        f"{'cupool memory summary, device ' + name:^{WIDTH}}",
        "-" * WIDTH,
        _halves(f"OOMs: {get('num_ooms')}", f"Alloc retries: {get('num_alloc_retries')}"),
    ]
    if "limit" in stats:  # cupool's own figures, where the stats carry them
        lines += _free_space(get)
    lines += ["=" * WIDTH, "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]
    pools = _POOL_ROWS[:1] if abbreviated else _POOL_ROWS
    for blocks, fmt in ((_SIZES, _size), (_COUNTS, _count)):
        for prefix, label in blocks:
            lines.append("-" * WIDTH)
            # Every row of a block uses the units its "all" row needs, as PyTorch's does.
            ref = [get(f"{prefix}.all.{m}") for m in _METRICS]
            for pname, sub in pools:
                cells = [fmt(get(f"{prefix}.{pname}.{m}"), r) for m, r in zip(_METRICS, ref)]
                lines.append(_row(sub or label, cells))
    for prefix, label in _OVERSIZE:
        lines.append("-" * WIDTH)
        lines.append(_row(label, [_count(v, v) for v in (get(f"{prefix}.{m}") for m in _METRICS)]))
    lines.append("=" * WIDTH)
    return "".join(f"|{line:<{WIDTH}}|\n" for line in lines)


def _free_space(get: Callable[[str], int]) -> list[str]:
    """The limit, and the free space in segments as bytes beside the largest free block.

    Not the ``fragmentation`` ratio of the stats ((reserved - allocated) /
    reserved): a pool holding 512 B in its one 2 MiB segment has 1.000 by it,
    though its free space is one block that any request up to 2 MiB can use.
    The free bytes beside the largest free block say what the ratio cannot:
    whether the free space is one hole or scattered.
    """
    free = get("reserved_bytes.all.current") - get("allocated_bytes.all.current")
    return [
        _halves(f"Limit: {format_bytes(get('limit'))}", f"Free in segments: {format_bytes(free)}"),
        _halves("", f"Largest free block: {format_bytes(get('largest_free_block'))}"),
    ]


def _reader(stats: Mapping[str, object], strict: bool) -> Callable[[str], int]:
    """A figure of ``stats`` as an int; with ``strict``, a missing or non-numeric one is an error naming it."""

    def get(key: str) -> int:
        value = stats.get(key, None if strict else 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            what = "no" if value is None else f"a {type(value).__name__} as"
            raise ValueError(f"memory_summary(): the stats have {what} {key!r}; pass a Pool or its stats()")
        return int(value)

    return get


def _halves(left: str, right: str) -> str:
    return f"{left:^37}|{right:^37}"


def _row(label: str, cells: list[str]) -> str:
    return f" {label:<21} | " + " | ".join(cells) + " "


def _scaled(n: int, ref: int, step: int, switch: int, units: tuple[str, ...]) -> tuple[int, str]:
    """``n`` in the unit that keeps ``ref`` (the block's "all" figure) below ``switch`` of it."""
    i = 0
    while i + 1 < len(units) and ref >= switch * step**i:
        i += 1
    return n // step**i, units[i]


def _size(n: int, ref: int) -> str:
    v, unit = _scaled(n, ref, 1024, 768 * 1024, ("B  ", "KiB", "MiB", "GiB", "TiB", "PiB"))
    return f"{v:6d} {unit}"


def _count(n: int, ref: int) -> str:
    v, unit = _scaled(n, ref, 1000, 750 * 1000, (" ", "K", "M"))
    return f"{v:7d} {unit} "
