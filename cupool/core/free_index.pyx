# distutils: language = c++
# cython: language_level=3
"""The heap's free-block index compiled: an ordered C++ set of (size, address), one per stream.

Charter: this module knows two integers per free block and their order, nothing
else.  It is compiled only (a ``.pyx``); uncompiled, the heap indexes free blocks
with ``sortedcontainers.SortedList`` through ``heap.SortedFreeIndex``, which has
the same methods and the same order, and the placement conformance suite holds
both to it.  The order is best fit's (``rules.fits_before``): size first, then
address, so ``first_at_least(n)`` is the best fit for ``n`` bytes.
"""

from libcpp.set cimport set as cset
from cython.operator cimport dereference as deref, preincrement as inc
from cpython.pyport cimport PY_SSIZE_T_MAX


cdef class FreeIndex:
    """(size, address) of the free blocks of one stream, in best fit's order (an ordered C++ set)."""

    cpdef add(self, Py_ssize_t size, Py_ssize_t addr):
        self.keys.insert(Key(size, addr))

    cpdef remove(self, Py_ssize_t size, Py_ssize_t addr):
        if self.keys.erase(Key(size, addr)) == 0:
            raise ValueError(f"({size}, {addr:#x}) is not in the free index")

    cpdef first_at_least(self, size):
        """The first (size, address) with at least ``size`` bytes, None if there is none (nor past
        the largest size an index holds)."""
        if size > PY_SSIZE_T_MAX:
            return None
        cdef cset[Key].iterator it = self.keys.lower_bound(Key(size, 0))
        if it == self.keys.end():
            return None
        return deref(it).first, deref(it).second

    cpdef Py_ssize_t largest(self):
        """The size of the largest free block, 0 if none."""
        if self.keys.empty():
            return 0
        return deref(self.keys.rbegin()).first

    def __len__(self) -> int:
        return self.keys.size()

    def __contains__(self, key) -> bool:
        size, addr = key
        return self.keys.count(Key(size, addr)) > 0

    def __iter__(self):
        cdef list out = []
        cdef cset[Key].iterator it = self.keys.begin()
        while it != self.keys.end():
            out.append((deref(it).first, deref(it).second))
            inc(it)
        return iter(out)
