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
 * (cudaStream_t is a pointer; no CUDA header is needed).  Each takes the GIL,
 * calls into Python and never lets an exception cross the C boundary.  alloc
 * asks `resolve(device)` once for the pool's malloc_key and stream_key (until
 * forget()), and calls malloc_key(size, stream_key(stream)) itself, remembering
 * the last stream's key: one Python call per allocation, into compiled code.
 * A refused allocation returns NULL and hands the Python exception to `report` (which
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
 * The live blocks are held here, in a map from address to cupool.Allocation:
 * a free pops its Allocation and drops it, and the Allocation's own finalizer
 * gives the block back to its pool, on the stream it was taken for.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace {

PyObject *resolve = nullptr;  // resolve(device) -> (pool, malloc_key, stream_key): where torch's blocks come from
PyObject *served = nullptr;   // {device: resolve(device)}, until forget()
PyObject *report = nullptr;   // report(exception): keeps a refusal's reason
PyObject *unknown = nullptr;  // unknown(ptr, size, device, stream): logs a free of a pointer not served here
std::unordered_map<void *, PyObject *> live;  // address -> Allocation (owned) of the blocks torch holds
PyObject *ptr_name = nullptr; // "ptr", interned

thread_local std::string reason;  // this thread's last refusal, for the C++ entry point
void *last_stream = nullptr;      // the last stream handle seen, and its key (stream_key is a pure function)
PyObject *last_key = nullptr;
PyObject *last_key_fn = nullptr;  // the stream_key that gave last_key (held, so its address is not reused)

// Clear the pending exception; a KeyboardInterrupt (Ctrl-C landing in Python code the shim runs) is
// re-armed (PyErr_SetInterrupt), so Python's SIGINT handler raises it at the program's next bytecode
// rather than losing it where no C caller can take it (issue 36 #3).
void clear_keeping_interrupts() {
    if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
        PyErr_SetInterrupt();
    }
    PyErr_Clear();
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
        PyObject *r = PyObject_CallOneArg(report, value);
        if (r == nullptr && PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
            clear_keeping_interrupts();
        } else if (r == nullptr) {
            PyErr_WriteUnraisable(report);
        }
        Py_XDECREF(r);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

// The (pool, malloc_key, stream_key) serving `device`, a new reference (a forget() on another thread,
// while this one runs Python code, must not free it under us); nullptr with an exception set.
PyObject *serving(int device) {
    PyObject *d = PyLong_FromLong(device);
    if (d == nullptr) {
        return nullptr;
    }
    PyObject *entry = PyDict_GetItemWithError(served, d);
    if (entry == nullptr && !PyErr_Occurred()) {
        PyObject *made = PyObject_CallOneArg(resolve, d);
        if (made != nullptr && !(PyTuple_Check(made) && PyTuple_GET_SIZE(made) == 3)) {
            PyErr_Format(PyExc_TypeError, "resolve() must give (pool, malloc_key, stream_key), got %R", made);
            Py_CLEAR(made);
        }
        if (made != nullptr && PyDict_SetItem(served, d, made) < 0) {
            Py_CLEAR(made);
        }
        entry = made;
    } else {
        Py_XINCREF(entry);
    }
    Py_DECREF(d);
    return entry;
}

// The key of `stream` by `key_fn`: remembered for the last stream seen, so one stream costs one call.
PyObject *stream_key(PyObject *key_fn, void *stream) {
    if (last_key != nullptr && stream == last_stream && key_fn == last_key_fn) {
        Py_INCREF(last_key);
        return last_key;
    }
    PyObject *handle = PyLong_FromVoidPtr(stream);
    if (handle == nullptr) {
        return nullptr;
    }
    PyObject *key = PyObject_CallOneArg(key_fn, handle);
    Py_DECREF(handle);
    if (key != nullptr) {
        Py_INCREF(key);
        Py_INCREF(key_fn);
        last_stream = stream;  // all three are set before a decref below may run Python code
        Py_XSETREF(last_key, key);
        Py_XSETREF(last_key_fn, key_fn);
    }
    return key;
}

// One try at a block: its address, or nullptr with a Python exception set.
void *alloc_once(size_t size, int device, void *stream) {
    PyObject *entry = serving(device);
    PyObject *a = nullptr;
    if (entry != nullptr) {
        PyObject *args[2] = {PyLong_FromSize_t(size), stream_key(PyTuple_GET_ITEM(entry, 2), stream)};
        if (args[0] != nullptr && args[1] != nullptr) {
            a = PyObject_Vectorcall(PyTuple_GET_ITEM(entry, 1), args, 2, nullptr);
        }
        Py_XDECREF(args[0]);
        Py_XDECREF(args[1]);
        Py_DECREF(entry);
    }
    if (a == nullptr) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "cupool could not allocate");
        }
        return nullptr;
    }
    void *ptr = nullptr;
    PyObject *address = PyObject_GetAttr(a, ptr_name);
    if (address != nullptr) {
        ptr = PyLong_AsVoidPtr(address);
        if (ptr == nullptr && !PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "cupool served a block at address 0");
        }
        Py_DECREF(address);
    }
    if (ptr != nullptr) {
        try {
            auto placed = live.emplace(ptr, a);  // `live` owns the reference now
            if (!placed.second) {
                PyErr_Format(PyExc_RuntimeError, "cupool served %p, which torch already holds", ptr);
                ptr = nullptr;
            }
        } catch (const std::bad_alloc &) {
            PyErr_NoMemory();
            ptr = nullptr;
        }
    }
    if (ptr == nullptr) {
        Py_DECREF(a);  // not kept: its block goes back at once
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "cupool could not record the block");
        }
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

