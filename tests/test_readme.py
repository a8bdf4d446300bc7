"""Every Python snippet in README.md runs, as a user would run it (issue 20 #6).

Each fenced ``python`` block (indented ones in lists too) is written to a file and
run by a fresh interpreter in an empty folder, so no snippet leans on another's
names, on this test session's state (default pools, an installed allocator), or
on files in the clone.  A block with ``if __name__ == "__main__":`` is a script
(the Dask one: worker processes are spawned and import the main module again)
and runs as ``python snippet.py``; any other block runs through a small driver
that also runs the hypothesis state machines it defines (``X.TestCase``), with
few examples, so a machine shown in the README is exercised, not just defined.

A block that cannot run here says so in an HTML comment on the line before it,
which the README does not render: ``<!-- readme-test: gpu -->`` runs only where
a CUDA GPU is usable and is skipped, saying why, elsewhere.  An unknown marker
fails, so a typo cannot skip a snippet quietly.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import cupool
from cupool import demo, workloads
from cupool.device import cuda_available

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)[ ]*\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
MARKER = re.compile(r"^\s*<!--\s*readme-test:\s*(?P<what>.*?)\s*-->\s*$")
MARKERS = {"gpu": "needs a CUDA GPU (none is usable on this machine)"}
SCRIPT = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.M)
TIMEOUT_S = 240  # the Dask snippet starts a two-worker cluster; the rest take seconds
#: What a snippet's output must show, by section: the README says it happens, so check that it does.
SHOWS = {
    "Movable buffers and compaction": r"moved 0x[0-9a-f]+ -> 0x[0-9a-f]+\n1 8388608 1\n",  # on_move fired
    "Memory pressure, leaks and alerts": r"^False\nDecision\(step='spill', .*bytes_freed=67108864",
    "Looking at a pool": r"^12582912 12582912\n",
}
if not cuda_available():
    SHOWS["Without a GPU"] = r"cudaErrorInsufficientDriver"

DRIVER = '''
import runpy, sys, unittest
from hypothesis import HealthCheck, settings

namespace = runpy.run_path(sys.argv[1])
cases = [v for v in namespace.values() if isinstance(v, type) and issubclass(v, unittest.TestCase)]
small = settings(max_examples=5, stateful_step_count=10, deadline=None, suppress_health_check=list(HealthCheck))
for case in cases:
    case.settings = small  # hypothesis' state machines read their settings here
suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(c) for c in cases)
result = unittest.TextTestRunner(stream=sys.stderr, verbosity=2).run(suite)
sys.exit(0 if result.wasSuccessful() else 1)
'''


@dataclass(frozen=True)
class Snippet:
    line: int  # of the opening fence, 1-based
    section: str  # the heading it sits under
    marker: str  # what the comment before it says ("" for none)
    code: str

    @property
    def script(self) -> bool:
        return bool(SCRIPT.search(self.code))


def snippets(text: str) -> list[Snippet]:
    """The README's fenced python blocks, each with its line, section and marker."""
    found = []
    for m in FENCE.finditer(text):
        if m.group("lang") != "python":
            continue
        before = text[: m.start()].rstrip("\n").splitlines()
        marked = MARKER.match(before[-1]) if before else None
        headings = [ln for ln in before if ln.startswith("#")]
        found.append(Snippet(
            line=text.count("\n", 0, m.start()) + 1,
            section=headings[-1].lstrip("# ") if headings else "",
            marker=marked.group("what") if marked else "",
            code=textwrap.dedent(m.group("body")),
        ))
    return found


SNIPPETS = snippets(README.read_text())


def test_the_snippets_are_found_with_their_markers():
    """The extraction itself: indented blocks, markers, scripts; and the README's sections still have theirs."""
    text = (
        "# A\n```python\nx = 1\n```\n\n## B\n<!-- readme-test: gpu -->\n```python\ny = 2\n```\n"
        "- item\n\n  ```python\n  z = 3\n  ```\n```bash\nls\n```\n"
        '```python\nif __name__ == "__main__":\n    pass\n```\n'
    )
    got = snippets(text)
    assert [(s.line, s.section, s.marker, s.code, s.script) for s in got] == [
        (2, "A", "", "x = 1\n", False),
        (8, "B", "gpu", "y = 2\n", False),
        (13, "B", "", "z = 3\n", False),
        (19, "B", "", 'if __name__ == "__main__":\n    pass\n', True),
    ]
    sections = {s.section for s in SNIPPETS}
    for name in ("A short tour", "Without a GPU", "Movable buffers and compaction", "Dask",
                 "Stress-testing your code with hypothesis", "Traces, replay and reports"):
        assert name in sections, f"no python snippet found under {name!r}"
    assert [s.section for s in SNIPPETS if s.script] == ["Dask"]


