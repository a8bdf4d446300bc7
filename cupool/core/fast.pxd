# The C types of cupool/core/fast.py, for Cython (an augmenting .pxd: the .py stays plain Python).
cimport cython

from cupool.core.park cimport Log, Mutex, Parking

cdef class Allocation


# Attributes are public so that the arena (a Python subclass) and the pool read them as before.

cdef class FastPath:
    cdef public Mutex lock  # a threading.Lock uncompiled
    cdef public object pending
    cdef public Parking stacks  # a DictParking uncompiled
    cdef public object books
    cdef public Log log  # a list uncompiled
    cdef public bint parking
    cdef public bint fast
    cdef public bint exact
    cdef public bint exiting
    cdef public object holder
    cdef public object sites
    cdef public object moved
    cdef object __weakref__

    @cython.locals(al=Allocation)
    cpdef free_locked(self, a)
    @cython.locals(al=Allocation)
    cpdef free(self, a)
    cdef public object stream_key
    cdef public object default_stream

    @cython.locals(a=Allocation)
    cpdef malloc(self, n, stream)
    cpdef request(self, nbytes, stream)
    # The slow path the arena provides (cupool.core.arena): a C call when it is compiled too.
    cpdef malloc_slow(self, n, stream)
    cpdef free_block(self, a)


@cython.no_gc
cdef class Allocation:
    cdef public object ptr
    cdef public object size
    cdef public object stream
    cdef public FastPath owner
    cdef public object block
    cdef public int kind
    cdef object __weakref__

    cpdef free(self)


@cython.locals(a=Allocation)
cdef Allocation new_allocation(FastPath owner, object block, object size, object stream, int kind)

@cython.locals(hits=cython.longlong, c_net=cython.longlong, c_top=cython.longlong, c_gain=cython.longlong, a_net=cython.longlong,
               a_top=cython.longlong, a_gain=cython.longlong, r_net=cython.longlong, r_top=cython.longlong, r_gain=cython.longlong,
               v=cython.longlong, n=cython.longlong, size=cython.longlong, align=cython.longlong)
cpdef tuple fold_log(list log)
