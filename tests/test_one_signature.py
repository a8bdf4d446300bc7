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


def test_the_engine_compiles_once_whatever_the_columns_types():
    """A trace built from ``int32`` columns or strided views replays on the engine's one compiled
    version, not a second compile of the whole engine."""
    import numpy as np

    from cupool.replay import engine as eng
    from cupool.replay import replay
    from cupool.trace import Trace

    n = 8
    kind = np.array([0, 1] * (n // 2), np.int64)  # alloc, free
    addr = np.repeat(np.arange(1, n // 2 + 1), 2)
    wide = np.zeros((n, 2), np.int64)
    wide[:, 0] = 4096
    plain = Trace(np.arange(n, dtype=np.int64), kind.astype(np.uint8), addr.astype(np.int64),
                  np.full(n, 4096, np.int64), np.zeros(n, np.int64))
    odd = Trace(np.arange(n, dtype=np.int32), kind, addr.astype(np.int32), wide[:, 0], np.zeros(n, np.int32))
    results = [replay(t, {"capacity": "64MiB"}) for t in (plain, odd)]
    assert results[0].peak_allocated == results[1].peak_allocated == 4096
    assert len(eng.run.signatures) == 1
