"""The pressure scheduler: ladder order, eviction order per policy, working sets beyond the device."""

import gc
import threading
import weakref
import zlib

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cupool

MiB = 1 << 20
SLOT = 2 * MiB


def tagged(pool, tag, size=SLOT):
    m = pool.movable(size)
    a = m.array(dtype=np.uint8)
    a[:] = tag
    del a
    return m


# ------------------------------------------------------------- ladder order
def test_lru_and_fifo_follow_the_design_order(tmp_path):
    for policy in ("lru", "fifo"):
        p = cupool.Pool("sim", capacity="64MiB", spill="host", spill_policy=policy)
        assert p.scheduler.order() == ["streams", "release", "compact", "rehome", "spill", "gc"]
    assert cupool.Pool("sim", capacity="64MiB").scheduler.order() == ["streams", "release", "compact", "rehome", "gc"]


def test_adaptive_compacts_first_when_fragmented_and_spills_first_when_full():
    p = cupool.Pool("sim", capacity="40MiB", spill="host", spill_policy="adaptive", defrag_threshold=None)
    assert p.scheduler.order() == ["streams", "release", "gc", "compact", "rehome", "spill"]  # idle pool
    ms = [p.movable(SLOT) for _ in range(10)]  # one 20 MiB segment, full
    for m in ms[::2]:
        m.free()  # fragmentation 0.5
    assert p.scheduler.order()[:4] == ["streams", "release", "compact", "rehome"]
    rest = [p.movable(SLOT) for _ in range(15)]  # fills the holes and a second segment: usage 1.0
    assert p.scheduler.order()[:4] == ["streams", "release", "spill", "gc"]
    del rest


# A pool that stitches (the default, on the sim device) tries stitching after release for a large request.
@pytest.mark.parametrize("expandable,stitch", [(False, []), (None, ["stitch"])], ids=["plain", "default"])
def test_the_ladder_runs_in_order_and_records_every_step(expandable, stitch):
    p = cupool.Pool("sim", capacity="16MiB", spill="host", defrag_threshold=None, expandable_segments=expandable)
    views = [p.movable(SLOT).array() for _ in range(8)]  # all leased: nothing can spill
    events = []
    p.subscribe(events.append)
    with pytest.raises(cupool.OutOfMemoryError, match=r"nothing could be spilled: no unleased movable buffer is on the device; 8 movable buffer\(s\) \(16 MiB\) are leased"):
        p.movable(SLOT)
    steps = [d.step for d in p.scheduler.decisions]
    assert steps == ["streams", "release", *stitch, "compact", "rehome", "spill", "gc"]
    assert not any(d.progress for d in p.scheduler.decisions)
    assert [e[1] for e in events if e[1].startswith("reclaim:")] == [f"reclaim:{s}" for s in steps]
    del views


def test_spill_decisions_report_the_bytes_they_freed():
    p = cupool.Pool("sim", capacity="16MiB", spill="host", defrag_threshold=None)
    ms = [tagged(p, i) for i in range(8)]
    events = []
    p.subscribe(events.append)
    extra = p.movable(SLOT)
    spill = [d for d in p.scheduler.decisions if d.step == "spill"]
    assert len(spill) == 1 and spill[0].progress and spill[0].bytes_freed == SLOT
    assert spill[0].usage == 1.0
    kinds = [e[1] for e in events]
    assert kinds.index("free_movable") < kinds.index("spill") < kinds.index("reclaim:spill") < kinds.index("alloc_movable")
    assert [e for e in events if e[1] == "reclaim:spill"][0][3] == SLOT
    assert not ms[0].on_device  # LRU: the least recently used went
    assert (ms[0].array(dtype=np.uint8) == 0).all()
    assert "restore" in [e[1] for e in events]
    del extra


def test_on_move_hears_of_a_spill():
    p = cupool.Pool("sim", capacity="16MiB", spill="host", defrag_threshold=None)
    heard = []
    first = p.movable(SLOT, on_move=lambda m, old, new: heard.append((old, new)))
    old = first.ptr
    others = [p.movable(SLOT) for _ in range(7)]
    p.movable(SLOT)
    assert heard == [(old, None)]
    del others


def test_oom_without_spill_does_not_suggest_spilling(pool):
    """A pool made without spilling gets an error about its own figures, not advice to spill."""
    ms = [pool.movable(16 * MiB) for _ in range(4)]
    with pytest.raises(cupool.OutOfMemoryError) as ei:
        pool.movable(16 * MiB)
    assert "spill" not in str(ei.value).lower() and ei.value.reason == ""
    del ms


