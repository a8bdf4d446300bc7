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

Two more a pool may call: ``stats()``, the upstream's own figures (names in the table
below), and ``set_release_threshold(nbytes)``, told the pool's ``release_threshold``.

| kind | segments from | total | growing and trimming | figures |
| --- | --- | --- | --- | --- |
| ``device`` | ``cudaMalloc`` / the sim arena | the device's memory | ``cudaFree`` synchronizes the device | none |
| ``managed`` | ``cudaMallocManaged``, advised and prefetched (below) / the sim device's managed memory | the device's memory plus host memory it may page out to (the sim device: its address span) | as ``device``; more may be reserved than the device holds (oversubscription) | ``managed.reserved_bytes``, ``managed.prefetched_bytes``, ``managed.unprefetched_bytes``, ``managed.oversubscribed_bytes`` (where the device knows it), ``num_prefetches``, ``num_prefetches_skipped`` |
| ``async`` | ``cudaMallocAsync`` / ``cudaFreeAsync`` on the segment's stream, from the device's default memory pool / the sim device's stream-ordered pool | the device's memory | never synchronizes: the driver frees in stream order | ``async.release_threshold``, ``async.driver_reserved_bytes``, ``async.driver_idle_bytes`` |

**Managed memory: advice and prefetch.**  A managed segment that fits in the device's
free memory when it is handed out (``mem_info()`` just before ``cudaMallocManaged``) is
advised to live on the device (preferred location) and to be mapped there (accessed by),
and prefetched to the device on the segment's stream: its first kernels then run without
page faults, and the driver keeps it resident rather than another segment's pages.  A
segment past that point (oversubscription) is only advised accessed-by, never prefetched:
a prefetch there makes the driver evict resident pages, those of the working set the pool
already handed out, to make room for pages nobody has touched, and the next kernels fault
them back (thrashing); unprefetched, its pages are placed on first touch, where they are
used, and the device reads them through its mapping where they lie.  Devices without
concurrent managed access (``managed_hints`` false: Windows, some embedded boards) take
no hints at all; the managed memory works the same, unadvised.

**Stream-ordered memory: the release threshold.**  The driver's pool keeps freed memory
until a synchronization (stream, event or device), then gives back what it holds beyond
its release threshold (``cudaMemPoolAttrReleaseThreshold``, counted over all it holds,
in use or idle).  cupool caches segments itself, so a segment it gives back was judged
surplus by the pool's own rule; the driver's threshold follows that rule: the pool's
``release_threshold`` (keep while no more than that is held), and 0 without one, where
cupool gives segments back only on ``empty_cache()`` or to make room, both meaning "give
it back".  A larger threshold (RMM sets the device's whole memory, PyTorch's own async
backend the maximum) would cache the same bytes twice, hidden from every other user of
the device.  The threshold belongs to the device's default pool, shared by the process:
the last pool made (or told) on a device sets it.  Between synchronizations the freed
bytes stay reusable by the next ``cudaMallocAsync``, so a pool that trims to make room
and grows again takes them back without a synchronization.

