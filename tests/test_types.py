"""cupool's annotations hold: ``mypy cupool`` passes with the project's configuration.

The configuration is ``[tool.mypy]`` in pyproject.toml: strict for ``cupool.core`` and
``cupool.device``, the default checks elsewhere.  mypy keeps its cache in ``.mypy_cache``
at the repository root, so a second run takes a few seconds.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_says_it_is_typed():
    # PEP 561: without the marker, type checkers ignore an installed package's annotations.
    assert (ROOT / "cupool" / "py.typed").is_file()


@pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="mypy is not installed (it comes with the test extra)"
)
def test_mypy_passes():
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "cupool"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, f"mypy cupool failed (exit {run.returncode}):\n{run.stdout}{run.stderr}"


# --------------------------------------------------- what a user's type checker sees (issue 20 #7)
NEEDS_MYPY = pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="mypy is not installed (it comes with the test extra)"
)
USER_CODE = '''
import numpy as np

import cupool


def run() -> int:
    pool = cupool.Pool("sim", capacity="64MiB")
    a = pool.malloc(1 << 20)
    size: int = a.size
    a.free()
    return size + cupool.memory_allocated()
'''
#: What the README's editable install needs of the tree: the rest (tests, docs, notebooks) stays behind.
_NOT_COPIED = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", ".mypy_cache", ".pytest_cache", ".hypothesis", "__pycache__",
    "*.so", "*.source-sha256", "*.build-error", "*.h5", ".venv*", "tests", "docs", "notebooks", "benchmarks",
)


#: A user's environment: no search path of this test run's (PYTHONPATH, MYPYPATH) leaks into it.
_USER_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}


@pytest.fixture(scope="module")
def user_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for this module's user files: each run outside the checkout's cache reads typeshed and
    numpy's stubs afresh, most of a cold run's time.  mypy keys its cache entries by module, file and options,
    so a run never reuses another's results for cupool read from elsewhere or under other flags."""
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True, timeout=600, check=False,
        env=_USER_ENV if env is None else env,
    )


