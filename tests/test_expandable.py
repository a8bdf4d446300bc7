"""Expandable segments and stitching (Note [Virtual memory]): the same pool code over mapped granules.

On the sim device a granule is a page range of a memfd mapped into reserved
address space, so a block's bytes really live in the mapping: a granule
unmapped under a live block would lose them (and touching it would fault).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from conftest import needs_gpu
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import cupool
from cupool.config import parse_conf
from cupool.core.books import ALL, RESERVED
from cupool.device import GRANULE, CudaDevice, SimDevice, SimPinnedDevice
from cupool.device.costs import H200
from cupool.device.sim import SimWholeHandles
from cupool.device.vmm import VirtualMemory, VirtualMemoryError, VirtualMemoryUnsupported
from cupool.errors import OutOfMemoryError
from cupool.trace import load_trace
from engines import engines_agree

MiB = 1 << 20


def expandable(capacity: str = "64MiB", **kw) -> cupool.Pool:
    return cupool.Pool(SimDevice(capacity), expandable_segments=True, defrag_threshold=None, **kw)


def reserved(pool: cupool.Pool) -> int:
    return int(pool.stats()["reserved_bytes.all.current"])


def mapped_in(pool: cupool.Pool) -> list[tuple[int, int]]:
    """The device's mappings, as (address, bytes): this pool is the only user of its device."""
    return sorted((m.addr, m.nbytes) for m in pool.device.virtual_memory().mappings())


def fill(pool: cupool.Pool, a: cupool.Allocation, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, a.size, dtype=np.uint8)
    pool.device.from_host(a.ptr, data)
    return data


# --------------------------------------------------------------------------- growth
def test_a_stream_s_segment_grows_in_place_by_granules():
    pool = expandable()
    a = pool.malloc(3 * MiB)
    b = pool.malloc(5 * MiB)
    assert b.ptr == a.ptr + 3 * MiB  # the same segment, grown at its end
    s = pool.stats()
    assert s["segment.large_pool.current"] == 1
    assert reserved(pool) == 8 * MiB == sum(n for _, n in mapped_in(pool))  # 4 MiB, then 4 more
    assert all(n == GRANULE for _, n in mapped_in(pool))  # one chunk per granule
    pool.check()


def test_streams_and_size_classes_grow_segments_of_their_own():
    pool = expandable()
    big0, big1, small0 = pool.malloc(4 * MiB, 0), pool.malloc(4 * MiB, 1), pool.malloc(1000, 0)
    segs = pool.snapshot()["segments"]
    assert len(segs) == 3
    assert {s["stream"] for s in segs if s["segment_type"] == "large"} == {0, 1}
    assert len({abs(big0.ptr - x.ptr) >= 4 * MiB for x in (big1, small0)}) == 1
    pool.check()


def test_a_block_s_bytes_live_in_the_mapping_and_survive_growth():
    pool = expandable()
    a = pool.malloc(3 * MiB)
    data = fill(pool, a, 1)
    arr = pool.empty(1 << 20, "uint8")  # grows the segment past a
    arr[:] = 9
    assert np.array_equal(pool.device.to_host(a.ptr, a.size), data)
    vm = pool.device.virtual_memory()
    assert np.array_equal(vm.bytes_at(a.ptr, a.size), data)  # the same bytes, through the memfd
    assert (arr == 9).all()


def test_empty_cache_unmaps_free_tails_and_the_bytes_are_gone():
    pool = expandable()
    a, b = pool.malloc(2 * MiB), pool.malloc(6 * MiB)
    tail = b.ptr + 2 * MiB
    pool.free(b)
    assert reserved(pool) == 8 * MiB  # cached until asked
    assert pool.empty_cache() == 6 * MiB
    assert reserved(pool) == 2 * MiB == sum(n for _, n in mapped_in(pool))
    with pytest.raises(VirtualMemoryError, match="not mapped"):
        pool.device.bytes_at(tail, 1)  # refused, not a segfault: the granules are gone
    c = pool.malloc(4 * MiB)  # and the segment grows again where it shrank
    assert c.ptr == a.ptr + 2 * MiB
    pool.check()