def test_the_two_set_up_commands_are_unchanged():
    """The README's promise to a fresh machine: exactly these two commands."""
    bash = [m.group("body").strip() for m in FENCE.finditer(README.read_text()) if m.group("lang") == "bash"]
    assert bash[:2] == ["pip install . && cupool demo", 'pip install -e ".[test,cuda12]" && python -m pytest -q']


def _run_snippet(snippet: Snippet, folder: Path) -> subprocess.CompletedProcess[str] | str:
    """``snippet`` run by a fresh interpreter in the empty ``folder``; its process, or why it did not end."""
    path = folder / "snippet.py"
    path.write_text(snippet.code)
    if snippet.script:
        argv = [sys.executable, str(path)]
    else:
        (folder / "driver.py").write_text(DRIVER)
        argv = [sys.executable, str(folder / "driver.py"), str(path)]
    env = {k: v for k, v in os.environ.items() if k != "CUPOOL_CONF"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))  # this checkout's cupool
    try:
        return subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return f"README line {snippet.line} ({snippet.section}) ran over {TIMEOUT_S} s:\n{e.stderr}"


def _runs_here(snippet: Snippet) -> bool:
    return not snippet.marker or (snippet.marker in MARKERS and (snippet.marker != "gpu" or cuda_available()))


@pytest.fixture(scope="module")
def snippet_runs(request, tmp_path_factory) -> dict[int, subprocess.CompletedProcess[str] | str]:
    """Every selected snippet that runs here, two at a time (each in its own process and empty folder, as
    before: the test run's own process waits on them, so the second core would otherwise idle), by line."""
    chosen = [item.callspec.params["snippet"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_the_snippet_runs" and item.module is request.module]
    chosen = [s for s in chosen if _runs_here(s)]
    folders = [tmp_path_factory.mktemp(f"line{s.line}") for s in chosen]
    with ThreadPoolExecutor(2) as workers:
        return dict(zip([s.line for s in chosen], workers.map(_run_snippet, chosen, folders)))


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"line{s.line}" for s in SNIPPETS])
def test_the_snippet_runs(snippet: Snippet, snippet_runs) -> None:
    if snippet.marker:
        assert snippet.marker in MARKERS, f"README line {snippet.line - 1}: unknown marker {snippet.marker!r}"
        if snippet.marker == "gpu" and not cuda_available():
            pytest.skip(f"README line {snippet.line}: {MARKERS['gpu']}")
    done = snippet_runs[snippet.line]
    if isinstance(done, str):
        pytest.fail(done)
    assert done.returncode == 0, (
        f"README line {snippet.line} ({snippet.section}) failed:\n{snippet.code}\n--- stderr:\n{done.stderr[-4000:]}"
    )
    shows = SHOWS.get(snippet.section)
    if shows is not None:
        assert re.search(shows, done.stdout, re.M), (
            f"README line {snippet.line} ({snippet.section}) printed {done.stdout!r}, which does not show {shows!r}"
        )


# ------------------------------------------------------------------ the demo's table
#: The README's demo table: its columns, by the demo's names for them.
DEMO_COLUMNS = {"source (PyTorch)": "source", "plain segments, compaction off": "plain, off",
                "defaults, compaction off": "off", "defaults, compaction on": "on"}
DEMO_STEPS, DEMO_SEED = 200, 0  # `cupool demo`'s defaults, which the README's table shows


def _markdown_table(section: str) -> list[list[str]]:
    """The first table in ``section`` of the README: its rows (header first), cells stripped of bold."""
    text = README.read_text()
    body = text[text.index(f"\n## {section}\n"):]
    body = body[:body.index("\n## ", 1)]
    rows = [ln for ln in body.splitlines() if ln.startswith("|")]
    assert rows, f"no table in the README's section {section!r}"
    return [[c.strip().replace("**", "") for c in ln.strip().strip("|").split("|")] for ln in rows if "---" not in ln]


