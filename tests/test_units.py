import numpy as np
import pytest

import cupool
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


@pytest.mark.parametrize(
    "n,shown",
    [
        (999 << 20, "999 MiB"),
        (int(999.4 * 2**20), "999 MiB"),
        (int(999.6 * 2**20), "1000 MiB"),
        (1000 << 20, "1000 MiB"),
        (1023 << 20, "1023 MiB"),
        (int(1023.6 * 2**20), "1 GiB"),
        (1 << 30, "1 GiB"),
        (1000, "1000 B"),
        (1 << 50, "1 PiB"),
        (2**63 - 1, "8 EiB"),
        (-(1000 << 10), "-1000 KiB"),
    ],
)
def test_format_bytes_between_999_5_and_1024_of_a_unit(n, shown):
    assert format_bytes(n) == shown


def test_format_bytes_never_prints_an_exponent():
    for exp in range(63):
        for frac in (0.9755, 0.976, 0.99, 0.999, 0.9999, 1.0):
            assert "e+" not in format_bytes(int(frac * 2**exp) + 1)


def test_parse_size_is_exact_and_bounded():
    assert parse_size("0.1GB") == 10**8
    assert parse_size("33.3%", total=1000) == 333
    assert parse_size(str(2**63 - 1)) == 2**63 - 1
    with pytest.raises(ValueError, match=r"capacity: '9999.*\.\.\..*' is more bytes than a 64-bit size holds"):
        parse_size("9" * 400, name="capacity")
    with pytest.raises(ValueError, match="max_size: .* is more bytes"):
        parse_size("9000000TiB", name="max_size")
    with pytest.raises(ValueError, match=r"nbytes must be at most 2\*\*63 - 1 bytes"):
        as_nbytes(2**63)
    assert as_nbytes(2**63 - 1) == 2**63 - 1


def test_sizes_of_thousands_of_digits_name_their_key():
    """Issue 36 #6: past 4,300 digits Python's int-limit message came out, naming no key."""
    from cupool.config import parse_conf

    with pytest.raises(ValueError, match=r"^capacity: '9999.*' is more bytes than a 64-bit size holds$"):
        parse_size("9" * 5000, name="capacity")
    with pytest.raises(ValueError, match=r"^capacity: .* is more than 100%$"):
        parse_size("9" * 5000 + "%", total=10, name="capacity")
    with pytest.raises(ValueError, match=r"^capacity: .* has 5000 digits after the point; a size has at most 100$"):
        parse_size("1." + "0" * 5000, name="capacity")
    assert parse_size("0" * 5000 + "12KiB") == 12 * 1024  # leading zeros are no digits of the value
    with pytest.raises(ValueError, match=r"^CUPOOL_CONF: capacity: '9999.*' is more bytes than a 64-bit size holds$"):
        parse_conf("capacity=" + "9" * 5000)
    with pytest.raises(ValueError, match=r"^capacity must be at most 2\*\*63 - 1 bytes, got a number of about 5001 digits$"):
        parse_size(10**5000, name="capacity")
    with pytest.raises(ValueError, match=r"^capacity must be >= 0, got a negative number of about 5001 digits$"):
        parse_size(-(10**5000), name="capacity")
    with pytest.raises(ValueError, match=r"^capacity must be at most 2\*\*63 - 1 bytes, got a number of about 5001"):
        cupool.Pool("sim", capacity=10**5000)
