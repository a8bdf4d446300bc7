"""Hostile PyTorch snapshots: bounded work and memory, and one clear error line (issue 28).

A few hundred bytes of pickle can describe a tree of 2**40 nodes by sharing
(a memo reference names an object again).  Printing such a value in an error
(``repr``, ``str``) took exponential time and memory; a tuple of them used as a
dict key made the unpickler itself hash every node, in C; a deep one overflowed
the stack into a raw ``RecursionError``.  Each case runs in a child process with
a time and memory limit, so that a regression fails the test instead of taking
the machine.
"""

from __future__ import annotations

import pickle
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from cupool.trace import TraceError, load_trace

ROOT = Path(__file__).resolve().parent.parent
#: Seconds a child may take: each finishes in about two (most of it importing cupool).
LIMIT_S = 60
#: Bytes of data a child may hold: a repr of the shared tree grows past any of them.
MEMORY = 2 << 30
COMMANDS = {"replay": [], "report": ["-o", "{tmp}/r.png"], "export": ["-o", "{tmp}/s.pickle"]}


def _shared(depth: int = 40) -> list:
    """Lists each holding the one before twice: 2**depth leaves, depth + 1 objects."""
    a: list = []
    for _ in range(depth):
        a = [a, a]
    return a


def _event_snapshot(**event) -> bytes:
    return pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1 << 32, "size": 512,
                                                              "time_us": 1, **event}]]})


def _segment_snapshot(segment=None, block=None) -> bytes:
    block = {"address": 1 << 32, "size": 512, "requested_size": 512, "state": "active_allocated", **(block or {})}
    seg = {"address": 1 << 32, "total_size": 2 << 20, "stream": 0, "segment_type": "large", "device": 0,
           "blocks": [block], **(segment or {})}
    return pickle.dumps({"segments": [seg], "device_traces": []})


def _s(text: str) -> bytes:
    """SHORT_BINUNICODE ``text``."""
    return b"\x8c" + bytes([len(text)]) + text.encode()


def _tuple_key_snapshot(depth: int = 40) -> bytes:
    """``{"segments": [], "device_traces": [], T: 1}`` with T the tuple of ``depth`` shared levels.

    Written opcode by opcode: building it in Python would hash T too.
    """
    t = b")\x940"  # EMPTY_TUPLE, MEMOIZE, POP
    for i in range(depth):
        t += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x940"  # BINGET i twice, TUPLE2, MEMOIZE, POP
    t += b"h" + bytes([depth])
    return b"\x80\x04}(" + _s("segments") + b"]" + _s("device_traces") + b"]" + t + b"K\x01u."


def _deep_snapshot(depth: int = 200_000) -> bytes:
    """An event whose address is a list nested ``depth`` deep (EMPTY_LIST ``depth`` times, then APPENDs)."""
    nested = b"]" * depth + b"a" * (depth - 1)
    return (b"\x80\x04}(" + _s("segments") + b"]" + _s("device_traces") + b"]]}(" + _s("action") + _s("alloc")
            + _s("addr") + nested + _s("size") + b"M\x00\x02" + b"uaau.")


def _int_keys_snapshot(n: int = 20_000) -> bytes:
    """A dict of ``n`` integer keys that all hash to 0 (multiples of 2**61 - 1): inserting them is quadratic."""
    keys = b"".join(b"\x8a\x0a" + (k * ((1 << 61) - 1)).to_bytes(10, "little") + b"K\x00" for k in range(1, n))
    return b"\x80\x04}(" + _s("segments") + b"]" + _s("device_traces") + b"]" + _s("x") + b"}(" + keys + b"uu."