void free_locked(void *ptr, size_t size, int device, void *stream) {
    auto found = live.find(ptr);
    if (found != live.end()) {
        PyObject *a = found->second;
        live.erase(found);
        Py_DECREF(a);  // the Allocation dies here: its finalizer frees the block
    } else if (unknown != nullptr) {
        PyObject *r = PyObject_CallFunction(unknown, "NnlN", PyLong_FromVoidPtr(ptr), (Py_ssize_t)size, (long)device,
                                            PyLong_FromVoidPtr(stream));
        if (r == nullptr && PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
            clear_keeping_interrupts();
        } else if (r == nullptr) {
            PyErr_WriteUnraisable(unknown);
        }
        Py_XDECREF(r);
    }
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

}  // namespace

extern "C" {

/* A block of `size` bytes on `device` for `stream`; NULL (never an exception) when cupool refuses. */
void *cupool_torch_alloc(size_t size, int device, void *stream) noexcept {
    if (!python_ready()) {
        reason = "cupool's torch shim was called while Python is not running (or is shutting down)";
        return nullptr;
    }
    PyGILState_STATE g = PyGILState_Ensure();
    void *ptr = alloc_locked(size, device, stream);
    PyGILState_Release(g);
    return ptr;
}

/* Give back a block cupool_torch_alloc returned; a pointer it did not return is logged, never fatal. */
void cupool_torch_free(void *ptr, size_t size, int device, void *stream) noexcept {
    if (ptr == nullptr || !python_ready()) {
        return;
    }
    PyGILState_STATE g = PyGILState_Ensure();
    free_locked(ptr, size, device, stream);
    PyGILState_Release(g);
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
    if (served != nullptr) {
        PyDict_Clear(served);
    }
    Py_CLEAR(last_key);
    Py_CLEAR(last_key_fn);
    Py_RETURN_NONE;
}

PyObject *shim_register(PyObject *, PyObject *args) {
    PyObject *s, *r, *u;
    if (!PyArg_ParseTuple(args, "OOO:register", &s, &r, &u)) {
        return nullptr;
    }
    for (PyObject *f : {s, r, u}) {
        if (!PyCallable_Check(f)) {
            PyErr_Format(PyExc_TypeError, "register() takes three callables, got %R", f);
            return nullptr;
        }
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
    return PyLong_FromSize_t(live.size());
}

PyObject *shim_reason(PyObject *, PyObject *) {
    return PyUnicode_DecodeUTF8(reason.data(), static_cast<Py_ssize_t>(reason.size()), "replace");
}

PyMethodDef methods[] = {
    {"register", shim_register, METH_VARARGS,
     "register(resolve, report, unknown): the Python callables the C functions call."},
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

}  // namespace

PyMODINIT_FUNC PyInit_torch_shim(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == nullptr) {
        return nullptr;
    }
    if (served == nullptr) {
        served = PyDict_New();
        ptr_name = PyUnicode_InternFromString("ptr");
    }
    if (served == nullptr || ptr_name == nullptr ||
        PyModule_AddStringConstant(m, "ALLOC", "cupool_torch_alloc") < 0 ||
        PyModule_AddStringConstant(m, "FREE", "cupool_torch_free") < 0 ||
        PyModule_AddStringConstant(m, "TORCH_ALLOC", "cupool_torch_alloc_or_throw") < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
