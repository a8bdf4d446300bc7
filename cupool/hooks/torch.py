"""PyTorch's CUDA tensors from cupool's pool, through torch's pluggable allocator.

``torch.cuda.memory.CUDAPluggableAllocator(path, alloc, free)`` loads a shared
library and calls two C functions by name.  cupool's library is the compiled
module ``cupool.hooks.torch_shim`` (``torch_shim.cpp``, built by ``pip
install`` like the fast path; ``cupool info`` says whether it was).  A request a
parked block fits, and the free of a small block, are served in C without the
GIL, through the compiled core's capsule (Note [Hits without the GIL]).  The
rest take the GIL and call this module: ``_resolve`` picks the pool, the one
given to ``use(pool)`` for that device or else ``default_pool(device)``, the
pool CuPy and Numba get there (found once per device, and kept until ``use``
changes it; a device this machine lacks is refused, ``_check_exists``), and
the pool lends the block for torch's stream (``Pool.lending``): the stream handle
becomes the block's stream key (``device.stream_key``), so cupool's stream rules
(Note [Streams]) hold for torch's streams.  The shim keeps each live block by
address (a C++ map): the block itself, or its ``Allocation`` where the pool
lends nothing (it tracks leak sites or checks admissions); a free of an address
it did not serve is logged (logger ``cupool.torch``) and ignored.

Note [Torch's allocator]
~~~~~~~~~~~~~~~~~~~~~~~~
PyTorch's ``CUDAPluggableAllocator::malloc`` (torch/csrc/cuda/CUDAPluggableAllocator.cpp)
stores whatever ``alloc`` returns in its table and hands it to the tensor
without checking it: a NULL becomes a tensor at address 0, and the first kernel
that touches it faults the device.  A C++ exception thrown by ``alloc``, on the
other hand, goes through ``malloc`` and ``allocate`` to torch's Python binding,
which raises any ``std::exception`` as ``RuntimeError`` with its message.  So
the shim has two allocating entry points with the pluggable signature:

* ``cupool_torch_alloc`` (``Shim.alloc``), for C callers (ctypes): returns NULL
  when cupool refuses, and nothing crosses the C boundary;
* ``cupool_torch_alloc_or_throw`` (``Shim.torch_alloc``), the one ``allocator()``
  gives torch: on NULL it throws ``std::runtime_error`` carrying cupool's reason
  (``cupool.OutOfMemoryError``'s message, say), after releasing the GIL.  The
  torch caller gets ``RuntimeError: cupool could not allocate N bytes on device
  D for PyTorch: OutOfMemoryError: ...``, never a tensor at address 0.

Either way ``last_error()`` gives this thread's last refusal as the exception
cupool raised (an ``OutOfMemoryError`` with its fields).  A Ctrl-C that lands
in the Python code a shim call runs is no refusal: the shim tries again and
re-arms the interrupt (``PyErr_SetInterrupt``), so the program gets its
``KeyboardInterrupt`` at its next bytecode and torch's caller its block.
PyTorch switches allocators only before its first CUDA tensor: ``change_current_allocator``
refuses once its allocator is initialised, and cupool says so
(``TorchAllocatorError``).  The swap is for the life of the process:
``uninstall()`` cannot give torch its caching allocator back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..core import compiled_module
from ..device.cuda import check_index
from ..errors import NoDeviceError, TorchAllocatorError
from ..pool import Pool
from .routing import current_device, default_pool, existing_pool, gpu_available

#: The compiled module that holds the C functions (``COMPILED_MODULES`` lists it).
SHIM_MODULE = "cupool.hooks.torch_shim"
#: What torch says when its allocator is already in use (``change_current_allocator``).
TOO_LATE = (
    "PyTorch's CUDA allocator is already in use: it can be switched to cupool only before the first "
    "CUDA tensor (or anything else that initialises torch's CUDA allocator). Call "
    "cupool.install(torch=True) (or torch.cuda.memory.change_current_allocator(cupool.torch.allocator())) "
    "at the start of the program"
)

log = logging.getLogger("cupool.torch")

_pools: dict[int, Pool] = {}  # device -> the pool use() gave
_local = threading.local()  # .error: this thread's last refusal
_setup_lock = threading.Lock()
_registered: list[ModuleType] = []
_served: dict[int, Pool] = {}  # device -> the pool the shim took there (``_resolve``), until ``use`` forgets it


@dataclass(frozen=True)
class Shim:
    """Where PyTorch finds cupool's allocator: the library's ``path`` and its functions' names.

    ``alloc`` and ``free`` have ``CUDAPluggableAllocator``'s signatures and never
    raise (``alloc`` returns NULL on a refusal): for C callers.  ``torch_alloc`` is
    ``alloc`` that throws a C++ exception instead of returning NULL: what torch
    is given (Note [Torch's allocator]).
    """

    path: str
    alloc: str
    free: str
    torch_alloc: str


def shim_status() -> tuple[str, str]:
    """``("built" | "not built", why)``: whether the shim runs here, for ``cupool info``."""
    module, why = compiled_module(SHIM_MODULE)
    return ("built" if module is not None else "not built"), why


def shim() -> Shim:
    """The shim's path and function names; raises ``TorchAllocatorError`` if it is not built."""
    module = _module()
    path = module.__file__
    assert path is not None
    return Shim(path, module.ALLOC, module.FREE, module.TORCH_ALLOC)


def _module() -> ModuleType:
    """The compiled shim, its Python callables registered once."""
    if _registered:
        return _registered[0]
    module, why = compiled_module(SHIM_MODULE)
    if module is None:
        raise TorchAllocatorError(f"cupool's PyTorch shim is not built here ({why}); reinstall cupool with a "
                                  "C++ compiler (`pip install .`; `cupool info` says why it was not built)")
    with _setup_lock:
        if not _registered:
            # The core's C functions (hits without the GIL); over an uncompiled core (a stale build) there
            # are none, and Pool.lending() gives no C state: each block is an Allocation, as before.
            park, _ = compiled_module("cupool.core.park")
            module.register(_resolve, _report, _unknown, None if park is None else park.C_API)
            _registered.append(module)
    return module


def _resolve(device: int) -> tuple[Any, ...]:
    """Where torch's blocks on ``device`` come from: the pool, its ``malloc_key``, its device's
    ``stream_key``, and ``Pool.lending()``'s three (None, None, 0 where it lends nothing).

    The shim asks once per device and keeps the answer (and so the pool) until
    ``use`` changes it, as CuPy's routed allocator keeps the default pool it found.
    """
    pool = serving_pool(device)
    _served[device] = pool
    return pool, pool.malloc_key, pool.device.stream_key, *(pool.lending() or (None, None, 0))


def _check_exists(device: int) -> None:
    """Refuse (``NoDeviceError``) a device index torch's caller passed that this machine does not have.

    A C caller can pass any int, and a default pool made for it would be a device
    of its own (issue 36 #4).  On a GPU the devices are CUDA's; on the simulated
    device they are those the program opened: device 0, this thread's current one
    (``cupool.sim_device``) and any a pool already serves (a default pool made,
    ``install``, ``using``).  ``use(pool)`` opens its pool's device too.
    """
    if gpu_available():
        import cupy

        return check_index(cupy.cuda.runtime, device)  # CUDA's devices: CudaDevice's own check
    if device == 0 or (device >= 0 and (device == current_device() or existing_pool(device) is not None)):
        return
    raise NoDeviceError(f"cupool.torch: device {device} does not exist: the simulated devices are 0, the current "
                        "one (cupool.sim_device) and those a pool serves (cupool.default_pool(i), "
                        "cupool.torch.use(pool))")


def _report(error: BaseException) -> None:
    _local.error = error


def _unknown(ptr: int, size: int, device: int, stream: int) -> None:
    log.warning("cupool.torch: free of %#x (%d bytes, device %d, stream %#x), which cupool did not serve; ignored",
                ptr, size, device, stream)


def last_error() -> BaseException | None:
    """The exception behind this thread's last refused allocation (None if none was refused).

    Kept until the next refusal on this thread, as ``errno`` is: ask after the
    allocation failed (a NULL from ``alloc``, a ``RuntimeError`` from torch).
    """
    error: BaseException | None = getattr(_local, "error", None)
    return error


def use(pool: Pool | None) -> None:
    """Serve torch's allocations on ``pool``'s device from ``pool``; None: the default pools again, everywhere.

    Blocks already handed out go back to the pool they came from.
    """
    if pool is not None:
        if not isinstance(pool, Pool):
            raise TypeError(f"cupool.torch.use() takes a cupool.Pool or None, got {type(pool).__name__}")
        if not pool.device.capabilities.device_memory:
            raise ValueError(f"cupool.torch.use(): {pool!r} holds pinned host memory, which cannot back CUDA tensors")
    with _setup_lock:
        if pool is None:
            _pools.clear()
        else:
            _pools[pool.device.index] = pool
        _served.clear()
        if _registered:
            _registered[0].forget()


def serving_pool(device: int) -> Pool:
    """The pool torch's allocations on ``device`` come from (the default pool is made if need be).

    ``NoDeviceError`` for a device this machine does not have (``_check_exists``).
    """
    pool = _pools.get(device)
    if pool is None:  # the shim keeps the pool it took: a default pool forgotten since (reset_default_pools) too
        pool = _served.get(device)
    if pool is None:
        _check_exists(device)
        pool = default_pool(device)
    return pool


def serving_pools() -> dict[int, Pool]:
    """The pools serving torch now, by device index: each ``use`` gave, and each the shim has taken since."""
    return dict(sorted({**_served, **_pools}.items()))


def live_blocks() -> int:
    """How many blocks torch holds through the shim now (0 where it is not built)."""
    return int(_registered[0].live()) if _registered else 0


#: How a torch user installs a supported torch: pyproject's ``torch`` extra, from the checkout (as the README says).
TORCH_EXTRA = "pip install \".[torch]\" in cupool's checkout"


def _import_torch() -> ModuleType:
    """torch, imported; ``TorchAllocatorError`` where it is missing or cannot be imported."""
    try:
        import torch
    except (ImportError, OSError) as e:  # OSError: a torch whose own libraries fail to load
        said = "PyTorch is not installed" if _not_installed(e) else f"PyTorch cannot be imported ({e})"
        raise TorchAllocatorError(f"{said}; {TORCH_EXTRA} installs a supported one") from e
    return torch


def _not_installed(error: BaseException | None) -> bool:
    """Whether ``error`` (``import torch``'s) says torch is not installed, rather than that it failed to load."""
    return isinstance(error, ModuleNotFoundError) and error.name == "torch"


def _has_cuda(torch: ModuleType) -> bool:
    """Whether this torch is built with CUDA (or HIP): has the C function ``CUDAPluggableAllocator`` calls.

    A CPU-only torch has ``torch.cuda.memory.CUDAPluggableAllocator`` but not
    ``torch._C._cuda_customAllocator``: the user would meet an ``AttributeError``
    from inside torch (issue 36 #8).
    """
    return getattr(torch._C, "_cuda_customAllocator", None) is not None


def torch_status() -> tuple[str, str]:
    """``(version | "not installed" | "cannot be imported", what it has)``: the torch ``cupool info`` shows.

    Imports torch where it is installed.
    """
    try:
        torch = _import_torch()
    except TorchAllocatorError as e:
        if _not_installed(e.__cause__):
            return "not installed", TORCH_EXTRA
        return "cannot be imported", str(e.__cause__)
    if not _has_cuda(torch):
        return str(torch.__version__), "no CUDA: cupool cannot serve its tensors"
    version = torch.version
    backend = f"CUDA {version.cuda}" if version.cuda else f"HIP {version.hip}"
    return str(torch.__version__), backend


def allocator() -> Any:
    """``torch.cuda.memory.CUDAPluggableAllocator`` over cupool's shim (imports torch).

    ``TorchAllocatorError`` where torch is missing, built without CUDA, or the shim is not built.
    """
    torch = _import_torch()
    if not _has_cuda(torch):
        raise TorchAllocatorError(f"PyTorch {torch.__version__} is built without CUDA: it has no CUDA tensors "
                                  f"for cupool to serve; install a CUDA build (on Linux x86-64, {TORCH_EXTRA} "
                                  "installs one)")
    s = shim()
    from torch.cuda import memory

    return memory.CUDAPluggableAllocator(s.path, s.torch_alloc, s.free)


def switch(plugged: Any) -> None:
    """Make ``plugged`` torch's CUDA allocator; too late (torch's allocator in use) is a ``TorchAllocatorError``."""
    from torch.cuda import memory

    try:
        memory.change_current_allocator(plugged)
    except RuntimeError as e:
        raise TorchAllocatorError(f"{TOO_LATE} (torch said: {e})") from e
