"""Spill and restore throughput per tier, and the layer cache's per-step time with and without prefetch.

Every figure is a median over ``--repeat`` runs, beside a baseline measured in the
same run on the same bytes: a plain host copy (numpy, into preallocated memory)
for the host tier, an h5py chunked write / read of one dataset for the HDF5 tier.
The cost of the CRC-32 every spill stores and every restore checks is measured by
running each tier again with the checksum switched off (this script only).

    python benchmarks/bench_spill.py [--device sim|cuda] [--mib 256] [--buffers 16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

import cupool
from cupool import streaming, workloads
from cupool.pressure import spill

MiB = 1 << 20


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_tier(device: str, spill: str, total: int, nbuf: int, repeat: int) -> tuple[float, float]:
    """Seconds to spill, then to restore, ``nbuf`` buffers holding ``total`` bytes."""
    pool = cupool.Pool(device, capacity=None if device != "sim" else 2 * total, spill=spill, defrag_threshold=None)
    bufs = [pool.movable(total // nbuf) for _ in range(nbuf)]
    for i, m in enumerate(bufs):
        m.array(dtype=np.uint8)[:] = i
    spill_t, restore_t = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        assert pool.spill() == total
        spill_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for m in bufs:
            m.array(dtype=np.uint8)
        pool.device.synchronize()
        restore_t.append(time.perf_counter() - t0)
    return statistics.median(spill_t), statistics.median(restore_t)


@contextlib.contextmanager
def checksums_off() -> Iterator[None]:
    """The tiers as they would be without verification: the checksum they store and check is a constant."""
    real = spill.checksum
    spill.checksum = lambda data: 0
    try:
        yield
    finally:
        spill.checksum = real


def bench_crc32(total: int, nbuf: int, repeat: int) -> float:
    """Seconds for zlib.crc32 over ``total`` bytes in ``nbuf`` buffers: the checksum's floor per spill or restore."""
    data = np.ones(total, np.uint8)
    size = total // nbuf
    return _median_time(lambda: [zlib.crc32(data[k * size : (k + 1) * size]) for k in range(nbuf)], repeat)


def bench_device_write(device: str, total: int, nbuf: int, repeat: int) -> float:
    """Seconds to copy ``total`` host bytes into ``nbuf`` freshly allocated device segments.

    A restore lands in a fresh segment (spilling gave the old one back), so this is
    the floor under every tier's restore time; on the sim device it is the cost of
    faulting in arena pages that ``free`` returned to the OS.
    """
    dev = cupool.Pool(device, capacity=None if device != "sim" else 2 * total).device
    size = total // nbuf
    data = np.ones(size, np.uint8)
    times = []
    for _ in range(repeat):
        ptrs = [dev.malloc(size) for _ in range(nbuf)]
        t0 = time.perf_counter()
        for ptr in ptrs:
            dev.from_host(ptr, data)
        dev.synchronize()
        times.append(time.perf_counter() - t0)
        for ptr in ptrs:
            dev.free(ptr, size)
    return statistics.median(times)


def bench_baselines(total: int, nbuf: int, repeat: int, tmp: Path) -> tuple[float, float, float, float]:
    """Plain host copy there and back, and h5py chunked write and read, of the same bytes."""
    src = np.ones(total, np.uint8)
    dst = np.empty_like(src)
    size = total // nbuf

    def copy_out() -> None:
        for k in range(nbuf):
            np.copyto(dst[k * size : (k + 1) * size], src[k * size : (k + 1) * size])

    def copy_in() -> None:
        for k in range(nbuf):
            np.copyto(src[k * size : (k + 1) * size], dst[k * size : (k + 1) * size])

    # One open file, as the tier keeps one; like the tier, a read drops its dataset.
    f = h5py.File(tmp / "baseline.h5", "w", rdcc_nbytes=64 * MiB)

    def h5_write() -> None:
        for k in range(nbuf):
            ds = f.create_dataset(f"b{k}", shape=(size,), dtype=np.uint8, chunks=(min(size, 4 * MiB),))
            ds.write_direct(src[k * size : (k + 1) * size])
        f.flush()

    def h5_read() -> None:
        for k in range(nbuf):
            out = np.empty(size, np.uint8)
            f[f"b{k}"].read_direct(out)
            del f[f"b{k}"]

    def h5_round_trips(timed) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            h5_write()
            t1 = time.perf_counter()
            h5_read()
            times.append((t1 - t0) if timed == "write" else (time.perf_counter() - t1))
        return statistics.median(times)

    copy_out()  # touch the pages once, as the pool's arena is touched before it spills
    try:
        return (
            _median_time(copy_out, repeat), _median_time(copy_in, repeat),
            h5_round_trips("write"), h5_round_trips("read"),
        )
    finally:
        f.close()


