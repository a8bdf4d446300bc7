"""``cupool demo`` refuses what it cannot run before it prints anything (issue 20 #2), and says what it is
doing meanwhile, on a terminal and through a pipe (issue 28)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from cupool import demo, workloads
from cupool.cli import main
from cupool.device import cuda_available

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be at least 1 (layers in the longer run), got 0"),
    (["--steps", "-5"], "--steps must be at least 1 (layers in the longer run), got -5"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
])
def test_bad_arguments_are_one_line_before_any_output(capsys, argv, message):
    assert main(["demo", "--device", "sim", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"cupool: error: {message}\n"


#: A short longer run whose live peak (156 MiB) is above what the streaming table needs (128 MiB), so that
#: working out what the demo needs takes one run of the table, not a search.
SHORT = ("--steps", "6", "--seed", "28")


@pytest.fixture(scope="module")
def refused() -> tuple[str, list[int]]:
    """``cupool demo --capacity 64MiB`` with SHORT, run once: (its stderr, the capacities of the runs that wrote
    and checked their layers (``fill=True``) before the refusal)."""
    runs: list[int] = []
    streaming_run = workloads.weight_streaming

    def spy(pool, shapes, **kw):
        if kw.get("fill"):
            runs.append(pool.device.capacity)
        return streaming_run(pool, shapes, **kw)

    err, out = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        mp.setattr(workloads, "weight_streaming", spy)
        assert main(["demo", "--device", "sim", "--capacity", "64MiB", *SHORT]) == 2
    assert out.getvalue() == ""
    return err.getvalue(), runs


def _named_capacity(err: str) -> int:
    """The MiB a refusal says would fit."""
    m = re.search(r"give --capacity (\d+)MiB or more", err)
    assert m, err
    return int(m[1])


def test_a_device_too_small_says_what_would_fit(refused):
    """What it names does fit: ``test_on_a_pipe_lines_say_what_is_running_as_it_runs`` runs the whole demo there."""
    err, _ = refused
    error, = err.splitlines()  # one line: no word of progress before a refusal (issue 36 #21)
    m = re.fullmatch(r"cupool: error: --capacity 64 MiB is too small for the demo with --steps 6 --seed 28: it needs "
                     r"at least (\d+) MiB \(give --capacity (\d+)MiB or more\)", error)
    assert m and m[1] == m[2], err
    need = int(m[1])
    assert need > 64 and (need << 20) % demo.STEP == 0


def test_a_device_too_small_is_refused_before_any_run_at_that_size(refused):
    """Issue 28: the refusal came after 24-46 s of runs at the given capacity, each out of memory in the end.

    The demo's own runs write and check every layer (``fill=True``); the search for the
    smallest device does not.  None of the former may start on a device too small.
    """
    err, runs = refused
    assert "is too small for the demo" in err
    assert runs == []


# ------------------------------------------------------------------ what a user sees while it computes
NOTICE = "cupool: no usable CUDA GPU found; using the simulated device (host memory)"
DEMO_ARGS = ("demo", *SHORT)  # the default device "auto": the sim device and its notice here
needs_no_gpu = pytest.mark.skipif(cuda_available(), reason="the fallback notice appears only without a GPU")


def _screen(raw: str, width: int) -> list[str]:
    """The lines a terminal ``width`` columns wide shows after ``raw`` (text, carriage returns, newlines,
    and the cursor-up and erase-line sequences tqdm may write; any other escape sequence fails the test)."""
    lines, row, col = [""], 0, 0
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\x1b":
            m = re.match(r"\x1b\[(\d*)([AK])", raw[i:])
            assert m, f"an escape sequence the test does not know: {raw[i:i + 8]!r}"
            if m[2] == "A":
                row = max(0, row - int(m[1] or 1))
            else:
                lines[row] = lines[row][:col]
            i += len(m[0])
            continue
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        else:
            if col == width:  # the terminal wraps a full line
                row, col = row + 1, 0
                lines += [""] * (row + 1 - len(lines))
            line = lines[row].ljust(col)
            lines[row] = line[:col] + ch + line[col + 1:]
            col += 1
        i += 1
    return [ln.rstrip() for ln in lines]


@needs_no_gpu
def test_on_a_terminal_the_notice_comes_first_and_the_bar_leaves_nothing_behind():
    """Issue 28: the bar and the no-GPU notice shared a line, and a 0% bar stayed on the screen."""
    width = 100
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, width, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "cupool", *DEMO_ARGS], cwd=ROOT, stdin=follower,
                            stdout=follower, stderr=follower, env={**os.environ, "COLUMNS": str(width)})
    os.close(follower)
    raw = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        raw += chunk
    os.close(leader)
    assert proc.wait(timeout=300) == 0
    text = raw.decode().replace("\r\n", "\n")  # the terminal's own newline translation
    assert re.search(r"cupool demo: .* \d+/\d+ \[", text), "no progress bar was drawn on the terminal"
    screen = _screen(text, width)
    assert NOTICE in screen, screen[:5]  # a line of its own, whole
    report = screen.index(next(ln for ln in screen if ln.startswith("cupool demo: weight streaming on sim")))
    assert screen.index(NOTICE) < report
    left = [ln for ln in screen if re.search(r"\d+/\d+ \[|%\|", ln)]
    assert left == [], f"the bar left {left} on the screen"
    assert all(ln.startswith(("cupool: ", "cupool demo: weight")) or not ln for ln in screen[:report + 1]), \
        screen[:report + 1]


def test_on_a_pipe_lines_say_what_is_running_as_it_runs(refused):
    """Issue 28: through a pipe the demo said nothing for 30 s; now a plain line per stage, as it starts.

    It runs on the sim device of the capacity a refusal named (``test_a_device_too_small_says_what_would_fit``),
    which shows that the whole demo fits there."""
    fits = ["--device", "sim", "--capacity", f"{_named_capacity(refused[0])}MiB"]
    proc = subprocess.Popen([sys.executable, "-m", "cupool", *DEMO_ARGS, *fits], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    while first.startswith("cupool: ") or "uncompiled" in first or first.startswith(" "):  # notices, warnings
        first = proc.stderr.readline()
    running = proc.poll() is None  # the line came while the demo was still at work
    # The rest through the same buffered reader: communicate() reads the pipe itself, and would lose a
    # line readline() had already buffered (stage 2, when it came in one read with stage 1).
    outs: list[str] = []
    reader = threading.Thread(target=lambda: outs.append(proc.stdout.read()))
    reader.start()
    rest = proc.stderr.read()
    reader.join(timeout=300)
    assert proc.wait(timeout=300) == 0, rest
    out = outs[0]
    assert running and first.startswith("cupool demo [1/"), first
    err = first + rest
    assert "\r" not in err and "\x1b" not in err
    stages = re.findall(r"^cupool demo \[(\d+)/(\d+)\]: (.+)$", err, re.M)
    total = int(stages[0][1])
    assert [int(i) for i, _, _ in stages] == list(range(1, total + 1)) and total > 4
    assert any("streaming table" in what for _, _, what in stages)
    assert out.startswith("cupool demo: weight streaming on sim") and "extreme" in out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_record_while_the_bar_shows_is_written_above_it():
    """What cupool logs during the demo (a warning, a note) gets a line of its own, and the bar goes at the end."""
    term = _Terminal()
    with demo.showing_progress(3, term) as progress:
        progress.stage("first")
        logging.getLogger("cupool").warning("cupool: something to say")
        progress.stage("second")
        assert re.search(r"cupool demo: second .* 1/3 \[", term.getvalue())
    screen = _screen(term.getvalue(), 200)
    assert [ln for ln in screen if ln] == ["cupool: something to say"], screen