def test_failed_spill_loses_nothing_and_says_why(tmp_path):
    folder = tmp_path / "missing"
    folder.mkdir()  # a missing folder is refused when the pool is made (test_spill_config.py)...
    p = cupool.Pool("sim", capacity="16MiB", spill=str(folder / "spill.h5"), defrag_threshold=None)
    folder.rmdir()  # ...so it goes missing after: only the spill can find out
    ms = [tagged(p, i) for i in range(8)]
    before = p.stats()
    with pytest.raises(cupool.OutOfMemoryError) as ei:
        p.movable(SLOT)
    msg = str(ei.value)
    assert "spilling did not help" in msg and "cannot create the spill file" in msg and "nothing was lost" in msg
    assert ei.value.reason and "missing" in ei.value.reason
    assert all(m.on_device for m in ms)
    for i, m in enumerate(ms):
        assert (m.array(dtype=np.uint8) == i).all()
    after = p.stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    p.check()


def test_oom_says_what_holds_the_device_when_every_victim_is_already_spilled():
    p = cupool.Pool("sim", capacity="16MiB", spill="host", defrag_threshold=None)
    raw = p.malloc(12 * MiB)
    ms = [tagged(p, i) for i in range(2)]
    assert p.spill() == 2 * SLOT
    with pytest.raises(cupool.OutOfMemoryError) as ei:
        p.malloc(6 * MiB)
    assert ei.value.reason == (
        "nothing could be spilled: no unleased movable buffer is on the device; "
        "12 MiB of raw allocations hold the device and never move"
    )
    del raw, ms


# ------------------------------------------- figures include fast-path frees
def _fill_then_free_small(p, n_free):
    """20 MiB reserved and allocated (a 14 MiB raw block, six 1 MiB small blocks); frees ``n_free``
    small ones through the fast path, whose accounting is only logged until folded."""
    big = p.malloc(14 * MiB)
    small = [p.malloc(MiB) for _ in range(6)]
    assert p.stats()["allocated_bytes.all.current"] == 20 * MiB
    del small[:n_free]
    return big, small


def test_adaptive_order_counts_frees_still_in_the_fast_paths_log():
    p = cupool.Pool("sim", capacity="20MiB", spill="host", spill_policy="adaptive", defrag_threshold=None)
    keep = _fill_then_free_small(p, 5)
    # usage 15/20 = 0.75 and fragmentation 5/20 = 0.25: below both thresholds, so
    # garbage is collected first; the unfolded tables still say usage 1.0 (spill first).
    assert p.scheduler.order() == ["streams", "release", "gc", "compact", "rehome", "spill"]
    del keep


@pytest.mark.parametrize("expandable,stitch", [(False, {}), (None, {"stitch": 0})], ids=["plain", "default"])
def test_decisions_count_only_what_their_step_freed(expandable, stitch):
    p = cupool.Pool("sim", capacity="20MiB", spill="host", defrag_threshold=None, expandable_segments=expandable)
    keep = _fill_then_free_small(p, 2)  # 2 MiB freed through the fast path before the ladder runs
    cycle = [p.malloc(MiB)]  # in the small segment the frees emptied
    cycle.append(cycle)
    del cycle
    gc.disable()
    try:
        with pytest.raises(cupool.OutOfMemoryError):
            p.malloc(4 * MiB)
    finally:
        gc.enable()
    freed = {d.step: d.bytes_freed for d in p.scheduler.decisions}
    # Stitching remaps granules and frees no block.
    assert freed == {"streams": 0, "release": 0, **stitch, "compact": 0, "rehome": 0, "spill": 0, "gc": MiB}
    released = {d.step: d.bytes_released for d in p.scheduler.decisions}
    assert released["release"] == 0  # the emptied segment holds the cycle's block until gc
    del keep


def test_order_and_victims_take_the_pool_lock():
    p = cupool.Pool("sim", capacity="16MiB", spill="host", spill_policy="adaptive")
    m = p.movable(SLOT)
    out = []
    for call in (p.scheduler.order, p.scheduler.victims):
        with p.hold():
            t = threading.Thread(target=lambda: out.append(call()))
            t.start()
            t.join(0.2)
            assert t.is_alive(), f"{call.__name__}() read the pool without its lock"
        t.join(5)
        assert not t.is_alive()
    assert out[1] == [m]


# ------------------------------------------------------ lifetime of the pool
def test_the_scheduler_does_not_keep_its_pool_alive():
    p = cupool.Pool("sim", capacity="16MiB", spill="host")
    ref = weakref.ref(p)
    gc.disable()
    try:
        del p
        assert ref() is None, "Pool -> Scheduler -> Pool cycle: the pool waits for the cycle collector"
    finally:
        gc.enable()


