"""Mechanism: the state of a pool and the rules that keep it consistent.

Nothing here decides policy (when to grow, what to reclaim): that is the pool's
and the pressure layer's job.  See docs/design.md.

This file's charter: it chooses, once per process and before anything imports
them, whether the modules in ``COMPILED_MODULES`` run compiled or from their
source, and says which and why (``build_info()``).  It knows nothing of what those
modules do.  The rules (docs/design.md, "Why Cython's pure-Python mode"):

- setup.py compiles each listed module with Cython from the very ``.py`` that runs
  uncompiled, and leaves beside the extension the sha256 of that source, the
  ``.py`` and its ``.pxd`` (``SOURCE_HASH_SUFFIX``), or a note saying why it did not build
  (``BUILD_ERROR_SUFFIX``).  It reads the names below from this file's text.
- The compiled module runs only if it exists, its recorded hash matches the source
  beside it, and ``CUPOOL_PURE_PYTHON`` is not ``1``.  An extension that does not
  match its source (an edited source in an editable install) is never used
  silently: the source runs, with one warning saying how to rebuild.  Nor is one
  that fails to import (built against another Python or CuPy).
- An extension shadows the ``.py`` of the same name at import, so the source is
  loaded here, under the module's own name, into ``sys.modules``.  Both paths are
  imported here, so that they are imported at the same point of ``import cupool``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path

#: Modules of this package that setup.py compiles (from the same .py that runs otherwise).
COMPILED_MODULES = ("fast",)
#: Beside a built extension: the sha256 of the source it was compiled from.
SOURCE_HASH_SUFFIX = ".source-sha256"
#: Beside where the extension would be: why it was not built.
BUILD_ERROR_SUFFIX = ".build-error"
#: Set to 1 to run the compiled modules' sources instead (the same behaviour, uncompiled).
PURE_ENV = "CUPOOL_PURE_PYTHON"

_HERE = Path(__file__).resolve().parent
_REBUILD = "rebuild it with `pip install -e .` (editable) or `pip install .` from the checkout"
_chosen: dict[str, tuple[str, str]] = {}  # module -> ("compiled" | "pure", why)


def _source_sha256(source: Path) -> str:
    """The hash setup.py records: the .py, then its augmenting .pxd if there is one."""
    h = hashlib.sha256(source.read_bytes())
    pxd = source.with_suffix(".pxd")
    if pxd.exists():
        h.update(pxd.read_bytes())
    return h.hexdigest()


def _why_not_compiled(name: str, source: Path) -> str | None:
    """None if the compiled ``name`` may run; else why not (and a warning if it is stale)."""
    flag = os.environ.get(PURE_ENV, "")
    if flag not in ("", "0"):
        if flag != "1":
            warnings.warn(f"{PURE_ENV}={flag!r} is neither 0 nor 1; running uncompiled", RuntimeWarning, stacklevel=2)
        return f"{PURE_ENV}={flag}"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]  # the file name setup.py builds
    note = _HERE / f"{name}{suffix}{BUILD_ERROR_SUFFIX}"
    found = [_HERE / f"{name}{s}" for s in importlib.machinery.EXTENSION_SUFFIXES if (_HERE / f"{name}{s}").exists()]
    if not found:
        if note.exists():
            return f"not compiled at install: {note.read_text().splitlines()[0]} (details: {note})"
        return "no compiled module beside the source (not built in place, or installed without setup.py)"
    ext = found[0]  # the file the import system would load
    recorded = ext.with_name(ext.name + SOURCE_HASH_SUFFIX)
    if recorded.exists() and recorded.read_text().strip() == _source_sha256(source):
        return None
    why = (f"{ext.name} was built from another version of {source.name}" if recorded.exists()
           else f"{ext.name} has no record of the source it was built from")
    warnings.warn(f"cupool runs {source} uncompiled (slower): {why}; {_REBUILD}", RuntimeWarning, stacklevel=2)
    return f"stale build: {why}"


def _load(name: str) -> None:
    full = f"{__name__}.{name}"
    source = _HERE / f"{name}.py"
    why = _why_not_compiled(name, source)
    if why is None:
        try:
            globals()[name] = importlib.import_module(full)
        except ImportError as exc:  # built for another CuPy or Python, say: the source still runs
            why = f"the compiled module does not import: {exc}"
            warnings.warn(f"cupool runs {source} uncompiled (slower): {why}; {_REBUILD}", RuntimeWarning, stacklevel=2)
        else:
            _chosen[name] = ("compiled", f"built from this {source.name}")
            return
    spec = importlib.util.spec_from_file_location(full, source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full]
        raise
    globals()[name] = module
    _chosen[name] = ("pure", why)


def build_info() -> dict[str, str]:
    """Which path runs, ``{"fast_path": "compiled" | "pure", "reason": ...}``, and why.

    Compiled only if every module in ``COMPILED_MODULES`` runs compiled; the reason
    names each module that does not.
    """
    pure = {name: why for name, (path, why) in _chosen.items() if path == "pure"}
    if not _chosen:
        return {"fast_path": "pure", "reason": "no compiled modules in this version"}
    if pure:
        return {"fast_path": "pure", "reason": "; ".join(f"{n}: {w}" for n, w in pure.items())}
    return {"fast_path": "compiled", "reason": "; ".join(f"{n}: {w}" for n, (_, w) in _chosen.items())}


def _select() -> None:
    for name in COMPILED_MODULES:
        if (_HERE / f"{name}.py").exists():  # a listed module may not be written yet
            _load(name)


_select()
