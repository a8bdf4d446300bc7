"""cupool: one GPU device-memory pool for CuPy and Numba.

Best fit with split and coalesce, stream-aware reuse, PyTorch-style statistics,
and a simulated device so the same pool runs (and is tested) without a GPU.
"""

from importlib.metadata import PackageNotFoundError, version

from ._units import format_bytes, parse_size
from .device import CudaDevice, Device, SimDevice
from .errors import (
    DoubleFreeError,
    ForeignAllocationError,
    InvalidFreeError,
    OutOfMemoryError,
)
from .pool import Allocation, Pool
from .replay import ReplayResult
from .trace import EventRecorder, Trace, TraceError, load_trace
from .hooks import cupy_allocator, default_pool, install, uninstall, using
from .pinned import PinnedPool
from .batch import BatchSizer
from .monitor import Alert, Monitor
from .scheduler import Decision
from .spill import SpillError

try:
    __version__ = version("cupool")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "Alert",
    "Allocation",
    "EventRecorder",
    "BatchSizer",
    "CudaDevice",
    "Decision",
    "Device",
    "DoubleFreeError",
    "ForeignAllocationError",
    "InvalidFreeError",
    "Monitor",
    "OutOfMemoryError",
    "Pool",
    "SimDevice",
    "SpillError",
    "format_bytes",
    "parse_size",
    "ReplayResult",
    "Trace",
    "TraceError",
    "load_trace",
    "PinnedPool",
    "cupy_allocator",
    "default_pool",
    "install",
    "uninstall",
    "using",
]