def _smallest_devices(shapes: list[tuple[int, int]], ratios: dict[str, str]) -> dict[str, int]:
    """``demo.smallest_devices(shapes)``, found cheaply where the README's ratios (``{setting: "1.05×"}``) hold.

    The demo bisects each setting's least capacity over [live peak, 4x the live peak] in ``demo.STEP`` steps,
    about eleven runs a setting, and success is monotone in the capacity (the demo relies on that).  So the
    least capacity prints the README's ratio exactly when the run completes at the largest capacity printing
    it and fails just below the smallest one (or that is below where the demo's search starts); the least
    capacity is then found by bisecting those few capacities.  Where a ratio does not hold, the demo's own
    search runs, so that the comparison shows what it prints.
    """
    live = workloads.peak_live_bytes(shapes)
    first, last = -(-live // demo.STEP), 4 * live // demo.STEP  # the demo's first search, in steps
    found = {}
    for name, pool_kw, kw in demo.SETTINGS:
        ratio = ratios.get(name, "").rstrip("×")
        steps = [k for k in range(first, last + 1) if f"{k * demo.STEP / live:.2f}" == ratio]

        def make(capacity: int, pool_kw: dict = pool_kw) -> cupool.Pool:
            return cupool.Pool("sim", capacity=capacity, **pool_kw)

        least = steps and workloads.smallest_capacity(make, shapes, steps[0] * demo.STEP, steps[-1] * demo.STEP,
                                                      demo.STEP, **kw)
        below = (steps[0] - 1) * demo.STEP if steps else 0
        if not least or (steps[0] > first and workloads.smallest_capacity(make, shapes, below, below, demo.STEP,
                                                                             **kw) is not None):
            return demo.smallest_devices(shapes)
        found[name] = least
    return found


def _demo_output(ratios: dict[str, str]) -> str:
    """What ``cupool demo --device sim`` prints above its streaming table, computed in this process.

    The demo's own functions with its arguments (sim, its default capacity, steps and seed), which are the
    figures it prints; only the streaming table and the check of the capacity (which change none of these) are
    left out, and the smallest devices are found from the README's ratios (``_smallest_devices``), to keep this
    quick.
    """
    def make(**pool_kw):
        return cupool.Pool("sim", **pool_kw)

    shapes = workloads.mixed_shapes(DEMO_STEPS, seed=DEMO_SEED)
    rows = [demo.mixed_run(make(**pool_kw), name, shapes, kw) for name, pool_kw, kw in demo.SETTINGS]
    smallest = _smallest_devices(shapes, ratios)
    for row in rows:
        row.smallest = smallest[row.name]
    first = make()
    result = demo.DemoResult(first.device.name, True, bool(first.config["expandable_segments"]),
                             demo.ten_steps(make), DEMO_STEPS, DEMO_SEED, shapes,
                             workloads.peak_live_bytes(shapes), rows, table=[])
    return demo.format_result(result)


def _printed_figures(out: str) -> dict[str, dict[str, str]]:
    """The README's cells as the demo's output gives them: {row label: {column name: cell}}."""
    names = ["source", *(name for name, _, _ in demo.SETTINGS)]
    summary = {}
    for which in ("max", "mean"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"  {which} fragmentation"))
        summary[which] = dict(zip(names, line.split()[2:], strict=True))
    figures = {"ten steps: max / mean fragmentation": {n: f"{summary['max'][n]} / {summary['mean'][n]}" for n in names}}
    mixed = f"{DEMO_STEPS} mixed layers: "
    row = re.compile(r"^  (?P<name>.+?)\s+(?P<max>\d\.\d{3})\s+(?P<mean>\d\.\d{3})\s+\d+ MiB \((?P<reserved>[\d.]+)x\)"
                     r"\s+(?P<allocs>\d+)\s+\d+ MiB \((?P<smallest>[\d.]+)x\)$", re.M)
    found = {m["name"]: m for m in row.finditer(out)}
    assert sorted(found) == sorted(names[1:]), out
    for label, cell in (("max / mean fragmentation", "{max} / {mean}"), ("peak reserved / live peak", "{reserved}×"),
                        ("smallest device / live peak", "{smallest}×"), ("device allocations", "{allocs}")):
        figures[mixed + label] = {"source": "", **{n: cell.format(**found[n].groupdict()) for n in names[1:]}}
    return figures


def test_the_demo_table_is_what_the_demo_prints():
    """Issue 28: the README's table showed figures (0.222 / 0.026, 1.30x, 189) that `cupool demo` no longer printed."""
    head, *rows = _markdown_table("The demo")
    assert [DEMO_COLUMNS.get(c) for c in head[1:]] == list(DEMO_COLUMNS.values()), head
    readme = {r[0]: dict(zip(DEMO_COLUMNS.values(), r[1:], strict=True)) for r in rows}
    out = _demo_output(readme.get(f"{DEMO_STEPS} mixed layers: smallest device / live peak", {}))
    assert readme == _printed_figures(out), out
    assert "'plain, off' reproduces the source's fragmentation and segments at every step." in out
