"""Mechanism: the state of a pool and the rules that keep it consistent.

Nothing here decides policy (when to grow, what to reclaim): that is the pool's
and the pressure layer's job.  See docs/design.md.

This file's charter: it chooses, once per process and before anything imports
them, whether the modules in ``COMPILED_MODULES`` run compiled or from their
source, and says which and why (``build_info()``, ``compiled_module()``).  It
knows nothing of what those modules do.  The rules (docs/design.md, "Why
Cython's pure-Python mode"):

- ``COMPILED_MODULES`` lists every module setup.py compiles, by dotted name,
  wherever it lives; setup.py reads it from this file's text.  A module's source
  is its ``.py`` (Cython's pure-Python mode, with an augmenting ``.pxd``: the
  same file runs uncompiled), its ``.pyx`` (compiled only: uncompiled, the
  module is absent and its user falls back, as ``cupool.hooks.cupy`` does) or
  its ``.cpp`` (a C++ extension written by hand, compiled only, as PyTorch's
  allocator shim: it cimports nothing, so the rules below about the modules
  listed before it do not apply to it).
- setup.py leaves beside each extension the sha256 of its source: the ``.py`` or
  ``.pyx``, its ``.pxd``, and the ``.pxd`` of every module listed before it, which
  it may cimport (``SOURCE_HASH_SUFFIX``); or a note saying why it did not build
  (``BUILD_ERROR_SUFFIX``).
- A compiled module runs only if it exists, its recorded hash matches the sources
  beside it, every module listed before it runs compiled too, and
  ``CUPOOL_PURE_PYTHON`` is not ``1``.  An extension that does not match its
  source (an edited source in an editable install) is never used silently: the
  source runs, with one warning saying how to rebuild.  Nor is one that fails to
  import (built against another Python or CuPy).  A marker that cannot be read
  (an empty or undecodable note, a folder where a hash should be) is a reason
  like any other, and warnings made errors (``-W error``) never fail the import:
  the source runs and ``build_info()`` says why.
- The modules of this package are chosen here, when it is imported, because an
  extension shadows the ``.py`` of the same name at import: the source is loaded
  here, under the module's own name, into ``sys.modules``.  A module elsewhere
  (it may need a library cupool does not require, as the CuPy memory object
  needs CuPy) is chosen by ``compiled_module()`` at its first use.

Note [One compiled core]
~~~~~~~~~~~~~~~~~~~~~~~~
What every allocation and free runs is compiled, from the source that also runs
uncompiled: the hit (``fast``), and on a miss or a large block best fit, split
and coalesce (``heap``), the figures (``books``) and the miss chain and the free
(``arena``).  Each is plain Python typed by an augmenting ``.pxd``: blocks,
segments, heaps, books and the arena are C structs there, and the arena's slow
path is a C call from the fast path.  Two pieces are written twice, as the log's
fold is, each behind one set of methods that the placement conformance suite and
the state machines hold both to (tests/test_both_paths.py): the heap's free index,
an ordered C++ set compiled (``free_index.pyx``) and a ``SortedList`` uncompiled
(``heap.SortedFreeIndex``), in best fit's order; and the fast path's lock, parked
stacks and log, C structures compiled (``park.pyx``, which PyTorch's shim reaches
without the GIL: Note [Hits without the GIL]) and ``threading.Lock``, a dict of
lists (``parking.DictParking``) and a list uncompiled.

The rule book and the size classes (``rules``, ``sizes``) compile too, as they
are: the heap and the arena call them as extension functions.  The Numba replay
engine compiles the same functions from their Python text, which it gets from
``source_twins`` (``register_jitable`` needs a function's bytecode, not an
extension's).  What stays Python, and why: the segment sources, which call the
device, the stream epochs, and the policy above.  A miss pays a few Python calls
into them; a hit pays none.
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
from types import ModuleType

#: Every module setup.py compiles, by dotted name, in build order: one may cimport those before it.
COMPILED_MODULES = ("cupool.core.sizes", "cupool.core.rules", "cupool.core.free_index", "cupool.core.heap", "cupool.core.park", "cupool.core.fast", "cupool.core.books", "cupool.core.arena", "cupool.hooks.cupy_memory", "cupool.hooks.torch_shim")
#: The source suffixes of a listed module, in the order they are looked for; Cython compiles the first two.
SOURCE_SUFFIXES = (".py", ".pyx", ".cpp")
#: Beside a built extension: the sha256 of the source it was compiled from.
SOURCE_HASH_SUFFIX = ".source-sha256"
#: Beside where the extension would be: why it was not built.
BUILD_ERROR_SUFFIX = ".build-error"
#: Set to 1 to run the compiled modules' sources instead (the same behaviour, uncompiled).
PURE_ENV = "CUPOOL_PURE_PYTHON"

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent.parent  # the folder that holds the cupool package
_REBUILD = "rebuild it with `pip install -e .` (editable) or `pip install .` from the checkout"
_chosen: dict[str, tuple[str, str]] = {}  # dotted module -> ("compiled" | "pure", why)


def module_source(dotted: str) -> Path | None:
    """The ``.py``, ``.pyx`` or ``.cpp`` a listed module is built from, None if it is not written yet."""
    base = _ROOT.joinpath(*dotted.split("."))
    for suffix in SOURCE_SUFFIXES:
        if base.with_suffix(suffix).exists():
            return base.with_suffix(suffix)
    return None


def _source_sha256(dotted: str, source: Path) -> str:
    """The hash setup.py records: the source, its augmenting .pxd if any, then the .pxd of each
    module listed before it (it may cimport them: its C code depends on their layout)."""
    h = hashlib.sha256(source.read_bytes())
    earlier = _cimported(dotted, source)
    for pxd in [source.with_suffix(".pxd")] + [_ROOT.joinpath(*d.split(".")).with_suffix(".pxd") for d in earlier]:
        if pxd.exists():
            h.update(pxd.read_bytes())
    return h.hexdigest()


def _cimported(dotted: str, source: Path) -> tuple[str, ...]:
    """The listed modules ``dotted`` may cimport: those before it, for a Cython source; none for C++."""
    return COMPILED_MODULES[:COMPILED_MODULES.index(dotted)] if source.suffix != ".cpp" else ()


def _read_marker(path: Path) -> str | None:
    """A build note's text, stripped, or None where it cannot be read (a folder, bad UTF-8, no access)."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _warn(message: str) -> None:
    """One RuntimeWarning; under ``-W error`` it is not raised, since the reason is kept anyway."""
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=4)
    except Warning:  # warnings made errors: the import still falls back, build_info() says why
        pass