A new upstream is one class here with these hooks and one line in ``KINDS``, plus the
device calls it needs on each device.
"""

from __future__ import annotations

from typing import Any, Protocol

#: The advice a managed upstream gives (``device.advise(ptr, nbytes, advice)``): cudaMemAdvise's
#: SetPreferredLocation and SetAccessedBy, both for the segment's own device.
ADVICE = ("preferred_location", "accessed_by")


class Upstream(Protocol):
    """The hooks a pool calls on its upstream (numbered in the module's docstring)."""

    kind: str

    def allocate(self, nbytes: int, stream: Any) -> int: ...
    def deallocate(self, ptr: int, nbytes: int, stream: Any) -> None: ...
    def mem_info(self) -> tuple[int, int]: ...
    def stats(self) -> dict[str, int]: ...
    def set_release_threshold(self, nbytes: int | None) -> None: ...


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

    def stats(self) -> dict[str, int]:
        """This upstream's own figures (the module's table); ``cudaMalloc`` has none."""
        return {}

    def set_release_threshold(self, nbytes: int | None) -> None:
        """The pool's ``release_threshold`` (None: unset); only the stream-ordered upstream passes it on."""
        return None


class ManagedUpstream(DeviceUpstream):
    """``cudaMallocManaged``: memory the driver pages between device and host, so a pool may hold more
    than the device has; advised and prefetched while it fits (the module's docstring says why).
    Never ask a shared GPU for more than it has free: that can hang it."""

    kind = "managed"

    def __init__(self, device: Any) -> None:
        super().__init__(device)
        self.hints = bool(getattr(device, "managed_hints", False))
        self.reserved = 0
        self.prefetches = 0
        self.skipped = 0
        self._prefetched: dict[int, int] = {}  # live segments prefetched when handed out
        self._unprefetched: dict[int, int] = {}  # live segments handed out past the device's free memory

    def allocate(self, nbytes: int, stream: Any) -> int:
        free = self.device.mem_info()[0] if self.hints else 0
        ptr = int(self.device.malloc_managed(nbytes))
        fits = nbytes <= free
        if self.hints:
            try:
                self._hint(ptr, nbytes, fits, 0 if stream is None else stream)
            except BaseException:
                self.device.free_managed(ptr, nbytes)
                raise
        (self._prefetched if fits else self._unprefetched)[ptr] = nbytes
        self.reserved += nbytes
        return ptr

    def _hint(self, ptr: int, nbytes: int, fits: bool, stream: Any) -> None:
        if fits:
            self.device.advise(ptr, nbytes, "preferred_location")
            self.device.advise(ptr, nbytes, "accessed_by")
            self.device.prefetch(ptr, nbytes, stream)
            self.prefetches += 1
        else:
            self.device.advise(ptr, nbytes, "accessed_by")
            self.skipped += 1

    def deallocate(self, ptr: int, nbytes: int, stream: Any) -> None:
        self.device.free_managed(ptr, nbytes)
        self._prefetched.pop(ptr, None)
        self._unprefetched.pop(ptr, None)
        self.reserved -= nbytes

    def mem_info(self) -> tuple[int, int]:
        free, total = self.device.managed_info()
        return int(free), int(total)

    def stats(self) -> dict[str, int]:
        """Managed bytes held, those prefetched when handed out and those handed out past the device's free
        memory, and (where the device knows it) how far the device is oversubscribed."""
        out = {
            "managed.reserved_bytes": self.reserved,
            "managed.prefetched_bytes": sum(self._prefetched.values()),
            "managed.unprefetched_bytes": sum(self._unprefetched.values()),
            "num_prefetches": self.prefetches,
            "num_prefetches_skipped": self.skipped,
        }
        over = getattr(self.device, "oversubscribed", None)
        if isinstance(over, int):
            out["managed.oversubscribed_bytes"] = over
        return out


class AsyncUpstream(DeviceUpstream):
    """``cudaMallocAsync`` / ``cudaFreeAsync`` on the segment's stream: growing and trimming never
    synchronize the device; the driver's pool orders reuse after the stream's work, and keeps what
    the pool's ``release_threshold`` allows (the module's docstring says why)."""

    kind = "async"

    def __init__(self, device: Any, release_threshold: int | None = None) -> None:
        super().__init__(device)
        self.release_threshold = 0
        self.set_release_threshold(release_threshold)

    def allocate(self, nbytes: int, stream: Any) -> int:
        return int(self.device.malloc_async(nbytes, 0 if stream is None else stream))

    def deallocate(self, ptr: int, nbytes: int, stream: Any) -> None:
        self.device.free_async(ptr, nbytes, 0 if stream is None else stream)

    def set_release_threshold(self, nbytes: int | None) -> None:
        """The driver's pool keeps what the pool's ``release_threshold`` would (None: nothing past a sync)."""
        threshold = 0 if nbytes is None else nbytes
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"release_threshold: a number of bytes >= 0 or None, got {nbytes!r}")
        self.device.set_release_threshold(threshold)
        self.release_threshold = threshold

    def stats(self) -> dict[str, int]:
        """The driver pool's threshold, what it holds (in use or idle) and what of that is idle."""
        reserved, used = self.device.async_pool_info()
        return {"async.release_threshold": self.release_threshold, "async.driver_reserved_bytes": int(reserved),
                "async.driver_idle_bytes": int(reserved) - int(used)}


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
