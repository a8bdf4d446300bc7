"""cupool's annotations hold: ``mypy cupool`` passes with the project's configuration.

The configuration is ``[tool.mypy]`` in pyproject.toml: strict for ``cupool.core`` and
``cupool.device``, the default checks elsewhere.  mypy keeps its cache in ``.mypy_cache``
at the repository root, so a second run takes a few seconds.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
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