@pytest.mark.parametrize("expandable", [False, None], ids=["plain", "default"])
def test_one_device_synchronization_per_spilled_buffer(monkeypatch, expandable):
    p = cupool.Pool("sim", capacity="16MiB", spill="host", defrag_threshold=None, expandable_segments=expandable)
    ms = [tagged(p, i) for i in range(3)]
    log, freeing = [], []
    real, real_free = p.device.synchronize, p.device.free
    monkeypatch.setattr(p.device, "synchronize", lambda *a: (freeing or log.append("sync"), real(*a)))

    def free(*a):  # giving a segment back waits too, as cudaFree does: not the spill's own wait
        freeing.append(a)
        try:
            real_free(*a)
        finally:
            freeing.pop()

    monkeypatch.setattr(p.device, "free", free)
    if p.config["expandable_segments"]:
        # Unmapping granules waits first (cuMemUnmap does not wait, as cudaFree does): not the spill's wait.
        vm = p.device.virtual_memory()
        real_unmap = vm.unmap
        monkeypatch.setattr(vm, "unmap", lambda *a: (log.append("unmap"), real_unmap(*a))[1])
    assert p.spill() == 3 * SLOT
    spill_waits = [i for i, x in enumerate(log) if x == "sync" and log[i + 1 : i + 2] != ["unmap"]]
    assert len(spill_waits) == 3, log
    del ms


# --------------------------------------------------- working set 3x device
@pytest.mark.parametrize("policy", ["lru", "fifo", "adaptive"])
@pytest.mark.parametrize("tier", ["host", "h5"])
def test_a_working_set_three_times_the_device_is_served(tmp_path, tier, policy):
    spill = "host" if tier == "host" else str(tmp_path / "spill.h5")
    p = cupool.Pool("sim", capacity="16MiB", spill=spill, spill_policy=policy)
    rng = np.random.default_rng(0)
    sizes = rng.integers(MiB // 2, 2 * MiB, 40)  # ~50 MiB of mixed sizes on a 16 MiB device
    bufs, crcs = [], []
    for i, n in enumerate(sizes):
        m = p.movable(int(n))
        a = m.array(dtype=np.uint8)
        a[:] = rng.integers(0, 256, int(n), dtype=np.uint8)
        crcs.append(zlib.crc32(a))
        del a
        bufs.append(m)
    assert sum(sizes) > 3 * p.limit
    for _ in range(3):  # random access passes: every buffer comes back intact
        for i in rng.permutation(len(bufs)):
            assert zlib.crc32(bufs[i].array(dtype=np.uint8)) == crcs[i]
    assert p.scheduler.spills > len(bufs)
    p.check()


# ----------------------------------------------- eviction order vs a model
class EvictionMachine(RuleBasedStateMachine):
    """Equal-size buffers on a device of CAP slots: each miss spills exactly the model's victim."""

    CAP = 6

    def __init__(self):
        super().__init__()
        self.policy = self.POLICY
        self.pool = cupool.Pool(
            "sim", capacity=self.CAP * SLOT, spill="host", spill_policy=self.policy, defrag_threshold=None
        )
        self.bufs = []  # Movable
        self.model = []  # dict(seq, used, on, leased, tag)
        self.views = {}
        self.clock = 0

    def _tick(self):
        self.clock += 1
        return self.clock

    def _victim(self):
        cands = [i for i, b in enumerate(self.model) if b["on"] and not self.views.get(i)]
        if not cands:
            return None
        key = (lambda i: self.model[i]["seq"]) if self.policy == "fifo" else (lambda i: self.model[i]["used"])
        return min(cands, key=key)

    def _make_room(self):
        """Play the pool's part for one more slot: spill the policy's victim when full."""
        if sum(b["on"] for b in self.model) == self.CAP:
            self.model[self._victim()]["on"] = False

    @rule()
    def create(self):
        tag = len(self.bufs) % 251
        self._make_room()
        self.bufs.append(tagged(self.pool, tag))
        t = self._tick()
        self.model.append({"seq": t, "used": t, "on": True, "tag": tag})

    @precondition(lambda self: self.bufs)
    @rule(i=st.integers(0, 10**6), keep=st.booleans())
    def touch(self, i, keep):
        # At most CAP - 2 buffers leased, so a victim always exists (the ladder's
        # behaviour when none does is tested above, without gc.collect in a loop).
        i %= len(self.bufs)
        b = self.model[i]
        if not b["on"]:
            self._make_room()
        view = self.bufs[i].array(dtype=np.uint8)
        b["on"] = True
        b["used"] = self._tick()
        assert (view == b["tag"]).all()
        if keep and (i in self.views or len(self.views) < self.CAP - 2):
            self.views.setdefault(i, []).append(view)

    @precondition(lambda self: self.views)
    @rule(i=st.integers(0, 10**6))
    def release(self, i):
        key = sorted(self.views)[i % len(self.views)]
        self.views[key].pop()
        if not self.views[key]:
            del self.views[key]

    @invariant()
    def residency_matches_the_model(self):
        assert [m.on_device for m in self.bufs] == [b["on"] for b in self.model]

    @invariant()
    def books_balance(self):
        self.pool.check()


@settings(max_examples=30)
class LRUMachine(EvictionMachine):
    POLICY = "lru"


@settings(max_examples=30)
class FIFOMachine(EvictionMachine):
    POLICY = "fifo"


@settings(max_examples=30)
class AdaptiveMachine(EvictionMachine):
    POLICY = "adaptive"


TestLRU = LRUMachine.TestCase
TestFIFO = FIFOMachine.TestCase
TestAdaptive = AdaptiveMachine.TestCase
