# The C types of cupool/core/heap.py, for Cython (an augmenting .pxd: the .py stays plain Python).
# Blocks and segments become structs with typed fields, so that best fit, split and coalesce
# read them without a dictionary lookup; their attributes stay public, as the arena, the
# expander, the view and the planner read and write them as before.
cimport cython
from cupool.core.free_index cimport FreeIndex as CompiledFreeIndex  # the name FreeIndex is the .py's

cdef class Segment
cdef class Block


cdef class Block:
    cdef public object addr  # an int shared with the Allocation's ptr: no new int per allocation
    cdef public Py_ssize_t size
    cdef public Segment segment
    cdef public Block prev
    cdef public Block next
    cdef public bint free
    cdef public object stream
    cdef public object epoch
    cdef public object payload
    cdef public Py_ssize_t requested


cdef class Segment:
    cdef public Py_ssize_t addr
    cdef public Py_ssize_t size
    cdef public Py_ssize_t used
    cdef public Block head
    cdef public Block tail
    cdef public bint keep
    cdef public object stream
    cdef public object region

    @cython.locals(out=list, b=Block, start=object, size=Py_ssize_t, run=bint, tag=object, stream=object)
    cpdef list layout(self, dict parked, bint live=*)


cdef class Heap:
    cdef public Py_ssize_t alignment
    cdef public dict segments
    cdef public dict _index
    cdef public dict _free
    cdef public Py_ssize_t reserved
    cdef public Py_ssize_t allocated
    cdef public Py_ssize_t n_allocated

    @cython.locals(best=tuple, key=tuple, idx=CompiledFreeIndex)
    cpdef Block find(self, object size, object stream)
    @cython.locals(rest=Py_ssize_t, tail=Block)
    cpdef Block take(self, Block block, Py_ssize_t size)
    @cython.locals(seg=Segment)
    cpdef Block give(self, Block block, object stream, object epoch=*)
    cpdef Block reassign(self, Block block, object stream)
    cpdef bint is_indexed(self, Block block)
    cpdef Py_ssize_t stream_count(self)
    @cython.locals(idx=CompiledFreeIndex)
    cpdef _insert(self, Block b)
    @cython.locals(idx=CompiledFreeIndex)
    cpdef _remove(self, Block b)
    @cython.locals(nxt=Block, prv=Block)
    cpdef Block _coalesce(self, Block b)


cpdef _absorb(Block left, Block right)
