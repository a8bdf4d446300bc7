"""Spill tiers: round trips with checksums, pinned host memory, HDF5 files, failures."""

import contextlib
import ctypes
import errno
import gc
import os
import re
import zlib

import h5py
import numpy as np
import pytest

import cupool
from cupool.device import CudaDevice
from cupool.pressure.spill import HDF5Tier, HostTier

MiB = 1 << 20


def fill(m, seed):
    a = m.array(dtype=np.uint8)
    a[:] = np.random.default_rng(seed).integers(0, 256, m.size, dtype=np.uint8)
    crc = zlib.crc32(a)
    del a
    return crc


def crc(m):
    return zlib.crc32(m.array(dtype=np.uint8))


@pytest.fixture(params=["host", "h5"])
def spill_pool(request, tmp_path):
    spill = "host" if request.param == "host" else str(tmp_path / "spill.h5")
    return cupool.Pool("sim", capacity="64MiB", spill=spill)


@pytest.mark.parametrize("size", [0, 1, 511, 3 * MiB + 7])
def test_round_trip_keeps_every_byte(spill_pool, size):
    m = spill_pool.movable(size)
    want = fill(m, size)
    gen = m.generation
    assert spill_pool.spill() == size
    assert not m.on_device and m.ptr is None and m.generation == gen + 1
    assert spill_pool.stats()["allocated_bytes.all.current"] == 0
    assert crc(m) == want  # .array() brought it back
    assert m.on_device and m.generation == gen + 2
    spill_pool.check()


def test_only_unleased_buffers_spill(spill_pool):
    a, b = spill_pool.movable(MiB), spill_pool.movable(MiB)
    want = fill(b, 1)
    view = a.array()
    assert spill_pool.spill() == MiB
    assert a.on_device and not b.on_device
    del view
    assert spill_pool.spill() == MiB and not a.on_device
    assert crc(b) == want


def test_spill_stops_once_enough_has_left(spill_pool):
    ms = [spill_pool.movable(MiB) for _ in range(4)]
    assert spill_pool.spill(MiB + 1) == 2 * MiB
    assert [m.on_device for m in ms] == [False, False, True, True]


def test_freeing_a_spilled_buffer_discards_its_copy(tmp_path):
    p = cupool.Pool("sim", capacity="64MiB", spill=str(tmp_path / "s.h5"))
    m = p.movable(MiB)
    p.spill()
    f = p.scheduler.tier._file.h5
    assert len(f) == 1
    m.free()
    assert len(f) == 0 and not m.on_device


def test_host_tier_uses_the_pinned_pool_and_gives_it_back():
    p = cupool.Pool("sim", capacity="64MiB", spill="host")
    pinned = p.scheduler.tier.pinned
    assert isinstance(pinned, cupool.PinnedPool)
    m = p.movable(2 * MiB)
    want = fill(m, 7)
    p.spill()
    assert pinned.stats()["allocated_bytes.all.current"] == 2 * MiB
    assert crc(m) == want
    gc.collect()
    assert pinned.stats()["allocated_bytes.all.current"] == 0


def test_host_tier_falls_back_to_pageable_memory_when_the_pinned_pool_is_full():
    device = cupool.Pool("sim", capacity="64MiB").device
    tier = HostTier(cupool.PinnedPool("sim", capacity="2MiB"))
    device_ptr = device.malloc(4 * MiB)
    device.bytes_at(device_ptr, 4 * MiB)[:] = 9
    h1 = tier.store(device, device_ptr, 2 * MiB)  # fills the pinned pool
    h2 = tier.store(device, device_ptr, 3 * MiB)  # does not fit: pageable
    assert h1._owner is not None and h2._owner is None
    assert (h2.load() == 9).all() and h2.load().nbytes == 3 * MiB


def test_hdf5_tier_writes_chunked_datasets_with_the_configured_cache(tmp_path):
    tier = HDF5Tier(tmp_path / "t.h5", chunk_bytes="1MiB", rdcc_nbytes="8MiB")
    device = cupool.Pool("sim", capacity="64MiB").device
    ptr = device.malloc(4 * MiB)
    device.bytes_at(ptr, 3 * MiB)[:] = np.arange(3 * MiB) % 251
    h = tier.store(device, ptr, 3 * MiB)
    f = tier._file.h5
    ds = f[h._name]
    assert ds.chunks == (MiB,) and ds.dtype == np.uint8 and ds.shape == (3 * MiB,)
    assert (ds[:] == np.arange(3 * MiB) % 251).all()  # a plain HDF5 dataset, readable by h5py
    assert f.id.get_access_plist().get_cache()[2] == 8 * MiB
    assert (h.load() == np.arange(3 * MiB) % 251).all()
    h.discard()
    assert len(f) == 0


