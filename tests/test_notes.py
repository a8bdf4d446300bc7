"""Named Notes: each is written once, beside the code it governs, and every citation finds it.

A Note is written as PyTorch writes them, a title ``Note [Name]`` underlined with ``~``
(in a module's docstring); anything else that says ``Note [Name]`` cites it.
docs/design.md keeps the index: one row per Note, naming the file that holds it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFINITION = re.compile(r"^\s*(?:#\s*)?Note \[([^\]]+)\]\s*\n\s*(?:#\s*)?(~{3,})\s*$", re.M)
CITATION = re.compile(r"Note \[([^\]]+)\]")
INDEX_ROW = re.compile(r"^\| \[([^\]]+)\] \| `([^`]+)` \|", re.M)


def _sources() -> list[Path]:
    files = [*(ROOT / "cupool").rglob("*.py"), *(ROOT / "cupool").rglob("*.pxd"), *(ROOT / "cupool").rglob("*.pyx"),
             *(ROOT / "cupool").rglob("*.cpp"), *(ROOT / "kernels").rglob("*.py"),
             *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"),
             ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    here = Path(__file__).resolve()
    return sorted({p.resolve() for p in files if "__pycache__" not in p.parts} - {here})


def _definitions() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in _sources():
        for m in DEFINITION.finditer(path.read_text()):
            name, underline = m.group(1), m.group(2)
            assert len(underline) >= len(f"Note [{name}]"), f"{path}: Note [{name}]'s underline is short"
            out.setdefault(name, []).append(path.relative_to(ROOT.resolve()).as_posix())
    return out


def test_every_note_is_written_once():
    defs = _definitions()
    assert len(defs) >= 11
    twice = {name: where for name, where in defs.items() if len(where) > 1}
    assert not twice, f"Notes written in more than one place: {twice}"


def test_every_cited_note_exists():
    defs = _definitions()
    missing = []
    for path in _sources():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for name in CITATION.findall(line):
                if name not in defs and name != "Name":  # "Note [Name]": how a Note is written
                    missing.append(f"{path.relative_to(ROOT.resolve())}:{lineno}: Note [{name}]")
    assert not missing, "cited but written nowhere:\n" + "\n".join(missing)


def test_the_design_index_lists_every_note_where_it_is():
    defs = _definitions()
    rows = dict(INDEX_ROW.findall((ROOT / "docs" / "design.md").read_text()))
    assert set(rows) == set(defs), f"index {sorted(rows)} vs written {sorted(defs)}"
    for name, path in rows.items():
        assert defs[name] == [path], f"Note [{name}] is indexed in {path} but written in {defs[name]}"


def test_a_note_beside_code_is_found_and_a_broken_citation_is_not(tmp_path):
    """The checker itself: a misspelt citation is caught (the test above would fail on it)."""
    text = '"""Doc.\n\nNote [Example]\n~~~~~~~~~~~~~~\nBody.\n"""\n# see Note [Exampel]\n'
    assert [m.group(1) for m in DEFINITION.finditer(text)] == ["Example"]
    assert CITATION.findall(text) == ["Example", "Exampel"]
