"""The compiled fast path: built from its one source, chosen at import, never stale.

Each test installs a copy of the checkout with ``pip install --target`` (no build
isolation, so Cython and setuptools come from this environment: the test extra
has both), then imports it in a fresh interpreter, as a user would.  Two installs
are made for the whole module, one with the C compiler and one with ``CC=false``,
and the stale cases edit copies of the first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from cupool.core import BUILD_ERROR_SUFFIX, COMPILED_MODULES, PURE_ENV, SOURCE_HASH_SUFFIX, build_info, module_source

ROOT = Path(__file__).resolve().parent.parent
EXT = sysconfig.get_config_var("EXT_SUFFIX")
#: Every listed module written in this version (dotted), and those of cupool.core (chosen at import: the fast path).
MODULES = [d for d in COMPILED_MODULES if module_source(d) is not None]
NAMES = [d.rpartition(".")[2] for d in MODULES if d.startswith("cupool.core.")]
#: The first of them written as a ``.py`` (the same file runs uncompiled): the one the stale-build tests edit.
FIRST_PY = next((d.rpartition(".")[2] for d in MODULES if d.startswith("cupool.core.")
                 and module_source(d).suffix == ".py"), None)
MEMORY = "cupool.hooks.cupy_memory"

pytestmark = pytest.mark.skipif(not NAMES, reason="none of cupool.core's COMPILED_MODULES is written yet")

#: What a user's first run does, CuPy memory included; prints what the test reads, as JSON.
_RUN = r"""
import json, sys
import cupool, cupool.core
pool = cupool.Pool("sim", capacity="16MiB")
blocks = [pool.malloc(n) for n in (1, 100, 4096, 100_000) * 8]
del blocks
arrays = [cupool.cupy_allocator(pool)(n) for n in (1, 100, 4096) * 4]
memory = type(arrays[0].mem).__name__
del arrays
stats = pool.stats()
print(json.dumps({
    "info": cupool.core.build_info(),
    "memory": cupool.hooks.cupy.memory_path(),
    "memory_object": memory,
    "files": {d.rpartition(".")[2]: sys.modules[d].__file__ for d in cupool.core.COMPILED_MODULES
              if d.startswith("cupool.core.") and d in sys.modules},  # a .pyx uncompiled is absent
    "allocated": stats["allocated_bytes.all.current"],
    "free_index": cupool.core.heap.FreeIndex.__module__,  # Note [One compiled core]
    "cupool": cupool.__file__,
}))
"""


def _path(site: Path, dotted: str, suffix: str) -> Path:
    """Where ``dotted``'s file with ``suffix`` lies in an install at ``site``."""
    return site.joinpath(*dotted.split(".")).with_name(dotted.rpartition(".")[2] + suffix)


def _copy_checkout(dest: Path) -> Path:
    """The files ``pip install .`` reads, without build products or caches."""
    dest.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", f"*{SOURCE_HASH_SUFFIX}", f"*{BUILD_ERROR_SUFFIX}")
    for name in ("cupool", "kernels", "src"):  # src/cupool and cupool/kernels are links: kept as links
        shutil.copytree(ROOT / name, dest / name, ignore=ignore, symlinks=True)
    return dest