def test_empty_cache_unmaps_the_granules_under_holes_between_live_blocks_as_pytorch_does(tmp_path):
    """Once a known defect: only free tails went back, so a hole in front of a live block stayed mapped."""
    pool = expandable()
    with pool.record(tmp_path / "holes.h5"):
        a, b, c = pool.malloc(5 * MiB), pool.malloc(3 * MiB), pool.malloc(MiB + 512)
        data_b, data_c = fill(pool, b, 2), fill(pool, c, 3)  # b straddles granules 2 and 3
        hole = a.ptr
        pool.free(a)
        assert pool.empty_cache() == 4 * MiB  # a's granules 0 and 1; granule 2 still holds b's first bytes
        assert reserved(pool) == 10 * MiB - 4 * MiB == sum(n for _, n in mapped_in(pool))
        with pytest.raises(VirtualMemoryError, match="not mapped"):
            pool.device.bytes_at(hole, 1)
        assert np.array_equal(pool.device.to_host(b.ptr, b.size), data_b)
        assert np.array_equal(pool.device.to_host(c.ptr, c.size), data_c)
        pool.check()
        pool.free(b), pool.free(c)
    fast = engines_agree(load_trace(tmp_path / "holes.h5"))
    assert fast.device_frees == pool.stats()["num_device_free"]
    assert fast.segment_frees == pool.stats()["segment.all.freed"]


def test_the_release_threshold_unmaps_free_tails_at_once():
    pool = expandable(release_threshold=0)
    a, b = pool.malloc(2 * MiB), pool.malloc(6 * MiB)
    pool.free(b)
    assert reserved(pool) == 2 * MiB
    pool.free(a)
    assert reserved(pool) == 0 and mapped_in(pool) == []
    pool.check()


def test_the_ladder_unmaps_another_stream_s_free_tail_to_grow():
    pool = expandable("16MiB")
    a, tail = pool.malloc(8 * MiB, stream=1), pool.malloc(4 * MiB, stream=1)
    pool.free(tail)  # cached at the end of stream 1's segment
    b = pool.malloc(8 * MiB, stream=2)  # 4 MiB left on the device: the ladder unmaps stream 1's tail
    assert reserved(pool) == 16 * MiB
    assert [d.step for d in pool.scheduler.decisions] == ["streams", "release"]
    assert pool.snapshot()["segments"][0]["total_size"] == 8 * MiB
    pool.free(b)
    pool.check()
    del a


def test_a_region_out_of_addresses_retires_and_a_new_one_takes_over():
    pool = expandable()
    pool._arena.segments.space.span = 2 * MiB  # regions of 4 MiB (REGION_LIMITS): as if holes had used them up
    vm = pool.device.virtual_memory()
    a = pool.malloc(2 * MiB)
    b = pool.malloc(4 * MiB)  # 2 MiB of addresses left: a new range
    assert len(vm.ranges()) == 2 and abs(b.ptr - a.ptr) >= 4 * MiB
    pool.check()
    a.free()
    pool.empty_cache()  # the retired range's last segment goes, and the range with it
    assert len(vm.ranges()) == 1 and reserved(pool) == 4 * MiB
    pool.check()
    del b


class _PricedSim(SimDevice):
    """A sim device that prices its calls as an H200's (for compaction's choice), and maps as the sim does."""

    costs = H200


