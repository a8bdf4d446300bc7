"""Routing CuPy's (and Numba's) device allocations to cupool pools.

Three ways in, from narrow to wide:

* ``cupy_allocator(pool)``: a callable for ``cupy.cuda.set_allocator``;
* ``with using(pool):``: this thread only, nests, restores what was there;
* ``install()`` / ``uninstall()``: the whole process, CuPy and Numba at once.

``routing`` decides which pool serves an allocation and holds all the state;
``cupy`` and ``numba`` (the EMM plugin, imported only when Numba is wanted)
adapt each library to it; ``scopes`` switches it per thread or per process.
Imports run in that order and never back into this package.
"""

from .cupy import cupy_allocator
from .routing import current_pool, default_pool, existing_pool, reset_default_pools, using_pools
from .scopes import install, installed, uninstall, using

__all__ = [
    "cupy_allocator",
    "current_pool",
    "default_pool",
    "existing_pool",
    "install",
    "installed",
    "reset_default_pools",
    "uninstall",
    "using",
    "using_pools",
]
