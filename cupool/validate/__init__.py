"""One command that proves cupool on a GPU: ``python -m cupool.validate``.

It runs the test suite's GPU tests and the conformance suites, Numba's own
memory tests under cupool's EMM plugin beside Numba's default, a CuPy workload
compared bit for bit with CuPy's own pool through every hook path, the move
kernel against memmove, compaction bandwidth, benchmarks beside CuPy's
``MemoryPool`` (and RMM where importable), pinned memory, spilling and a trace
recorded on the GPU, torch and CuPy sharing one pool (and torch's alloc + free
beside PyTorch's and RMM's allocators), the async upstream's trims without a
device synchronization and the managed upstream's prefetch, and writes a dated
markdown report for
docs/gpu-validation.md.  Without a GPU it says so, marks every check skipped and
exits 0; ``--device sim`` rehearses the checks that mean something there.

* ``records``: ``Result`` (what a check returns) and ``Context`` (what it gets);
* ``runner``: the list of checks, ``run_checks`` and the command line;
* ``report``: the environment and the markdown;
* ``suites``, ``workload``, ``bench``, ``memory``, ``upstreams``, ``torch_checks``: the checks
  (``torch_child``: the torch checks' child process, one allocator each);
* ``gpu_only``: the pytest plugin that picks the suite's GPU tests.

Nothing in cupool imports this package: it sits at the top, like the CLI.
"""

from .records import FAILED, PASSED, SKIPPED, Context, Result, Table
from .runner import CHECKS, Check, main, run_checks

__all__ = ["CHECKS", "FAILED", "PASSED", "SKIPPED", "Check", "Context", "Result", "Table", "main", "run_checks"]
