# distutils: language = c++
# cython: language_level=3
"""The fast path's state in C: the pool's lock, the parked stacks and the accounting log.

Charter: this module knows blocks as (reference, address, size, where their
requested size goes), streams as integers, and the lock; it never decides
anything the fast path does not (``fast.py`` says when to park, when a hit may
happen, and which stacks are cold: Note [Cold stacks], whose clock is kept here
because a hit without the GIL is a request too).  It is compiled only (a
``.pyx``); uncompiled, the fast path keeps a dict of lists (``parking.DictParking``),
a list for the log and ``threading.Lock``, with the same methods, and the suites
run both (tests/test_both_paths.py).

Note [Hits without the GIL]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A C caller that keeps its blocks itself (PyTorch's shim, ``hooks/torch_shim.cpp``)
takes a parked block and parks one back without the GIL, through the capsule
``C_API``: ``hit`` and ``park`` try the pool's lock (never wait: a busy lock sends
the caller to its Python path, which waits the way Note [Lock protocol] says),
and serve only while ``ready`` (the fast path's ``fast``, and no leak sites: each
needs a Python object per block) and no finalizer's free is queued (``pending``'s
length, read under the lock: a free queued at that instant waits for the next
Python operation, as it would had the lock holder been Python).  A hit writes the
block's requested size (``Block.requested``, a C field whose address the stack
keeps) and logs ``n + 1`` as a Python hit does; past ``log_max`` entries it
refuses, so that the Python path folds the log into the books.  No reference
count changes without the GIL: a parked block's reference passes from the stack
to the caller and back (``Parked.block``).
"""

from cpython.exc cimport PyErr_CheckSignals
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.object cimport PyObject
from cpython.pycapsule cimport PyCapsule_New
from cpython.pystate cimport PyThreadState
from libc.stdlib cimport free, malloc
from posix.time cimport CLOCK_REALTIME, clock_gettime, timespec
from cpython.ref cimport Py_DECREF, Py_INCREF
from cython.operator cimport dereference as deref, preincrement as inc

from cupool.core.heap cimport Block

cdef extern from "Python.h":
    PyThreadState* PyEval_SaveThread()
    void PyEval_RestoreThread(PyThreadState*)
    Py_ssize_t Py_SIZE(PyObject*) nogil

cdef extern from "<pthread.h>" nogil:
    int pthread_mutex_init(pthread_mutex_t *mutex, const void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *mutex)
    int pthread_mutex_trylock(pthread_mutex_t *mutex)
    int pthread_mutex_timedlock(pthread_mutex_t *mutex, const timespec *abstime)
    int pthread_mutex_unlock(pthread_mutex_t *mutex)

#: How long one wait of a blocking ``Mutex.acquire`` without a timeout lasts before it runs the
#: signal handlers owed (a mutex's wait, unlike Python's lock's, is not cut short by a signal).
cdef double WAIT_SLICE_S = 0.05

#: Bumped whenever ``ParkApi`` or ``Parked`` changes; the shim refuses another.
API_VERSION = 1
cdef long long ALIGN = 512  # sizes.ALIGNMENT: a hit rounds as the fast path does


