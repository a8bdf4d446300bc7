"""The ``cupool`` command's rough edges, the ``export`` command, and the benchmark scripts' ``--help``."""

from __future__ import annotations

import argparse
import json
import logging
import pickle
import signal
import subprocess
import sys
import warnings
from importlib.metadata import version
from pathlib import Path

import pytest

import cupool
from cupool import cli
from cupool.cli import main
from cupool.observe.snapshot import export_snapshot
from cupool.replay import replay
from cupool.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("info", "demo", "replay", "report", "export")
#: What a shell reports for a command killed by SIGPIPE, and what cupool returns when its reader leaves.
EXIT_BROKEN_PIPE = 141


def _cupool(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cupool", *args], cwd=ROOT, stderr=subprocess.PIPE, **kw)


def test_help_describes_every_command_in_plain_words(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    description = " ".join(out.split("positional arguments:")[0].split())
    assert "``" not in out and "GPU device-memory pool" in description
    for cmd in COMMANDS:
        assert f"({cmd})" in description and f"    {cmd} " in out


@pytest.mark.parametrize("cmd", ["info", "demo"])
def test_cuda_without_a_gpu_is_one_line_and_exit_2(monkeypatch, capsys, cmd):
    monkeypatch.setattr(cupool.device, "cuda_available", lambda: False)
    assert main([cmd, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cupool: error: --device cuda:") and "no usable CUDA GPU" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_a_reader_that_leaves_ends_the_command_quietly():
    proc = _cupool("info", "--device", "sim", "--capacity", "64MiB", stdout=subprocess.PIPE)
    proc.stdout.close()  # as `cupool info | head -0` does, before cupool writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE
    assert err == "", err


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py")))
def test_benchmark_scripts_answer_help_without_running(script):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage: ") and "options:" in r.stdout, r.stdout[:500]


# ------------------------------------------------------------------ export
def _recorded_with_moves(tmp_path):
    pool = cupool.Pool("sim", capacity="512MiB", initial_size="36MiB", defrag_threshold=None)
    path = tmp_path / "moved.h5"
    with pool.record(path):
        bufs = [pool.movable(3 << 20) for _ in range(12)]  # all in the preallocated segment
        raw = pool.malloc(5 << 20)
        for m in bufs[::2]:
            m.free()
        assert pool.compact().moves > 0
    return pool, path, (bufs, raw)


def _live(segments):
    return {b["address"]: b["size"] for s in segments for b in s["blocks"] if b["state"] != "inactive"}


def test_export_a_trace_file_ends_where_the_pool_did(tmp_path, capsys):
    pool, path, keep = _recorded_with_moves(tmp_path)
    out = tmp_path / "snap.pickle"
    assert main(["export", str(path), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {out}: ") and "PyTorch trace entries" in said
    data = pickle.loads(out.read_bytes())
    segments = pool.snapshot()["segments"]
    assert [s["address"] for s in data["segments"]] == [s["address"] for s in segments]
    assert _live(data["segments"]) == _live(segments) and len(_live(segments)) == 7
    for seg in data["segments"]:  # blocks tile their segment
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    # Following the exported frees and allocs ends in the exported state, and it replays.
    live = {}
    for e in data["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            assert live.pop(e["addr"]) == e["size"]
    assert live == _live(segments)
    r = replay(load_trace(out), {"capacity": "512MiB"})
    assert r.unmatched_frees == 0 and r.peak_allocated == 12 * (3 << 20) + (5 << 20)
    del keep


def test_export_of_a_log_without_segments_gives_each_live_block_one(tmp_path, capsys):
    log = tmp_path / "rmm.csv"
    log.write_text("Thread,Time,Action,Pointer,Size,Stream\n1,1.0,allocate,0x1000,512,0x0\n"
                   "1,1.5,allocate,0x9000,4096,0x0\n1,2.0,free,0x1000,512,0x0\n")
    out = tmp_path / "rmm.pickle"
    assert main(["export", str(log), "-o", str(out)]) == 0
    data = pickle.loads(out.read_bytes())
    assert [(s["address"], s["total_size"]) for s in data["segments"]] == [(0x9000, 4096)]
    assert [e["action"] for e in data["device_traces"][0]] == ["alloc", "alloc", "free_requested", "free_completed"]
    empty = tmp_path / "empty.csv"
    empty.write_text("Thread,Time,Action,Pointer,Size,Stream\n")
    assert main(["export", str(empty), "-o", str(out)]) == 0
    assert "with no events" in capsys.readouterr().out


def test_export_bad_input_exits_2(tmp_path, capsys):
    _, path, _ = _recorded_with_moves(tmp_path)
    assert main(["export", str(path), "-o", str(tmp_path / "missing" / "s.pickle")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nope.h5")]) == 2
    assert "nope.h5: cannot read" in capsys.readouterr().err
    assert main(["export", str(path), "-o", str(tmp_path / "s.pickle"), "--index", "-1"]) == 2
    assert "--index must be a device index >= 0" in capsys.readouterr().err


def test_exporting_a_pool_nobody_records_says_so(tmp_path):
    pool, _, keep = _recorded_with_moves(tmp_path)
    out = tmp_path / "after.pickle"
    with pytest.warns(UserWarning, match="no events: the pool is not being recorded.*cupool export"):
        pool.export_snapshot(out)
    data = pickle.loads(out.read_bytes())
    assert data["device_traces"] == [[]] and _live(data["segments"]) == _live(pool.snapshot()["segments"])
    with pool.record(), warnings.catch_warnings():
        warnings.simplefilter("error")  # recorded: events, and no warning
        pool.malloc(1000)
        assert export_snapshot(pool, out) > 0
    del keep


# ------------------------------------------------------------------ info, --version, --help (issue 20 #8)
def test_info_keeps_every_key_apart_from_its_value(capsys):
    assert main(["info", "--device", "sim", "--capacity", "64MiB"]) == 0
    out = capsys.readouterr().out
    section = out.split("configuration\n")[1].split("versions\n")[0]
    rows = dict(line.split(None, 1) for line in section.splitlines())
    pool = cupool.Pool("sim", capacity="64MiB")
    assert set(rows) == set(pool.config)  # e.g. not one key "expandable_segmentsFalse"
    # The sim device has virtual memory on Linux (a memfd), where the defaults turn expandable segments on.
    vmm = str(sys.platform.startswith("linux"))
    assert rows["expandable_segments"] == rows["stitch"] == vmm and rows["capacity"] == "64 MiB"
    starts = {line.index(v) for line, v in zip(section.splitlines(), rows.values())}
    assert len(starts) == 1  # one column of values


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"cupool {version('cupool')}\n"


def test_every_option_has_help(capsys):
    for cmd in COMMANDS:
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        entries: list[list[str]] = []  # per option: its name, then its help
        for line in capsys.readouterr().out.split("options:\n")[1].splitlines():
            if line.strip().startswith("-"):
                name, _, text = line.strip().partition("  ")
                entries.append([name, text.strip()])
            elif entries and line.strip():
                entries[-1].append(line.strip())
        assert entries and not [e[0] for e in entries if not "".join(e[1:])], cmd  # e.g. --seed SEED alone


# ------------------------------------------------------------------ help, errors and --device (issue 28)
def test_every_command_has_a_description_and_every_argument_help():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS)
    assert all(c.help and c.help.strip() for c in sub._choices_actions)  # the top-level list of commands
    for name, command in sub.choices.items():
        assert command.description and len(command.description.split()) >= 10, name  # a paragraph of its own
        for action in command._actions:
            assert action.help and action.help.strip() and action.help != argparse.SUPPRESS, \
                f"cupool {name} {'/'.join(action.option_strings) or action.dest}"


@pytest.mark.parametrize("argv, usage", [
    (["demo", "--bogus"], "usage: cupool demo "),  # once the top-level usage
    (["info", "--device", "sim", "--bogus", "x"], "usage: cupool info "),
    (["demo", "--steps", "x"], "usage: cupool demo "),
    (["export"], "usage: cupool export "),
    (["bogus"], "usage: cupool "),
    (["--bogus", "info"], "usage: cupool [-h]"),  # before the command: cupool's own
])
def test_a_command_line_argparse_cannot_read_is_refused_under_the_commands_usage(capsys, argv, usage):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    *usage_lines, last = err.rstrip("\n").split("\n")
    assert last.startswith("cupool: error: ") and not any("error" in line for line in usage_lines), err


@pytest.mark.parametrize("argv, message", [
    (["info", "--device", "foo"], "--device foo: device must be 'auto', 'sim', 'sim:N', 'cuda' or 'cuda:N', "
                                  "got 'foo'"),
    (["demo", "--device", "sim:x"], "--device sim:x: device: the index in 'sim:x' must be a non-negative integer, "
                                    "as in 'sim:1'"),
    (["replay", "--device", "one", "never-read.pickle"], "--device one: device must be 'auto', 'sim', 'sim:N', "
                                                         "'cuda' or 'cuda:N', got 'one', or the index of a device "
                                                         "of the snapshot, as in --device 1"),
])
def test_device_is_a_name_everywhere_and_a_bad_one_is_one_line(capsys, argv, message):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"cupool: error: {message}\n"


def test_replay_device_names_a_recorded_gpu_without_needing_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cupool.device, "cuda_available", lambda: False)
    busy = [{"action": "alloc", "addr": 1 << 32, "size": 30 << 20, "stream": 0, "time_us": 1, "frames": []}]
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[], busy]}))
    for device in ("cuda:1", "1", " 1 "):  # a bare index, as torch takes one (issue 35 #4)
        assert main(["replay", str(path), "--device", device]) == 0
        assert "peak allocated     30 MiB" in capsys.readouterr().out
    assert main(["replay", str(path), "--device", "auto"]) == 0  # the default: the busiest device
    assert "peak allocated     30 MiB" in capsys.readouterr().out
    assert main(["replay", str(path), "--device", "cuda:0"]) == 2
    assert "device 0 holds nothing" in capsys.readouterr().err


@pytest.fixture
def conf(monkeypatch):
    """Set ``CUPOOL_CONF`` for one test; the default pools made from it are forgotten after."""
    from cupool.hooks import reset_default_pools

    def set_conf(value: str) -> None:
        monkeypatch.setenv("CUPOOL_CONF", value)
        reset_default_pools()

    yield set_conf
    reset_default_pools()


def _configuration(out: str) -> dict[str, str]:
    section = out.split("configuration\n")[1].split("versions\n")[0]
    return dict(line.split(None, 1) for line in section.splitlines())


def test_info_shows_the_pool_default_pool_makes_from_cupool_conf(conf, capsys):
    conf("device=sim,capacity=256MiB,max_size=100MB,release_threshold=50%,expandable_segments=false")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "CUPOOL_CONF     device=sim,capacity=256MiB,max_size=100MB" in out
    rows = _configuration(out)
    default = cupool.default_pool().config
    assert set(rows) == set(default)
    assert rows["capacity"] == "256 MiB" and rows["max_size"] == "100MB" and rows["limit"] == "95.4 MiB"
    assert rows["release_threshold"] == cupool.format_bytes(default["release_threshold"]) == "128 MiB"
    assert rows["expandable_segments"] == str(default["expandable_segments"]) == "False"
    assert main(["info", "--capacity", "128MiB"]) == 0  # the command line over CUPOOL_CONF
    assert _configuration(capsys.readouterr().out)["capacity"] == "128 MiB"


@pytest.mark.parametrize("value", ["max_sise=1GB", "device=sim,device=sim", "max_split_size_mb:128"])
def test_info_refuses_the_cupool_conf_default_pool_refuses_in_its_words(conf, capsys, value):
    conf(value)
    with pytest.raises(ValueError) as refused:
        cupool.default_pool()
    assert main(["info", "--device", "sim"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"cupool: error: {refused.value}\n"


def test_a_sim_device_the_process_has_no_addresses_for_is_one_line(monkeypatch, capsys):
    """Before: since issue 34 a sim device whose address space the process is refused (``ulimit -v``) raises
    ``AddressSpaceExhausted``, a ``MemoryError``, where it raised a ``ValueError``, and the command ended
    in a traceback instead of its one line."""
    from cupool.device import sim

    def refused(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(sim.mmap, "mmap", refused)
    assert main(["info", "--device", "sim", "--capacity", "16GiB"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("cupool: error: capacity: a sim device of 16 GiB needs 32 GiB of address ")
    assert err.count("\n") == 1 and "ulimit -v" in err


def test_counts_are_singular_when_one(tmp_path, capsys):
    log = tmp_path / "one.csv"
    log.write_text("Thread,Time,Action,Pointer,Size,Stream\n1,1.0,allocate,0x1000,512,0x0\n")
    assert main(["export", str(log), "-o", str(tmp_path / "one.pickle")]) == 0
    assert ": 1 PyTorch trace entry from 1 event (rmm) of " in capsys.readouterr().out
    assert main(["export", str(log), "-o", str(tmp_path / "again.csv")]) == 0
    assert ": 1 RMM log row from 1 event (rmm) of " in capsys.readouterr().out


# ------------------------------------------------------------------ Ctrl-C (issue 36 #9)
def _busy_trace(path: Path) -> Path:
    pool = cupool.Pool("sim", capacity="1GiB")
    with pool.record(path):
        live = [pool.malloc((n % 97 + 1) << 12) for n in range(3000)]
        for a in live[::2]:
            a.free()
    return path


def test_ctrl_c_during_a_comparison_is_one_line_after_the_rows_and_exit_130(tmp_path):
    trace = _busy_trace(tmp_path / "t.h5")
    # Far more replays than can run before the signal lands, so that it lands inside one of them.  The child
    # alone gets the signal, in a session of its own, with SIGINT's default action (not one ignored by a shell
    # that started this suite in the background), which Python turns into KeyboardInterrupt.
    proc = subprocess.Popen(
        [sys.executable, "-m", "cupool", "replay", str(trace), "--engine", "pool", "--compare", *["recorded"] * 500],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("recorded "):  # the first row: a replay finished, the next one runs
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert err == "cupool: interrupted\n"
    rows = [line for line in seen + rest.splitlines(keepends=True) if line.startswith("recorded ")]
    assert seen[-1] in rows and 1 <= len(rows) < 500  # what was printed stays; the rest never ran


def test_ctrl_c_keeps_the_rows_printed_before_it(tmp_path, monkeypatch, capsys):
    import cupool.replay.commands as commands

    trace = _busy_trace(tmp_path / "t.h5")
    real = commands.replay
    calls = []

    def interrupted_at_the_second(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(commands, "replay", interrupted_at_the_second)
    try:
        status = main(["replay", str(trace), "--engine", "pool", "--compare", "recorded", "release_threshold=0"])
    except KeyboardInterrupt:  # a failure of this test, not an interrupt of the suite
        pytest.fail("KeyboardInterrupt came out of main")
    assert status == 130
    out, err = capsys.readouterr()
    assert err == "cupool: interrupted\n"
    assert [line.split()[0] for line in out.splitlines() if line.startswith(("recorded ", "release_"))] == ["recorded"]


@pytest.mark.parametrize("argv", [["info", "--device", "sim"], ["demo", "--device", "sim"], ["replay"], ["report"]])
def test_a_negative_size_is_refused_by_the_setting_not_taken_for_an_option(tmp_path, capsys, argv):
    """``--capacity -1GiB`` reads -1GiB as the size it is meant as (issue 36 #19), not as an unknown option."""
    if argv[0] in ("replay", "report"):
        argv = [*argv, str(_busy_trace(tmp_path / "t.h5")), "-o" if argv[0] == "report" else "--engine",
                str(tmp_path / "r.png") if argv[0] == "report" else "pool"]
    assert main([*argv, "--capacity", "-1GiB"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("cupool: error: "), err
    assert "capacity: cannot parse '-1GiB' as a size (try 2GB, 512MiB or 50%)" in err


def test_a_replay_on_a_device_smaller_than_the_recorded_max_size_runs_capped_by_the_device(tmp_path, capsys):
    """The pool refuses a max_size past its device (issue 36 #19); a replay given a smaller --capacity than the
    recording's cap is capped by that device, as before, rather than refused for a max_size nobody gave."""
    pool = cupool.Pool("sim", capacity="1GiB", max_size="900MiB")
    with pool.record(tmp_path / "capped.h5"):
        keep = [pool.malloc(10 << 20) for _ in range(30)]
    for engine in ("pool", "numba"):
        assert main(["replay", str(tmp_path / "capped.h5"), "--capacity", "128MiB", "--engine", engine,
                     "--json"]) == 0
        row = json.loads(capsys.readouterr().out)
        assert row["capacity"] == 128 << 20 and row["ooms"] == 30 - 12 and "max_size" not in row["settings"]
    assert main(["replay", str(tmp_path / "capped.h5"), "--capacity", "1GiB", "--engine", "pool", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["max_size"] == "900MiB"  # under the device: kept
    del keep


# ------------------------------------------------------------------ the no-GPU notice (issue 36 #17)
NO_GPU = "no usable CUDA GPU found"


@pytest.fixture
def no_gpu(monkeypatch, caplog):
    """No GPU, and the once-per-process notice not yet given; yields the notices logged."""
    monkeypatch.setattr(cupool.device, "_auto_note_given", False)
    monkeypatch.setattr(cupool.device, "cuda_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="cupool"):
        yield lambda: [r.getMessage() for r in caplog.records if NO_GPU in r.getMessage()]


def test_info_shows_the_fallback_in_its_table_and_not_again_as_a_notice(no_gpu, capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "auto  cuda when a GPU is usable, else sim: sim here" in out and "device          sim " in out
    assert no_gpu() == []


def test_the_notice_never_comes_before_an_error_and_comes_once(no_gpu, capsys):
    with pytest.raises(ValueError, match="capacity: cannot parse"):
        cupool.Pool(capacity="-1GiB")
    with pytest.raises(ValueError, match="max_size"):  # refused after the device is made: still no notice
        cupool.Pool(capacity="8MiB", max_size="16MiB")
    assert main(["demo", "--capacity", "-1GiB"]) == 2
    assert capsys.readouterr().err == "cupool: error: capacity: cannot parse '-1GiB' as a size (try 2GB, 512MiB or " \
                                      "50%)\n"
    assert no_gpu() == []
    cupool.Pool(capacity="8MiB")
    cupool.Pool(capacity="8MiB")
    assert len(no_gpu()) == 1


# ------------------------------------------------------------------ --compare cupool (issue 35 #4)
def _snapshot(path: Path) -> Path:
    """A PyTorch snapshot (plain segments, as PyTorch's allocator runs by default) of allocs and frees."""
    events, t = [], 0
    for i in range(40):
        t += 1
        events.append({"action": "alloc", "addr": (1 << 32) + i * (64 << 20), "size": ((i % 7) + 1) << 20,
                       "stream": 0, "time_us": t, "frames": []})
    for i in range(0, 40, 2):
        t += 1
        events.append({"action": "free_completed", "addr": (1 << 32) + i * (64 << 20), "size": ((i % 7) + 1) << 20,
                       "stream": 0, "time_us": t, "frames": []})
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))
    return path


@pytest.mark.parametrize("engine", ["numba", "pool"])
def test_compare_cupool_replays_cupools_defaults_on_the_recorded_device(tmp_path, capsys, engine):
    snap = _snapshot(tmp_path / "snap.pickle")
    assert main(["replay", str(snap), "--engine", engine, "--json", "--compare", "recorded", "cupool"]) == 0
    recorded, defaults = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [recorded["configuration"], defaults["configuration"]] == ["recorded", "cupool"]
    assert recorded["settings"]["expandable_segments"] is False and recorded["settings"]["stitch"] is False
    assert defaults["settings"]["expandable_segments"] is True and defaults["settings"]["stitch"] is True
    assert defaults["capacity"] == recorded["capacity"]  # the same device
    # A pool made with the settings the row ran with is a fresh cupool.Pool on that device.
    ran_with = {k: v for k, v in defaults["settings"].items() if k != "capacity"}
    assert cupool.Pool("sim", capacity=defaults["capacity"], **ran_with).config == \
        cupool.Pool("sim", capacity=defaults["capacity"]).config
    # --config applies over cupool's defaults too.
    assert main(["replay", str(snap), "--engine", engine, "--json", "--compare", "cupool",
                 "--config", "release_threshold=0"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["release_threshold"] == 0