def test_hdf5_file_space_is_reused_and_the_file_removed_with_the_pool(tmp_path):
    path = tmp_path / "s.h5"
    p = cupool.Pool("sim", capacity="64MiB", spill=str(path))
    ms = [p.movable(4 * MiB) for _ in range(4)]
    p.spill()
    for m in ms:
        m.array()
    size1 = path.stat().st_size
    assert path.stat().st_mode & 0o777 == 0o600  # device memory is nobody else's to read
    for _ in range(3):
        p.spill()
        for m in ms:
            m.array()
    assert path.stat().st_size <= size1 + MiB  # not 4x: unlinked datasets' space comes back
    del p, ms, m
    gc.collect()
    assert not path.exists()


def test_hdf5_tier_never_opens_an_existing_file(tmp_path):
    path = tmp_path / "data.h5"
    with h5py.File(path, "w") as f:
        f["precious"] = np.arange(10)
    before = path.read_bytes()
    p = cupool.Pool("sim", capacity="64MiB", spill=str(path))
    m = p.movable(MiB)
    want = fill(m, 3)
    refused = f"cannot create the spill file {re.escape(str(path))}: it already exists"
    with pytest.raises(cupool.SpillError, match=refused):
        p.spill()
    assert m.on_device and crc(m) == want
    del p, m
    gc.collect()
    assert path.read_bytes() == before  # neither written nor removed


def test_a_second_pool_on_a_live_spill_path_is_refused_and_the_first_keeps_its_bytes(tmp_path):
    path = tmp_path / "s.h5"
    first = cupool.Pool("sim", capacity="64MiB", spill=str(path))
    ms = [first.movable(MiB) for _ in range(3)]
    want = [fill(m, i) for i, m in enumerate(ms)]
    first.spill()
    second = cupool.Pool("sim", capacity="64MiB", spill=str(path))
    other = second.movable(MiB)
    with pytest.raises(cupool.SpillError, match="already exists.*give each process its own path"):
        second.spill()
    assert other.on_device
    assert [crc(m) for m in ms] == want


def test_a_full_disk_loses_nothing_and_the_next_spill_starts_a_fresh_file(tmp_path, monkeypatch):
    path = tmp_path / "s.h5"
    p = cupool.Pool("sim", capacity="64MiB", spill=str(path))
    early, late = p.movable(MiB), p.movable(MiB)
    want = fill(early, 5), fill(late, 6)
    assert p.spill(1) == MiB and not early.on_device  # least recently used first

    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", no_space)  # every write the spill file makes now fails
    with pytest.raises(cupool.SpillError, match="No space left on device"):
        p.spill()
    assert late.on_device and not early.on_device
    assert not path.exists()  # the retired file's name is gone; its descriptor still holds early's bytes
    p.check()
    assert (crc(early), crc(late)) == want
    monkeypatch.undo()
    assert p.spill() == 2 * MiB and path.exists()  # a fresh file at the same path
    assert (crc(early), crc(late)) == want
    p.check()


