/* cupool.hooks.torch_shim: PyTorch's pluggable-allocator functions over cupool's pool.
 *
 * torch.cuda.memory.CUDAPluggableAllocator(path, alloc, free) dlopen()s a shared
 * library and calls two C functions by name.  This extension module is that
 * library: cupool.hooks.torch registers the Python callables it needs, and
 * torch then calls
 *
 *   void* cupool_torch_alloc(size_t size, int device, void* stream)
 *   void  cupool_torch_free(void* ptr, size_t size, int device, void* stream)
 *
 * (cudaStream_t is a pointer; no CUDA header is needed).  Each first tries the pool
 * without the GIL (Note [Hits without the GIL], cupool/core/park.pyx): a request whose
 * size a parked block fits, on the stream seen last, takes that block, and a free of a
 * small block parks it, through the two C functions the compiled core exports in the
 * capsule cupool.core.park.C_API.  Everything else takes the GIL and calls into Python,
 * never letting an exception cross the C boundary.  alloc asks `resolve(device)` once
 * for the pool's entry points (until forget()): `lend(size, key)` gives (block, kind)
 * for a size that parks (<= 1 MiB), and `free_lent(block, size, key, kind)` takes one
 * back; a larger size, or any while the pool tracks leak sites or checks admissions,
 * gets an Allocation from `malloc_key`; the last stream's key is remembered.  A refused allocation returns NULL and hands the Python exception to `report` (which
 * keeps it for cupool.torch.last_error()); a free that fails is written to
 * sys.unraisablehook, as Python does for a failing finalizer.  A KeyboardInterrupt
 * is neither: the allocation is tried again and the interrupt re-armed for the
 * program (alloc_locked).
 *
 * PyTorch does not check the pointer its pluggable allocator returns (a NULL
 * becomes a tensor at address 0), so torch is given a third function with the
 * same signature, cupool_torch_alloc_or_throw: on NULL it throws a C++
 * std::runtime_error carrying cupool's reason, after the GIL is released.  The
 * exception travels through torch's C++ frames to its Python binding, which
 * raises it as RuntimeError.  Only a C++ caller may use that one; a C caller
 * (ctypes) uses cupool_torch_alloc and checks for NULL.
 *
 * The live blocks are held here, in a map from address to what torch holds (Held):
 * the block itself (a reference, its size asked and its stream's id) or an
 * Allocation.  A map guarded by a mutex of its own, which no thread holds while it
 * waits for the GIL or the pool's lock (the pool's lock is only tried under it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>

#include <cstddef>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// cupool/core/park.pxd's Parked and ParkApi, as the compiled core lays them out (checked at register()).
struct Parked {
    PyObject *block;  // a reference its holder owns
    unsigned long long addr;
    Py_ssize_t size;
    Py_ssize_t *requested;
};
struct ParkApi {
    int version;
    int parked_size;
    int (*entry)(PyObject *block, Parked *out);  // GIL held: -1 with an exception set
    int (*hit)(void *state, Py_ssize_t n, long long stream, Parked *out);  // no GIL: 1, or 0 (ask Python)
    int (*park)(void *state, const Parked *e, Py_ssize_t n, long long stream);  // no GIL: 1, or 0
};
constexpr int PARK_API_VERSION = 1;  // park.pyx's API_VERSION
constexpr int SMALL = 0;  // cupool.core.sizes.SMALL: the blocks a free parks
// cupool.core.sizes.SMALL_MAX (the module's LENDS_UP_TO, which a test compares): larger requests never
// park, so they gain nothing from being lent, and keep their Allocation (one object per block, not two);
// nor does the C path try them (Python, which it leaves them to, decides the same).
constexpr size_t SMALL_MAX = size_t(1) << 20;

const ParkApi *park_api = nullptr;  // the compiled core's C functions; nullptr: every call takes the GIL

PyObject *resolve = nullptr;  // resolve(device) -> (pool, malloc_key, stream_key, lend, free_lent, state)
PyObject *report = nullptr;   // report(exception): keeps a refusal's reason
PyObject *unknown = nullptr;  // unknown(ptr, size, device, stream): logs a free of a pointer not served here
PyObject *ptr_name = nullptr; // "ptr", interned

// What resolve() gave for a device, and the blocks served through it.  A forgotten record
// (forget()) lives on, retired, while torch holds blocks it served.
struct Record {
    PyObject *entry;              // resolve()'s tuple (owned): it keeps the pool alive
    void *state;                  // the pool's ParkState (Note [Hits without the GIL]), or nullptr
    long held = 0;                // blocks torch holds through it, and allocations in flight (guard)
    void *last_stream = nullptr;  // the last stream handle seen (guard), its key (owned) and its id:
    PyObject *last_key = nullptr; // stream_key is a pure function
    long long last_id = -1;       // -1: not a stream a C hit can name (a key that is no int in [0, 2**63))
    bool known = false;
};

// What torch holds at an address: an Allocation, or the block itself with what freeing it needs.
struct Held {
    Record *record;
    PyObject *allocation;  // owned, or nullptr
    Parked parked;         // the block (owned) when allocation is nullptr
    Py_ssize_t n;          // bytes asked
    long long stream;      // the stream's id (a key that is an int)
    int kind;
};

std::mutex guard;  // guards the three below; held without the GIL, never while waiting for Python
std::unordered_map<int, Record *> records;  // device -> what serves it now
std::vector<Record *> retired;              // forgotten records still holding blocks
std::unordered_map<void *, Held> live;      // address -> what torch holds there

thread_local std::string reason;  // this thread's last refusal, for the C++ entry point

// Clear the pending exception; a KeyboardInterrupt (Ctrl-C landing in Python code the shim runs) is
// re-armed (PyErr_SetInterrupt), so Python's SIGINT handler raises it at the program's next bytecode
// rather than losing it where no C caller can take it (issue 36 #3).
void clear_keeping_interrupts() {
    if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
        PyErr_SetInterrupt();
    }
    PyErr_Clear();
}

// The end of a call into Python whose result nobody takes (`r`, new or nullptr): a failure is
// cleared, a KeyboardInterrupt re-armed, anything else written to sys.unraisablehook for `callee`.
void settle(PyObject *r, PyObject *callee) {
    if (r == nullptr && PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
        clear_keeping_interrupts();
    } else if (r == nullptr) {
        PyErr_WriteUnraisable(callee);
    }
    Py_XDECREF(r);
}

// The pending Python exception, given to `report` and kept (as text) in `reason`; nothing stays raised.
void refuse(const char *fallback) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == nullptr) {  // no exception: a refusal cupool's own code signalled without one
        PyErr_SetString(PyExc_RuntimeError, fallback);
        PyErr_Fetch(&type, &value, &tb);
    }
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != nullptr && value != nullptr) {
        PyException_SetTraceback(value, tb);
    }
    reason = fallback;
    if (value != nullptr) {
        PyObject *text = PyObject_Str(value);
        const char *s = text == nullptr ? nullptr : PyUnicode_AsUTF8(text);
        if (s != nullptr) {
            reason = std::string(reinterpret_cast<PyTypeObject *>(type)->tp_name) + ": " + s;
        }
        Py_XDECREF(text);
        clear_keeping_interrupts();
    }
    if (report != nullptr && value != nullptr) {
        settle(PyObject_CallOneArg(report, value), report);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

// Retired records that hold nothing now, deleted (GIL held: their references go).
void sweep() {
    std::vector<Record *> done;
    {
        std::lock_guard<std::mutex> g(guard);
        for (auto it = retired.begin(); it != retired.end();) {
            if ((*it)->held == 0) {
                done.push_back(*it);
                it = retired.erase(it);
            } else {
                ++it;
            }
        }
    }
    for (Record *r : done) {  // outside the guard: a decref may run any Python code
        Py_XDECREF(r->last_key);
        Py_DECREF(r->entry);
        delete r;
    }
}

// The record serving `device`, pinned (held + 1: a forget() while this thread runs Python code
// cannot delete it); nullptr with an exception set.  GIL held.
Record *pinned_record(int device) {
    {
        std::lock_guard<std::mutex> g(guard);
        auto found = records.find(device);
        if (found != records.end()) {
            ++found->second->held;
            return found->second;
        }
    }
    PyObject *d = PyLong_FromLong(device);
    if (d == nullptr) {
        return nullptr;
    }
    PyObject *made = PyObject_CallOneArg(resolve, d);
    Py_DECREF(d);
    if (made == nullptr) {
        return nullptr;
    }
    if (!(PyTuple_Check(made) && PyTuple_GET_SIZE(made) == 6)) {
        PyErr_Format(PyExc_TypeError, "resolve() must give (pool, malloc_key, stream_key, lend, free_lent, state), "
                     "got %R", made);
        Py_DECREF(made);
        return nullptr;
    }
    size_t state = PyLong_AsSize_t(PyTuple_GET_ITEM(made, 5));
    if (state == static_cast<size_t>(-1) && PyErr_Occurred()) {
        Py_DECREF(made);
        return nullptr;
    }
    Record *rec = new (std::nothrow) Record();
    if (rec == nullptr) {
        Py_DECREF(made);
        PyErr_NoMemory();
        return nullptr;
    }
    rec->entry = made;
    // Lent blocks and C hits go together: a pool that lends nothing (or runs uncompiled, state 0)
    // is served through malloc_key, an Allocation per block.
    rec->state = park_api != nullptr && PyTuple_GET_ITEM(made, 3) != Py_None ? reinterpret_cast<void *>(state) : nullptr;
    Record *kept = rec;
    try {
        std::lock_guard<std::mutex> g(guard);
        auto placed = records.emplace(device, rec);
        kept = placed.first->second;  // another thread's, if it resolved the device meanwhile
        ++kept->held;
    } catch (const std::bad_alloc &) {
        kept = nullptr;
    }
    if (kept != rec) {
        Py_DECREF(made);
        delete rec;
        if (kept == nullptr) {
            PyErr_NoMemory();
        }
    }
    return kept;
}

void unpin(Record *rec) {
    {
        std::lock_guard<std::mutex> g(guard);
        --rec->held;
    }
    sweep();
}

// The key of `stream` (a new reference), remembered with its id for the last stream seen.  GIL held.
PyObject *stream_key(Record *rec, void *stream) {
    {
        std::lock_guard<std::mutex> g(guard);
        if (rec->known && rec->last_stream == stream) {
            Py_INCREF(rec->last_key);
            return rec->last_key;
        }
    }
    PyObject *handle = PyLong_FromVoidPtr(stream);
    if (handle == nullptr) {
        return nullptr;
    }
    PyObject *key = PyObject_CallOneArg(PyTuple_GET_ITEM(rec->entry, 2), handle);
    Py_DECREF(handle);
    if (key == nullptr) {
        return nullptr;
    }
    long long id = -1;
    if (PyLong_CheckExact(key)) {  // as park.Parking.stream_id names it
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(key, &overflow);
        if (v >= 0 && !overflow) {
            id = v;
        }
        PyErr_Clear();
    }
    Py_INCREF(key);
    PyObject *old;
    {
        std::lock_guard<std::mutex> g(guard);
        old = rec->last_key;
        rec->last_key = key;
        rec->last_stream = stream;
        rec->last_id = id;
        rec->known = true;
    }
    Py_XDECREF(old);  // outside the guard: a decref may run Python code
    return key;
}

// A block from the parked stacks without the GIL, or nullptr (ask Python).
void *alloc_without_gil(size_t size, int device, void *stream) {
    if (park_api == nullptr || size > SMALL_MAX) {  // a larger request never finds a block parked for it
        return nullptr;
    }
    std::lock_guard<std::mutex> g(guard);
    auto found = records.find(device);
    if (found == records.end()) {
        return nullptr;
    }
    Record *rec = found->second;
    if (rec->state == nullptr || !rec->known || rec->last_stream != stream || rec->last_id < 0) {
        return nullptr;
    }
    Parked e;
    Py_ssize_t n = static_cast<Py_ssize_t>(size);
    if (!park_api->hit(rec->state, n, rec->last_id, &e)) {
        return nullptr;
    }
    void *ptr = reinterpret_cast<void *>(e.addr);
    try {
        if (live.emplace(ptr, Held{rec, nullptr, e, n, rec->last_id, SMALL}).second) {
            ++rec->held;
            return ptr;
        }
    } catch (const std::bad_alloc &) {
    }
    // Not recorded (no host memory, or an address torch holds already): the block goes back to
    // its stack, and the Python path says why.  (A busy lock now strands it until the pool closes.)
    park_api->park(rec->state, &e, n, rec->last_id);
    return nullptr;
}

// Free what `h` holds through Python, keeping the exception set if any (GIL held): an Allocation
// dies, a block goes to free_lent, which never waits for the pool's lock (a busy one queues the
// free, Note [Finalizers]).
void release(const Held &h) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (h.allocation != nullptr) {
        Py_DECREF(h.allocation);  // its finalizer frees the block
    } else if (h.parked.block != nullptr) {
        PyObject *free_lent = PyTuple_GET_ITEM(h.record->entry, 4);
        PyObject *args[4] = {h.parked.block, PyLong_FromSsize_t(h.n), PyLong_FromLongLong(h.stream),
                             PyLong_FromLong(h.kind)};
        PyObject *r = args[1] && args[2] && args[3] ? PyObject_Vectorcall(free_lent, args, 4, nullptr) : nullptr;
        for (int i = 1; i < 4; ++i) {
            Py_XDECREF(args[i]);
        }
        settle(r, free_lent);
        Py_DECREF(h.parked.block);
    }
    PyErr_Restore(type, value, tb);
}

// What torch will hold for `got` (lend's (block, kind), or an Allocation): its address, or nullptr
// with an exception set and the block given back.  Takes the reference to `got`.  GIL held.
void *hold(Record *rec, PyObject *got, Py_ssize_t n, long long stream) {
    Held h{rec, nullptr, Parked{nullptr, 0, 0, nullptr}, n, stream, SMALL};
    if (PyTuple_Check(got) && PyTuple_GET_SIZE(got) == 2) {  // lend's (block, kind)
        PyObject *block = PyTuple_GET_ITEM(got, 0);
        h.kind = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(got, 1)));
        if (!PyErr_Occurred()) {
            park_api->entry(block, &h.parked);  // a new reference, or an exception and none
        }
        Py_DECREF(got);
    } else {  // an Allocation
        h.allocation = got;
        PyObject *address = PyObject_GetAttr(got, ptr_name);
        if (address != nullptr) {
            h.parked.addr = reinterpret_cast<unsigned long long>(PyLong_AsVoidPtr(address));
            Py_DECREF(address);
        }
    }
    void *ptr = PyErr_Occurred() ? nullptr : reinterpret_cast<void *>(h.parked.addr);
    if (ptr == nullptr && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_RuntimeError, "cupool served a block at address 0");
    }
    if (ptr != nullptr) {
        try {
            std::lock_guard<std::mutex> g(guard);
            if (!live.emplace(ptr, h).second) {
                PyErr_Format(PyExc_RuntimeError, "cupool served %p, which torch already holds", ptr);
                ptr = nullptr;
            }
        } catch (const std::bad_alloc &) {
            PyErr_NoMemory();
            ptr = nullptr;
        }
    }
    if (ptr == nullptr) {
        release(h);  // not kept: its block goes back at once
    }
    return ptr;
}

// One try at a block through Python: its address, or nullptr with a Python exception set.  GIL held.
void *alloc_once(size_t size, int device, void *stream) {
    Record *rec = pinned_record(device);
    if (rec == nullptr) {
        return nullptr;
    }
    void *ptr = nullptr;
    PyObject *key = stream_key(rec, stream);
    if (key != nullptr) {
        long long id;
        {
            std::lock_guard<std::mutex> g(guard);
            id = rec->last_id;
        }
        bool lending = rec->state != nullptr && id >= 0 && size <= SMALL_MAX;  // else an Allocation, kept
        PyObject *args[2] = {PyLong_FromSize_t(size), key};
        PyObject *got = nullptr;
        if (args[0] != nullptr) {
            got = PyObject_Vectorcall(PyTuple_GET_ITEM(rec->entry, lending ? 3 : 1), args, 2, nullptr);
        }
        Py_XDECREF(args[0]);
        Py_DECREF(key);
        if (got != nullptr) {
            ptr = hold(rec, got, static_cast<Py_ssize_t>(size), id);
        } else if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "cupool could not allocate");
        }
    }
    if (ptr == nullptr) {
        unpin(rec);  // served nothing; on success the pin is the held block's count
    }
    return ptr;
}

// A block for torch, or nullptr with the refusal reported.  A KeyboardInterrupt is no refusal:
// Ctrl-C landed in the Python code this call runs (the pool raises a deferred one as its operation
// ends, Note [Interrupts]), and no C caller can take a Python exception.  So the allocation is
// tried again, and the interrupt re-armed once it is done (issue 36 #3).  One that comes back on
// every one of INTERRUPTED_TRIES tries is raised by something other than a Ctrl-C landing by
// chance: that allocation is refused with it (and it is re-armed too), rather than tried for ever.
constexpr int INTERRUPTED_TRIES = 100;

void *alloc_locked(size_t size, int device, void *stream) {
    if (resolve == nullptr) {
        PyErr_SetString(PyExc_RuntimeError,
                        "cupool's torch shim is loaded but not set up: import cupool.torch first");
        refuse("cupool.torch is not imported");
        return nullptr;
    }
    int interrupted = 0;
    void *ptr;
    while ((ptr = alloc_once(size, device, stream)) == nullptr && interrupted < INTERRUPTED_TRIES &&
           PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
        PyErr_Clear();
        ++interrupted;
    }
    if (ptr == nullptr) {
        refuse("cupool could not allocate");
    }
    if (interrupted > 0) {  // after the last try, which the re-armed handler would interrupt again
        PyErr_SetInterrupt();
    }
    return ptr;
}

// Free what torch held through Python, and let go of its record.  GIL held.
void give_back(const Held &h) {
    release(h);
    unpin(h.record);
}

// Whether Python can take a call now: not before it starts, nor while it shuts down (where
// PyGILState_Ensure would end a thread other than the main one).  Torch may free tensors then:
// their memory goes with the process.
bool python_ready() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsInitialized() && !Py_IsFinalizing();
#else
    return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}


// Torch's free of `ptr`: parked without the GIL where the pool lets a C caller, else through Python.
void free_ptr(void *ptr, size_t size, int device, void *stream) {
    Held h;
    bool found = false;
    {
        std::lock_guard<std::mutex> g(guard);
        auto it = live.find(ptr);
        if (it != live.end()) {
            h = it->second;
            live.erase(it);
            found = true;
            if (h.allocation == nullptr && h.kind == SMALL && h.record->state != nullptr &&
                park_api->park(h.record->state, &h.parked, h.n, h.stream)) {
                --h.record->held;  // a retired record is swept at the next call through Python
                return;
            }
        }
    }
    PyGILState_STATE g = PyGILState_Ensure();
    if (found) {
        give_back(h);
    } else if (unknown != nullptr) {
        settle(PyObject_CallFunction(unknown, "NnlN", PyLong_FromVoidPtr(ptr), (Py_ssize_t)size, (long)device,
                                     PyLong_FromVoidPtr(stream)),
               unknown);
    }
    PyGILState_Release(g);
}

}  // namespace

extern "C" {

/* A block of `size` bytes on `device` for `stream`; NULL (never an exception) when cupool refuses. */
void *cupool_torch_alloc(size_t size, int device, void *stream) noexcept {
    if (!python_ready()) {
        reason = "cupool's torch shim was called while Python is not running (or is shutting down)";
        return nullptr;
    }
    void *ptr = alloc_without_gil(size, device, stream);
    if (ptr != nullptr) {
        return ptr;
    }
    PyGILState_STATE g = PyGILState_Ensure();
    ptr = alloc_locked(size, device, stream);
    PyGILState_Release(g);
    return ptr;
}

