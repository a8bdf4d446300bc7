"""Streaming layer weights from HDF5 through a small cache of movable buffers.

The weight-streaming pattern of the memory-management notes behind cupool: a
model too large for the device is run layer by layer; each layer's weights are
read lazily from an HDF5 file (h5py, with its chunk cache sized by
``rdcc_nbytes``), kept in a cache of ``max_cached_layers`` device buffers, and the
next ``prefetch_distance`` layers are read ahead.

Prefetching reads the host copy of upcoming layers in a background thread, so
file I/O overlaps the caller's compute on the current layer (h5py holds the GIL
while reading, but the compute of array code mostly does not).  Device memory is
taken only when a layer is actually used, so ``max_cached_layers`` bounds device
memory exactly.  Cached layers live in ``Movable`` buffers: between uses nothing
leases them, so the pool may compact them (keeping fragmentation down, which is
what the settings table measures) or spill them under pressure.
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._units import parse_size
from .core.handles import Movable
from .pool import Pool
from .pressure.spill import chunk_cache_slots
from .workloads import source_shapes

#: The source's four cache settings: (name, max_cached_layers, prefetch_distance, mean, peak fragmentation).
SOURCE_SETTINGS = [
    ("conservative", 2, 1, 0.05, 0.12),
    ("default", 4, 2, 0.13, 0.44),
    ("aggressive", 6, 3, 0.08, 0.25),
    ("extreme", 8, 4, 0.06, 0.18),
]

_GROUP = "layers"


@dataclass(frozen=True)
class StreamStep:
    """One ``LayerCache.get`` and the pool right after it."""

    step: int
    layer: int
    event: str  # "hit" (on the device), "prefetched" (read ahead) or "miss" (read now)
    fragmentation: float
    reserved: int
    allocated: int
    segments: int
    seconds: float


@dataclass(frozen=True)
class SettingRow:
    """One line of ``settings_table``: cupool's figures beside the source's."""

    setting: str
    max_cached_layers: int
    prefetch_distance: int
    source_mean: float
    source_peak: float
    mean: float
    peak: float
    hits: int
    misses: int
    prefetched: int
    bytes_read: int
    seconds: float


class _Entry:
    __slots__ = ("buf", "shape", "dtype", "loaded", "used")

    def __init__(self, buf: Movable, shape: tuple[int, ...], dtype: np.dtype, now: int) -> None:
        self.buf = buf
        self.shape = shape
        self.dtype = dtype
        self.loaded = now
        self.used = now


class LayerCache:
    """Layers of an HDF5 model file, served from at most ``max_cached_layers`` device buffers.

    ``get(i)`` returns layer ``i`` as a device array (numpy on sim, CuPy on CUDA)
    that pins its buffer while alive; drop it when the layer's work is done.
    ``policy`` picks the layer to evict: ``"lru"`` or ``"fifo"``.
    """

    def __init__(
        self,
        h5_path: str | os.PathLike,
        pool: Pool,
        max_cached_layers: int = 4,
        prefetch_distance: int = 2,
        policy: str = "lru",
        rdcc_nbytes: int | str = "64MiB",
    ) -> None:
        if not isinstance(pool, Pool):
            raise TypeError(f"LayerCache needs a cupool.Pool, got {type(pool).__name__}")
        for name, v, lo in (("max_cached_layers", max_cached_layers, 1), ("prefetch_distance", prefetch_distance, 0)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
            if v < lo:
                raise ValueError(f"{name} must be >= {lo}, got {v}")
        if policy not in ("lru", "fifo"):
            raise ValueError(f"policy must be 'lru' or 'fifo', got {policy!r}")
        import h5py

        cache = parse_size(rdcc_nbytes, name="rdcc_nbytes")
        self._file = h5py.File(h5_path, "r", rdcc_nbytes=cache, rdcc_nslots=chunk_cache_slots(cache, 1 << 20))
        if _GROUP not in self._file:
            self._file.close()
            raise ValueError(f"{h5_path} has no '{_GROUP}' group of layer datasets (see build_model_file)")
        self._layers = [self._file[_GROUP][k] for k in sorted(self._file[_GROUP])]
        self.pool = pool
        self.max_cached_layers = max_cached_layers
        self.prefetch_distance = prefetch_distance
        self.policy = policy
        self._cached: dict[int, _Entry] = {}
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._reader = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cupool-prefetch") if prefetch_distance else None
        )
        self._clock = 0
        self.hits = 0
        self.misses = 0
        self.prefetched = 0
        self.bytes_read = 0
        self.steps: list[StreamStep] = []

    def __len__(self) -> int:
        return len(self._layers)

    def get(self, i: int) -> Any:
        """Layer ``i`` on the device, loaded (or waited for) if it is not cached."""
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < len(self._layers):
            raise IndexError(f"layer index must be in [0, {len(self._layers)}), got {i!r}")
        i = int(i)
        t0 = time.perf_counter()
        self._clock += 1
        entry = self._cached.get(i)
        if entry is not None:
            event = "hit"
            self.hits += 1
        else:
            fut = self._pending.pop(i, None)
            if fut is not None:
                event = "prefetched"
                self.prefetched += 1
                host = fut.result()
            else:
                event = "miss"
                self.misses += 1
                host = self._read(i)
            entry = self._upload(i, host)
        entry.used = self._clock
        view = entry.buf.array(entry.shape, entry.dtype)
        self._prefetch_after(i)
        s = self.pool.stats()
        self.steps.append(
            StreamStep(
                len(self.steps) + 1, i, event, s["fragmentation"], int(s["reserved_bytes.all.current"]),
                int(s["allocated_bytes.all.current"]), int(s["segment.all.current"]), time.perf_counter() - t0,
            )
        )
        return view

    def cached(self) -> list[int]:
        """Indices of the layers on the device, in load order."""
        return sorted(self._cached, key=lambda k: self._cached[k].loaded)

    def close(self) -> None:
        """Stop prefetching, free the cached buffers and close the file."""
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
            self._reader = None
        self._pending.clear()
        for entry in self._cached.values():
            entry.buf.free()
        self._cached.clear()
        self._file.close()

    def __enter__(self) -> LayerCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- internals
    def _read(self, i: int) -> np.ndarray:
        ds = self._layers[i]
        out = np.empty(ds.shape, ds.dtype)
        ds.read_direct(out)
        self.bytes_read += out.nbytes
        return out

    def _upload(self, i: int, host: np.ndarray) -> _Entry:
        while len(self._cached) >= self.max_cached_layers:
            self._evict()
        buf = self.pool.movable(host.nbytes)
        lease = buf.array(dtype=np.uint8)  # pins the buffer while its bytes are written
        assert buf.ptr is not None, "a leased buffer is on the device"
        self.pool.device.from_host(buf.ptr, host)
        del lease
        entry = self._cached[i] = _Entry(buf, host.shape, host.dtype, self._clock)
        return entry

    def _evict(self) -> None:
        key = (lambda k: self._cached[k].used) if self.policy == "lru" else (lambda k: self._cached[k].loaded)
        victim = min(self._cached, key=key)
        self._cached.pop(victim).buf.free()

    def _prefetch_after(self, i: int) -> None:
        if self._reader is None:
            return
        for j in range(i + 1, min(i + 1 + self.prefetch_distance, len(self._layers))):
            if j not in self._cached and j not in self._pending:
                self._pending[j] = self._reader.submit(self._read, j)
        # Reads for layers the stream has jumped past would only hold host memory.
        for j in [j for j in self._pending if not i < j <= i + self.prefetch_distance]:
            self._pending.pop(j).cancel()


def build_model_file(path: str | os.PathLike, shapes: Sequence[tuple[int, ...]], dtype: Any = np.float32, chunk_bytes: int | str = "1MiB") -> Path:
    """Write a synthetic model: one chunked dataset per layer, filled so that every layer's bytes differ.

    Layer ``i`` holds ``(arange(n) % 1009 + 1000 * i)`` as ``dtype``; ``layer_values``
    recomputes it for checks.
    """
    import h5py

    path = Path(path)
    chunk = parse_size(chunk_bytes, name="chunk_bytes")
    dt = np.dtype(dtype)
    with h5py.File(path, "w") as f:
        g = f.create_group(_GROUP)
        for i, shape in enumerate(shapes):
            rows = max(1, min(shape[0], chunk // max(1, int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize)))
            g.create_dataset(f"{i:05d}", data=layer_values(i, shape, dt), chunks=(rows, *shape[1:]))
    return path


def layer_values(i: int, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n, dtype=np.int64) % 1009 + 1000 * i).astype(dtype).reshape(shape)


def stream(cache: LayerCache, order: list[int], compute: Any = None) -> list[StreamStep]:
    """Run ``order`` through ``cache``, calling ``compute(array)`` on each layer; returns the steps."""
    first = len(cache.steps)
    for i in order:
        view = cache.get(i)
        if compute is not None:
            compute(view)
        del view
    return cache.steps[first:]


def settings_table(
    shapes: Sequence[tuple[int, ...]] | None = None,
    passes: int = 3,
    device: str = "sim",
    capacity: int | str | None = None,
    workdir: str | os.PathLike | None = None,
    **pool_kwargs: Any,
) -> list[SettingRow]:
    """Stream a synthetic model under the source's four cache settings; cupool's figures beside the source's.

    ``shapes`` defaults to the ten layer shapes of the first design (shared/DESIGN.md section 1; float32),
    streamed ``passes`` times in order, as a model is run once per token.  Each
    setting gets a fresh pool (``device``, ``capacity`` and ``pool_kwargs``).
    """
    shapes = source_shapes() if shapes is None else shapes
    order = list(range(len(shapes))) * passes
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = build_model_file(Path(tmp) / "model.h5", shapes)
        rows = []
        for name, cached, prefetch, src_mean, src_peak in SOURCE_SETTINGS:
            pool = Pool(device, capacity=capacity, **pool_kwargs)
            t0 = time.perf_counter()
            with LayerCache(path, pool, cached, prefetch) as cache:
                steps = stream(cache, order)
                frag = [s.fragmentation for s in steps]
                rows.append(
                    SettingRow(
                        name, cached, prefetch, src_mean, src_peak, sum(frag) / len(frag), max(frag),
                        cache.hits, cache.misses, cache.prefetched, cache.bytes_read, time.perf_counter() - t0,
                    )
                )
    return rows


def format_table(rows: list[SettingRow]) -> str:
    """The settings table as text, for ``cupool demo`` and the docs."""
    head = (
        f"{'setting':<13}{'cached':>7}{'prefetch':>9}   {'mean frag':>9} {'(source)':>8}   "
        f"{'peak frag':>9} {'(source)':>8}   {'hits':>5} {'misses':>6} {'prefetched':>10}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.setting:<13}{r.max_cached_layers:>7}{r.prefetch_distance:>9}   {r.mean:>9.3f} {r.source_mean:>8.2f}   "
            f"{r.peak:>9.3f} {r.source_peak:>8.2f}   {r.hits:>5} {r.misses:>6} {r.prefetched:>10}"
        )
    return "\n".join(lines)
