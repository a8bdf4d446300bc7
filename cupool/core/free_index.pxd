# distutils: language = c++
# The compiled heap calls the free index's methods as C functions (cupool/core/heap.pxd cimports this).
from libcpp.set cimport set as cset
from libcpp.utility cimport pair

ctypedef pair[Py_ssize_t, Py_ssize_t] Key


cdef class FreeIndex:
    cdef cset[Key] keys

    cpdef add(self, Py_ssize_t size, Py_ssize_t addr)
    cpdef remove(self, Py_ssize_t size, Py_ssize_t addr)
    cpdef first_at_least(self, size)
    cpdef Py_ssize_t largest(self)