cdef class Mutex:
    """The pool's lock compiled: ``threading.Lock``'s interface over a POSIX mutex, which the fast
    path takes without a Python call and the torch shim without the GIL (Note [Hits without the GIL]).

    Not CPython's ``PyThread`` lock, which ``threading.Lock`` wraps: on 3.11 its every try reads
    the monotonic clock for a deadline it does not need, 35 ns a try and release against 10 for
    the mutex, and a warm pair takes the lock twice.  A mutex is released by the thread that took
    it, which every pool operation does (Note [Lock protocol]); a forked child gets a new one
    (Note [Fork]).
    """

    def __cinit__(self):
        self.handle = <pthread_mutex_t *>malloc(sizeof(pthread_mutex_t))
        if self.handle == NULL or pthread_mutex_init(self.handle, NULL) != 0:
            free(self.handle)
            self.handle = NULL
            raise MemoryError("cupool: cannot allocate a lock")

    def __dealloc__(self):
        if self.handle != NULL:
            pthread_mutex_destroy(self.handle)
            free(self.handle)

    cpdef bint acquire(self, bint blocking=True, double timeout=-1) except -1:
        """``threading.Lock.acquire``: while waiting, a signal's Python handler runs at the end of
        the wait, or every ``WAIT_SLICE_S`` without a timeout (Note [Lock protocol]); a handler that
        raises ends the wait."""
        cdef timespec deadline
        cdef double wait
        cdef int status
        cdef PyThreadState *state
        if pthread_mutex_trylock(self.handle) == 0:
            return True
        if not blocking:
            return False
        while True:
            wait = WAIT_SLICE_S if timeout < 0 else timeout
            clock_gettime(CLOCK_REALTIME, &deadline)  # pthread_mutex_timedlock's clock
            deadline.tv_sec += <long>wait
            deadline.tv_nsec += <long>((wait - <long>wait) * 1e9)
            if deadline.tv_nsec >= 1000000000:
                deadline.tv_sec += 1
                deadline.tv_nsec -= 1000000000
            state = PyEval_SaveThread()  # waits without the GIL
            status = pthread_mutex_timedlock(self.handle, &deadline)
            PyEval_RestoreThread(state)
            if status == 0:
                return True
            PyErr_CheckSignals()  # raises what a handler raised
            if timeout >= 0:  # timed out: a timed wait ends
                return False

    cpdef release(self):
        pthread_mutex_unlock(self.handle)

    def locked(self):
        if pthread_mutex_trylock(self.handle) == 0:
            pthread_mutex_unlock(self.handle)
            return False
        return True

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


cdef class Log:
    """The fast path's accounting log: ``+(requested + 1)`` per hit, ``-(requested + 1)`` per park.

    A C vector, so that a hit without the GIL appends to it; the books take it and fold it
    with ``fast.fold_log``, as they fold the uncompiled list.
    """

    cpdef append(self, long long v):
        self.values.push_back(v)

    def extend(self, values):
        for v in values:
            self.values.push_back(v)

    def __len__(self):
        return self.values.size()

    cpdef list take(self):
        """The entries, in order, and the log emptied: for the books' fold (``fast.fold_log``)."""
        out = [v for v in self.values]
        self.values.clear()
        return out


