"""Byte sizes as people write them ("2GB", "512MiB", "50%") and as people read them."""

from __future__ import annotations

import operator
import re
import reprlib
from fractions import Fraction
from typing import SupportsIndex, cast

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*|%)\s*$")
#: The largest byte count cupool takes: what an int64 holds, as traces, the replay engine
#: and every device API (ssize_t, size_t) store sizes.  Larger counts are refused as
#: arguments rather than reaching those as an OverflowError or a wrapped-around number.
MAX_NBYTES = (1 << 63) - 1
#: No device holds more: 256 TiB is the 48-bit address space of today's CPUs and GPUs.
#: Traces are held to it (a larger block in a log is damage, not a workload).
MAX_DEVICE_BYTES = 1 << 48
_SHOWN = reprlib.Repr()
_SHOWN.maxlong = _SHOWN.maxstring = 40
#: Digits after the point that a size may have: far past what changes a byte count (2**40 is 13 digits),
#: and far below Python's limit on converting digits to an int (4300), which has no word of the key.
_MAX_DECIMALS = 100


def _shown_int(n: int) -> str:
    """``n`` for an error message: Python will not turn an int of more than 4300 digits into text."""
    if n.bit_length() <= 128:
        return _SHOWN.repr(n)
    return f"a{' negative' if n < 0 else ''} number of about {int(n.bit_length() * 0.30103) + 1} digits"


def as_nbytes(value: object, name: str = "nbytes") -> int:
    """Validate a byte count given to malloc-like calls.

    Integers (and objects with ``__index__``, e.g. numpy integers) are accepted;
    ``bool``, floats and strings are not, because a silent conversion would hide a
    caller's bug (``malloc(1.5)`` or ``malloc("1MB")`` almost always is one).
    """
    if type(value) is int:
        n = value
    elif isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an integer number of bytes, got {type(value).__name__} {value!r}")
    else:
        n = operator.index(cast(SupportsIndex, value))  # its type has __index__, checked above
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {_shown_int(n)}")
    if n > MAX_NBYTES:
        raise ValueError(f"{name} must be at most 2**63 - 1 bytes, got {_shown_int(n)}")
    return n


def parse_size(value: object, total: int | None = None, name: str = "size") -> int:
    """Parse a configured size: an int, or a string such as "2GB", "512MiB", "1.5G" or "50%".

    KB/MB/GB are decimal and KiB/MiB/GiB (or K/M/G) are binary, as on the labels of
    disks and in ``nvidia-smi`` respectively.  Percentages need ``total``: they are
    taken of the device's memory.  The number is read exactly (a float would turn
    a long digit string into infinity, and "0.1GB" into 100000000.00000001).
    """
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ValueError(f"{name}: cannot parse {_SHOWN.repr(value)} as a size (try 2GB, 512MiB or 50%)")
        whole, _, decimals = m.group(1).partition(".")
        whole, unit = whole.lstrip("0"), m.group(2).lower()
        if len(whole) > len(str(MAX_NBYTES)):  # read as digits, it would meet Python's limit on them
            raise ValueError(f"{name}: {_SHOWN.repr(value)} is " + (
                "more than 100%" if unit == "%" else "more bytes than a 64-bit size holds"))
        if len(decimals) > _MAX_DECIMALS:
            raise ValueError(f"{name}: {_SHOWN.repr(value)} has {len(decimals)} digits after the point; "
                             f"a size has at most {_MAX_DECIMALS}")
        number = Fraction(f"{whole or 0}.{decimals}0")
        if unit == "%":
            if total is None:
                raise ValueError(f"{name}: {value!r} is a percentage, but there is no total to take it of")
            if number > 100:
                raise ValueError(f"{name}: {_SHOWN.repr(value)} is more than 100%")
            return int(total * number / 100)
        if unit not in _UNITS:
            raise ValueError(f"{name}: unknown unit {m.group(2)!r} in {value!r}")
        n = int(number * _UNITS[unit])
        if n > MAX_NBYTES:
            raise ValueError(f"{name}: {_SHOWN.repr(value)} is more bytes than a 64-bit size holds")
        return n
    return as_nbytes(value, name)


def format_bytes(n: float) -> str:
    """Human units, binary, three significant figures: 1536 -> '1.5 KiB'.

    A value that rounds to 1000 or more of a unit but is under 1024 of it keeps
    its unit, shown as a whole number ("1000 MiB"), because three significant
    figures would print it as "1e+03".
    """
    sign = "-" if n < 0 else ""
    n = abs(n)
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    for unit in units:
        if round(n) < 1024 or unit == units[-1]:
            if unit == "B":
                return f"{sign}{int(n)} B"
            return f"{sign}{n:.3g} {unit}" if n < 999.5 else f"{sign}{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
