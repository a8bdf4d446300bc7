"""A pytest plugin that keeps only the tests that need a GPU: ``pytest -p cupool.validate.gpu_only``.

A test needs a GPU when it is marked ``gpu`` or carries a ``skipif`` whose reason
says it needs one ("needs a CUDA GPU ...": the suite's ``needs_gpu`` and the
conformance suites' CUDA parameters say so).  Selecting on the reason as well as
the mark means a GPU test that was never given the mark still runs where the GPU
minutes are; a test skipped *on* a GPU ("on a GPU this would ...") is left out.
"""

from __future__ import annotations

import re
from typing import Any

_NEEDS_GPU = re.compile(r"\bneeds\b.*\bGPU\b")


def needs_gpu(item: Any) -> bool:
    if item.get_closest_marker("gpu") is not None:
        return True
    return any(_NEEDS_GPU.search(str(mark.kwargs.get("reason", ""))) for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    keep = [item for item in items if needs_gpu(item)]
    dropped = [item for item in items if not needs_gpu(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
