"""What a GPU's runtime and driver calls cost, measured once, for choosing between two ways of doing
one thing (compaction's copy or remap) and for estimating a GPU time from a list of calls without a GPU.

Note [Per-call costs]
~~~~~~~~~~~~~~~~~~~~~
``H200`` holds the figures of one run on an NVIDIA H200 (2026-11-28, driver 580,
``shared/gpu-runs/2026-11-28-h200/costs.md``, from ``docs/gpu-validation.json``:
``bench_vmm.py`` medians of 20, validate's compaction checks medians of 9).  Each
virtual-memory call is priced as that run measured it for one granule, its context
push and pop included (they were timed together; the 8- and 64-granule figures are
8 and 64 such calls, 10-25% cheaper each).  That run never timed one call over a
range of many granules, so a ``cuMemSetAccess`` or ``cuMemUnmap`` over a range costs
one call here whatever its length, and ``cuMemCreate`` of a large handle costs one of
a granule (``cudaMalloc`` of 2 MiB and of 128 MiB took 51.5 and 61.1 µs, so size
matters little there): the next GPU run should time both (``bench_vmm.py``).
Calls no check timed alone carry ``measured=False`` and a figure from what was
timed around them (said beside each); a benchmark prints which ones an estimate
leaned on.

Compaction's choice follows from the table (``remap_pays``): remapping a granule is an
unmap, a map and a share of one ``set_access`` (at least 18.9 + 38.8 µs with the calls
batched per range), where copying its 2 MiB at 1,337 GB/s takes 1.6 µs: on this GPU a
copy is cheaper at every size, by 30x or more, so compaction on CUDA copies through the
mover and never remaps.  On the sim device a copy is a CPU ``memmove`` (a few GB/s) and
a remap an ``mmap``: remapping wins there, and the sim device has no table (None).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CallCost:
    """One call's price: ``seconds`` per call plus ``per_byte`` seconds for each byte it moves."""

    seconds: float
    per_byte: float = 0.0
    measured: bool = True
    source: str = ""

    def of(self, nbytes: int = 0) -> float:
        return self.seconds + self.per_byte * nbytes


#: A device-to-device copy's bandwidth on the H200 (CuPy, 64 x 4 MiB: ``compaction-bandwidth``).
H200_COPY_BYTES_PER_SECOND = 1337e9
_US = 1e-6

#: Per-call costs on the H200 of 2026-11-28 (Note [Per-call costs]), by the call's name in
#: ``cupy.cuda.runtime`` or ``cuda.bindings.driver``; "launch" is the move kernel.
H200: dict[str, CallCost] = {
    "cuMemCreate": CallCost(25.8 * _US, source="bench_vmm create, 1 granule"),
    "cuMemMap": CallCost(18.9 * _US, source="bench_vmm map, 1 granule"),
    "cuMemSetAccess": CallCost(51.6 * _US, source="bench_vmm set_access, 1 granule"),
    "cuMemUnmap": CallCost(38.8 * _US, source="bench_vmm unmap, 1 granule"),
    "cuMemRelease": CallCost(22.0 * _US, source="bench_vmm release, 1 granule"),
    "cuMemAddressReserve": CallCost(25.8 * _US, measured=False, source="priced as cuMemCreate"),
    "cuMemAddressFree": CallCost(22.0 * _US, measured=False, source="priced as cuMemRelease"),
    "cuCtxPushCurrent": CallCost(0.0, measured=False, source="inside each VMM call's figure"),
    "cuCtxPopCurrent": CallCost(0.0, measured=False, source="inside each VMM call's figure"),
    "malloc": CallCost(51.5 * _US, source="bench_vmm cudaMalloc, 2 MiB"),
    "free": CallCost(40.8 * _US, source="bench_vmm cudaFree, 2 MiB"),
    # One 128 MiB copy took 111 us, of which the bytes at 1,337 GB/s are 100.4 us: 10.6 us a call,
    # its stream synchronization included (priced below at 0 so that it is not counted twice).
    "memcpyAsync": CallCost(10.6 * _US, 1 / H200_COPY_BYTES_PER_SECOND, source="one 128 MiB copy: 111 us"),
    "cuMemcpyBatchAsync": CallCost(10.6 * _US, 1 / H200_COPY_BYTES_PER_SECOND, measured=False,
                                   source="priced as one memcpyAsync of all its bytes"),
    "memcpy": CallCost(10.6 * _US, 1 / H200_COPY_BYTES_PER_SECOND, measured=False, source="priced as memcpyAsync"),
    "streamSynchronize": CallCost(0.0, measured=False, source="inside memcpyAsync's figure"),
    "deviceSynchronize": CallCost(0.0, measured=False, source="waits for queued work, priced with it"),
    # 4,096 moves of 4 KiB (16 MiB) in one launch took 1,256 us: 13.4 GB/s on moves that small.
    "launch": CallCost(0.0, 1256 * _US / (16 << 20), source="4,096 moves of 4 KiB: 1,256 us"),
    "streamCreateWithFlags": CallCost(0.0, measured=False, source="once per device"),
}


def copy_seconds(costs: dict[str, CallCost], nbytes: int) -> float:
    """One device-to-device copy of ``nbytes``: the baseline compaction's targets are stated against."""
    return costs["memcpyAsync"].of(nbytes)


def remap_seconds(costs: dict[str, CallCost], granules: int) -> float:
    """Remapping ``granules`` granules, the calls batched per range: one unmap, a map each, one set_access."""
    return costs["cuMemUnmap"].of() + granules * costs["cuMemMap"].of() + costs["cuMemSetAccess"].of()


def remap_pays(costs: dict[str, CallCost] | None, nbytes: int, granule: int) -> bool:
    """Whether remapping ``nbytes`` of whole granules is cheaper than copying them (Note [Per-call costs]).

    ``costs`` None (a device without a table: the sim device's memfd) remaps, as a CPU copy costs more there.
    """
    if costs is None:
        return True
    return remap_seconds(costs, nbytes // granule) < copy_seconds(costs, nbytes)
