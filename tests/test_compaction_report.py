"""``CompactionReport`` as people read it (issue 20 #9): sizes in units, fractions rounded, times in ms."""

from __future__ import annotations

import re

import cupool


def test_a_compaction_report_reads_well():
    pool = cupool.Pool("sim", capacity="256MiB", initial_size="21MiB", defrag_threshold=None)
    layers = [pool.movable(3 << 20) for _ in range(7)]
    for layer in layers[::2]:
        layer.free()
    report = pool.compact()
    text = repr(report)
    assert report.moves > 0 and not re.search(r"\d\.\d{4,}", text), text  # no 17-digit floats
    assert text.startswith(f"CompactionReport(moves={report.moves}, bytes_moved=")
    assert f"bytes_moved={cupool.format_bytes(report.bytes_moved)}" in text
    assert (f"fragmentation={report.fragmentation_before:.3f}->{report.fragmentation_after:.3f}" in text
            and re.search(r"time=\d+\.\d\d ms \(moving \d+\.\d\d ms\), loading the move kernel \d+\.\d\d ms\)$",
                          text))
    del layers
