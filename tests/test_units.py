import numpy as np
import pytest

from cupool._units import as_nbytes, format_bytes, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2GB", 2 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5G", int(1.5 * 2**30)),
        ("100", 100),
        (" 4 KiB ", 4096),
        ("1kb", 1000),
        (1234, 1234),
        (np.int64(7), 7),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_percent_needs_total():
    assert parse_size("50%", total=1000) == 500
    with pytest.raises(ValueError, match="percentage"):
        parse_size("50%")
    with pytest.raises(ValueError, match="more than 100%"):
        parse_size("150%", total=10)


@pytest.mark.parametrize("bad", ["2 parsecs", "GB", "", "1..2GB", "-5MB"])
def test_parse_size_rejects_garbage(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (1.5, TypeError), ("1", TypeError), (True, TypeError), (None, TypeError)])
def test_as_nbytes_rejects(bad, exc):
    with pytest.raises(exc, match="nbytes"):
        as_nbytes(bad)


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(20 << 20) == "20 MiB"
    assert format_bytes(3 << 40) == "3 TiB"
