# The C types of cupool/core/books.py, for Cython (an augmenting .pxd: the .py stays plain Python).
# ``account`` is the arena's one call per figure it changes, several per allocation: a C call
# with typed indexes, so a miss pays no Python call for its bookkeeping.
cimport cython

from cupool.core.park cimport Log


cdef class Books:
    # ROWS x (small, large, all), C integers: read from outside through ``current`` (a read of
    # the attribute from Python is a copy, as lists of lists).
    cdef readonly long long cur[7][3]
    cdef readonly long long peak[7][3]
    cdef readonly long long total_in[7][3]
    cdef readonly long long total_out[7][3]
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

    cpdef account(self, int kind, int row, long long delta)
    cpdef long long current(self, int row, int col=*) except? -1
    @cython.locals(col=int)
    cpdef _fold_row(self, int row, long long net, long long top, long long gained, long long lost)
    cpdef fold(self)