def test_a_failure_inside_hdf5_retires_the_file_and_loses_nothing(tmp_path, monkeypatch):
    path = tmp_path / "s.h5"
    p = cupool.Pool("sim", capacity="64MiB", spill=str(path))
    m = p.movable(MiB)
    want = fill(m, 5)

    def broken(self, *a, **k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(h5py.Dataset, "write_direct", broken)
    with pytest.raises(cupool.SpillError, match="Input/output error"):
        p.spill()
    assert m.on_device and crc(m) == want
    assert p.scheduler.tier._file is None and not path.exists()
    p.check()


@pytest.mark.parametrize(
    "spill,exc,word",
    [(42, TypeError, "spill"), ("hots", ValueError, "spill"), ("out.txt", ValueError, ".h5")],
)
def test_bad_spill_arguments(spill, exc, word):
    with pytest.raises(exc, match=word):
        cupool.Pool("sim", capacity="64MiB", spill=spill)


def test_bad_policy():
    with pytest.raises(ValueError, match="spill_policy"):
        cupool.Pool("sim", capacity="64MiB", spill="host", spill_policy="random")


def test_spill_needs_a_tier(pool):
    pool.movable(MiB)
    with pytest.raises(RuntimeError, match="spill="):
        pool.spill()


def test_bad_hdf5_tier_arguments(tmp_path):
    with pytest.raises(ValueError, match="chunk_bytes"):
        HDF5Tier(tmp_path / "x.h5", chunk_bytes=0)


# ------------------------------------------------------ configured HDF5 tier
def test_a_configured_hdf5_tier_is_given_to_the_pool(tmp_path):
    path = tmp_path / "cfg.h5"
    tier = HDF5Tier(path, chunk_bytes="1MiB", rdcc_nbytes="8MiB", rdcc_nslots=521)
    p = cupool.Pool("sim", capacity="64MiB", spill=tier)
    assert p.scheduler.tier is tier
    m = p.movable(3 * MiB)
    want = fill(m, 11)
    p.spill()
    f = tier._file.h5
    (name,) = list(f)
    assert f[name].chunks == (MiB,)
    _, nslots, nbytes, _ = f.id.get_access_plist().get_cache()
    assert (nslots, nbytes) == (521, 8 * MiB)
    assert crc(m) == want
    with pytest.raises(ValueError, match="already serves another live pool"):
        cupool.Pool("sim", capacity="64MiB", spill=tier)
    assert p.scheduler.tier is tier  # the refused pool took nothing from the first
    del p, m
    q = cupool.Pool("sim", capacity="64MiB", spill=tier)  # its pool is gone: free to serve another
    assert q.scheduler.tier is tier


def test_the_default_slot_count_is_a_prime_near_100_per_chunk():
    tier = HDF5Tier("x.h5", chunk_bytes="4MiB", rdcc_nbytes="64MiB")
    assert tier.rdcc_nslots == 1601  # 100 * 16 chunks, rounded up to a prime


@pytest.mark.parametrize(
    "kw,exc,word",
    [
        ({"chunk_bytes": 0}, ValueError, "chunk_bytes"),
        ({"chunk_bytes": "4GiB"}, ValueError, "chunk_bytes"),
        ({"chunk_bytes": "lots"}, ValueError, "chunk_bytes"),
        ({"rdcc_nbytes": -1}, ValueError, "rdcc_nbytes"),
        ({"rdcc_nbytes": 1.5}, TypeError, "rdcc_nbytes"),
        ({"rdcc_nslots": 0}, ValueError, "rdcc_nslots"),
        ({"rdcc_nslots": "many"}, TypeError, "rdcc_nslots"),
        ({"path": 3}, TypeError, "path"),
    ],
)
def test_bad_hdf5_tier_configuration(tmp_path, kw, exc, word):
    kw.setdefault("path", tmp_path / "x.h5")
    with pytest.raises(exc, match=word):
        HDF5Tier(**kw)


# --------------------------------------------------------------- lifetimes
def test_dropping_the_pool_closes_and_removes_its_spill_file_at_once(tmp_path):
    path = tmp_path / "s.h5"
    p = cupool.Pool("sim", capacity="64MiB", spill=str(path))
    m = p.movable(MiB)
    p.spill()
    assert path.exists()
    gc.disable()  # no cycle collection: plain reference counting must do it
    try:
        del m, p
        assert not path.exists()
    finally:
        gc.enable()


def test_a_failed_file_creation_leaves_no_file_behind(tmp_path, monkeypatch):
    path = tmp_path / "s.h5"
    p = cupool.Pool("sim", capacity="64MiB", spill=str(path))
    m = p.movable(MiB)
    want = fill(m, 2)

    def refuse(*a, **k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(h5py, "File", refuse)
    with pytest.raises(cupool.SpillError, match="cannot create the spill file"):
        p.spill()
    assert not path.exists()
    assert p.scheduler.tier._file is None
    assert m.on_device and crc(m) == want
    monkeypatch.undo()
    p.spill()  # a later spill creates the file afresh
    assert path.exists() and not m.on_device and crc(m) == want


def test_any_copy_failure_gives_the_pinned_block_back(monkeypatch):
    p = cupool.Pool("sim", capacity="64MiB", spill="host")
    tier = p.scheduler.tier
    m = p.movable(2 * MiB)
    want = fill(m, 4)

    def broken(ptr, out):
        raise RuntimeError("copy engine fault")

    monkeypatch.setattr(p.device, "read_into", broken)
    with pytest.raises(RuntimeError, match="copy engine fault"):
        p.spill()
    assert tier._pinned_held == 0
    assert tier.pinned.stats()["allocated_bytes.all.current"] == 0
    assert m.on_device and crc(m) == want


class _FakeRuntime:
    """Just enough of cupy.cuda.runtime for the tiers' copies: host memory posing as a GPU."""

    memcpyDeviceToHost = 2

    def __init__(self):
        self.syncs = 0

    def deviceSynchronize(self):
        self.syncs += 1

    def memcpy(self, dst, src, n, kind):
        ctypes.memmove(dst, src, n)


def _fake_gpu():
    dev = object.__new__(CudaDevice)
    dev._rt = _FakeRuntime()
    dev._dev = contextlib.nullcontext()
    dev.index = 0
    return dev


@pytest.mark.parametrize("tier", ["host", "h5"])
def test_tiers_copy_from_a_gpu_without_waiting_for_it_again(tmp_path, tier):
    # The scheduler synchronizes once before a spill; the tier's copy must not add a second.
    dev = _fake_gpu()
    memory = np.arange(3 * MiB, dtype=np.uint64).view(np.uint8)[: 3 * MiB].copy()
    t = HostTier() if tier == "host" else HDF5Tier(tmp_path / "g.h5")
    h = t.store(dev, memory.ctypes.data, memory.nbytes)
    assert dev._rt.syncs == 0
    assert (h.load() == memory).all()


class _DictTier:
    """A user's own tier: bytes kept in a dict, as small as the Tier protocol allows."""

    name = "dict"

    def __init__(self):
        self.store_calls = 0
        self.held = {}

    def store(self, device, ptr, nbytes):
        self.store_calls += 1
        data = np.empty(nbytes, dtype=np.uint8)
        device.read_into(ptr, data)
        key = object()
        self.held[key] = data
        tier = self

        class Handle:
            def load(self):
                return tier.held[key]

            def discard(self):
                del tier.held[key]

        return Handle()

    def describe(self):
        return "a dict in this process"


def test_a_users_own_tier_serves_the_pool_and_is_recorded_by_name(tmp_path):
    tier = _DictTier()
    assert isinstance(tier, cupool.pressure.spill.Tier)
    p = cupool.Pool("sim", capacity="64MiB", spill=tier)
    assert p.scheduler.tier is tier
    m = p.movable(3 * MiB)
    want = fill(m, 9)
    with p.record(tmp_path / "t.h5") as rec:
        assert p.spill() == 3 * MiB
    assert tier.store_calls == 1 and len(tier.held) == 1 and not m.on_device
    assert crc(m) == want  # restored from the user's tier
    assert tier.held == {}  # the copy was discarded once the buffer came back
    assert rec.trace().config["spill"] == "dict"
    assert cupool.load_trace(tmp_path / "t.h5").config["spill"] == "dict"


def test_a_tier_that_is_not_one_is_refused_by_name():
    with pytest.raises(TypeError, match="store"):
        cupool.Pool("sim", capacity="64MiB", spill=object())


def test_spilling_to_host_runs_no_gc_collect_in_the_pinned_pool(monkeypatch):
    """The host tier's pinned pool holds only the tier's copies, so its ladder's gc.collect() freed
    nothing: once it ran on nearly every spill into a fragmented pinned pool (76 times in this loop)."""
    import cupool

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    p = cupool.Pool("sim", capacity="16MiB", spill="host")
    rng = np.random.default_rng(0)
    bufs = [p.movable(int(n)) for n in rng.integers(1 << 19, 2 << 20, 40)]
    for _ in range(3):
        for i in rng.permutation(len(bufs)):
            bufs[i].array()
    assert p.scheduler.spills > len(bufs)
    assert calls == [], f"gc.collect ran {len(calls)} times"
