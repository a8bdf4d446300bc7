"""A PyTorch snapshot is untrusted input: its work is bounded by what the file can honestly hold (issue 21 #10)."""

from __future__ import annotations

import pickle
import time

import pytest

from cupool.cli import main
from cupool.trace import TraceError, load_trace


def _repeating(path, n_segments: int, n_blocks: int) -> int:
    """A snapshot naming one segment and one block by reference; returns the blocks it claims."""
    block = {"address": 1 << 32, "size": 512, "requested_size": 512, "state": "active_allocated"}
    segment = {"address": 1 << 32, "total_size": 2 << 20, "stream": 0, "segment_type": "small",
               "device": 0, "blocks": [block] * n_blocks}
    path.write_bytes(pickle.dumps({"segments": [segment] * n_segments, "device_traces": []}))
    return n_segments * n_blocks


def test_a_snapshot_repeating_one_block_by_reference_is_refused_at_once(tmp_path, capsys):
    p = tmp_path / "bomb.pickle"
    claimed = _repeating(p, 3000, 3000)
    assert p.stat().st_size < 16_000 and claimed == 9_000_000
    t0 = time.perf_counter()
    with pytest.raises(TraceError, match="repeats objects by reference"):
        load_trace(p)
    assert main(["replay", str(p)]) == 2
    assert time.perf_counter() - t0 < 5  # it took 41 s before the bound, and 962 MiB
    err = capsys.readouterr().err
    assert "bomb.pickle" in err and "than a file of" in err


def test_an_honest_snapshot_of_the_same_shape_loads(tmp_path):
    """Distinct blocks, each a dict of its own, are within the bound however many there are."""
    blocks = [{"address": (1 << 32) + 512 * i, "size": 512, "requested_size": 512, "state": "active_allocated"}
              for i in range(2000)]
    seg = {"address": 1 << 32, "total_size": 2 << 20, "stream": 0, "segment_type": "small", "device": 0,
           "blocks": blocks}
    p = tmp_path / "honest.pickle"
    p.write_bytes(pickle.dumps({"segments": [seg], "device_traces": []}))
    trace = load_trace(p)
    assert trace.config["snapshot"]["seeded_blocks"] == 2000


def test_events_repeated_by_reference_are_refused_too(tmp_path):
    ev = {"action": "alloc", "addr": 1 << 32, "size": 512, "stream": 0, "time_us": 1, "frames": []}
    p = tmp_path / "events.pickle"
    p.write_bytes(pickle.dumps({"segments": [], "device_traces": [[ev] * 3000] * 3000}))
    with pytest.raises(TraceError, match="repeats objects by reference"):
        load_trace(p)