@NEEDS_MYPY
def test_an_editable_install_is_visible_to_mypy_strict(tmp_path: Path, user_cache: Path) -> None:
    """``pip install -e .`` as the README does it, into a fresh venv, then ``mypy --strict`` on a user's file."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=_NOT_COPIED)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)  # this environment's pip installs into it (pip --python)
    python = env_dir / "bin" / "python"
    # The dependencies (and setuptools, for an offline build) come from this environment, as a plain path:
    # its own .pth files, this checkout's editable install among them, are not read through it.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=_USER_ENV,
    ).stdout.strip()
    here = [p for p in sys.path if p.endswith("site-packages")]
    # Without Cython, as most users install: the build leaves the fast path uncompiled (setup.py says so),
    # which spares this test half a minute of compiling that has nothing to do with what it checks.
    no_cython = tmp_path / "no-cython" / "Cython"
    no_cython.mkdir(parents=True)
    (no_cython / "__init__.py").write_text("raise ImportError('Cython is hidden from this test install')\n")
    Path(site, "deps.pth").write_text("\n".join([str(no_cython.parent), *here]) + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-build-isolation",
         "--no-index", "-e", str(repo)],
        capture_output=True, text=True, timeout=600, check=False, env=_USER_ENV,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    (tmp_path / "app.py").write_text(USER_CODE)
    run = _mypy(["--strict", "--python-executable", str(python), "--cache-dir", str(user_cache), "app.py"],
                tmp_path)
    assert run.returncode == 0, f"mypy --strict on a user's file:\n{run.stdout}{run.stderr}"


REVEALS = '''
import numpy as np

import cupool

pool = cupool.Pool("sim", capacity="64MiB")
reveal_type(pool.empty((4,), np.float32))
reveal_type(pool.movable(1 << 20).array((4,), np.float32))
reveal_type(pool.record())
reveal_type(cupool.PinnedPool("sim").empty((4,)))
'''
#: What a user's mypy should see, in REVEALS' order (regular expressions over mypy's "Revealed type is").
REVEALED = (
    r"cupool\.core\.handles\.DeviceArray",  # numpy's on sim, CuPy's on CUDA: what both have
    r"cupool\.core\.handles\.DeviceArray",
    r"cupool\.trace\.recorder\.EventRecorder",
    r"numpy\.ndarray\[.*\]",  # pinned memory is host memory: always numpy
)


@NEEDS_MYPY
def test_the_pools_arrays_and_recorder_have_real_types(tmp_path: Path, user_cache: Path) -> None:
    """``reveal_type`` in a user's ``mypy --strict`` run, cupool read from this checkout's source."""
    (tmp_path / "app.py").write_text(REVEALS)
    env = dict(_USER_ENV, MYPYPATH=str(ROOT))
    run = _mypy(["--strict", "--follow-imports=silent", "--cache-dir", str(user_cache), "app.py"],
                tmp_path, env)
    revealed = [line.split("Revealed type is ", 1)[1].strip('"') for line in run.stdout.splitlines()
                if "Revealed type is" in line]
    assert len(revealed) == len(REVEALED), run.stdout + run.stderr
    for got, want in zip(revealed, REVEALED):
        assert re.fullmatch(want, got), f"revealed {got!r}, wanted {want!r}:\n{run.stdout}"


# --------------------------------------------------- stats() is typed key by key (issue 28)
STATS_CODE = '''
import cupool


def peaks(pool: cupool.Pool) -> tuple[int, float, int]:
    stats = pool.stats()
    peak: int = stats["allocated_bytes.all.peak"]
    fragmentation: float = stats["fragmentation"]
    mapped: int = stats.get("expandable.mapped_bytes", 0)
    return peak, fragmentation, mapped
'''
#: What ``mypy --strict`` must refuse of the same dict: a ratio is not an int, and a key must exist.
STATS_WRONG = '''
import cupool

pool = cupool.Pool("sim", capacity="64MiB")
ratio: int = pool.stats()["cache_hit_rate"]
typo = pool.stats()["allocated_bytes.all.peek"]
'''


@NEEDS_MYPY
def test_a_stats_figure_is_an_int_to_mypy_strict(tmp_path: Path, user_cache: Path) -> None:
    """``peak: int = pool.stats()[...]`` failed ``mypy --strict`` while stats() was ``dict[str, int | float]``."""
    env = dict(_USER_ENV, MYPYPATH=str(ROOT))
    (tmp_path / "good.py").write_text(STATS_CODE)
    (tmp_path / "bad.py").write_text(STATS_WRONG)
    args = ["--strict", "--follow-imports=silent", "--cache-dir", str(user_cache)]
    good = _mypy([*args, "good.py"], tmp_path, env)
    assert good.returncode == 0, f"mypy --strict on stats() figures:\n{good.stdout}{good.stderr}"
    bad = _mypy([*args, "bad.py"], tmp_path, env)
    assert 'expression has type "float", variable has type "int"' in bad.stdout, bad.stdout
    assert '"allocated_bytes.all.peek"' in bad.stdout, bad.stdout


@pytest.mark.parametrize("config", [
    {"expandable_segments": False},
    {"expandable_segments": True},
    {"expandable_segments": False, "spill": "host"},
    {"expandable_segments": True, "spill": "host"},
    {"expandable_segments": False, "upstream": "managed"},
    {"expandable_segments": False, "upstream": "async"},
], ids=["plain", "expandable", "spill", "expandable-spill", "managed", "async"])
def test_the_stats_type_names_exactly_the_keys_stats_returns(config):
    """The ``Stats`` TypedDict is written out key by key; this keeps it equal to what the pool really returns."""
    import cupool
    from cupool.core.figures import ExpandableStats, Stats, UpstreamStats

    pool = cupool.Pool("sim", capacity="64MiB", **config)
    a = pool.malloc(3 << 20)
    stats = pool.stats()
    assert type(stats) is dict  # a plain dict at run time
    upstream = config.get("upstream")
    optional = {k for k in UpstreamStats.__optional_keys__ if upstream and k.startswith(f"{upstream}.")}
    if upstream == "managed":
        optional |= {"num_prefetches", "num_prefetches_skipped"}
    if config["expandable_segments"]:
        optional |= ExpandableStats.__optional_keys__
    assert set(stats) == Stats.__required_keys__ | optional
    hints = Stats.__annotations__
    assert {k: type(v).__name__ for k, v in stats.items()} == {k: hints[k].__name__ for k in stats}
    del a
