"""Which pool serves an allocation of this thread on a device.

The order is ``using`` (this thread, innermost first), then the pool of
``install`` (the whole process), then the device's default pool.  Both CuPy's
allocator (for ``pool=None``) and the Numba plugin ask here, so the two libraries
always agree on where memory goes.  This module holds the state and nothing
else in cupool.hooks keeps any, which is what lets every other hooks module
import it without a cycle.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Iterator
from typing import SupportsIndex

from ..config import ENV_VAR, env_conf
from ..device import cuda_available
from ..device.kinds import AUTO, auto_kind
from ..errors import StateError
from ..pool import Pool

_lock = threading.Lock()  # guards the default pools
_local = threading.local()
_default_pools: dict[int, Pool] = {}
_process_pool: Pool | None = None
_has_gpu: bool | None = None


def gpu_available() -> bool:
    """Whether a CUDA GPU is usable; probed once, as the answer decides every routing."""
    global _has_gpu
    if _has_gpu is None:
        _has_gpu = cuda_available()
    return _has_gpu


def current_device() -> int:
    """CuPy's current device; without a GPU, this thread's sim device (0 unless ``sim_device`` chose another)."""
    if not gpu_available():
        return getattr(_local, "sim_index", 0)
    import cupy

    return cupy.cuda.runtime.getDevice()


@contextlib.contextmanager
def sim_device(index: int) -> Iterator[int]:
    """Make sim device ``index`` this thread's current device inside the block (nests, restores).

    What ``with cupy.cuda.Device(index):`` is on a GPU, for machines without one:
    ``default_pool()``, ``current_pool()``, ``using``'s device check and the Numba
    plugin all follow it, so code that keeps a pool per device runs unchanged.
    Like CUDA's current device it is per thread, and a new thread starts on 0.
    Any index >= 0 names a sim device; its default pool is made on first use.
    """
    index = _check_index(index, "sim_device()")
    if gpu_available():
        raise StateError("sim_device(): a CUDA GPU is in use, so switch devices with cupy.cuda.Device(i)")
    previous = getattr(_local, "sim_index", 0)
    _local.sim_index = index
    try:
        yield index
    finally:
        _local.sim_index = previous


def _check_index(device: object, caller: str) -> int:
    """``device`` as a device index, or a clear error naming ``caller``; a bool is not an index."""
    if type(device) is int and device >= 0:  # the common case, on Numba's allocation path
        return device
    if isinstance(device, bool) or not isinstance(device, SupportsIndex):
        raise TypeError(f"{caller}: a device index is an int, got {device!r}")
    index = operator.index(device)
    if index < 0:
        raise ValueError(f"{caller}: a device index must be >= 0, got {index}")
    return index


def default_pool(device: int | None = None) -> Pool:
    """The pool of ``device`` (default: the current one), made on first use from ``CUPOOL_CONF``.

    Without a usable GPU the default pool of device ``i`` lives on sim device
    ``i`` (``"sim:i"``).  A bad ``CUPOOL_CONF`` raises here, every time, rather
    than falling back to defaults.
    """
    index = current_device() if device is None else _check_index(device, "default_pool()")
    pool = _default_pools.get(index)
    if pool is not None:
        return pool
    conf = env_conf()
    with _lock:
        pool = _default_pools.get(index)
        if pool is None:
            kind = conf.pop("device", AUTO)
            if kind == AUTO:
                kind = auto_kind(gpu_available()).name
            try:
                pool = Pool(f"{kind}:{index}", **conf)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{ENV_VAR}: cannot make the default pool of device {index}: {e}") from e
            _default_pools[index] = pool
    return pool


def reset_default_pools() -> None:
    """Forget the default pools, so the next use makes them again from ``CUPOOL_CONF``.

    For tests and for a changed ``CUPOOL_CONF``: memory already handed out stays
    valid, as each allocation keeps its own pool alive.
    """
    with _lock:
        _default_pools.clear()


def check_device_pool(pool: object, caller: str) -> Pool:
    """Refuse, in ``caller``'s words, a pool that cannot serve device arrays on the current device."""
    if not isinstance(pool, Pool):
        raise TypeError(f"{caller} takes a cupool.Pool, got {type(pool).__name__}")
    if not pool.device.capabilities.device_memory:
        raise ValueError(f"{caller}: {pool!r} holds pinned host memory, which cannot back device arrays")
    current = current_device()
    if pool.device.index != current:
        switch = "cupy.cuda.Device" if gpu_available() else "cupool.sim_device"
        raise ValueError(
            f"{caller}: the pool belongs to device {pool.device.index} ({pool.device.name}), "
            f"but the current device is {current}; switch devices first ({switch}({pool.device.index}))"
        )
    return pool


def current_pool(device: int | None = None) -> Pool:
    """The pool allocations of this thread go to: ``using`` first, then ``install``, then the default."""
    index = current_device() if device is None else _check_index(device, "current_pool()")
    return existing_pool(index) or default_pool(index)


def existing_pool(device: int | None = None) -> Pool | None:
    """Like ``current_pool``, but None rather than creating the default pool."""
    index = current_device() if device is None else _check_index(device, "existing_pool()")
    for pool in reversed(getattr(_local, "pools", ())):
        if pool.device.index == index:
            return pool
    process = _process_pool
    if process is not None and process.device.index == index:
        return process
    return _default_pools.get(index)


def using_pools() -> tuple[Pool, ...]:
    """The pools this thread's open ``using`` blocks route to, innermost last."""
    return tuple(getattr(_local, "pools", ()))


@contextlib.contextmanager
def thread_route(pool: Pool) -> Iterator[Pool]:
    """Put ``pool`` first for this thread inside the block; ``using`` adds CuPy's allocator on top."""
    stack = getattr(_local, "pools", None)
    if stack is None:
        stack = _local.pools = []
    stack.append(pool)
    try:
        yield pool
    finally:
        stack.pop()


def set_process_pool(pool: Pool | None) -> None:
    """Make ``pool`` the process-wide choice on its device (None: the default pools); ``install`` owns this."""
    global _process_pool
    _process_pool = pool