@pytest.mark.parametrize("make, whole", [(SimDevice, False), (_PricedSim, False), (SimWholeHandles, True)])
def test_whole_handles_are_a_capability_of_the_device_not_its_cost_table(make, whole):
    """Before: ``whole_handles = device.costs is not None`` took "has a cost table" to mean "is a GPU",
    so a device priced like an H200 mapped one handle per grow, and the sim device could not opt in
    to measure what that costs.  Now ``Capabilities.whole_handles`` says it, once: CUDA devices (and the
    CUDA double) set it, and ``SimWholeHandles`` is the sim device opting in."""
    pool = cupool.Pool(make("64MiB"), expandable_segments=True, defrag_threshold=None)
    a = pool.malloc(6 * MiB)
    b = pool.malloc(9 * MiB)  # the same region grown by 5 granules
    assert mapped_in(pool) == ([(a.ptr, 6 * MiB), (a.ptr + 6 * MiB, 10 * MiB)] if whole
                               else [(a.ptr + i * GRANULE, GRANULE) for i in range(8)])
    pool.check()
    a.free()
    pool.empty_cache()  # a handle goes back only whole: the first, wholly free, does
    assert mapped_in(pool) == ([(a.ptr + 6 * MiB, 10 * MiB)] if whole
                               else [(a.ptr + i * GRANULE, GRANULE) for i in range(3, 8)])
    del b
    assert CudaDevice.capabilities.whole_handles and not SimDevice.capabilities.whole_handles


def test_the_initial_segment_is_mapped_and_kept():
    pool = expandable(initial_size="8MiB")
    assert reserved(pool) == 8 * MiB
    a = pool.malloc(6 * MiB)
    pool.free(a)
    pool.empty_cache()
    assert reserved(pool) == 8 * MiB  # preallocated: empty_cache leaves it alone
    pool.close()
    assert mapped_in(pool) == [] and pool.device.virtual_memory().ranges() == []


def test_closing_gives_every_granule_and_range_back():
    pool = expandable()
    a = pool.malloc(3 * MiB)
    pool.malloc(100).free()
    with pytest.warns(ResourceWarning):
        pool.close()
    vm = pool.device.virtual_memory()
    assert [n for _, n in mapped_in(pool)] == [GRANULE, GRANULE]  # a's segment drains
    a.free()
    assert vm.mappings() == [] and vm.ranges() == [] and vm.in_use == 0


def test_a_dropped_pool_gives_its_granules_back():
    dev = SimDevice("64MiB")
    pool = cupool.Pool(dev, expandable_segments=True)
    pool.malloc(5 * MiB)  # dropped at once: the pool drains and gives it back
    del pool
    gc.collect()
    vm = dev.virtual_memory()
    assert vm.mappings() == [] and vm.in_use == 0


def test_granules_and_plain_segments_share_the_device_s_capacity():
    dev = SimDevice("16MiB")
    plain = cupool.Pool(dev, expandable_segments=False)  # device-malloc segments, beside the granules
    x = plain.malloc(12 * MiB)  # a segment of its own size
    pool = cupool.Pool(dev, expandable_segments=True)
    with pytest.raises(OutOfMemoryError):
        pool.malloc(8 * MiB)
    assert pool.malloc(4 * MiB).size == 4 * MiB
    assert dev.mem_info()[0] == 16 * MiB - dev.used - 4 * MiB
    x.free()


def test_movable_buffers_compact_and_spill_through_the_mappings():
    pool = cupool.Pool(SimDevice("64MiB"), expandable_segments=True, stitch=True, spill="host")
    ms = [pool.movable((k % 3 + 1) * MiB + 4096) for k in range(12)]
    for i, m in enumerate(ms):
        m.array(dtype="uint8")[:] = i
    for m in ms[::2]:
        m.free()
    before = reserved(pool)
    report = pool.compact()
    assert report.moves and reserved(pool) < before  # packed, and the freed granules unmapped
    pool.check()
    assert pool.spill() and reserved(pool) == 0  # every granule back to the device
    for i, m in list(enumerate(ms))[1::2]:
        assert (m.array(dtype="uint8") == i).all()  # restored into fresh granules, bytes intact
    pool.check()


