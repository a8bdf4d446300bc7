"""Observers of a pool, built only on its public surfaces.

* ``monitor``: threshold alerts on usage and fragmentation (``Monitor``, ``Alert``);
* ``batch``: a batch size sized to the memory past steps needed (``BatchSizer``);
* ``snapshot``: export in PyTorch's memory-snapshot format (``Pool.export_snapshot``).

They read a pool through ``subscribe``, ``view``, ``hold()``, ``peak_window()``,
``stats()`` and ``snapshot()``, never its internals, so the core can change under
them.  This file imports none of them on purpose: ``cupool.pool`` imports
``cupool.observe.snapshot``, which loads this package first, and a package that
pulled in ``monitor`` or ``batch`` here (both import the pool) would close an
import cycle.  Import the modules themselves, or the names from ``cupool``.
"""