def _fallback(source: Path) -> str:
    """What running without the compiled module means, for a warning."""
    if source.suffix == ".py":
        return f"cupool runs {source} uncompiled (slower)"
    if source.suffix == ".cpp":
        return f"cupool does without the module compiled from {source}"
    return f"cupool does without the module compiled from {source} (its fallback is slower)"


def _why_not_compiled(dotted: str, source: Path) -> str | None:
    """None if the compiled ``dotted`` may run; else why not (and a warning if it is stale)."""
    flag = os.environ.get(PURE_ENV, "")
    if flag not in ("", "0"):
        if flag != "1":
            _warn(f"{PURE_ENV}={flag!r} is neither 0 nor 1; running uncompiled")
        return f"{PURE_ENV}={flag}"
    for earlier in _cimported(dotted, source):
        if module_source(earlier) is not None and _choose(earlier)[0] != "compiled":
            return f"it needs {earlier} compiled, which runs uncompiled"
    folder, name = source.parent, source.stem
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]  # the file name setup.py builds
    note = folder / f"{name}{suffix}{BUILD_ERROR_SUFFIX}"
    found = [folder / f"{name}{s}" for s in importlib.machinery.EXTENSION_SUFFIXES if (folder / f"{name}{s}").exists()]
    if not found:
        if note.exists():
            text = _read_marker(note)
            line = text.splitlines()[0] if text else "(the note is empty or unreadable)"
            return f"not compiled at install: {line} (details: {note})"
        return "no compiled module beside the source (not built in place, or installed without setup.py)"
    ext = found[0]  # the file the import system would load
    record = ext.with_name(ext.name + SOURCE_HASH_SUFFIX)
    recorded = _read_marker(record) if record.exists() else None
    if recorded is not None and recorded == _source_sha256(dotted, source):
        return None
    why = (f"{ext.name} was built from another version of {source.name}" if recorded
           else f"{ext.name} has an unreadable record of the source it was built from" if record.exists()
           else f"{ext.name} has no record of the source it was built from")
    _warn(f"{_fallback(source)}: {why}; {_REBUILD}")
    return f"stale build: {why}"