def bench_streaming(device: str, tmp: Path, repeat: int, layers: int) -> dict[int, float]:
    """Median per-step seconds of a pass over the model, with and without prefetch, with a matmul per layer."""
    shapes = [workloads.MIXED_SHAPES[i % 6] for i in range(layers)]
    path = streaming.build_model_file(tmp / "model.h5", shapes)
    rhs = {}

    def compute(w: np.ndarray) -> None:  # stands in for the layer's work; releases the GIL
        x = rhs.setdefault(w.shape[1], np.ones((w.shape[1], 256), np.float32))
        np.asarray(w) @ x

    out = {}
    for prefetch in (0, 2):
        per_step = []
        for _ in range(repeat):
            pool = cupool.Pool(device, capacity="1GiB" if device == "sim" else None)
            with streaming.LayerCache(path, pool, max_cached_layers=2, prefetch_distance=prefetch) as cache:
                t0 = time.perf_counter()
                streaming.stream(cache, list(range(layers)), compute)
                per_step.append((time.perf_counter() - t0) / layers)
        out[prefetch] = statistics.median(per_step)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="sim")
    ap.add_argument("--mib", type=int, default=256, help="bytes spilled per run, in MiB")
    ap.add_argument("--buffers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    total = args.mib * MiB
    gb = total / 1e9
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        copy_out, copy_in, h5w, h5r = bench_baselines(total, args.buffers, args.repeat, tmp)
        with checksums_off():
            bare = {
                "host": bench_tier(args.device, "host", total, args.buffers, args.repeat),
                "hdf5": bench_tier(args.device, str(tmp / "bare.h5"), total, args.buffers, args.repeat),
            }
        host_s, host_r = bench_tier(args.device, "host", total, args.buffers, args.repeat)
        h5_s, h5_r = bench_tier(args.device, str(tmp / "spill.h5"), total, args.buffers, args.repeat)
        dev_w = bench_device_write(args.device, total, args.buffers, args.repeat)
        crc = bench_crc32(total, args.buffers, args.repeat)
        print(f"spill/restore of {args.mib} MiB in {args.buffers} buffers on {args.device}, median of {args.repeat}")
        print(f"{'':<22}{'GB/s':>8}{'baseline GB/s':>15}{'ratio':>8}")
        for name, t, base in (
            ("host spill", host_s, copy_out), ("host restore", host_r, copy_in),
            ("hdf5 spill", h5_s, h5w), ("hdf5 restore", h5_r, h5r),
        ):
            print(f"{name:<22}{gb / t:>8.2f}{gb / base:>15.2f}{base / t:>8.2f}")
        print(f"{'device write':<22}{gb / dev_w:>8.2f}   (host -> fresh device segments: every restore's floor)")
        print(f"\nCRC-32 checksums (zlib.crc32 alone: {gb / crc:.2f} GB/s), seconds without / with, and the ratio:")
        for name, (s, r) in (("host", (host_s, host_r)), ("hdf5", (h5_s, h5_r))):
            bs, br = bare[name]
            print(f"  {name + ' spill':<20}{bs:>8.4f} / {s:.4f}  {s / bs:.2f}x")
            print(f"  {name + ' restore':<20}{br:>8.4f} / {r:.4f}  {r / br:.2f}x")
        steps = bench_streaming(args.device, tmp, args.repeat, args.layers)
        print(f"\nlayer cache, {args.layers} layers, 2 cached, a matmul per layer (median per-step time):")
        print(f"  no prefetch        {steps[0] * 1e3:8.3f} ms")
        print(f"  prefetch 2         {steps[2] * 1e3:8.3f} ms   ({steps[0] / steps[2]:.2f}x faster)")


if __name__ == "__main__":
    main()
