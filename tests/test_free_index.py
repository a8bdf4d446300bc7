"""The heap's free index, compiled and not: the same answers to every sequence of calls.

The index is the one piece of the compiled core written twice (Note [One compiled core]):
an ordered C++ set (``cupool.core.free_index``) and ``heap.SortedFreeIndex`` over a
``SortedList``.  Both are driven here by the same random calls and must agree with each
other and with a plain sorted list after every call.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupool.core import compiled_module
from cupool.core.heap import FreeIndex, SortedFreeIndex

COMPILED, WHY = compiled_module("cupool.core.free_index")

SIZES = st.integers(1, 64).map(lambda k: k * 512)
ADDRS = st.integers(0, 255).map(lambda k: k * 512)
CALLS = st.lists(st.tuples(st.sampled_from(["add", "remove", "first_at_least"]), SIZES, ADDRS), max_size=200)


def _implementations() -> list[type]:
    return [SortedFreeIndex] + ([COMPILED.FreeIndex] if COMPILED is not None else [])


@settings(max_examples=200, deadline=None)
@given(CALLS)
def test_every_index_answers_as_a_sorted_list_does(calls):
    indexes = [impl() for impl in _implementations()]
    model: list[tuple[int, int]] = []
    for op, size, addr in calls:
        if op == "add" and (size, addr) not in model:
            model.append((size, addr))
            model.sort()
            for idx in indexes:
                idx.add(size, addr)
        elif op == "remove" and model:
            size, addr = model.pop(addr % len(model))
            for idx in indexes:
                idx.remove(size, addr)
        elif op == "first_at_least":
            want = next((k for k in model if k[0] >= size), None)  # best fit: smallest, then lowest
            assert [idx.first_at_least(size) for idx in indexes] == [want] * len(indexes)
        for idx in indexes:
            assert list(idx) == model
            assert len(idx) == len(model)
            assert idx.largest() == (model[-1][0] if model else 0)
            assert all(k in idx for k in model) and (1, 1) not in idx


@pytest.mark.parametrize("impl", _implementations(), ids=lambda c: c.__module__)
def test_a_key_not_in_the_index_is_refused_and_changes_nothing(impl):
    idx = impl()
    idx.add(1024, 0)
    with pytest.raises(ValueError):
        idx.remove(512, 0)
    assert list(idx) == [(1024, 0)]


@pytest.mark.parametrize("impl", _implementations(), ids=lambda c: c.__module__)
def test_a_request_larger_than_any_block_finds_nothing(impl):
    """Even past what a C integer holds: a request of 2**64 bytes (the pool refuses it as out of memory)."""
    idx = impl()
    idx.add(1 << 40, 0)
    assert idx.first_at_least(1 << 64) is None
    assert idx.first_at_least(1 << 40) == (1 << 40, 0)


def test_the_compiled_heap_uses_the_compiled_index():
    """Where the index was built, the heap uses it (Note [One compiled core]); else it says why not."""
    if COMPILED is None:
        pytest.skip(f"the free index is not compiled here: {WHY}")
    assert FreeIndex is COMPILED.FreeIndex
