# The C types of cupool/core/arena.py, for Cython (an augmenting .pxd: the .py stays plain Python).
# The arena is the fast path's subclass: compiled, its slow path (``malloc_slow``, ``place``,
# ``free_block``) is a C call from the fast path, and it reads heaps, blocks and books as structs.
cimport cython
from cupool.core.books cimport Books
from cupool.core.fast cimport Allocation, FastPath
from cupool.core.heap cimport Block, Heap, Segment


cdef class Arena(FastPath):
    cdef public object device
    cdef public object limit
    cdef public object policy
    cdef public tuple heaps
    cdef public object observers
    cdef public object segments
    cdef public object view
    cdef public bint closed
    cdef public object streams
    cdef public bint compaction_stale
    cdef public object refusal
    cdef public object forked
    cdef public object give_back

    @cython.locals(misses=Py_ssize_t, kind=int, a=Allocation, block=Block)
    cpdef malloc_slow(self, n, stream)
    @cython.locals(kind=int, heap=Heap, books=Books, block=Block)
    cpdef tuple place(self, n, stream, bint exact=*, bint closed_ok=*)
    @cython.locals(block=Block, kind=int, size=Py_ssize_t, books=Books, merged=Block, seg=Segment, raw=bint)
    cpdef free_block(self, a)
