"""A pytest plugin standing in for numba-cuda's repository ``conftest.py``: ``-p cupool.validate.numba_shim``.

Numba's CUDA test classes ask for a class fixture, ``initialize_from_pytest_config``,
that numba-cuda defines in the conftest of its source tree, which its wheel does
not ship; run from an installed Numba, every test of theirs errors at setup.  The
fixture only records a debugging option (dump failed FileCheck reproducers), so
this gives the same default.  A conftest that does define it wins over a plugin.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="class")
def initialize_from_pytest_config(request: Any) -> None:
    request.cls._dump_failed_filechecks = False
