# cython: language_level=3
"""CuPy's memory object made by cupool: one object per allocation, freed through the fast path.

Charter: this module knows CuPy's ``BaseMemory`` layout and cupool's fast path
(``cupool.core.fast``, whose C declarations it cimports), and nothing of pools,
routing or policy.  ``cupool.hooks.cupy`` chooses it, or falls back to CuPy's
``UnownedMemory`` when it cannot run (``memory_path()`` says which and why).

It is compiled only (a ``.pyx``: a subclass of a C type with C fields has no
plain-Python twin), builds without CuPy (the base's layout is declared here, as
CuPy ships no ``.pxd``), and imports only with CuPy and the compiled fast path.

How it is used, and why one object: Note [One memory object] in ``cupool.hooks.cupy``.

The layouts declared below are checked against the installed CuPy before first
use (``layout_mismatch``): the base's size and ancestry, a round trip of
``ptr``, ``size`` and ``device_id`` written here and read back through CuPy's
own accessors and its ``MemoryPointer``; and ``MemoryPointer``'s own size,
ancestry and fields, which ``pointer_to`` writes instead of calling CuPy's
constructor (a Python call and its argument parsing, a fifth of the hook's cost).
"""

cimport cython
from cpython.pycapsule cimport PyCapsule_GetName, PyCapsule_GetPointer, PyCapsule_IsValid
from libc.stdint cimport intptr_t
from libc.string cimport strcmp
from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF

from cupool.core.fast cimport Allocation, FastPath, new_allocation

cdef extern from *:
    """
    /* CuPy's BaseMemory (cupy/cuda/memory.pxd): three public fields after the object header. */
    typedef struct {
        PyObject_HEAD
        size_t ptr;
        Py_ssize_t size;
        int device_id;
    } cupool_BaseMemoryObject;
    """
    ctypedef struct cupool_BaseMemoryObject:
        pass

    # check_size ignore: layout_mismatch() compares the size itself and says what differs.
    ctypedef class cupy.cuda.memory.BaseMemory [object cupool_BaseMemoryObject, check_size ignore]:
        cdef size_t ptr
        cdef Py_ssize_t size
        cdef int device_id

cdef extern from *:
    """
    /* CuPy's MemoryPointer (cupy/cuda/memory.pxd): its C methods' table, then three fields. */
    typedef struct {
        PyObject_HEAD
        void *vtab;
        intptr_t ptr;
        int device_id;
        cupool_BaseMemoryObject *mem;  /* a BaseMemory: typed so that C++ (this module is C++) assigns one */
    } cupool_MemoryPointerObject;
    """
    ctypedef struct cupool_MemoryPointerObject:
        pass

    ctypedef class cupy.cuda.memory.MemoryPointer [object cupool_MemoryPointerObject, check_size ignore]:
        cdef intptr_t ptr
        cdef int device_id
        cdef BaseMemory mem


@cython.no_gc  # as BaseMemory and Allocation: it holds no container that could lead back to it
@cython.final
cdef class PoolMemory(BaseMemory):
    """Device memory of a cupool pool, as CuPy holds it (Note [One memory object]).

    ``ptr``, ``size`` (the bytes CuPy asked for) and ``device_id`` are CuPy's
    fields.  The rest is the block's, adopted from an ``Allocation``: ``addr`` is
    its ``ptr`` (the pool's own int, so that a free makes none and reads nothing
    of the block).  Invariant: ``block`` is not None until the memory dies.
    """

    cdef FastPath owner
    cdef object block
    cdef object addr
    cdef object requested
    cdef object stream
    cdef int kind
    cdef Allocation held  # only where the pool records call sites: that Allocation, alive with the memory

    def __dealloc__(self):
        global _nshells
        cdef Allocation a
        if self.block is not None:
            # The one free protocol (Note [Finalizers]): an Allocation's own finalizer, as it drops.
            if _nshells:
                _nshells -= 1
                a = <Allocation>_shells[_nshells]
                Py_DECREF(a)  # the slot's reference: ``a`` holds its own
                a.ptr = self.addr
                a.size = self.requested
                a.stream = self.stream
                a.owner = self.owner
                a.block = self.block
                a.kind = self.kind
            else:
                a = new_allocation(self.owner, self.block, self.requested, self.stream, self.kind)
            self.block = None
            a = None

    @property
    def nbytes(self):
        """Bytes of the pool's block behind this memory (the request rounded up)."""
        if self.held is not None:
            return self.held.nbytes
        return 0 if self.block is None else int(self.block.size)


