"""CuPy's pool API on a cupool pool (issue 36 #12): what ``cupy.get_default_memory_pool()`` answers,
with CuPy's names and signatures, read from the pool's own figures and limit."""

from __future__ import annotations

import inspect
import re

import pytest

import cupool

MiB = 1 << 20
#: CuPy's MemoryPool methods a program asks of its pool, beside malloc.
CUPY_METHODS = ("used_bytes", "total_bytes", "free_bytes", "n_free_blocks", "free_all_blocks", "set_limit", "get_limit")


def _cupy_style_report(mempool) -> tuple[int, int, int, int]:
    """Code written for ``cupy.get_default_memory_pool()``, unchanged."""
    return mempool.used_bytes(), mempool.total_bytes(), mempool.free_bytes(), mempool.n_free_blocks()


def test_the_pool_answers_what_cupys_pool_does():
    pool = cupool.Pool("sim", capacity="64MiB")
    a = pool.malloc(3 * MiB)
    b = pool.malloc(5 * MiB)
    b.free()
    s = pool.stats()
    used, total, free, n_free = _cupy_style_report(pool)
    assert used == s["allocated_bytes.all.current"] == a.nbytes
    assert total == s["reserved_bytes.all.current"] > used
    assert free == total - used
    with pool.hold() as view:
        assert n_free == sum(b.free for seg in view.segments() for b in seg.blocks) >= 1
    assert pool.free_all_blocks() is None
    assert pool.total_bytes() < total, "free_all_blocks gave nothing back"
    assert pool.used_bytes() == used
    a.free()
    pool.free_all_blocks(stream=None)
    assert _cupy_style_report(pool)[:3] == (0, 0, 0)


def test_set_limit_takes_cupys_size_and_fraction():
    pool = cupool.Pool("sim", capacity="64MiB")
    assert pool.get_limit() == pool.limit == 64 * MiB
    pool.set_limit(size=16 * MiB)
    assert pool.get_limit() == pool.limit == pool.stats()["limit"] == 16 * MiB
    with pytest.raises(cupool.OutOfMemoryError):
        pool.malloc(20 * MiB)
    pool.set_limit(fraction=0.5)
    assert pool.get_limit() == 32 * MiB
    pool.set_limit("25%")  # cupool's sizes still work, positionally too
    assert pool.get_limit() == 16 * MiB
    for lifted in ({}, {"size": 0}, {"fraction": 0}):  # CuPy: none, or 0, disables the limit
        pool.set_limit(size=8 * MiB)
        pool.set_limit(**lifted)
        assert pool.get_limit() == 64 * MiB, lifted


def test_the_limit_property_means_what_it_says_and_only_set_limit_speaks_cupy():
    """``pool.limit = 0`` went through ``set_limit``, whose CuPy rule made 0 lift the cap to the device."""
    pool = cupool.Pool("sim", capacity="64MiB")
    pool.limit = 0
    assert pool.limit == 0
    with pytest.raises(cupool.OutOfMemoryError):
        pool.malloc(1)
    pool.limit = "128MiB"  # more than the device: capped at it, as before
    assert pool.limit == 64 * MiB
    with pytest.raises(ValueError, match="limit"):
        pool.limit = -1
    assert pool.limit == 64 * MiB


@pytest.mark.parametrize("args,error,match", [
    ({"size": MiB, "fraction": 0.5}, ValueError, "not both"),
    ({"fraction": 1.5}, ValueError, r"fraction must be in \[0, 1\], got 1.5"),
    ({"fraction": "half"}, TypeError, "fraction must be a number"),
    ({"size": -1}, ValueError, "size must be >= 0"),
])
def test_a_bad_limit_is_refused_and_changes_nothing(args, error, match):
    pool = cupool.Pool("sim", capacity="64MiB", max_size="48MiB")
    with pytest.raises(error, match=match):
        pool.set_limit(**args)
    assert pool.get_limit() == 48 * MiB


def test_the_cupy_allocators_pool_answers_too():
    pytest.importorskip("cupy")
    pool = cupool.Pool("sim", capacity="64MiB")
    allocator = cupool.cupy_allocator(pool)
    a = pool.malloc(MiB)
    assert _cupy_style_report(allocator.pool) == _cupy_style_report(pool)
    a.free()


def test_the_names_and_parameters_are_cupys():
    cupy = pytest.importorskip("cupy")
    for name in CUPY_METHODS:
        # CuPy's methods are compiled: their signature is the first line of the docstring.
        doc = getattr(cupy.cuda.MemoryPool, name).__doc__
        m = re.match(rf"MemoryPool\.{name}\(self(?:, )?([^)]*)\)", doc)
        assert m, f"CuPy's {name} docstring: {doc[:80]!r}"
        theirs = [p.split("=")[0].strip() for p in m.group(1).split(",") if p.strip()]
        ours = list(inspect.signature(getattr(cupool.Pool, name)).parameters)[1:]
        assert ours == theirs, (name, ours, theirs)