/* Give back a block cupool_torch_alloc returned; a pointer it did not return is logged, never fatal. */
void cupool_torch_free(void *ptr, size_t size, int device, void *stream) noexcept {
    if (ptr == nullptr || !python_ready()) {
        return;
    }
    free_ptr(ptr, size, device, stream);
}

/* cupool_torch_alloc for PyTorch, which does not check for NULL: a refusal throws, with cupool's reason. */
void *cupool_torch_alloc_or_throw(size_t size, int device, void *stream) {
    void *ptr = cupool_torch_alloc(size, device, stream);
    if (ptr == nullptr) {
        throw std::runtime_error("cupool could not allocate " + std::to_string(size) + " bytes on device " +
                                 std::to_string(device) + " for PyTorch: " + reason);
    }
    return ptr;
}

}  // extern "C"

namespace {

PyObject *shim_forget(PyObject *, PyObject *) {
    {
        std::lock_guard<std::mutex> g(guard);
        for (auto &entry : records) {
            retired.push_back(entry.second);
        }
        records.clear();
    }
    sweep();
    Py_RETURN_NONE;
}

PyObject *shim_register(PyObject *, PyObject *args) {
    PyObject *s, *r, *u, *capsule = Py_None;
    if (!PyArg_ParseTuple(args, "OOO|O:register", &s, &r, &u, &capsule)) {
        return nullptr;
    }
    for (PyObject *f : {s, r, u}) {
        if (!PyCallable_Check(f)) {
            PyErr_Format(PyExc_TypeError, "register() takes three callables, got %R", f);
            return nullptr;
        }
    }
    if (capsule != Py_None) {
        auto api = static_cast<const ParkApi *>(PyCapsule_GetPointer(capsule, "cupool.core.park.C_API"));
        if (api == nullptr) {
            return nullptr;
        }
        if (api->version != PARK_API_VERSION || api->parked_size != static_cast<int>(sizeof(Parked))) {
            PyErr_Format(PyExc_ImportError, "cupool.core.park.C_API is version %d (%d-byte blocks); this shim was "
                         "built for version %d (%d): reinstall cupool", api->version, api->parked_size,
                         PARK_API_VERSION, static_cast<int>(sizeof(Parked)));
            return nullptr;
        }
        std::lock_guard<std::mutex> g(guard);
        if (!records.empty() || !live.empty()) {
            PyErr_SetString(PyExc_RuntimeError, "register(): the core's C functions are given before the first block");
            return nullptr;
        }
        park_api = api;
    }
    Py_INCREF(s);
    Py_INCREF(r);
    Py_INCREF(u);
    Py_XSETREF(resolve, s);
    Py_XSETREF(report, r);
    Py_XSETREF(unknown, u);
    Py_RETURN_NONE;
}

PyObject *shim_live(PyObject *, PyObject *) {
    std::lock_guard<std::mutex> g(guard);
    return PyLong_FromSize_t(live.size());
}

PyObject *shim_reason(PyObject *, PyObject *) {
    return PyUnicode_DecodeUTF8(reason.data(), static_cast<Py_ssize_t>(reason.size()), "replace");
}

PyMethodDef methods[] = {
    {"register", shim_register, METH_VARARGS,
     "register(resolve, report, unknown[, park_api]): the Python callables the C functions call, and the "
     "capsule cupool.core.park.C_API (hits without the GIL)."},
    {"forget", shim_forget, METH_NOARGS, "Forget which pool serves each device: resolve() is asked again."},
    {"live", shim_live, METH_NOARGS, "How many blocks torch holds through the shim now."},
    {"reason", shim_reason, METH_NOARGS, "This thread's last refusal, as the C++ entry point words it."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "torch_shim",
    "PyTorch's pluggable-allocator functions over cupool's pool (see torch_shim.cpp).",
    -1, methods, nullptr, nullptr, nullptr, nullptr,
};


// A fork's child gets `guard` unlocked, whatever a thread of the parent was doing with it (Note [Fork]:
// the child's pools refuse, but torch may still free there, and must not hang on a lock nobody holds).
void fork_prepare() { guard.lock(); }
void fork_release() { guard.unlock(); }

}  // namespace

PyMODINIT_FUNC PyInit_torch_shim(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == nullptr) {
        return nullptr;
    }
    if (ptr_name == nullptr) {
        ptr_name = PyUnicode_InternFromString("ptr");
        if (pthread_atfork(fork_prepare, fork_release, fork_release) != 0) {
            Py_DECREF(m);
            return PyErr_NoMemory();
        }
    }
    if (ptr_name == nullptr ||
        PyModule_AddStringConstant(m, "ALLOC", "cupool_torch_alloc") < 0 ||
        PyModule_AddStringConstant(m, "FREE", "cupool_torch_free") < 0 ||
        PyModule_AddStringConstant(m, "TORCH_ALLOC", "cupool_torch_alloc_or_throw") < 0 ||
        PyModule_AddIntConstant(m, "LENDS_UP_TO", static_cast<long>(SMALL_MAX)) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
