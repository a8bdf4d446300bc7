# distutils: language = c++
# The C types of cupool/core/park.pyx: the fast path (fast.pxd) cimports them, and the torch shim
# reaches the two nogil functions through the capsule ``C_API`` (its layout is written again in
# cupool/hooks/torch_shim.cpp, checked there by ``ParkApi.version`` and ``ParkApi.parked_size``).
from libcpp.map cimport map as cmap
from libcpp.utility cimport pair
from libcpp.vector cimport vector
from cpython.object cimport PyObject

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass

from cupool.core.heap cimport Block

ctypedef pair[Py_ssize_t, long long] Slot  # (block size, stream id): one stack


cdef struct Parked:
    PyObject *block  # a reference the holder owns: the stack, or the shim while torch has it
    unsigned long long addr
    Py_ssize_t size
    Py_ssize_t *requested  # &block.requested: written without the GIL on a hit


cdef struct Stack:
    vector[Parked] blocks
    long long asked  # the tick of the last request of this size on this stream (0: none)
    bint again  # that request came within warm_ticks of the one before it (Note [Cold stacks])


cdef struct ParkState:
    pthread_mutex_t *lock  # the pool's lock (Mutex.handle)
    PyObject *pending  # the fast path's finalizer queue (a deque, borrowed): Note [Hits without the GIL]
    bint ready  # parking on, no subscriber wants every event, no leak sites: a hit may skip Python
    Py_ssize_t log_max
    vector[long long] *log
    cmap[Slot, Stack] *stacks  # an entry per (size, stream) asked for or parked on, kept (2,048 sizes at most)
    Py_ssize_t count  # parked blocks, all stacks
    long long tick  # 1 + the requests of sizes not remembered: the stacks' clock (Note [Cold stacks])
    long long warm_ticks  # a size asked for again within this many ticks is warm
    vector[Slot] *cold  # stacks that were empty and cold when a block was parked on them, since the last sweep


cdef struct ParkApi:
    int version
    int parked_size
    int (*entry)(object block, Parked *out) except -1
    int (*hit)(ParkState *s, Py_ssize_t n, long long stream, Parked *out) noexcept nogil
    int (*park)(ParkState *s, const Parked *e, Py_ssize_t n, long long stream) noexcept nogil


cdef class Mutex:
    cdef pthread_mutex_t *handle
    cpdef bint acquire(self, bint blocking=*, double timeout=*) except -1
    cpdef release(self)


cdef class Log:
    cdef vector[long long] values
    cpdef append(self, long long v)
    cpdef list take(self)


cdef class Parking:
    cdef ParkState state
    cdef public Mutex lock
    cdef object pending
    cdef Log log
    cdef dict ids  # stream keys that are not ints in [0, 2**63): their ids (negative)
    cdef dict keys  # and back

    cdef list empty(self, bint cold_only)
    cdef take_all(self, cmap[Slot, Stack].iterator it, list out)
    cdef long long stream_id(self, object stream) except? -1
    cdef object stream_key(self, long long sid)
    cpdef take(self, Py_ssize_t n, Py_ssize_t size, object stream)
    cpdef put(self, Block block, Py_ssize_t requested, object stream)
