"""The HDF5 layer cache: correct bytes, eviction, prefetch, counters and the settings table."""

import h5py
import numpy as np
import pytest

import cupool
from cupool import streaming

SHAPES = [(64, 64), (128, 32), (32, 128), (256, 16), (16, 256), (32, 32)]


@pytest.fixture
def model(tmp_path):
    return streaming.build_model_file(tmp_path / "m.h5", SHAPES, chunk_bytes="4KiB")


def test_model_file_is_chunked_with_distinct_layers(model):
    with h5py.File(model, "r") as f:
        layers = [f["layers"][k] for k in sorted(f["layers"])]
        assert [d.shape for d in layers] == SHAPES
        assert all(d.chunks is not None and np.prod(d.chunks) * 4 <= 4096 for d in layers)
        assert not np.array_equal(layers[0][:1, :1], layers[1][:1, :1])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_every_layer_arrives_intact_and_counters_add_up(model, pool, prefetch):
    order = list(range(len(SHAPES))) * 2
    with streaming.LayerCache(model, pool, max_cached_layers=3, prefetch_distance=prefetch) as cache:
        for i in order:
            view = cache.get(i)
            assert np.array_equal(view, streaming.layer_values(i, SHAPES[i]))
            del view
        assert cache.hits + cache.misses + cache.prefetched == len(order)
        assert len(cache.cached()) == 3
        assert cache.bytes_read == sum(int(np.prod(SHAPES[s.layer])) * 4 for s in cache.steps if s.event != "hit")
        if prefetch:
            assert cache.prefetched > 0 and cache.misses == 2  # the first layer of each pass
        else:
            assert cache.prefetched == 0 and cache.misses == len(order)
        assert [s.step for s in cache.steps] == list(range(1, len(order) + 1))
        assert all(0 <= s.fragmentation < 1 for s in cache.steps)
    assert pool.stats()["allocated_bytes.all.current"] == 0  # close() freed the buffers


def test_lru_and_fifo_evict_differently(model, pool):
    order = [0, 1, 0, 2]  # with room for two: LRU keeps 0, FIFO drops it
    for policy, kept in (("lru", [0, 2]), ("fifo", [1, 2])):
        with streaming.LayerCache(model, pool, max_cached_layers=2, prefetch_distance=0, policy=policy) as cache:
            streaming.stream(cache, order)
            assert sorted(cache.cached()) == kept
            assert [s.event for s in cache.steps] == ["miss", "miss", "hit", "miss"]


def test_cached_layers_are_movable_and_spill_under_pressure(model, tmp_path):
    p = cupool.Pool("sim", capacity="2MiB", spill="host")
    hog = [p.movable(500 << 10) for _ in range(4)]  # leaves 48 KiB: three of the six layers
    with streaming.LayerCache(model, p, max_cached_layers=6, prefetch_distance=0) as cache:
        for i in range(len(SHAPES)):
            assert np.array_equal(cache.get(i), streaming.layer_values(i, SHAPES[i]))
        assert p.scheduler.spills > 0
    del hog


def test_bad_arguments(model, pool, tmp_path):
    with pytest.raises(ValueError, match="max_cached_layers"):
        streaming.LayerCache(model, pool, max_cached_layers=0)
    with pytest.raises(TypeError, match="prefetch_distance"):
        streaming.LayerCache(model, pool, prefetch_distance=1.5)
    with pytest.raises(ValueError, match="policy"):
        streaming.LayerCache(model, pool, policy="mru")
    with pytest.raises(TypeError, match="Pool"):
        streaming.LayerCache(model, "sim")
    empty = tmp_path / "empty.h5"
    h5py.File(empty, "w").close()
    with pytest.raises(ValueError, match="layers"):
        streaming.LayerCache(empty, pool)
    with streaming.LayerCache(model, pool) as cache:
        with pytest.raises(IndexError, match="layer index"):
            cache.get(len(SHAPES))


def test_settings_table_has_the_four_settings_beside_the_source(tmp_path):
    rows = streaming.settings_table(shapes=SHAPES, passes=2, capacity="64MiB", workdir=tmp_path)
    assert [(r.setting, r.max_cached_layers, r.prefetch_distance) for r in rows] == [
        ("conservative", 2, 1), ("default", 4, 2), ("aggressive", 6, 3), ("extreme", 8, 4)
    ]
    assert [(r.source_mean, r.source_peak) for r in rows] == [(0.05, 0.12), (0.13, 0.44), (0.08, 0.25), (0.06, 0.18)]
    for r in rows:
        assert 0 <= r.mean <= r.peak < 1
        assert r.hits + r.misses + r.prefetched == 2 * len(SHAPES)
    assert rows[-1].hits > 0  # eight cached layers hold this six-layer model
    text = streaming.format_table(rows)
    assert "conservative" in text and "extreme" in text