def test_compaction_remaps_whole_granules_instead_of_copying(monkeypatch):
    pool = expandable()
    ms = [pool.movable(n * MiB) for n in (2, 4, 4, 6)]
    for i, m in enumerate(ms):
        arr = m.array(dtype="uint8")
        arr[:] = i
        arr[-1] = 100 + i
        del arr
    copied = []
    real = pool.device.execute_moves
    monkeypatch.setattr(pool.device, "execute_moves", lambda s, d, n: (copied.append(int(n.sum())), real(s, d, n)))
    ms[0].free()  # the others slide down by one granule, over themselves
    report = pool.compact()
    assert report.bytes_moved == 14 * MiB and copied == []
    assert pool.stats()["compaction_bytes_remapped"] == 14 * MiB
    for i, m in list(enumerate(ms))[1:]:
        arr = m.array(dtype="uint8")
        assert (arr[:-1] == i).all() and arr[-1] == 100 + i
        del arr
    pool.check()


# --------------------------------------------------------------------------- stitching
def _holes(pool: cupool.Pool) -> list[cupool.Allocation]:
    """A 16 MiB device filled by four 4 MiB blocks, the first and third freed: 8 MiB free, 4 MiB at most in a row."""
    blocks = [pool.malloc(4 * MiB) for _ in range(4)]
    pool.free(blocks[0])
    pool.free(blocks[2])
    return blocks


def test_without_stitching_the_ladder_unmaps_holes_and_grows_anew():
    """Issue 25: a pool that does not stitch once failed here, where the program's own empty_cache()
    succeeds; its ladder's release step now unmaps the holes' granules (``release_cuts_holes``)."""
    pool = expandable("16MiB", stitch=False)  # stitch=None follows expandable_segments: on
    blocks = _holes(pool)
    kept = {i: fill(pool, blocks[i], i) for i in (1, 3)}
    big = pool.malloc(8 * MiB)  # the holes' 8 MiB of granules, unmapped and mapped afresh elsewhere
    assert reserved(pool) == 16 * MiB and pool.stats()["num_stitches"] == 0
    assert [d.step for d in pool.scheduler.decisions if d.progress][-1] == "release"
    for i, d in kept.items():
        assert np.array_equal(pool.device.to_host(blocks[i].ptr, blocks[i].size), d)
    pool.check()
    del big, blocks


def test_stitching_maps_the_free_granules_of_holes_side_by_side_without_a_copy():
    pool = expandable("16MiB", stitch=True)
    blocks = _holes(pool)
    kept = {i: fill(pool, blocks[i], i) for i in (1, 3)}
    big = pool.malloc(8 * MiB)
    data = fill(pool, big, 7)
    assert reserved(pool) == 16 * MiB  # no new memory: the holes' granules, remapped
    assert pool.stats()["num_stitches"] == 1
    for i, d in kept.items():
        assert np.array_equal(pool.device.to_host(blocks[i].ptr, blocks[i].size), d)
    assert np.array_equal(pool.device.to_host(big.ptr, big.size), data)
    assert any(d.step == "stitch" for d in pool.scheduler.decisions)
    pool.check()
    pool.free(big)  # a stitched block's granules go back as soon as it is free
    assert reserved(pool) == 8 * MiB
    assert pool.malloc(8 * MiB).size == 8 * MiB  # grown afresh now that the device has room
    pool.check()


def test_stitching_takes_what_holes_lack_from_the_device():
    pool = expandable("20MiB", stitch=True)
    blocks = _holes(pool)
    big = pool.malloc(12 * MiB)  # 8 MiB of holes + 4 MiB fresh
    assert reserved(pool) == 20 * MiB
    pool.free(big)
    pool.check()
    del blocks


def test_stitch_emits_unmaps_then_one_map():
    pool = expandable("16MiB", stitch=True)
    blocks = _holes(pool)
    seen = []
    pool.subscribe(lambda ev: seen.append(ev[1:4]), kinds=("segment_map", "segment_unmap"))
    big = pool.malloc(8 * MiB)
    assert [k for k, _, _ in seen] == ["segment_unmap", "segment_unmap", "segment_map"]
    assert seen[-1][1:] == (big.ptr, 8 * MiB)
    del blocks


# --------------------------------------------------------------------------- bad input
def test_a_device_without_virtual_memory_is_a_clear_error():
    with pytest.raises(VirtualMemoryUnsupported, match="expandable_segments=True needs a device with virtual memory"):
        cupool.Pool(SimPinnedDevice("16MiB"), expandable_segments=True)


