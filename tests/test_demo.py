"""``cupool demo`` refuses what it cannot run before it prints anything (issue 20 #2)."""

from __future__ import annotations

import re

import pytest

from cupool import demo
from cupool.cli import main


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be at least 1 (layers in the longer run), got 0"),
    (["--steps", "-5"], "--steps must be at least 1 (layers in the longer run), got -5"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
])
def test_bad_arguments_are_one_line_before_any_output(capsys, argv, message):
    assert main(["demo", "--device", "sim", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"cupool: error: {message}\n"


def test_a_device_too_small_says_what_would_fit(capsys):
    assert main(["demo", "--device", "sim", "--capacity", "64MiB", "--steps", "20"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    m = re.fullmatch(r"cupool: error: --capacity 64 MiB is too small for the demo with --steps 20 --seed 0: it needs "
                     r"at least (\d+) MiB \(give --capacity (\d+)MiB or more\)\n", err)
    assert m and m[1] == m[2], err
    need = int(m[1])
    assert need > 64 and (need << 20) % demo.STEP == 0
    # What it names does fit: the whole demo runs there.
    assert main(["demo", "--device", "sim", "--capacity", f"{need}MiB", "--steps", "20"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cupool demo: weight streaming on sim") and "extreme" in out