cdef enum:
    SHELLS = 64

#: Allocations that gave their block away, for a free to fill and drop (Note [One memory object]):
#: ``_shells[:_nshells]``, a reference each.  A C array, not a list: a list that empties and
#: refills at every allocation (one live array at a time) reallocates its items at both ends.
cdef PyObject* _shells[SHELLS]
cdef Py_ssize_t _nshells = 0


cdef PoolMemory adopt(Allocation a, int device_id):
    """A ``PoolMemory`` for ``a``, which hands its block over (or is held: Note [One memory object])."""
    global _nshells
    cdef PoolMemory m = PoolMemory.__new__(PoolMemory)
    m.ptr = a.ptr
    m.size = a.size
    m.device_id = device_id
    if a.owner.sites is None:
        m.owner = a.owner
        m.block = a.block
        m.addr = a.ptr
        m.requested = a.size
        m.stream = a.stream
        m.kind = a.kind
        a.block = None  # nobody else has seen a: kept for a free to fill, or dies without freeing
        if _nshells < SHELLS:
            a.owner = None
            Py_INCREF(a)
            _shells[_nshells] = <PyObject*>a
            _nshells += 1
    else:
        m.held = a
    return m


cdef inline MemoryPointer pointer_to(PoolMemory m):
    """``MemoryPointer(m, 0)``, its fields written here (as its ``_init`` writes them) without a Python call."""
    cdef MemoryPointer p = MemoryPointer.__new__(MemoryPointer)
    p.ptr = <intptr_t>m.ptr
    p.device_id = m.device_id
    p.mem = m
    return p


# ------------------------------------------------------------------- CuPy's C lookups
ctypedef intptr_t (*stream_ptr_fn)() except? -1
ctypedef int (*device_id_fn)(int) except? -1

cdef stream_ptr_fn _stream_ptr = NULL
cdef device_id_fn _device_id = NULL


cdef void* _capsule(module, str name, bytes signature):
    """CuPy's own C function ``name`` of ``module``, if its signature is the one declared here."""
    capsule = getattr(module, "__pyx_capi__", {}).get(name)
    if capsule is None or not PyCapsule_IsValid(capsule, PyCapsule_GetName(capsule)):
        return NULL
    if strcmp(PyCapsule_GetName(capsule), signature) != 0:
        return NULL
    return PyCapsule_GetPointer(capsule, PyCapsule_GetName(capsule))


def c_lookups():
    """Which of CuPy's C functions the GPU path calls directly: ``{"stream": bool, "device": bool}``.

    ``cupy.cuda.stream.get_current_stream_ptr`` (a ``cdef`` function: no Python
    object is made) and ``cupy.cuda.device.get_device_id`` (``cudaGetDevice``).
    A function whose signature differs is called through Python instead.
    """
    return {"stream": _stream_ptr != NULL, "device": _device_id != NULL}


def _find_lookups():
    global _stream_ptr, _device_id
    import cupy.cuda.device
    import cupy.cuda.stream

    _stream_ptr = <stream_ptr_fn>_capsule(cupy.cuda.stream, "get_current_stream_ptr", b"intptr_t (void)")
    _device_id = <device_id_fn>_capsule(cupy.cuda.device, "get_device_id", b"int (int __pyx_skip_dispatch)")


_find_lookups()


