"""``njit`` for cupool's compiled code: with ``cache=True`` the cache stays out of the package.

Why.  Numba's default cache sits beside the source, in ``__pycache__``.  For an
installed cupool that is ``site-packages/cupool/kernels/__pycache__`` and
``site-packages/cupool/replay/__pycache__``: files pip did not install, so
``pip uninstall`` (which ``pip install -e .`` runs first) leaves them, and with
them a ``site-packages/cupool`` folder without ``__init__.py``.  That folder is a
namespace package that shadows the editable install: ``import cupool`` outside
the checkout then gives a module without ``Pool``.

What.  Numba's own search for a cache folder, minus the in-tree one:
``NUMBA_CACHE_DIR`` when the user set it, else Numba's user-wide folder
(``$XDG_CACHE_HOME/numba`` or ``~/.cache/numba``, where Numba already caches
packages installed read-only), one subfolder per source folder, so that two
environments never share entries.  Where no folder is writable the function is
compiled in each process, as with ``cache=False``.

Why cache at all.  The replay engine takes about 40 s of CPU to compile on two busy cores and loads from the
cache in well under a second; the move kernel ~2 s against 0.1 s (2-core machine).

Private Numba API.  Numba has no per-function cache location: only the
process-wide ``NUMBA_CACHE_DIR`` and (in recent versions)
``NUMBA_CACHE_LOCATOR_CLASSES``, which are the user's to set and win here too.
So this subclasses ``numba.core.caching``'s ``FunctionCache`` and
``CompileResultCacheImpl`` (its ``_locator_classes`` list), and sets the
dispatcher's ``_cache`` exactly as ``Dispatcher.enable_caching`` does.  These are
the same from Numba 0.59 to 0.68.  Should they go, the function falls back to
Numba's plain ``cache=True``; ``tests/test_install.py`` fails then, because it
checks that every cached function's cache folder lies outside the package.
``_OneSignature`` (one compiled version per argument types, see it) overrides the
dispatcher's ``get_call_template``, which Numba's typing calls for every call from
compiled code (numba 0.68.1); ``tests/test_one_signature.py`` fails should that change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
from numba.core import types
from numba.core.registry import CPUDispatcher

try:
    from numba.core.caching import CompileResultCacheImpl, FunctionCache

    class _OutOfTreeCacheImpl(CompileResultCacheImpl):
        _locator_classes = [c for c in CompileResultCacheImpl._locator_classes if "InTree" not in c.__name__]

    class _OutOfTreeFunctionCache(FunctionCache):
        _impl_class = _OutOfTreeCacheImpl

    _cache_class: type[FunctionCache] | None = _OutOfTreeFunctionCache
except (ImportError, AttributeError, TypeError):  # pragma: no cover - a Numba laid out otherwise
    _cache_class = None


class _OneSignature(CPUDispatcher):
    """A dispatcher that compiles one version per argument *type*, never one per constant.

    Called from compiled code with a constant argument (a module's ``LARGE``, a
    literal ``0``, ``True``), a plain Numba dispatcher first compiles a version
    specialised to that value (``Literal[int](1)``), and each such version is a
    whole compile of the function and of everything it calls.  The replay engine
    passes constants in many places, which made 26 of its 73 compiles duplicates
    (2026-11-26, ``benchmarks/bench_replay.py --cold``).  Typing the call with the
    constants' plain types (``int64``, ``bool``) reuses the one version; Numba
    converts the constant at the call.
    """

    def get_call_template(self, args: tuple, kws: dict) -> Any:
        return super().get_call_template(tuple(types.unliteral(a) for a in args),
                                         {k: types.unliteral(v) for k, v in kws.items()})


def njit(**options: Any) -> Callable[[Callable], Any]:
    """``numba.njit(**options)``, one version per argument types (``_OneSignature``); ``cache=True`` caches
    outside the package (see the module's doc)."""
    cache = options.pop("cache", False)

    def decorate(fn: Callable) -> Any:
        dispatcher = _OneSignature(py_func=fn, locals={}, targetoptions={**options, "nopython": True})
        if cache:
            _enable_caching(dispatcher)
        return dispatcher

    return decorate


def _enable_caching(dispatcher: Any) -> None:
    if _cache_class is None:  # pragma: no cover - see the module's doc
        dispatcher.enable_caching()
        return
    try:
        cache = _cache_class(dispatcher.py_func)
    except RuntimeError:  # Numba's "no locator available": no writable folder, so no cache
        return
    except (AttributeError, TypeError):  # pragma: no cover - a Numba laid out otherwise
        dispatcher.enable_caching()
        return
    dispatcher._cache = cache
