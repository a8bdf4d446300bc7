"""What an installed cupool holds, and what running it leaves beside it.

The README's two commands, ``pip install . && cupool demo`` and then
``pip install -e ".[test,cuda12]"``, once broke ``import cupool`` when run in that
order in one environment: the demo's Numba cache files, which pip had not
installed and so did not uninstall, kept ``site-packages/cupool/kernels/__pycache__``
alive, and that ``site-packages/cupool``, without ``__init__.py``, was a namespace
package that shadowed the editable install.  These tests hold each link of that
chain; ``.ci/run`` runs the two commands themselves, in that order, in a fresh
environment (a second environment here would take minutes).

The wheel is built as ``pip install .`` builds it (with build isolation, so the
build requirements come from the package index); without an index the build test
is skipped.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _source_files() -> set[str]:
    """Every module of the source tree, by the path it must have in the wheel."""
    out = {p.relative_to(ROOT).as_posix() for p in (ROOT / "cupool").rglob("*.py")}
    out |= {f"cupool/kernels/{p.relative_to(ROOT / 'kernels').as_posix()}" for p in (ROOT / "kernels").rglob("*.py")}
    return {p for p in out if "__pycache__" not in p}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout (the build writes build/ and egg-info beside its source)."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "setup.py"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("cupool", "kernels", "src"):  # src/cupool and cupool/kernels are links: kept as links
        shutil.copytree(ROOT / name, src / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.source-sha256", "*.build-error"))
    # What the wheel holds is under test here, not the speed of its compiled modules: -O0 builds them ~4x faster.
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"), str(src)],
        check=False, capture_output=True, text=True, timeout=300, env={**os.environ, "CFLAGS": "-O0"},
    )
    if r.returncode and "No matching distribution found" in r.stdout + r.stderr:
        pytest.skip("the build requirements cannot be fetched (no package index)")
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (work / "dist").glob("cupool-*.whl")
    return whl


def test_the_wheel_holds_every_module_and_kernels_only_inside_cupool(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {n for n in names if ".dist-info/" not in n}
    missing = sorted(_source_files() - modules)
    assert not missing, f"not in the wheel (add their packages to [tool.setuptools] packages): {missing}"
    assert not {n for n in modules if n.split("/")[0] != "cupool"}, "the wheel installs something beside cupool/"
    assert not {n for n in modules if "__pycache__" in n}, "the wheel ships cache files"
    # Each compiled module ships with the source it was built from (cupool.core checks its hash at import).
    assert {"cupool/core/fast.pxd", "cupool/hooks/cupy_memory.pyx"} <= modules
    built = [n for n in modules if n.endswith(".so")]
    cc = os.environ.get("CC") or (sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc.split()[0]):  # the compiler the build would use (CC, else Python's own)
        from cupool.core import COMPILED_MODULES

        stems = {so.split(".")[0] for so in built}
        assert stems == {d.replace(".", "/") for d in COMPILED_MODULES}, f"a C compiler builds each listed module: {built}"
    for so in built:
        assert f"{so}.source-sha256" in modules, f"{so} ships without the hash of its source"
    (top,) = [n for n in names if n.endswith(".dist-info/top_level.txt")] or [None]
    if top is not None:
        assert zipfile.ZipFile(wheel).read(top).decode().split() == ["cupool"]


_RUN_INSTALLED = r"""
import importlib.util, sys
from pathlib import Path
import numpy as np
from numba.core.registry import CPUDispatcher
import cupool
target = Path(sys.argv[1]).resolve()
assert Path(cupool.__file__).resolve().is_relative_to(target), cupool.__file__
from cupool.kernels import move
import cupool.replay.engine as engine
import cupool.replay.engine_heap as engine_heap
import cupool.replay.engine_memory as engine_memory
import cupool.replay.engine_live as engine_live

z = np.zeros(2, np.int64)
for dt in (np.uint8, np.uint64):  # the sim device's moves, as the demo's compactions run them
    buf = np.arange(64, dtype=dt)
    move.move_cpu(buf, z + 8, z, z + 4)
    assert list(buf[:4]) == [8, 9, 10, 11]
compiled = {id(f): f for m in (move, engine, engine_heap, engine_memory, engine_live)
            for f in vars(m).values()
            if isinstance(f, CPUDispatcher)}.values()
for f in compiled:  # the replay engine's functions are only located here, not compiled (that takes ~55 s)
    assert hasattr(f._cache, "cache_path"), f"{f.__name__} is not cached"
    path = Path(f._cache.cache_path).resolve()
    assert not path.is_relative_to(target), f"{f.__name__} caches inside the installed package: {path}"
print(len(compiled))
"""


def test_running_an_installed_copy_writes_nothing_inside_it(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CACHE")}
    env.update(PYTHONPATH=str(target), XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", _RUN_INSTALLED, str(target)], cwd=tmp_path, env=env,
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert int(r.stdout.split()[-1]) > 30  # the move kernel and the replay engine's functions were seen
    # What pip uninstall removes: the files in RECORD and the bytecode of their modules.
    (record,) = target.glob("cupool-*.dist-info/RECORD")
    owned = set()
    for line in record.read_text().splitlines():
        path = (target / line.split(",")[0]).resolve()
        owned.add(path)
        if path.suffix == ".py":
            owned.add(Path(importlib.util.cache_from_source(str(path))).resolve())
    left = sorted(str(p.relative_to(target)) for p in (target / "cupool").rglob("*")
                  if p.is_file() and p.resolve() not in owned)
    assert not left, f"files pip uninstall would leave behind in site-packages: {left}"
    assert list((tmp_path / "cache").rglob("*.nbi")), "the move kernel was not cached in the user's cache folder"


def test_only_cupools_own_njit_asks_for_a_cache():
    """Numba's own ``cache=True`` (``njit``, ``jit``, ``cuda.jit``) caches inside the package."""
    bad = []
    for path in sorted([*(ROOT / "cupool").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        from_numba = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                      and (node.module or "").split(".")[0] == "numba" for a in node.names}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and any(k.arg == "cache" for k in node.keywords)):
                continue
            f = node.func
            root = f.value if isinstance(f, ast.Attribute) else f
            if isinstance(root, ast.Name) and (root.id == "numba" or root.id in from_numba):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"use cupool.kernels.caching.njit for cache=True: {bad}"


def test_import_cupool_from_outside_the_checkout_finds_the_package(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", "import cupool; print(cupool.__file__); print(list(cupool.__path__)); cupool.Pool"],
        cwd=tmp_path, check=False, capture_output=True, text=True, timeout=60,
    )
    if "No module named 'cupool'" in r.stderr:
        pytest.skip("cupool is not installed in this environment (the tests run from the checkout)")
    assert r.returncode == 0 and r.stdout.split("\n")[0] != "None", (
        "outside the checkout `import cupool` does not find the package; a folder "
        f"site-packages/cupool left by an earlier install may shadow it:\n{r.stdout}{r.stderr}"
    )