def _choose(dotted: str) -> tuple[str, str]:
    """Load ``dotted`` compiled or from its source, once; ("compiled" | "pure", why)."""
    if dotted in _chosen:
        return _chosen[dotted]
    source = module_source(dotted)
    assert source is not None, dotted
    why = _why_not_compiled(dotted, source)
    if why is None:
        try:
            module = importlib.import_module(dotted)
        except (ImportError, AttributeError, ValueError, TypeError) as exc:  # built for another Python, CuPy, fast.pxd
            # (Cython looks up and checks the types a module cimports at import: those errors)
            why = f"the compiled module does not import: {exc}"
            _warn(f"{_fallback(source)}: {why}; {_REBUILD}")
        else:
            _chosen[dotted] = ("compiled", f"built from this {source.name}")
            _publish(dotted, module)
            return _chosen[dotted]
    _chosen[dotted] = ("pure", why)
    if source.suffix == ".py":
        _publish(dotted, _exec_source(dotted, source))
    return _chosen[dotted]


def source_twins(*dotted: str) -> tuple[ModuleType, ...]:
    """The listed modules ``dotted`` run from their ``.py`` whether or not they run compiled, in order,
    each importing the twins before it: for Numba, which compiles a function from its bytecode, not an
    extension's (``cupool.replay.engine_rules``), while the pool calls the compiled modules.  The same
    text, so the same rules.  A module that runs from its source anyway is its own twin."""
    twins: list[ModuleType] = []
    compiled: dict[str, ModuleType] = {}
    try:
        for name in dotted:
            if _choose(name)[0] == "pure":
                twins.append(sys.modules[name])
                continue
            compiled[name] = sys.modules[name]
            source = module_source(name)
            assert source is not None, name
            twins.append(_exec_source(name, source))  # in sys.modules while those after it import it
    finally:
        sys.modules.update(compiled)
    return tuple(twins)


def _exec_source(dotted: str, source: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(dotted, source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[dotted] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[dotted]
        raise
    return module


def _publish(dotted: str, module: ModuleType) -> None:
    if dotted.rpartition(".")[0] == __name__:
        globals()[dotted.rpartition(".")[2]] = module


def compiled_module(dotted: str) -> tuple[ModuleType | None, str]:
    """A listed module outside this package, compiled, and why; or None and why not.

    ``None`` means its user runs its uncompiled fallback.  Chosen once per
    process, at the first call, by the rules above.
    """
    if module_source(dotted) is None:
        return None, "its source is not in this installation"
    path, why = _choose(dotted)
    return (sys.modules[dotted] if path == "compiled" else None), why


def build_info() -> dict[str, str]:
    """Which path runs, ``{"fast_path": "compiled" | "pure", "reason": ...}``, and why.

    The fast path is this package's listed modules: compiled only if each of them
    runs compiled; the reason names each one that does not.  (Listed modules
    elsewhere say which runs through ``compiled_module``.)
    """
    mine = {d.rpartition(".")[2]: c for d, c in _chosen.items() if d.rpartition(".")[0] == __name__}
    pure = {name: why for name, (path, why) in mine.items() if path == "pure"}
    if not mine:
        return {"fast_path": "pure", "reason": "no compiled modules in this version"}
    if pure:
        return {"fast_path": "pure", "reason": "; ".join(f"{n}: {w}" for n, w in pure.items())}
    return {"fast_path": "compiled", "reason": "; ".join(f"{n}: {w}" for n, (_, w) in mine.items())}


def _select() -> None:
    for dotted in COMPILED_MODULES:
        if dotted.rpartition(".")[0] == __name__ and module_source(dotted) is not None:
            _choose(dotted)


_select()
