"""cupool's ``njit`` compiles one version of a function per argument types, never one per constant
(issue 25: the replay engine's constant arguments had made 20 extra compiles, each of a function and
everything it calls)."""

from __future__ import annotations

from numba import types

from cupool.kernels.caching import njit

LARGE = 1


@njit()
def _callee(h, n, flag):
    return h * n if flag else n


@njit()
def _caller(n):
    # A module constant, a literal and a boolean constant, then the same call with variables.
    return _callee(LARGE, n, True) + _callee(0, n, False) + _callee(n, n, n > 1)


def test_constants_share_the_one_version():
    assert _caller(3) == 3 + 3 + 9
    assert _callee.signatures == [(types.int64, types.int64, types.boolean)]


def test_called_from_python_as_before():
    assert _callee(2, 5, True) == 10
    assert len(_callee.signatures) == 1