# --------------------------------------------------------------------------- allocators
def pointer_allocator(pool, malloc, int index, bint cuda, wrong_device):
    """``allocate(nbytes) -> MemoryPointer`` over ``PoolMemory``, for ``cupy.cuda.set_allocator``.

    ``malloc`` is the pool's ``malloc_key``.  With ``cuda`` the block is taken for
    CuPy's current stream on device ``index``; another current device raises
    ``wrong_device(current, index)``.  Without, stream 0 (the sim device: CuPy
    has no streams there).  The allocator keeps ``pool`` alive (``allocate.pool``).
    """
    from cupy.cuda import get_current_stream
    from cupy.cuda.runtime import getDevice

    # The arena's own malloc is called in C (no bound method, no argument parsing); a wrapped
    # one (an admission check: Pool.set_admission) through Python, as given.
    cdef FastPath arena = getattr(malloc, "__self__", None) if _is_arena_malloc(malloc) else None

    def allocate(nbytes):  # CuPy's int, passed on as it is: the Allocation's size shares it
        cdef int current
        cdef object stream = 0
        if cuda:
            current = _device_id(0) if _device_id != NULL else getDevice()
            if current != index:
                raise wrong_device(current, index)
            stream = _stream_ptr() if _stream_ptr != NULL else get_current_stream().ptr
        if arena is not None:
            return pointer_to(adopt(arena.malloc(nbytes, stream), index))
        return pointer_to(adopt(<Allocation?>malloc(nbytes, stream), index))

    allocate.pool = pool
    return allocate


cdef bint _is_arena_malloc(malloc):
    """Whether ``malloc`` is a fast path's own ``malloc``, bound, and not overridden."""
    owner = getattr(malloc, "__self__", None)
    return isinstance(owner, FastPath) and getattr(type(owner), "malloc", None) is (<object>FastPath).__dict__["malloc"] \
        and getattr(malloc, "__name__", None) == "malloc"


def layout_mismatch():
    """None if ``PoolMemory`` fits the installed CuPy's ``BaseMemory``; else what differs."""
    import cupy.cuda.memory as cm

    base = cm.BaseMemory
    if PoolMemory.__mro__[1] is not base or base.__mro__ != (base, object):
        return f"cupy.cuda.memory.BaseMemory derives from {base.__mro__[1:]}, not from object alone"
    if base.__basicsize__ != sizeof(cupool_BaseMemoryObject):
        return (f"cupy.cuda.memory.BaseMemory is {base.__basicsize__} bytes, "
                f"cupool declares {sizeof(cupool_BaseMemoryObject)}")
    cdef PoolMemory m = PoolMemory.__new__(PoolMemory)
    m.ptr, m.size, m.device_id = 0x7F5EED000200, 0x1234567, 3
    seen = (base.ptr.__get__(m), base.size.__get__(m), base.device_id.__get__(m))
    if seen != (0x7F5EED000200, 0x1234567, 3):
        return f"CuPy reads ptr, size, device_id as {seen} where cupool wrote (0x7f5eed000200, 0x1234567, 3)"
    p = cm.MemoryPointer(m, 0x100)
    if (p.ptr, p.device_id, p.mem) != (0x7F5EED000300, 3, m):
        return f"CuPy's MemoryPointer over cupool's memory reads ptr {p.ptr:#x}, device {p.device_id}"
    pointer = cm.MemoryPointer
    if pointer.__mro__ != (pointer, object):
        return f"cupy.cuda.memory.MemoryPointer derives from {pointer.__mro__[1:]}, not from object alone"
    if pointer.__basicsize__ != sizeof(cupool_MemoryPointerObject):
        return (f"cupy.cuda.memory.MemoryPointer is {pointer.__basicsize__} bytes, "
                f"cupool declares {sizeof(cupool_MemoryPointerObject)}")
    cdef object q = pointer_to(m)  # untyped: read back through CuPy's own accessors
    if (type(q), q.ptr, q.device_id, q.mem, (q + 0x100).ptr) != (pointer, 0x7F5EED000200, 3, m, 0x7F5EED000300):
        return f"CuPy reads the MemoryPointer cupool writes as ptr {q.ptr:#x}, device {q.device_id}"
    return None
