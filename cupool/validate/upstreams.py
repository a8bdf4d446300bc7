"""The upstreams' GPU checks (issue 27): stream-ordered growth and trim without a device synchronization,
and managed memory on a streaming workload with and without prefetch.

* ``async-release``: a pool on ``upstream="async"`` with ``release_threshold=0`` grows and gives
  back a segment per round on stream B while a kernel that spins for a set time runs on stream A.
  A device synchronization would wait for that kernel, so the kernel still running when the
  rounds are done proves there was none (provided the rounds took less than the spin: the
  check says when they did not, as then it proves nothing).  ``upstream="device"`` runs the
  same beside it, for its figures (``cudaFree`` synchronizes).  The driver pool's idle bytes
  after a stream synchronization show the release threshold at work.  On the sim device, the
  device's synchronization counter says the same.
* ``managed-streaming``: chunks of managed memory, each written by a kernel and reduced, kept
  live until the end (a streaming working set), with the upstream's prefetch and advice and
  without them (a device that takes no hints), timed as interleaved medians.  The working set
  is a quarter of the device's free memory, measured first and capped, so no more managed
  memory is asked for than is free: on a GPU that others share, more can hang it.  On the sim
  device the same runs, and a second working set past the capacity shows the rule: what fits
  is prefetched, the rest is not.

``pool.empty_cache()`` waits for the device by design (it settles every stream), so the
trims measured here are those ``release_threshold`` makes at a free.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..device.cuda import CudaDevice
from ..device.sim import SimDevice
from ..pool import Pool
from .records import FAILED, PASSED, Context, Result, Table, skipped

MiB = 1 << 20
#: How long the kernel on stream A spins, in milliseconds (the trims on stream B must take less).
SPIN_MS = 400.0
_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


# --------------------------------------------------------------------------- async-release
def async_release(ctx: Context) -> Result:
    """Grow and trim on the async upstream without a device synchronization, beside ``upstream="device"``."""
    rounds = 5 if ctx.quick else 20
    if ctx.rehearsal:
        return _async_on_sim(rounds)
    import cupy as cp

    kernel = cp.RawKernel(_SPIN, "spin")
    rt = cp.cuda.runtime
    try:
        clock_khz = int(rt.deviceGetAttribute(rt.cudaDevAttrClockRate, cp.cuda.Device().id))
    except (AttributeError, rt.CUDARuntimeError):  # a toolkit without the attribute: assume a fast clock
        clock_khz = 0
    # kHz x ms: cycles at the stated clock, at least 2 GHz's worth (a faster clock only shortens the spin).
    cycles = int(max(clock_khz, 2_000_000) * SPIN_MS)
    table = Table(("upstream", "rounds", "grow+trim (ms)", "kernel on stream A still running after",
                   "driver idle after a stream sync"))
    figures: dict[str, float] = {}
    problems: list[str] = []
    for upstream in ("async", "device"):
        pool = Pool(ctx.device, upstream=upstream, release_threshold=0, expandable_segments=False)
        a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        with a:
            kernel((1,), (1,), (cp.int64(cycles),))
        t0 = time.perf_counter()
        for _ in range(rounds):
            pool.malloc(64 * MiB, stream=b).free()
        seconds = time.perf_counter() - t0
        busy = not a.done
        b.synchronize()
        idle = "-"
        if upstream == "async":
            assert isinstance(pool.device, CudaDevice)
            reserved, used = pool.device.async_pool_info()
            idle = f"{(reserved - used) / MiB:.0f} MiB"
            figures["async: driver idle bytes after a stream sync"] = reserved - used
        a.synchronize()
        s = pool.stats()
        pool.close()
        figures[f"{upstream}: grow+trim, {rounds} rounds (ms)"] = seconds * 1e3
        figures[f"{upstream}: kernel still running after (1 = yes)"] = int(busy)
        table.rows.append((upstream, rounds, f"{seconds * 1e3:.2f}", "yes" if busy else "no", idle))
        if upstream == "async":
            if s["num_device_free"] != rounds:
                problems.append(f"async: {s['num_device_free']} segments given back where {rounds} were expected")
            if seconds * 1e3 >= SPIN_MS:
                problems.append(f"async: the rounds took {seconds * 1e3:.0f} ms, no less than the kernel's "
                                f"{SPIN_MS:.0f} ms spin, so its still running proves nothing")
            elif not busy:
                problems.append("async: the kernel on stream A had finished when the rounds did: something "
                                "synchronized the device")
    return Result(
        FAILED if problems else PASSED,
        summary=("async upstream: grow+trim with a kernel still running on another stream (no device sync)"
                 if not problems else problems[0]),
        details="\n".join([*problems, f"A {SPIN_MS:.0f} ms kernel on stream A; segments of 64 MiB grown and "
                           "given back (release_threshold=0) on stream B."]),
        commands=["python -m cupool.validate --only async-release"],
        figures=figures, tables=[table],
    )


def _async_on_sim(rounds: int) -> Result:
    table = Table(("upstream", "rounds", "segments given back", "device synchronizations"))
    figures: dict[str, float] = {}
    for upstream in ("async", "device"):
        pool = Pool("sim", capacity=256 * MiB, upstream=upstream, release_threshold=0, expandable_segments=False)
        dev = pool.device
        assert isinstance(dev, SimDevice)
        before = dev.syncs
        for _ in range(rounds):
            pool.malloc(64 * MiB, stream=1).free()
        syncs = dev.syncs - before
        table.rows.append((upstream, rounds, pool.stats()["num_device_free"], syncs))
        figures[f"{upstream}: device synchronizations in {rounds} rounds"] = syncs
        pool.close()
    ok = figures[f"async: device synchronizations in {rounds} rounds"] == 0
    return Result(
        PASSED if ok else FAILED,
        summary=f"sim: async grow+trim made {figures[f'async: device synchronizations in {rounds} rounds']:.0f} "
        f"device synchronizations, device made {figures[f'device: device synchronizations in {rounds} rounds']:.0f}",
        commands=["python -m cupool.validate --device sim --only async-release"],
        figures=figures, tables=[table],
    )


# --------------------------------------------------------------------------- managed-streaming
def _variant(device_class: type, hints: bool) -> type:
    """``device_class`` counting the bytes it prefetches, and (``hints`` false) taking no hints at all."""

    def prefetch(self: Any, ptr: int, nbytes: int, stream: int) -> None:
        self.prefetched_here += nbytes
        getattr(device_class, "prefetch")(self, ptr, nbytes, stream)

    body: dict[str, Any] = {"prefetch": prefetch, "prefetched_here": 0}
    if not hints:
        body["managed_hints"] = False
    return type(f"{device_class.__name__}{'Hinted' if hints else 'Unhinted'}", (device_class,), body)


def _stream_through(pool: Pool, chunks: int, chunk: int, sync: Any) -> tuple[float, float]:
    """Write and reduce ``chunks`` managed chunks, all kept live; (seconds, checksum)."""
    t0 = time.perf_counter()
    live, total = [], 0.0
    for i in range(chunks):
        a: Any = pool.empty(chunk // 4, "float32")
        a.fill(float(i + 1))
        total += float(a.sum())
        live.append(a)
    sync()
    seconds = time.perf_counter() - t0
    del live
    return seconds, total


def managed_streaming(ctx: Context) -> Result:
    """A streaming working set on managed memory below the device's free memory, with and without prefetch."""
    chunk = (16 if ctx.rehearsal else 64) * MiB
    repeat = 3 if ctx.quick else 7
    if ctx.rehearsal:
        make: Any = lambda cls: cls("512MiB")  # noqa: E731
        sync: Any = lambda: None  # noqa: E731
        base: type = SimDevice
    else:
        import cupy as cp

        make = lambda cls: cls(cp.cuda.Device().id)  # noqa: E731
        sync = cp.cuda.Device().synchronize
        base = CudaDevice
    probe = make(base)
    free = int(probe.mem_info()[0])
    cap = ((32 if ctx.quick else 128) if ctx.rehearsal else 512 if ctx.quick else 2048) * MiB
    working = min(cap, free // 4)
    chunks = working // chunk
    if chunks < 2:
        return skipped(f"only {free / MiB:.0f} MiB free on the device: too little for a working set of two "
                       f"{chunk // MiB} MiB chunks at a quarter of it")
    if not probe.managed_hints:
        return skipped(f"{probe.name} takes no managed-memory prefetch or advice (no concurrent managed access)")
    samples: dict[str, list[float]] = {"with": [], "without": []}
    sums, prefetched = set(), {"with": 0, "without": 0}
    for _ in range(repeat):
        for label, hints in (("with", True), ("without", False)):
            device = make(_variant(base, hints))
            pool = Pool(device, upstream="managed")
            seconds, total = _stream_through(pool, chunks, chunk, sync)
            pool.close()
            samples[label].append(seconds)
            sums.add(total)
            prefetched[label] = device.prefetched_here
    med = {k: statistics.median(v) for k, v in samples.items()}
    figures: dict[str, float] = {
        "free before (MiB)": free / MiB, "working set (MiB)": chunks * chunk / MiB,
        "with prefetch (ms)": med["with"] * 1e3, "without prefetch (ms)": med["without"] * 1e3,
        "without / with (x)": med["without"] / med["with"], "prefetched (MiB)": prefetched["with"] / MiB,
    }
    table = Table(("variant", "median (ms)", "prefetched"))
    for label in ("with", "without"):
        table.rows.append((f"{label} prefetch and advice", f"{med[label] * 1e3:.2f}",
                           f"{prefetched[label] // MiB} MiB"))
    problems = []
    if len(sums) != 1:
        problems.append(f"the checksums differ between runs: {sorted(sums)}")
    if prefetched["with"] < chunks * chunk:
        problems.append(f"{prefetched['with'] // MiB} MiB prefetched of a {chunks * chunk // MiB} MiB working set "
                        "that fits")
    if ctx.rehearsal:
        over = _oversubscribed_on_sim(chunk)
        figures.update(over)
        table.rows.append(("sim, 768 MiB on a 512 MiB device", "-", f"{over['past capacity: prefetched (MiB)']:.0f} "
                           f"MiB, {over['past capacity: not prefetched (MiB)']:.0f} MiB not"))
        if over["past capacity: prefetched (MiB)"] > 512:
            problems.append("past the capacity, segments were still prefetched")
    return Result(
        FAILED if problems else PASSED,
        summary=problems[0] if problems else f"{chunks * chunk // MiB} MiB in {chunks} chunks: with prefetch "
        f"{med['with'] * 1e3:.1f} ms, without {med['without'] * 1e3:.1f} ms (medians of {repeat})",
        details="\n".join([*problems, f"{free // MiB} MiB free before; the working set is at most a quarter of it, "
                           "so no more managed memory was asked for than was free."]),
        commands=[f"python -m cupool.validate{' --device sim' if ctx.device == 'sim' else ''} --only "
                  "managed-streaming"],
        figures=figures, tables=[table],
    )


def _oversubscribed_on_sim(chunk: int) -> dict[str, float]:
    """On the sim device only: 768 MiB of managed chunks on a 512 MiB device; what was prefetched."""
    pool = Pool("sim", capacity=512 * MiB, upstream="managed")
    device = pool.device
    assert isinstance(device, SimDevice)
    live = [pool.malloc(chunk) for _ in range(768 * MiB // chunk)]
    out = {"past capacity: prefetched (MiB)": device.prefetched / MiB,
           "past capacity: not prefetched (MiB)": (768 * MiB - device.prefetched) / MiB,
           "past capacity: oversubscribed (MiB)": device.oversubscribed / MiB}
    del live
    pool.close()
    return out