def test_the_defaults_are_on_where_the_device_has_virtual_memory_and_off_elsewhere():
    """None (the default) means on wherever the device has virtual memory, and stitch follows."""
    on = cupool.Pool(SimDevice("16MiB"))
    assert (on.config["expandable_segments"], on.config["stitch"]) == (True, True)
    on.malloc(MiB).free()
    assert mapped_in(on)  # granules, not a device malloc
    assert cupool.Pool(SimDevice("16MiB"), stitch=False).config["expandable_segments"] is True
    off = cupool.Pool(SimPinnedDevice("16MiB"))
    assert (off.config["expandable_segments"], off.config["stitch"]) == (False, False)
    dev = SimPinnedDevice("16MiB")
    with pytest.raises(VirtualMemoryUnsupported, match="stitch=True needs a device with virtual memory: pinned:sim"):
        cupool.Pool(dev, stitch=True)  # asked for by name: refused, not quietly off
    assert dev.mem_info()[0] == dev.capacity


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"expandable_segments": False, "stitch": True}, ValueError, "needs expandable_segments=True"),
        ({"expandable_segments": 1}, TypeError, r"expandable_segments must be True, False or None .*got 1"),
        ({"expandable_segments": True, "stitch": "yes"}, TypeError, r"stitch must be True, False or None .*got 'yes'"),
        ({"stitch": 1}, TypeError, r"stitch must be True, False or None .*got 1"),
    ],
)
def test_bad_settings_are_refused(kw, error, match):
    dev = SimDevice("16MiB")
    with pytest.raises(error, match=match):
        cupool.Pool(dev, **kw)
    assert dev.mem_info()[0] == dev.capacity and dev._vm is None  # nothing was taken


def test_bad_calls_on_a_pool_s_virtual_memory_are_refused_and_change_nothing():
    pool = expandable()
    a = pool.malloc(3 * MiB)
    data = fill(pool, a, 3)
    vm = pool.device.virtual_memory()
    before = (vm.mappings(), vm.ranges(), vm.in_use)
    chunk = vm.create(GRANULE)
    with pytest.raises(VirtualMemoryError, match="overlaps a mapping"):
        vm.map(a.ptr, chunk)  # over the pool's granule
    with pytest.raises(VirtualMemoryError, match="not a positive multiple of the granularity"):
        vm.create(GRANULE + 4096)
    with pytest.raises(VirtualMemoryError, match="not covered exactly by whole mappings"):
        vm.unmap(a.ptr, 3 * GRANULE)  # more than the pool mapped there
    vm.release(chunk)
    assert (vm.mappings(), vm.ranges(), vm.in_use) == before
    pool.check()
    assert np.array_equal(pool.device.to_host(a.ptr, a.size), data)


def test_cupool_conf_reads_the_virtual_memory_flags():
    assert parse_conf("expandable_segments=true,stitch=false") == {"expandable_segments": True, "stitch": False}
    with pytest.raises(ValueError, match="must be true or false"):
        parse_conf("expandable_segments=maybe")