HOSTILE = {
    "shared lists as an address": (_event_snapshot(addr=_shared()), "addr must be an integer, got a list of 2 items"),
    "shared lists as an action": (_event_snapshot(action=_shared()), "the action must be a string, got a list of 2"),
    "shared lists as a block's state": (_segment_snapshot(block={"state": _shared()}),
                                        "state must be a string, got a list of 2 items"),
    "shared lists as a segment's device": (_segment_snapshot(segment={"device": _shared()}),
                                           "segments[0] (segment): device must be an integer, got a list of 2"),
    "a shared tuple as a dict key": (_tuple_key_snapshot(), "is not a string, as every key of a PyTorch snapshot"),
    "colliding integer keys": (_int_keys_snapshot(), "is not a string, as every key of a PyTorch snapshot"),
    "a list nested 200,000 deep": (_deep_snapshot(), "addr must be an integer, got a list of 1 item"),
}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY, MEMORY))


def _child(args: list[str]) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repository root, within ``LIMIT_S`` and ``MEMORY`` (a timeout fails the test)."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S,
                          preexec_fn=_limit_memory, check=False)


def test_the_hostile_files_are_tiny():
    """Their damage comes from sharing and depth, not from their size."""
    assert len(_event_snapshot(addr=_shared())) < 1000 and len(_tuple_key_snapshot()) < 400


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_the_api_refuses_a_hostile_snapshot_at_once(tmp_path, case):
    data, problem = HOSTILE[case]
    path = tmp_path / "hostile.pickle"
    path.write_bytes(data)
    code = (f"import cupool.trace as t\ntry:\n    t.load_trace({str(path)!r})\nexcept t.TraceError as e:\n"
            "    print('refused:', e)\n")
    r = _child(["-c", code])
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    assert r.stdout.startswith(f"refused: {path}: ") and problem in r.stdout, r.stdout
    assert len(r.stdout) < 400  # described by type and size, not printed


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", ["shared lists as an address", "a shared tuple as a dict key",
                                  "a list nested 200,000 deep"])
def test_each_command_refuses_a_hostile_snapshot_in_one_line(tmp_path, command, case):
    data, problem = HOSTILE[case]
    path = tmp_path / "hostile.pickle"
    path.write_bytes(data)
    r = _child(["-m", "cupool", command, str(path), *(a.format(tmp=tmp_path) for a in COMMANDS[command])])
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith(f"cupool: error: {path}: ") and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert problem in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostile.pickle"]  # nothing written


def test_an_honest_snapshot_with_tuples_and_shared_strings_still_loads(tmp_path):
    """Tuples as values (``segment_pool_id``) and strings named again by the memo are what PyTorch writes."""
    frames = [{"filename": "model.py", "line": 7, "name": "forward"}]
    seg = {"address": 1 << 32, "total_size": 2 << 20, "stream": 0, "segment_type": "large", "device": 0,
           "segment_pool_id": (0, 0), "frames": frames,
           "blocks": [{"address": 1 << 32, "size": 512, "requested_size": 500, "state": "active_allocated",
                       "frames": frames}]}
    events = [{"action": "alloc", "addr": (1 << 32) + 512 * (i + 1), "size": 512, "stream": 0, "time_us": i,
               "frames": frames} for i in range(50)]
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"honest{protocol}.pickle"
        path.write_bytes(pickle.dumps({"segments": [seg], "device_traces": [events],
                                       "allocator_settings": {"expandable_segments": False}}, protocol=protocol))
        trace = load_trace(path)
        assert trace.counts()["alloc"] == 51 and trace.config["snapshot"]["seeded_blocks"] == 1


def test_a_dict_with_a_number_as_key_is_refused_before_unpickling(tmp_path):
    path = tmp_path / "numbers.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "allocator_settings": {1: 2}}))
    with pytest.raises(TraceError, match=r"a dict key \(opcode SETITEM at byte \d+\) is not a string"):
        load_trace(path)


def test_real_snapshots_pass_the_walk():
    """PyTorch's own snapshots, where present beside the repository (``shared/traces``, as test_real_traces)."""
    shared = ROOT.parent / "shared" / "traces"
    found = sorted(shared.glob("*.pickle")) if shared.is_dir() else []
    if not found:
        pytest.skip(f"no real snapshots here ({shared} is absent; it is not part of the repository)")
    for path in found:
        assert len(load_trace(path)) > 0, path
