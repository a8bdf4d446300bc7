"""What a check returns and what it is given: the records the runner and the report share.

A check is a function ``Context -> Result``.  Keeping the record plain (no
methods that run anything) is what lets the report writer be tested with made-up
results, and the checks without a report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..device.kinds import KINDS

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass
class Table:
    """Rows side by side (pass counts, benchmark variants); cells are rendered with ``str`` or as numbers."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]] = field(default_factory=list)


@dataclass
class Result:
    """One check's outcome.  ``figures`` are numbers measured in this run (ratios included);
    ``summary`` is the one line the report's overview shows."""

    status: str
    summary: str = ""
    details: str = ""
    commands: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    name: str = ""
    title: str = ""
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in (PASSED, FAILED, SKIPPED):
            raise ValueError(f"status must be {PASSED}, {FAILED} or {SKIPPED}, got {self.status!r}")

    def named(self, name: str, title: str, seconds: float) -> Result:
        return dataclasses.replace(self, name=name, title=title, seconds=seconds)


def skipped(reason: str) -> Result:
    return Result(SKIPPED, summary=reason, details=reason)


@dataclass
class Context:
    """What every check may use.

    ``device`` is a kind of ``cupool.device.kinds``: ``"cuda"`` for the real run, or
    a kind that needs no GPU (``"sim"``) to rehearse the checks that mean something
    there (``rehearsal``).  Files a check leaves for later
    (a trace) go to ``workdir`` with the report's ``stem``.  ``tests`` is the
    test suite's folder, None when cupool was installed without it.
    ``passing_paths`` is filled by the CuPy workload check with the hook paths
    whose results matched CuPy's pool bit for bit, for the hook benchmark to
    choose among.
    """

    device: str = "cuda"
    workdir: Path = field(default_factory=Path.cwd)
    stem: str = "gpu-validation"
    tests: Path | None = None
    quick: bool = False
    timeout: float = 300.0
    passing_paths: tuple[str, ...] | None = None

    @property
    def rehearsal(self) -> bool:
        """A run on a kind that needs no GPU: the checks that mean something there, as a rehearsal."""
        return not KINDS[self.device].needs_gpu

    def file(self, suffix: str) -> Path:
        """A file beside the report: ``<workdir>/<stem><suffix>``."""
        return self.workdir / f"{self.stem}{suffix}"