cdef class Parking:
    """Parked blocks, a stack per (block size, stream), with the lock and log a hit needs.

    Invariants (the pool's lock held to change them): every block on a stack is
    allocated in the heap and free in the books (Note [Fast path]); the stacks
    hold one reference to each; every stack that was empty and cold when a block
    was parked on it since the last sweep is in ``state.cold`` (Note [Cold stacks]).
    """

    def __cinit__(self, Mutex lock, object pending, Log log, Py_ssize_t log_max, long long warm_ticks):
        self.state.stacks = new cmap[Slot, Stack]()
        self.state.cold = new vector[Slot]()
        self.state.tick = 1
        self.state.warm_ticks = warm_ticks
        self.state.log = &log.values
        self.state.log_max = log_max
        self.state.pending = <PyObject *>pending
        self.state.ready = False
        self.state.count = 0
        self.lock = lock
        self.state.lock = lock.handle
        self.pending = pending
        self.log = log
        self.ids = {}
        self.keys = {}

    def __dealloc__(self):
        cdef cmap[Slot, Stack].iterator it
        if self.state.stacks != NULL:
            it = self.state.stacks.begin()
            while it != self.state.stacks.end():
                for e in deref(it).second.blocks:
                    Py_DECREF(<object>e.block)
                inc(it)
            del self.state.stacks
        if self.state.cold != NULL:
            del self.state.cold

    property ready:
        """Whether a C caller may hit and park without Python (the fast path keeps it)."""
        def __get__(self):
            return self.state.ready

        def __set__(self, bint value):
            self.state.ready = value

    def rebind(self, Mutex lock):
        """Use ``lock`` from now on (a fork's child makes its arena a new one)."""
        self.lock = lock
        self.state.lock = lock.handle

    def __len__(self):
        return self.state.count

    cdef long long stream_id(self, object stream) except? -1:
        cdef int overflow = 0
        cdef long long v
        if type(stream) is int:
            v = PyLong_AsLongLongAndOverflow(stream, &overflow)
            if not overflow and v >= 0:
                return v
        sid = self.ids.get(stream)
        if sid is None:
            sid = self.ids[stream] = -2 - len(self.ids)
            self.keys[sid] = stream
        return sid

    cdef object stream_key(self, long long sid):
        return sid if sid >= 0 else self.keys[sid]

    cpdef take(self, Py_ssize_t n, Py_ssize_t size, object stream):
        """A parked block of ``size`` bytes on ``stream`` for ``n`` bytes asked, logged; None if none,
        and the request remembered (Note [Cold stacks])."""
        cdef Parked e
        cdef long long sid = self.stream_id(stream)
        cdef Stack *st
        cdef cmap[Slot, Stack].iterator it
        if not hit_locked(&self.state, n, size, sid, &e):
            it = self.state.stacks.find(Slot(size, sid))
            if it == self.state.stacks.end():  # a size not remembered: the clock ticks
                self.state.tick += 1
                st = &deref(self.state.stacks)[Slot(size, sid)]
            else:
                st = &deref(it).second
            asked(&self.state, st)
            return None
        block = <object>e.block
        Py_DECREF(block)  # the stack's reference, now the local's
        return block

    cpdef put(self, Block block, Py_ssize_t requested, object stream):
        """Park ``block`` (its requested size was ``requested``), logged."""
        cdef Parked e
        make_entry(block, &e)
        park_locked(&self.state, &e, requested, self.stream_id(stream))

    def unpark(self):
        """Empty every stack: ``[(stream, [blocks])]``, a stream once per block size."""
        return self.empty(False)

    def unpark_cold(self):
        """Empty the cold stacks blocks were parked on since the last call, as ``unpark`` (Note [Cold stacks])."""
        return self.empty(True)

    cdef list empty(self, bint cold_only):
        """Empty every stack, or only the cold ones listed since the last sweep."""
        cdef list out = []
        cdef cmap[Slot, Stack].iterator it
        cdef Slot slot
        cdef size_t i = 0
        if cold_only:
            while i < self.state.cold.size():
                slot = deref(self.state.cold)[i]
                i += 1
                it = self.state.stacks.find(slot)
                if it != self.state.stacks.end() and not is_warm(&self.state, &deref(it).second):
                    self.take_all(it, out)
        else:
            it = self.state.stacks.begin()
            while it != self.state.stacks.end():
                self.take_all(it, out)
                inc(it)
        self.state.cold.clear()
        return out

    cdef take_all(self, cmap[Slot, Stack].iterator it, list out):
        """Move a stack's blocks (their references) to ``out``; the stack stays, with what was asked of it."""
        cdef Stack *st = &deref(it).second
        if st.blocks.size():
            blocks = []
            for e in st.blocks:
                blocks.append(<object>e.block)
                Py_DECREF(<object>e.block)
            out.append((self.stream_key(deref(it).first.second), blocks))
            self.state.count -= st.blocks.size()
            st.blocks.clear()

    def warm(self):
        """The (block size, stream) of every warm stack, empty or not (Note [Cold stacks])."""
        cdef cmap[Slot, Stack].iterator it = self.state.stacks.begin()
        out = set()
        while it != self.state.stacks.end():
            if is_warm(&self.state, &deref(it).second):
                out.add((deref(it).first.first, self.stream_key(deref(it).first.second)))
            inc(it)
        return out

    def addresses(self):
        """The parked blocks' addresses, each with its stack's stream: ``{address: stream}``."""
        cdef cmap[Slot, Stack].iterator it = self.state.stacks.begin()
        out = {}
        while it != self.state.stacks.end():
            if deref(it).second.blocks.size():
                stream = self.stream_key(deref(it).first.second)
                for e in deref(it).second.blocks:
                    out[e.addr] = stream
            inc(it)
        return out

    def state_address(self):
        """Where this object's ``ParkState`` is, for the capsule's functions (the caller keeps this
        object alive as long as it uses the address)."""
        return <size_t>&self.state