def _install(src: Path, target: Path, **env: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-v",
         "--target", str(target), str(src)],
        env={**os.environ, **env}, check=False, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _run(site: Path, tmp: Path, **env: str) -> tuple[dict, str]:
    """Run a short pool in a fresh interpreter that imports cupool from ``site``; (its report, its stderr)."""
    environ = {k: v for k, v in os.environ.items() if k != PURE_ENV}
    environ.update(PYTHONPATH=str(site), **env)
    r = subprocess.run([sys.executable, "-c", _RUN], cwd=tmp, env=environ,
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert Path(out["cupool"]).is_relative_to(site), out["cupool"]
    assert out["allocated"] == 0
    return out, r.stderr


def _has_compiler() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(os.environ.get("CC", cc).split()[0]) is not None


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    pytest.importorskip("Cython", reason="the test extra installs Cython, which these builds need")
    return _copy_checkout(tmp_path_factory.mktemp("build") / "src")


@pytest.fixture(scope="module")
def compiled_site(src, tmp_path_factory) -> Path:
    if not _has_compiler():
        pytest.skip("no C compiler on this machine: only the uncompiled install can be tested")
    site = tmp_path_factory.mktemp("compiled") / "site"
    _install(src, site, CFLAGS="-O0")  # what is built and chosen is under test here, not its speed: 4x faster
    return site


def test_with_a_compiler_the_install_builds_each_module_and_runs_it(compiled_site, tmp_path):
    for dotted in MODULES:  # wherever it lives: cupool/core/fast, cupool/hooks/cupy_memory
        assert _path(compiled_site, dotted, EXT).is_file()
        assert _path(compiled_site, dotted, f"{EXT}{SOURCE_HASH_SUFFIX}").is_file()
        assert not _path(compiled_site, dotted, f"{EXT}{BUILD_ERROR_SUFFIX}").exists()
    out, err = _run(compiled_site, tmp_path)
    assert out["info"]["fast_path"] == "compiled", out["info"]
    assert all(f.endswith(EXT) for f in out["files"].values()), out["files"]
    assert out["free_index"] == "cupool.core.free_index", out  # the C++ index, not the SortedList fallback
    assert out["memory"][0] == out["memory_object"] == "PoolMemory", out
    assert "uncompiled" not in err and "Warning" not in err, err


def test_the_environment_variable_forces_the_uncompiled_path(compiled_site, tmp_path):
    out, err = _run(compiled_site, tmp_path, **{PURE_ENV: "1"})
    assert out["info"] == {"fast_path": "pure", "reason": "; ".join(f"{n}: {PURE_ENV}=1" for n in NAMES)}
    assert all(f.endswith(".py") for f in out["files"].values()), out["files"]
    assert out["free_index"] == "cupool.core.heap", out
    assert out["memory"] == ["UnownedMemory", f"{PURE_ENV}=1"] and out["memory_object"] == "UnownedMemory"
    assert "uncompiled" not in err, err
    out, _ = _run(compiled_site, tmp_path, **{PURE_ENV: "0"})
    assert out["info"]["fast_path"] == "compiled" and out["memory_object"] == "PoolMemory"


@pytest.mark.parametrize("change", ["edit the source", "lose the record"])
def test_a_stale_build_is_never_used_and_says_how_to_rebuild(compiled_site, tmp_path, change):
    """As after editing a compiled module's .py in an editable install without rebuilding."""
    site = tmp_path / "site"
    shutil.copytree(compiled_site, site)
    name = FIRST_PY
    if change == "edit the source":
        with open(site / "cupool" / "core" / f"{name}.py", "a") as f:
            f.write("\n# an edit after the build\n")
    else:
        (site / "cupool" / "core" / f"{name}{EXT}{SOURCE_HASH_SUFFIX}").unlink()
    out, err = _run(site, tmp_path)
    assert out["info"]["fast_path"] == "pure" and "stale build" in out["info"]["reason"], out["info"]
    assert out["files"][name] == str(site / "cupool" / "core" / f"{name}.py")
    warnings = [line for line in err.splitlines() if "RuntimeWarning" in line]
    assert len(warnings) == 1 and "pip install" in warnings[0], err


def test_an_extension_that_does_not_import_is_not_used(compiled_site, tmp_path):
    """As with a module built for another Python: the source runs, and the warning says why."""
    site = tmp_path / "site"
    shutil.copytree(compiled_site, site)
    name = FIRST_PY
    (site / "cupool" / "core" / f"{name}{EXT}").write_bytes(b"not a shared object")
    out, err = _run(site, tmp_path)
    assert out["info"]["fast_path"] == "pure" and "does not import" in out["info"]["reason"], out["info"]
    assert out["files"][name] == str(site / "cupool" / "core" / f"{name}.py")
    assert len([line for line in err.splitlines() if "RuntimeWarning" in line]) == 1, err


@pytest.fixture(scope="module")
def plain_site(src, tmp_path_factory) -> tuple[Path, str]:
    """An install made without a C compiler, and what pip printed."""
    site = tmp_path_factory.mktemp("plain") / "site"
    r = _install(src, site, CC="false", CXX="false")
    return site, r.stdout + r.stderr


def test_without_a_compiler_the_install_succeeds_and_runs_uncompiled(plain_site, tmp_path):
    site, printed = plain_site
    assert "not compiled, cupool will run uncompiled" in printed  # said once, at install
    for dotted in MODULES:
        assert not _path(site, dotted, EXT).exists()
        assert _path(site, dotted, f"{EXT}{BUILD_ERROR_SUFFIX}").read_text().startswith("no working C compiler\n")
    out, err = _run(site, tmp_path)
    assert out["info"]["fast_path"] == "pure" and "no working C compiler" in out["info"]["reason"], out["info"]
    assert all(f.endswith(".py") for f in out["files"].values()), out["files"]
    assert out["memory_object"] == "UnownedMemory" and f"needs {MODULES[0]} compiled" in out["memory"][1], out
    assert "uncompiled" not in err, err  # not being compiled is said by build_info and `cupool info`, not at import


def test_a_stale_memory_object_is_never_used_and_the_fast_path_still_runs(compiled_site, tmp_path):
    """The CuPy memory object (a .pyx outside cupool.core) is chosen by the same rules, at its first use."""
    site = tmp_path / "site"
    shutil.copytree(compiled_site, site)
    with open(_path(site, MEMORY, ".pyx"), "a") as f:
        f.write("\n# an edit after the build\n")
    out, err = _run(site, tmp_path)
    assert out["info"]["fast_path"] == "compiled", out["info"]
    assert out["memory_object"] == "UnownedMemory" and "stale build" in out["memory"][1], out
    warnings = [line for line in err.splitlines() if "RuntimeWarning" in line]
    assert len(warnings) == 1 and "cupy_memory" in warnings[0] and "pip install" in warnings[0], err


def test_the_memory_objects_record_covers_the_fast_paths_declarations_it_cimports(compiled_site):
    """An edited fast.pxd (or any core .pxd listed before it) makes the memory object stale too: its C
    code depends on that layout."""
    record = _path(compiled_site, MEMORY, f"{EXT}{SOURCE_HASH_SUFFIX}").read_text().strip()
    earlier = COMPILED_MODULES[:COMPILED_MODULES.index(MEMORY)]
    pxds = [p for p in (_path(compiled_site, d, ".pxd") for d in earlier) if p.exists()]
    assert compiled_site / "cupool" / "core" / "fast.pxd" in pxds
    sources = [_path(compiled_site, MEMORY, ".pyx"), *pxds]
    assert record == hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()


#: Build notes a user's disk may hold (issue 28): each must make cupool fall back, saying why, never fail the import.
_BROKEN = {
    # the first listed module's note: a later one's reason is that the first runs uncompiled
    "an empty build note": ("plain", lambda site: _path(site, MODULES[0], f"{EXT}{BUILD_ERROR_SUFFIX}")
                            .write_bytes(b""), "the note is empty or unreadable"),
    "a build note not in UTF-8": ("plain", lambda site: _path(site, MODULES[0], f"{EXT}{BUILD_ERROR_SUFFIX}")
                                  .write_bytes(b"\xff\xfe not UTF-8\n"), "the note is empty or unreadable"),
    "a folder for the source's hash": ("compiled", lambda site: _folder_for(
        _path(site, "cupool.core.fast", f"{EXT}{SOURCE_HASH_SUFFIX}")), "unreadable record"),
}


def _folder_for(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("broken", list(_BROKEN))
def test_a_broken_build_note_falls_back_with_a_reason(compiled_site, plain_site, tmp_path, broken):
    which, spoil, reason = _BROKEN[broken]
    site = tmp_path / "site"
    shutil.copytree(compiled_site if which == "compiled" else plain_site[0], site)
    spoil(site)
    out, _ = _run(site, tmp_path)
    assert out["info"]["fast_path"] == "pure" and reason in out["info"]["reason"], out["info"]
    assert out["files"]["fast"] == str(site / "cupool" / "core" / "fast.py")


def test_warnings_made_errors_do_not_fail_the_import_of_a_stale_build(compiled_site, tmp_path):
    site = tmp_path / "site"
    shutil.copytree(compiled_site, site)
    with open(site / "cupool" / "core" / "fast.py", "a") as f:
        f.write("\n# an edit after the build\n")
    out, _ = _run(site, tmp_path, PYTHONWARNINGS="error")
    assert out["info"]["fast_path"] == "pure" and "stale build" in out["info"]["reason"], out["info"]


def test_build_info_and_cupool_info_say_which_path_runs(capsys):
    from cupool.cli import main

    info = build_info()
    assert info["fast_path"] in ("compiled", "pure") and info["reason"]
    assert main(["info"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fast path")]
    assert line.split()[2:] == f"{info['fast_path']} ({info['reason']})".split()
