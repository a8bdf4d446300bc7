"""A pool's size settings, checked and resolved to bytes.

Charter: knows the device's total and the units (``cupool._units``), nothing of
pools, heaps or devices beyond that number.  ``Pool`` calls ``check_fraction``
before it makes a device (a bad setting must not leave one behind) and
``resolve`` once the device's total is known.

| setting | resolves to |
| --- | --- |
| ``max_size`` (bytes, "2GB", "50%") | the limit: at most this; more than the device holds is refused |
| ``memory_fraction`` (0 < f <= 1) | the limit: at most this share of the device |
| ``initial_size`` | a preallocated segment, whole pages, within the limit |
| ``release_threshold`` | bytes above which emptied memory goes back at once |
| ``set_limit(size, fraction)`` | CuPy's: the limit; neither, or 0, is the device's total |
"""

from __future__ import annotations

from ._units import format_bytes, parse_size
from .core.sizes import round_page


def check_fraction(memory_fraction: float | None) -> None:
    """A clear error unless ``memory_fraction`` is None or a number in (0, 1]."""
    if memory_fraction is None:
        return
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)):
        raise TypeError(f"memory_fraction must be a number, got {memory_fraction!r}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")


def resolve(
    total: int, max_size: int | str | None, memory_fraction: float | None,
    initial_size: int | str | None, release_threshold: int | str | None,
) -> tuple[int, int, int | None]:
    """``(limit, initial bytes, release threshold)`` on a device of ``total`` bytes (see the table)."""
    limit = total
    if max_size is not None:
        limit = parse_size(max_size, total, "max_size")
        if limit > total:  # a cap the device can never reach caps nothing: a typo or the wrong device
            raise ValueError(f"max_size: {max_size!r} is more than the {format_bytes(total)} ({total} bytes) this "
                             "pool's memory holds; give at most that, or a share such as '80%'")
    if memory_fraction is not None:
        limit = min(limit, int(total * memory_fraction))
    init = 0 if initial_size is None else round_page(parse_size(initial_size, total, "initial_size"))
    if init > limit:
        raise ValueError(f"initial_size {format_bytes(init)} is above the pool's limit {format_bytes(limit)}")
    threshold = None if release_threshold is None else parse_size(release_threshold, total, "release_threshold")
    return limit, init, threshold


def cupy_limit(total: int, size: int | str | None, fraction: float | None) -> int:
    """The cap CuPy's ``MemoryPool.set_limit(size=None, fraction=None)`` means on a device of ``total`` bytes:
    ``size`` as ``max_size`` takes it (capped at ``total``), or a ``fraction`` in [0, 1]; neither, or 0, is
    ``total`` (CuPy's "no limit")."""
    if size is not None and fraction is not None:
        raise ValueError("set_limit: give size or fraction, not both (as CuPy's set_limit)")
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise TypeError(f"set_limit: fraction must be a number in [0, 1], got {fraction!r}")
        if not 0 <= fraction <= 1:
            raise ValueError(f"set_limit: fraction must be in [0, 1], got {fraction}")
        return int(total * fraction) or total
    return total if size is None else min(total, parse_size(size, total, "size")) or total