cdef int make_entry(object block, Parked *out) except -1:
    """``out`` for ``block`` (a heap Block), holding a new reference to it.  GIL held."""
    cdef Block b = <Block?>block
    out.addr = b.addr
    out.size = b.size
    out.requested = &b.requested
    Py_INCREF(b)
    out.block = <PyObject *>b
    return 0


cdef inline bint is_warm(const ParkState *s, const Stack *st) noexcept nogil:
    """Last asked for within ``warm_ticks``, by a hit or within ``warm_ticks`` of the request before
    (Note [Cold stacks])."""
    return st.again and s.tick - st.asked < s.warm_ticks


cdef inline bint is_stale(const ParkState *s, const Stack *st) noexcept nogil:
    """Asked for last too long ago to make a next request a second one."""
    return st.asked == 0 or s.tick - st.asked >= s.warm_ticks


cdef inline void asked(ParkState *s, Stack *st) noexcept nogil:
    """Remember a request of the stack's size, made at ``s.tick`` (Note [Cold stacks])."""
    st.again = not is_stale(s, st)
    st.asked = s.tick


cdef inline int hit_locked(ParkState *s, Py_ssize_t n, Py_ssize_t size, long long stream, Parked *out) noexcept nogil:
    """Pop a parked block of ``size`` on ``stream`` for ``n`` bytes into ``out``, logged (lock held)."""
    cdef cmap[Slot, Stack].iterator it = s.stacks.find(Slot(size, stream))
    if it == s.stacks.end() or deref(it).second.blocks.empty():
        return 0
    out[0] = deref(it).second.blocks.back()
    deref(it).second.blocks.pop_back()
    deref(it).second.again = True  # a parked block asked for: the size recurred
    deref(it).second.asked = s.tick
    s.count -= 1
    out.requested[0] = n
    s.log.push_back(n + 1)
    return 1


cdef inline int park_locked(ParkState *s, const Parked *e, Py_ssize_t n, long long stream) noexcept nogil:
    """Push ``e`` (its reference passes to the stack), logged (lock held); list a cold stack it starts."""
    cdef Slot slot = Slot(e.size, stream)
    cdef Stack *st = &deref(s.stacks)[slot]
    if st.blocks.empty() and not is_warm(s, st):
        s.cold.push_back(slot)
    st.blocks.push_back(e[0])
    s.count += 1
    s.log.push_back(-1 - n)
    return 1


cdef inline bint open_for_c(ParkState *s) noexcept nogil:
    """Try the lock; True when held and a C caller may go on (Note [Hits without the GIL])."""
    if pthread_mutex_trylock(s.lock) != 0:
        return False
    if s.ready and Py_SIZE(s.pending) == 0 and <Py_ssize_t>s.log.size() < s.log_max:
        return True
    pthread_mutex_unlock(s.lock)
    return False


cdef int c_hit(ParkState *s, Py_ssize_t n, long long stream, Parked *out) noexcept nogil:
    """A parked block for ``n`` bytes on ``stream``, without the GIL: 1, or 0 (ask Python)."""
    cdef Py_ssize_t size = ((n + ALIGN - 1) // ALIGN) * ALIGN or ALIGN
    cdef int got
    if not open_for_c(s):
        return 0
    got = hit_locked(s, n, size, stream, out)
    pthread_mutex_unlock(s.lock)
    return got


cdef int c_park(ParkState *s, const Parked *e, Py_ssize_t n, long long stream) noexcept nogil:
    """Park ``e`` for a free of ``n`` bytes asked on ``stream``, without the GIL: 1, or 0 (ask Python)."""
    if not open_for_c(s):
        return 0
    park_locked(s, e, n, stream)
    pthread_mutex_unlock(s.lock)
    return 1


cdef ParkApi api
api.version = API_VERSION
api.parked_size = sizeof(Parked)
api.entry = make_entry
api.hit = c_hit
api.park = c_park

#: The C functions a C caller uses (``ParkApi`` in park.pxd): a capsule named ``cupool.core.park.C_API``.
C_API = PyCapsule_New(&api, b"cupool.core.park.C_API", NULL)
