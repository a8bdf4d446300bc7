"""The parked stacks, compiled (``park.Parking``, a C++ map of vectors) and not (``parking.DictParking``).

Both answer every call alike, and log alike, over any sequence of parks, hits and
unparks, with streams of any hashable key (the compiled stacks name an int in
[0, 2**63) by itself and any other key by an id of its own: Note [Hits without the GIL]).
"""

from __future__ import annotations

import collections
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupool.core import compiled_module
from cupool.core.fast import make_lock
from cupool.core.parking import DictParking
from cupool.core.heap import Block

park, why = compiled_module("cupool.core.park")
pytestmark = pytest.mark.skipif(park is None, reason=f"the compiled stacks are not built here: {why}")

STREAMS = st.sampled_from([0, 7, 2**63 - 1, 2**63, 2**64 + 5, -3, "side", None, (1, 2)])
SIZES = st.sampled_from([512, 1024, 4096, 1 << 20])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), SIZES, st.integers(0, 1 << 20), STREAMS),
        st.tuples(st.just("take"), SIZES, st.integers(0, 1 << 20), STREAMS),
        st.tuples(st.just("unpark"), st.none(), st.none(), st.none()),
        st.tuples(st.just("unpark_cold"), st.none(), st.none(), st.none()),
    ),
    max_size=60,
)


def _pair(warm_ticks=1 << 16):
    """A compiled Parking and a DictParking, each with its own log."""
    c_log, d_log = park.Log(), []
    c = park.Parking(make_lock(), collections.deque(), c_log, 4096, warm_ticks)
    d = DictParking(threading.Lock(), collections.deque(), d_log, 4096, warm_ticks)
    return c, c_log, d, d_log


@settings(max_examples=200, deadline=None)
@given(OPS, st.integers(1, 12))
def test_the_compiled_stacks_answer_as_the_dict_of_lists(ops, warm_ticks):
    c, c_log, d, d_log = _pair(warm_ticks)
    blocks = {}  # one Block per (address), shared by both sides
    addr = 1 << 20
    for op, size, n, stream in ops:
        if op == "put":
            addr += size
            b = blocks[addr] = Block(addr, size, None, None)
            c.put(b, n, stream)
            d.put(b, n, stream)
        elif op == "take":
            got_c, got_d = c.take(n, size, stream), d.take(n, size, stream)
            assert got_c is got_d
            if got_c is not None:
                assert got_c.requested == n
        elif op == "unpark_cold":  # in the order the cold stacks were listed, on both
            assert [(s, [b.addr for b in bs]) for s, bs in c.unpark_cold()] == [
                (s, [b.addr for b in bs]) for s, bs in d.unpark_cold()]
        else:
            got_c = [(s, [b.addr for b in bs]) for s, bs in c.unpark()]
            got_d = [(s, [b.addr for b in bs]) for s, bs in d.unpark()]
            assert sorted(got_c, key=repr) == sorted(got_d, key=repr)
        assert len(c) == len(d)
        assert c.warm() == d.warm()
        assert c.addresses() == d.addresses()
    assert c_log.take() == d_log


def test_a_hit_hands_over_the_stacks_reference_and_a_park_takes_one():
    c, _, _, _ = _pair()
    b = Block(4096, 4096, None, None)
    before = sys.getrefcount(b)
    c.put(b, 4000, 0)
    assert sys.getrefcount(b) == before + 1  # the stack's
    got = c.take(4000, 4096, 0)
    assert got is b
    del got
    assert sys.getrefcount(b) == before
    c.put(b, 1, 0)
    del c  # a Parking dropped with blocks on it lets them go
    assert sys.getrefcount(b) == before


def test_put_refuses_what_is_not_a_heap_block():
    c, log, _, _ = _pair()
    with pytest.raises(TypeError):
        c.put(object(), 1, 0)
    assert len(c) == 0 and len(log) == 0
