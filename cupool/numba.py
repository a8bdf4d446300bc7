"""Numba EMM plugin entry point: ``NUMBA_CUDA_MEMORY_MANAGER=cupool.numba``.

Numba imports the module this variable names and uses its
``_numba_memory_manager``; the plugin itself lives in ``cupool.hooks.numba``,
next to the routing it follows.  Nothing in cupool imports this module, so it
adds no edge to the package's import graph.
"""

from __future__ import annotations

from .hooks.numba import CupoolMemoryManager, default_pinned_pool

_numba_memory_manager = CupoolMemoryManager

__all__ = ["CupoolMemoryManager", "_numba_memory_manager", "default_pinned_pool"]
