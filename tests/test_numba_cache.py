"""The Numba cache sees every file cupool's compiled code reads (``cupool.kernels.caching.SOURCES``).

Numba stamps a cache entry with its own module's source alone.  When the rule book
renamed ``merged_tag`` to ``merged_stream``, ``engine_heap.py``'s cached code kept
calling the old name and every test passed, until a clean machine compiled it
(issue 25).  A cupool function is now stamped with a hash of ``SOURCES`` too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from cupool.kernels import caching

PACKAGE = caching._PACKAGE  # noqa: SLF001 - the folder the stamps are taken over

#: Imports of the compiled modules (and of the modules they call compiled) that compiled code never reads,
#: each with why: they serve the Python around it.
NOT_READ_COMPILED = {
    "errors.py": "exceptions raised from Python, never from compiled code",
    "device/kinds.py": "the device row's choices in the settings registry: the engine has no device slot",
    "trace/importers.py": "replay/calls.py reads traces in Python; compiled code reads only its constants",
    "trace/format.py": "replay/calls.py reads traces in Python; compiled code reads only its constants",
}


def _imports(path: Path) -> set[str]:
    """The package files ``path`` imports directly, relative to the package."""
    tree = ast.parse(path.read_text())
    here = path.parent.relative_to(PACKAGE).parts
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = list(here[: len(here) - (node.level - 1)]) if node.level > 1 else list(here)
        base += node.module.split(".") if node.module else []
        for alias in node.names:
            for parts in (base + [alias.name], base):
                for candidate in (PACKAGE.joinpath(*parts).with_suffix(".py"), PACKAGE.joinpath(*parts, "__init__.py")):
                    if candidate.is_file() and candidate != path:
                        out.add(str(candidate.relative_to(PACKAGE)))
                        break
                else:
                    continue
                break
    return out


def test_sources_cover_what_the_compiled_modules_import():
    sources = {str(f.relative_to(PACKAGE)) for f in caching.source_files()}
    missing = {}
    for rel in sorted(sources):
        for dep in _imports(PACKAGE / rel) - sources - set(NOT_READ_COMPILED):
            if dep.endswith("__init__.py"):
                continue  # a package's names come from its modules, each checked where imported
            missing.setdefault(rel, []).append(dep)
    assert missing == {}, f"add these to caching.SOURCES, or to NOT_READ_COMPILED with why: {missing}"


def test_a_change_to_any_source_changes_the_stamp(tmp_path):
    (tmp_path / "replay").mkdir()
    rules = tmp_path / "rules.py"
    rules.write_text("def f(a):\n    return a\n")
    (tmp_path / "replay" / "engine.py").write_text("x = 1\n")
    before = caching.sources_stamp(tmp_path, ("replay/engine*.py", "rules.py"))
    rules.write_text("def f(a):\n    return a + 1\n")
    assert caching.sources_stamp(tmp_path, ("replay/engine*.py", "rules.py")) != before


def test_the_engine_is_stamped_with_the_rule_book_too():
    from cupool.replay import engine_heap

    own, rest = engine_heap.coalesce._cache._impl.locator.get_source_stamp()
    assert rest == caching.sources_stamp()
    assert "core/rules.py" in {str(f.relative_to(PACKAGE)) for f in caching.source_files()}


def test_one_cache_whichever_path_imports_the_file(tmp_path, monkeypatch):
    """An editable install imports each file as ``src/cupool/...`` from elsewhere and as ``cupool/...``
    inside the checkout (``src/cupool`` is a link): both must find the same cache entries, or the
    engine compiles once per path (40 s each; found running ``cupool replay`` outside the checkout
    after the tests had filled the cache inside it)."""
    real = tmp_path / "pkg"
    (real / "replay").mkdir(parents=True)
    (real / "replay" / "engine.py").write_text("def f(a):\n    return a\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "pkg").symlink_to(real, target_is_directory=True)
    linked = tmp_path / "src" / "pkg"

    monkeypatch.setattr(caching.numba.config, "CACHE_DIR", str(tmp_path / "cache"))
    locator = next(c for c in caching._OutOfTreeCacheImpl._locator_classes if "UserProvided" in c.__name__)  # noqa: SLF001

    def f(a):
        return a

    paths = {locator(f, str(base / "replay" / "engine.py")).get_cache_path() for base in (real, linked)}
    assert len(paths) == 1
    assert caching.sources_stamp(real, ("replay/*.py",)) == caching.sources_stamp(linked, ("replay/*.py",))
