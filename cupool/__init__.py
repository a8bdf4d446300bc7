"""cupool: one GPU device-memory pool for CuPy, Numba and PyTorch.

Best fit with split and coalesce, stream-aware reuse, compaction of movable
buffers, spilling under pressure, PyTorch-style statistics and traces, and a
simulated device so the same pool runs (and is tested) without a GPU.
"""

from importlib.metadata import PackageNotFoundError, version

from ._units import format_bytes, parse_size
from .observe.batch import BatchSizer
from .device import CudaDevice, Device, SimDevice
from .errors import ClosedError, DoubleFreeError, Error, ForeignAllocationError, InvalidFreeError, OutOfMemoryError
from .hooks import cupy_allocator, default_pool, install, uninstall, using
from .hooks.routing import sim_device
from .observe.memory import (
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    reset_peak_memory_stats,
)
from .observe.monitor import Alert, Monitor
from .observe.summary import memory_summary
from .core.handles import Movable
from .core.fast import Allocation
from .pool import CompactionReport, PinnedPool, Pool
from .replay import ReplayResult
from .pressure.scheduler import Decision
from .pressure.spill import CorruptSpillError, HDF5Tier, HostTier, SpillError
from .trace import EventRecorder, Trace, TraceError, load_trace

try:
    __version__ = version("cupool")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "Alert",
    "Allocation",
    "BatchSizer",
    "ClosedError",
    "CompactionReport",
    "CorruptSpillError",
    "CudaDevice",
    "Decision",
    "Device",
    "DoubleFreeError",
    "Error",
    "EventRecorder",
    "ForeignAllocationError",
    "HDF5Tier",
    "HostTier",
    "InvalidFreeError",
    "Monitor",
    "Movable",
    "OutOfMemoryError",
    "PinnedPool",
    "Pool",
    "ReplayResult",
    "SimDevice",
    "SpillError",
    "Trace",
    "TraceError",
    "cupy_allocator",
    "default_pool",
    "format_bytes",
    "install",
    "load_trace",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "memory_summary",
    "parse_size",
    "reset_peak_memory_stats",
    "sim_device",
    "uninstall",
    "using",
]
