"""The engine's free index splits each (heap, stream) into a treap per size band (``engine_heap.band``).

Best fit stays exact only if the bands cut the (size, address) order into consecutive runs: ``band``
must never decrease as the size grows, and every size must have a band.  The engines-agree and
conformance suites check the placements; these check the bands and the bitmap that finds the next one
in use, at the edges where a mistake hides (powers of two, a band's first and last size, the bitmap's
words).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from cupool.replay.engine_heap import _next_band, band
from cupool.replay.engine_layout import BITS, NBANDS, NBITS, NPS, ROOT


def _edges() -> list[int]:
    sizes = {0, 1, 511, 512, 513}
    for o in range(1, 63):
        for d in (-513, -512, -1, 0, 1, 511, 512):
            s = (1 << o) + d
            if 0 <= s < 1 << 63:
                sizes.add(s)
    return sorted(sizes | {(1 << 63) - 1})


def test_bands_never_decrease_and_cover_every_size():
    sizes = _edges()
    bands = [band(s) for s in sizes]
    assert all(0 <= b < NBANDS for b in bands)
    assert all(a <= b for a, b in zip(bands, bands[1:]))
    assert band((1 << 63) - 1) == NBANDS - 1  # the largest size uses the last band: none is wasted


def test_small_sizes_have_a_band_per_unit_and_larger_ones_eight_per_doubling():
    assert [band(512 * u) for u in range(1, 16)] == list(range(1, 16))
    for o in range(4, 20):  # units 2**o .. 2**(o+1): eight bands, each as wide as the next
        starts = [band(512 * ((8 + k) << (o - 3))) for k in range(8)]
        assert starts == list(range(starts[0], starts[0] + 8))
        assert band(512 * (1 << (o + 1))) == starts[-1] + 1


@given(st.lists(st.integers(0, NBANDS - 1), unique=True, max_size=40), st.integers(0, NBANDS + 70))
def test_next_band_is_the_first_band_in_use_from_c_on(used, c):
    ps = np.zeros((1, NPS, 1), np.int64)
    ps[0, ROOT:, 0] = -1
    for b in used:
        ps[0, BITS + b // 64, 0] |= np.int64(1) << np.int64(b % 64)
    assert NBITS * 64 >= NBANDS
    expected = min((b for b in used if b >= c), default=-1)
    assert _next_band(ps, 0, 0, c) == expected
