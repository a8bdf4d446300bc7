"""Counts in words, as every message and picture prints them: "1 segment", "2 segments".

One helper, so that no output says "1 segments" or "1 OOMs" again: the CLI,
the Jupyter map and the report all count through ``count``.
"""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1 (``plural`` where adding "s" is wrong)."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"
