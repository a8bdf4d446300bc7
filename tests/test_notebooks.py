"""Every notebook in notebooks/ runs top to bottom on the sim device, in a real Jupyter kernel, and reads well.

Notebooks are kept with outputs cleared, so diffs stay readable and nothing
stale is shipped; that is checked too.  Each executed notebook is checked as a
reader sees it: it writes nothing into the folder it runs in (a user's clone),
every figure has a title and no legend over its lines or bars, no stray
``<matplotlib...>`` object is printed, and it renders to HTML with nbconvert
(as CI does) with every figure in it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

NEEDS = "the notebook tests need the test extra: pip install '.[test]' in cupool's checkout"
nbformat = pytest.importorskip("nbformat", reason=NEEDS)
pytest.importorskip("nbclient", reason=NEEDS)
from nbclient import NotebookClient  # noqa: E402
from nbclient.exceptions import CellExecutionError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

#: Run first in the kernel: notes every figure matplotlib draws (inline output, or a file): its titles, and
#: how many points of its lines, and how many bars, lie under its legends.
_PROBE = r'''
import json as _probe_json
import numpy as _probe_np
from matplotlib.backend_bases import FigureCanvasBase as _ProbeCanvas

_probe_drawn = []
_probe_print = _ProbeCanvas.print_figure


def _probe_covered(ax):
    legend = ax.get_legend()
    if legend is None:
        return 0
    box = legend.get_window_extent()
    n = 0
    for line in ax.lines:
        xy = line.get_transform().transform(_probe_np.asarray(line.get_xydata(), float))
        n += int(((xy[:, 0] > box.x0) & (xy[:, 0] < box.x1) & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1)).sum())
    n += sum(bool(patch.get_window_extent().overlaps(box)) for patch in ax.patches)
    return n


def _probe_print_figure(self, *args, **kwargs):
    out = _probe_print(self, *args, **kwargs)
    fig = self.figure
    fig.draw_without_rendering()
    _probe_drawn.append({
        "suptitle": fig.get_suptitle() if hasattr(fig, "get_suptitle") else (fig._suptitle.get_text() if fig._suptitle else ""),
        "titles": [ax.get_title() for ax in fig.axes if ax.get_visible()],
        "covered": [_probe_covered(ax) for ax in fig.axes],
    })
    return out


_ProbeCanvas.print_figure = _probe_print_figure
'''
_REPORT = "print(_probe_json.dumps(_probe_drawn))"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"


def _execute(path: Path, folder: Path) -> tuple[nbformat.NotebookNode, list[dict]]:
    """The notebook run in ``folder`` (its working directory), and what its figures showed."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(_PROBE))
    nb.cells.append(nbformat.v4.new_code_cell(_REPORT))
    client = NotebookClient(nb, kernel_name="python3", timeout=180, resources={"metadata": {"path": str(folder)}})
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MPLBACKEND", raising=False)  # the kernel's own inline backend, as a user has
        # The kernel runs in an empty folder: without this it would import whichever cupool is installed.
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        try:
            client.execute()
        except CellExecutionError as e:
            pytest.fail(f"{path.name} failed:\n{e}")
    drawn = json.loads(nb.cells[-1].outputs[0]["text"])
    del nb.cells[0], nb.cells[-1]
    return nb, drawn


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Each notebook run once, in an empty folder of its own: (folder, notebook, figures)."""
    runs: dict[Path, tuple[Path, nbformat.NotebookNode, list[dict]]] = {}

    def run(path: Path) -> tuple[Path, nbformat.NotebookNode, list[dict]]:
        if path not in runs:
            folder = tmp_path_factory.mktemp(path.stem)
            runs[path] = (folder, *_execute(path, folder))
        return runs[path]

    return run


def _results(nb) -> list[str]:
    return [o["data"].get("text/plain", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o["output_type"] == "execute_result"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_reads_well(path, tmp_path, executed):
    folder, nb, drawn = executed(path)
    assert sorted(p.name for p in folder.iterdir()) == [], "the notebook wrote into the folder it runs in"
    for i, fig in enumerate(drawn):
        assert fig["suptitle"] or all(fig["titles"]), f"{path.name}: figure {i} has an untitled plot: {fig}"
        assert not any(fig["covered"]), f"{path.name}: figure {i}: a legend covers its lines or bars: {fig}"
    stray = [r for r in _results(nb) if re.match(r"\[?<matplotlib|Text\(|\(-?[0-9.]+, -?[0-9.]+\)$", r)]
    assert not stray, f"{path.name}: stray outputs {stray}"
    long_floats = [r for r in _results(nb) if re.search(r"\d\.\d{6,}", r)]
    assert not long_floats, f"{path.name}: unrounded floats in {long_floats}"

    nbconvert = pytest.importorskip("nbconvert", reason="rendering to HTML needs the test extra (nbconvert)")
    html, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    figures = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', html)) == figures > 0 or figures == 0
    assert "Traceback" not in html and nb.cells[0].source.splitlines()[0].lstrip("# ") in html
    (tmp_path / f"{path.stem}.html").write_text(html)  # for a person to look at: pytest keeps recent tmp dirs


def test_quickstart_shows_its_holes(executed):
    """The segment map's holes are wide enough to see: the 2 MiB segment of small blocks alternates."""
    _, nb, _ = executed(next(p for p in NOTEBOOKS if p.name == "01-quickstart.ipynb"))
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("small = "))
    svg = next(o["data"]["text/html"] for o in cell.outputs if "text/html" in o.get("data", {}))
    rows: dict[str, list[tuple[float, float]]] = {}  # a bar's blocks; free space is the bar showing between them
    for x, y, w, h in re.findall(r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)"', svg):
        rows.setdefault(round(float(y) + float(h)), []).append((float(x), float(w)))  # pieces stand on the bar's foot
    holes = []
    for bar, *blocks in rows.values():  # the first rect of a row is its segment's whole bar
        blocks.sort()
        holes += [b[0] - (a[0] + a[1]) for a, b in zip(blocks, blocks[1:])]
    assert len([h for h in holes if h >= 40]) >= 2, holes  # on a 640 px bar: 256 KiB of 2 MiB is 80 px
