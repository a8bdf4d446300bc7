"""Under a file-size limit the sim device's virtual memory (a memfd) cannot grow: the error says so.

Issue 28: a sim pool with virtual memory said "out of memory ... reserved 0 B" and nothing more,
though the device's own error named the memfd's limit; the pool's growth dropped it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as a batch job's limit would be
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    import cupool
    pool = cupool.Pool("sim", capacity="64MiB")  # the defaults: expandable segments over a memfd
    assert pool.config["expandable_segments"]
    try:
        pool.malloc(4 << 20)
    except cupool.OutOfMemoryError as e:
        print(e)
""")


def test_an_out_of_memory_under_a_file_size_limit_names_it():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout.strip()
    assert said.startswith("cupool: out of memory") and "reserved 0 B" in said
    assert "the device refused" in said and "ulimit -f" in said and "memfd" in said