# --------------------------------------------------------------------------- scale
class _Counting:
    """Counts the calls a pool makes to its device's VirtualMemory."""

    OPS = ("reserve", "create", "map", "set_access", "unmap", "release", "free_range")

    def __init__(self, vm: VirtualMemory, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        for op in self.OPS:
            real = getattr(vm, op)

            def counted(*a, _real=real, **k):
                self.n += 1
                return _real(*a, **k)

            monkeypatch.setattr(vm, op, counted)


@pytest.mark.parametrize("live", [1, 2000])
def test_device_calls_per_grow_and_unmap_do_not_grow_with_live_blocks(live, monkeypatch):
    pool = expandable("256MiB")
    keep = [pool.malloc(4096) for _ in range(live)]  # small blocks, in their own segment
    big = [pool.malloc(2 * MiB) for _ in range(live // 100 + 1)]  # and large ones before the tail
    calls = _Counting(pool.device.virtual_memory(), monkeypatch)
    tail = pool.malloc(6 * MiB)  # grow by 3 granules
    grew = calls.n
    pool.free(tail)
    calls.n = 0
    pool.empty_cache()  # unmap them
    assert (grew, calls.n) == (3 + 3 + 1, 1 + 3)  # create and map per granule, one set_access; unmap, releases
    del keep, big


# --------------------------------------------------------------------------- traces, snapshots, replay
def _run(pool: cupool.Pool) -> None:
    """Layers of a model streamed through the pool, with cache releases: grows, tails unmapped, regrown."""
    from cupool import workloads

    workloads.weight_streaming(pool, workloads.mixed_shapes(12, seed=0))
    live = [pool.malloc(n * MiB + 512) for n in (1, 3, 6, 2, 9)]
    for a in live[1::2]:
        a.free()
    pool.empty_cache()
    live.append(pool.malloc(5 * MiB))


@pytest.fixture
def recorded(tmp_path):
    pool = expandable("512MiB")
    path = tmp_path / "run.h5"
    with pool.record(path):
        _run(pool)
    return path, pool


def test_a_recording_has_segment_map_and_unmap_events_and_replays_exactly(recorded):
    from cupool.replay import replay
    from cupool.trace import load_trace

    path, pool = recorded
    trace = load_trace(path)
    counts = trace.counts()
    assert counts["segment_map"] and counts["segment_unmap"] and "segment_alloc" not in counts
    s = pool.stats()
    for engine in ("numba", "pool"):  # the recorded settings: both engines model virtual memory
        r = replay(trace, engine=engine)
        assert r.config["expandable_segments"] is True
        assert (r.peak_reserved, r.ooms) == (s["reserved_bytes.all.peak"], s["num_ooms"])


def test_replay_compare_runs_a_plain_recording_on_expandable_segments(tmp_path, capsys):
    from cupool.cli import main
    from cupool.replay import replay
    from cupool.trace import load_trace

    pool = cupool.Pool("sim", capacity="512MiB", defrag_threshold=None)
    path = tmp_path / "plain.h5"
    with pool.record(path):
        _run(pool)
    assert main(["replay", str(path), "--compare", "recorded", "expandable_segments=True,stitch=True"]) == 0
    rows = capsys.readouterr().out.splitlines()
    peaks = {r.split()[0]: r.split()[1:3] for r in rows if r.startswith(("recorded ", "expandable"))}
    assert len(peaks) == 2
    trace = load_trace(path)
    plain, grown = replay(trace, engine="pool"), replay(trace, {"expandable_segments": True})
    assert grown.engine == "numba" and grown.peak_reserved <= plain.peak_reserved
    assert replay(trace, {"expandable_segments": True}, engine="pool").peak_reserved == grown.peak_reserved


def test_snapshots_show_expandable_segments_as_pytorch_does(recorded, tmp_path):
    import pickle

    from cupool.observe.snapshot import export_trace, to_torch_snapshot
    from cupool.trace import load_trace

    path, pool = recorded
    now = to_torch_snapshot(pool)
    assert now["segments"] and all(s["is_expandable"] for s in now["segments"])
    export_trace(load_trace(path), tmp_path / "snap.pickle")
    with open(tmp_path / "snap.pickle", "rb") as fh:
        snap = pickle.load(fh)
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert {"segment_map", "segment_unmap"} <= actions
    # The segments the trace's maps and unmaps leave are the pool's: contiguous mapped ranges.
    assert sorted((s["address"], s["total_size"]) for s in snap["segments"] if s["is_expandable"]) == sorted(
        (s["address"], s["total_size"]) for s in pool.snapshot()["segments"]
    )


def test_an_expandable_snapshot_renders_with_torch_memory_viz(recorded, tmp_path):
    mv = pytest.importorskip("torch.cuda._memory_viz", reason="torch is not installed (pip install torch, or '.[viz]' in cupool's checkout)")
    import pickle

    from cupool.observe.snapshot import export_trace
    from cupool.trace import load_trace

    path, pool = recorded
    export_trace(load_trace(path), tmp_path / "snap.pickle")
    data = pickle.loads((tmp_path / "snap.pickle").read_bytes())
    assert f"segments: {len(pool.snapshot()['segments'])}" in mv.segsum(data)
    assert mv.trace(data)
    for html in (mv.trace_plot(data), mv.segment_plot(data)):
        assert "snapshot.pickle" in html


# --------------------------------------------------------------------------- the state machine
class ExpandableMachine(RuleBasedStateMachine):
    """Random allocations, frees, cache releases and stitches on an expandable pool.

    Movable buffers of whole granules (and a little more) are compacted by remapping.
    Invariants: the heaps and books agree (``pool.check()``, which includes the
    expander's: every mapped granule lies in exactly one segment, every segment is
    mapped whole, no chunk is mapped twice); reserved bytes are mapped granules;
    the device maps exactly the pool's granules; every live block's bytes are
    intact.  Live blocks never overlap, in addresses (the heap's tiling) or in
    physical memory (one chunk per granule, each mapped once).
    """

    device: object = None  # None: a fresh 48 MiB sim device per run

    @initialize(threshold=st.sampled_from([None, 0, 8 * MiB]), stitch=st.booleans())
    def setup(self, threshold, stitch):
        self.pool = cupool.Pool(
            SimDevice("48MiB") if self.device is None else self.device, max_size="48MiB",
            expandable_segments=True, stitch=stitch, release_threshold=threshold, defrag_threshold=None,
        )
        self.live: list[tuple[cupool.Allocation, int]] = []
        self.movables: list[tuple[cupool.Movable, int]] = []
        self.seed = 0

    def teardown(self):
        if hasattr(self, "pool"):
            self.live.clear()
            self.movables.clear()
            self.pool.close()

    @rule(
        size=st.one_of(
            st.integers(1, 1 * MiB), st.integers(1 * MiB, 12 * MiB), st.integers(1, 6).map(lambda k: k * GRANULE)
        ),
        stream=st.sampled_from([0, 0, 1]),
    )
    def malloc(self, size, stream):
        try:
            a = self.pool.malloc(size, stream)
        except OutOfMemoryError:
            return
        self.seed += 1
        self.pool.device.from_host(a.ptr, np.full(min(a.size, 4096), self.seed % 251, np.uint8))
        self.live.append((a, self.seed % 251))

    @rule(granules=st.integers(1, 4))
    def fill_and_punch(self, granules):
        """Fill the pool with blocks of whole granules and free every other one: holes to stitch."""
        got = []
        while len(got) < 64:
            try:
                got.append(self.pool.malloc(granules * GRANULE))
            except OutOfMemoryError:
                break
        for a in got[::2]:
            self.pool.free(a)
        for a in got[1::2]:
            self.seed += 1
            self.pool.device.from_host(a.ptr, np.full(4096, self.seed % 251, np.uint8))
            self.live.append((a, self.seed % 251))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6))
    def free(self, i):
        a, _ = self.live.pop(i % len(self.live))
        self.pool.free(a)

    @rule(granules=st.integers(1, 3), extra=st.sampled_from([0, 4096]))
    def movable(self, granules, extra):
        try:
            m = self.pool.movable(granules * GRANULE + extra)
        except OutOfMemoryError:
            return
        self.seed += 1
        arr = m.array(dtype="uint8")
        arr[:4096] = arr[-1] = self.seed % 251
        del arr
        self.movables.append((m, self.seed % 251))

    @precondition(lambda self: self.movables)
    @rule(i=st.integers(0, 10**6))
    def free_movable(self, i):
        m, _ = self.movables.pop(i % len(self.movables))
        m.free()

    @rule()
    def compact(self):
        self.pool.compact()  # whole granules are remapped, the rest copied

    @rule()
    def empty_cache(self):
        self.pool.empty_cache()

    @invariant()
    def consistent(self):
        pool = self.pool
        pool.check()
        exp = pool._arena.segments
        vm = pool.device.virtual_memory()
        mapped = {m.addr: m.chunk for m in vm.mappings()}
        # The device maps exactly the pool's chunks, each at its base (a chunk per grow on a GPU).
        assert mapped == {a: c for a, c in exp.chunks.items() if exp.base_of[c.id] == a}
        assert all(m.accessible for m in vm.mappings())
        assert pool._arena.books.cur[RESERVED][ALL] == sum(m.nbytes for m in vm.mappings()) == vm.in_use
        assert len(exp.chunks) * GRANULE == vm.in_use
        for a, v in self.live:
            assert (pool.device.to_host(a.ptr, min(a.size, 4096)) == v).all(), f"{a!r} lost its bytes"
        for m, v in self.movables:
            arr = pool.device.to_host(m.ptr, m.size)
            assert (arr[:4096] == v).all() and arr[-1] == v, f"{m!r} lost its bytes"


TestExpandableMachine = ExpandableMachine.TestCase
# Each out-of-memory runs the ladder's gc.collect(): keep the ci profile's run near 10 s.
TestExpandableMachine.settings = settings(
    settings.default, max_examples=max(settings.default.max_examples // 4, 1), deadline=None
)


def test_on_the_cuda_backend_every_map_is_one_whole_granule_chunk_from_offset_0():
    """The H100's rule (driver 580): cuMemMap of a prefix or at an offset is NOT_SUPPORTED (the CUDA
    double's driver refuses it so, and the pool would raise)."""
    from cupool.device.cuda_vmm import CudaVirtualMemory
    from cupool.testing.cuda_double import CudaDouble

    double = CudaDouble("128MiB")

    class OnDriver(SimDevice):
        def virtual_memory(self):
            if not hasattr(self, "_cuda_vm"):
                self._cuda_vm = CudaVirtualMemory(0, driver=double.driver)
            return self._cuda_vm

    pool = cupool.Pool(OnDriver("128MiB"), expandable_segments=True, stitch=True, max_size="24MiB")
    blocks = [pool.malloc(n * MiB) for n in (3, 5, 4, 4, 4, 4)]  # 24 MiB, grown in place
    blocks[1].free()
    blocks[3].free()
    big = pool.malloc(8 * MiB)  # no room left: stitched from the holes' granules
    assert pool.stats()["num_stitches"] == 1
    big.free()
    pool.empty_cache()
    pool.check()
    creates = [c.nbytes for c in double.log.calls if c.name == "cuMemCreate"]
    maps = [c.nbytes for c in double.log.calls if c.name == "cuMemMap"]
    assert set(creates) == set(maps) == {GRANULE}
    assert len(maps) > len(creates)  # some chunks were remapped elsewhere (stitching)
    del blocks


# --------------------------------------------------------------------------- GPU
@needs_gpu
def test_expandable_segments_on_a_gpu_smoke():
    pytest.importorskip("cuda.bindings", reason="CUDA virtual memory needs the vmm extra (cuda-bindings)")
    import cupy

    pool = cupool.Pool("cuda", expandable_segments=True, stitch=True, max_size="256MiB")
    a = pool.empty(3 << 18, "float32")  # 3 MiB
    a[:] = 1
    b = pool.empty(5 << 18, "float32")
    b[:] = 2
    assert b.data.ptr == a.data.ptr + 3 * MiB
    del b
    assert pool.empty_cache() > 0
    assert float(cupy.sum(a)) == 3 << 18
    pool.check()
    del a
    pool.close()


@needs_gpu
def test_expandable_machine_on_a_gpu():
    pytest.importorskip("cuda.bindings", reason="CUDA virtual memory needs the vmm extra (cuda-bindings)")
    from cupool.device import CudaDevice

    class OnGpu(ExpandableMachine):
        device = CudaDevice(0)  # one device, so one VirtualMemory: each run's pool gives it all back

    OnGpu.TestCase.settings = settings(max_examples=10, stateful_step_count=30, deadline=None)
    OnGpu.TestCase().runTest()
