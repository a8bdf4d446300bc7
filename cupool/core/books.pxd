# The C types of cupool/core/books.py, for Cython (an augmenting .pxd: the .py stays plain Python).
# ``account`` is the arena's one call per figure it changes, several per allocation: a C call
# with typed indexes, so a miss pays no Python call for its bookkeeping.
cimport cython

from cupool.core.park cimport Log


cdef class Books:
    cdef public list cur
    cdef public list peak
    cdef public list total_in
    cdef public list total_out
    cdef public Log log  # a list uncompiled
    cdef public Py_ssize_t hits
    cdef public Py_ssize_t misses
    cdef public Py_ssize_t retries
    cdef public Py_ssize_t syncs
    cdef public Py_ssize_t ooms
    cdef public Py_ssize_t device_allocs
    cdef public Py_ssize_t device_frees
    cdef public Py_ssize_t releases_before_split
    cdef public Py_ssize_t compactions
    cdef public Py_ssize_t bytes_moved
    cdef public Py_ssize_t movables
    cdef public list _windows
    cdef public bint _sampled_peaks_reset
    cdef object __weakref__

    @cython.locals(cur=list, t=list, peak=list)
    cpdef account(self, int kind, int row, object delta)
    cpdef fold(self)
