"""Where a pool's plain segments come from: an upstream, in RMM's manner, chosen by name.

Charter: this module knows devices' allocation calls and nothing of pools, heaps
or policy.  A pool takes each plain segment from its upstream and gives it back
there (``cupool.core.segments.DeviceSegments``); device services (streams,
events, arrays, moves) stay the device's.  Virtual memory (expandable segments)
is a segment source of its own and takes no upstream.

An upstream implements three hooks, as RMM's ``device_memory_resource`` does:

1. ``allocate(nbytes, stream) -> int``: the address of ``nbytes`` of fresh memory,
   usable in stream order on ``stream`` (a device's stream key), or
   ``DeviceOutOfMemory`` with nothing changed;
2. ``deallocate(ptr, nbytes, stream)``: give it back, in stream order on ``stream``;
3. ``mem_info() -> (free, total)``: what this upstream can still hand out, and its
   total, which a pool's percentages and default limit are taken of.

| kind | segments from | total | growing and trimming |
| --- | --- | --- | --- |
| ``device`` | ``cudaMalloc`` / the sim arena | the device's memory | ``cudaFree`` synchronizes the device |
| ``managed`` | ``cudaMallocManaged`` / the sim device's managed memory | the device's memory plus host memory it may page out to (the sim device: its address span) | as ``device``; more may be reserved than the device holds (oversubscription) |
| ``async`` | ``cudaMallocAsync`` on the segment's stream / the sim device's stream-ordered model | the device's memory | never synchronizes: the driver frees in stream order |

A new upstream is one class here with these three hooks and one line in ``KINDS``,
plus the device calls it needs on each device.
"""

from __future__ import annotations

from typing import Any, Protocol


class Upstream(Protocol):
    """The hooks a pool calls on its upstream (numbered in the module's docstring)."""

    kind: str

    def allocate(self, nbytes: int, stream: Any) -> int: ...
    def deallocate(self, ptr: int, nbytes: int, stream: Any) -> None: ...
    def mem_info(self) -> tuple[int, int]: ...


class DeviceUpstream:
    """``cudaMalloc`` and ``cudaFree`` (the sim arena's ``malloc`` and ``free``)."""

    kind = "device"

    def __init__(self, device: Any) -> None:
        self.device = device

    def allocate(self, nbytes: int, stream: Any) -> int:
        return int(self.device.malloc(nbytes))

    def deallocate(self, ptr: int, nbytes: int, stream: Any) -> None:
        self.device.free(ptr, nbytes)

    def mem_info(self) -> tuple[int, int]:
        free, total = self.device.mem_info()
        return int(free), int(total)


class ManagedUpstream(DeviceUpstream):
    """``cudaMallocManaged``: memory the driver pages between device and host, so a pool may hold more
    than the device has.  Never ask a shared GPU for more than it has free: that can hang it."""

    kind = "managed"

    def allocate(self, nbytes: int, stream: Any) -> int:
        return int(self.device.malloc_managed(nbytes))

    def deallocate(self, ptr: int, nbytes: int, stream: Any) -> None:
        self.device.free_managed(ptr, nbytes)

    def mem_info(self) -> tuple[int, int]:
        free, total = self.device.managed_info()
        return int(free), int(total)


class AsyncUpstream(DeviceUpstream):
    """``cudaMallocAsync`` / ``cudaFreeAsync`` on the segment's stream: growing and trimming never
    synchronize the device; the driver's pool orders reuse after the stream's work."""

    kind = "async"

    def allocate(self, nbytes: int, stream: Any) -> int:
        return int(self.device.malloc_async(nbytes, 0 if stream is None else stream))

    def deallocate(self, ptr: int, nbytes: int, stream: Any) -> None:
        self.device.free_async(ptr, nbytes, 0 if stream is None else stream)


#: Every upstream, by the name ``Pool(upstream=...)`` and ``CUPOOL_CONF`` take.
KINDS: dict[str, type[DeviceUpstream]] = {"device": DeviceUpstream, "managed": ManagedUpstream, "async": AsyncUpstream}


def make_upstream(kind: Any, device: Any) -> DeviceUpstream:
    """The upstream named ``kind`` over ``device``; a ``ValueError`` naming an unknown one, or one the device lacks."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"upstream must be one of {', '.join(KINDS)}, got {kind!r}")
    needs = {"managed": "malloc_managed", "async": "malloc_async"}.get(kind)
    if needs is not None and not callable(getattr(device, needs, None)):
        raise ValueError(f"upstream={kind!r}: the {device.name} device ({type(device).__name__}) has no {kind} memory")
    return KINDS[kind](device)
