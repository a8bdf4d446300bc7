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
environments never share entries.  The folder is the source's real one: an editable
install imports each file by two paths (``src/cupool/...`` from elsewhere,
``cupool/...`` inside the checkout, and ``kernels/`` through a link), which would
otherwise compile the engine once for each.  Where no folder is writable the function is
compiled in each process, as with ``cache=False``.

Why cache at all.  The replay engine takes about 40 s of CPU to compile on two busy cores and loads from the
cache in well under a second; the move kernel ~2 s against 0.1 s (2-core machine).

What a cached function depends on.  Numba stamps a cache entry with its own
module's source alone, so an edit to a module its compiled code calls (the rule
book, the size classes, first-fit ranges) or whose constants it freezes (pages,
granules, the engine's slots) left callers loading their old code: a renamed
rule still "ran" from the cache (issue 25).  So a function of cupool's is
stamped with its own module's source and a hash of every file of ``SOURCES``
too; ``tests/test_numba_cache.py`` holds ``SOURCES`` to what the compiled
modules import.

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

import functools
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
from numba.core import types
from numba.core.registry import CPUDispatcher

#: The package's files, beside the compiled function's own module, that its code reads: what it
#: calls compiled and the constants it freezes (glob patterns, relative to the package).
SOURCES = ("replay/engine*.py", "replay/calls.py", "kernels/*.py", "core/rules.py", "core/sizes.py", "_units.py",
           "device/ranges.py", "device/vmm.py", "device/base.py", "settings.py")
_PACKAGE = Path(__file__).absolute().parent.parent  # not resolved: kernels/ is linked into the checkout's package


def source_files(package: Path = _PACKAGE, sources: tuple[str, ...] = SOURCES) -> list[Path]:
    """Every file ``sources`` names under ``package``, in a fixed order."""
    return [f for pattern in sources for f in sorted(package.glob(pattern))]


def sources_stamp(package: Path = _PACKAGE, sources: tuple[str, ...] = SOURCES) -> str:
    """A hash of the contents of every file of ``sources``: the part of a cache entry's stamp Numba's misses.

    Files are named relative to ``package``, so the stamp is the same wherever the package is
    imported from (see ``_stamped``).
    """
    files = source_files(package, sources)
    return _hash_files(str(package), tuple((str(f.relative_to(package)), f.stat().st_mtime_ns, f.stat().st_size)
                                           for f in files))


@functools.lru_cache(maxsize=8)
def _hash_files(package: str, stamps: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, _, _ in stamps:  # mtime and size key the memo: an edited file is read again
        h.update(name.encode())
        h.update(Path(package, name).read_bytes())
    return h.hexdigest()


def _stamped(locator: Any) -> Any:
    """``locator``, whose stamp for a function of cupool also covers ``SOURCES``."""

    class Stamped(locator):
        @classmethod
        def get_suitable_cache_subpath(cls, py_file: str) -> str:
            # The real file's folder: an editable install imports the same file as
            # src/cupool/replay/engine.py from elsewhere and as cupool/replay/engine.py inside the
            # checkout (and kernels/ through a link), and Numba's folder per path compiled the
            # engine once for each (tests/test_numba_cache.py).
            return str(super().get_suitable_cache_subpath(os.path.realpath(py_file)))

        def get_source_stamp(self) -> Any:
            own = super().get_source_stamp()
            py_file = getattr(self, "_py_file", None)
            if py_file is None or not Path(py_file).absolute().is_relative_to(_PACKAGE):
                return own
            return own, sources_stamp()

    Stamped.__name__ = Stamped.__qualname__ = f"Stamped{locator.__name__}"
    return Stamped


try:
    from numba.core.caching import CompileResultCacheImpl, FunctionCache

    class _OutOfTreeCacheImpl(CompileResultCacheImpl):
        _locator_classes = [_stamped(c) for c in CompileResultCacheImpl._locator_classes if "InTree" not in c.__name__]

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
    passes constants in many places, which made 20 extra versions of its functions
    (2026-11-26, ``benchmarks/bench_replay.py --cold``; docs/benchmarks.md).  Typing the call with the
    constants' plain types (``int64``, ``bool``) reuses the one version; Numba
    converts the constant at the call.
    """

    def get_call_template(self, args: Any, kws: Any) -> Any:
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
