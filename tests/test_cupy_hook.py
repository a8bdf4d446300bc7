"""CuPy on cupool without a GPU: CuPy builds ndarrays on a custom allocator's memory as long as no kernel runs."""

import sys
import threading

import cupy
import numpy as np
import pytest

import cupool
from conftest import HAS_GPU, needs_gpu
from cupool import hooks
from cupool.config import parse_conf
from cupool.device import SimDevice

MiB = 1 << 20


@pytest.fixture(autouse=True)
def clean_hooks(monkeypatch):
    """Every test starts uninstalled, with no default pools and CuPy's own allocator."""
    before = cupy.cuda.get_allocator()
    hooks.reset_default_pools()
    monkeypatch.delenv("CUPOOL_CONF", raising=False)
    yield
    if hooks.installed():
        cupool.uninstall()
    cupy.cuda.set_allocator(before)
    hooks.reset_default_pools()


def live(pool):
    return pool.stats()["allocation.all.current"]


def spans_of(arrays):
    return sorted((a.data.ptr, a.nbytes) for a in arrays)


def in_live_blocks(pool, spans) -> bool:
    """Each span starts a live block of ``pool`` at least as long: where it lies in device memory (a device
    malloc, or granules mapped into reserved addresses, the default) is the pool's business."""
    with pool.hold() as view:
        live_blocks = {b.addr: b.size for seg in view.segments() for b in seg.blocks if not b.free}
    return all(live_blocks.get(p, -1) >= n for p, n in spans)


@pytest.mark.parametrize("expandable", [None, False], ids=["default", "plain"])
def test_arrays_come_from_the_pool_do_not_overlap_and_return(expandable):
    pool = cupool.Pool("sim", capacity="64MiB", expandable_segments=expandable)
    with cupool.using(pool):
        xs = [cupy.empty((n,), np.float32) for n in (256, 1, 1000, 300_000, 3 * MiB // 4)]
    spans = spans_of(xs)
    assert in_live_blocks(pool, spans) and all(p % 512 == 0 for p, _ in spans)
    for (p0, n0), (p1, _) in zip(spans, spans[1:]):
        assert p0 + n0 <= p1
    s = pool.stats()
    assert s["allocation.all.current"] == 5
    assert s["requested_bytes.all.current"] == sum(x.nbytes for x in xs)
    view = xs[2][10:20]
    del xs
    assert live(pool) == 1  # the view keeps its base's memory
    del view
    assert live(pool) == 0
    pool.check()


def test_memory_is_really_the_pools(pool):
    with cupool.using(pool):
        x = cupy.empty((64,), np.int32)
    pool.device.bytes_at(x.data.ptr, 256)[:] = 7
    assert x.data.ptr in [b["address"] for seg in pool.snapshot()["segments"] for b in seg["blocks"]]
    assert (pool.device.bytes_at(x.data.ptr, 256) == 7).all()


def test_using_nests_restores_and_routes_by_innermost(pool):
    other = cupool.Pool("sim", capacity="16MiB")
    outer_alloc = cupy.cuda.get_allocator()
    with cupool.using(pool):
        a = cupy.empty(10)
        with cupool.using(other):
            b = cupy.empty(10)
            assert hooks.current_pool() is other
        c = cupy.empty(10)
        assert hooks.current_pool() is pool
    assert cupy.cuda.get_allocator() is outer_alloc
    assert live(pool) == 2 and live(other) == 1
    del a, b, c


def test_using_restores_after_an_exception(pool):
    before = cupy.cuda.get_allocator()
    with pytest.raises(KeyError):
        with cupool.using(pool):
            raise KeyError("boom")
    assert cupy.cuda.get_allocator() is before
    assert hooks.using_pools() == ()


def test_using_is_thread_local(pool):
    """Another thread keeps the process-wide allocator while this one is inside using()."""
    process_pool = cupool.Pool("sim", capacity="16MiB")
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(cupool.cupy_allocator(process_pool))
    seen = {}
    inside, done = threading.Event(), threading.Event()

    def other_thread():
        inside.wait()
        seen["array"] = cupy.empty((1000,), np.float32)
        seen["live"] = (live(pool), live(process_pool))
        done.set()

    t = threading.Thread(target=other_thread)
    try:
        t.start()
        with cupool.using(pool):
            x = cupy.empty((10,), np.float32)
            inside.set()
            done.wait(10)
        t.join()
    finally:
        cupy.cuda.set_allocator(previous)
    assert seen["live"] == (1, 1)  # this thread's x in pool, the other's array in process_pool
    del x
    seen.clear()
    assert live(pool) == 0 and live(process_pool) == 0


def test_install_routes_everywhere_and_uninstall_restores(pool):
    before = cupy.cuda.get_allocator()
    assert cupool.install(pool) is pool
    assert hooks.current_pool() is pool
    got = {}

    def worker():
        got["x"] = cupy.empty(100)  # process-wide: other threads too

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert live(pool) == 1
    from numba.cuda.cudadrv import driver

    from cupool.numba import CupoolMemoryManager

    assert driver._memory_manager is CupoolMemoryManager
    cupool.uninstall()
    assert cupy.cuda.get_allocator() == before
    assert driver._memory_manager is None
    got.clear()
    assert live(pool) == 0


def test_using_wins_over_install(pool):
    other = cupool.Pool("sim", capacity="16MiB")
    cupool.install(pool, numba=False)
    with cupool.using(other):
        x = cupy.empty(10)
    y = cupy.empty(10)
    assert live(other) == 1 and live(pool) == 1
    del x, y


def test_install_without_a_pool_uses_the_default_pool_from_cupool_conf(monkeypatch):
    monkeypatch.setenv("CUPOOL_CONF", "device=sim,capacity=64MiB,max_size=50%,initial_size=4MiB")
    p = cupool.install(numba=False)
    assert p is cupool.default_pool() and p.device.kind == "sim"
    assert p.limit == 32 * MiB and p.stats()["reserved_bytes.all.current"] == 4 * MiB
    x = cupy.empty(1000, np.uint8)
    assert live(p) == 1
    del x


def test_install_twice_is_refused_and_changes_nothing(pool):
    cupool.install(pool, numba=False)
    alloc = cupy.cuda.get_allocator()
    other = cupool.Pool("sim", capacity="16MiB")
    with pytest.raises(RuntimeError, match="already installed"):
        cupool.install(other)
    assert cupy.cuda.get_allocator() is alloc and hooks.current_pool() is pool
    x = cupy.empty(10)
    assert live(pool) == 1 and live(other) == 0
    del x


def test_uninstall_without_install_is_refused():
    before = cupy.cuda.get_allocator()
    with pytest.raises(RuntimeError, match="not installed"):
        cupool.uninstall()
    assert cupy.cuda.get_allocator() is before


class _SecondDevice(SimDevice):
    """A sim device posing as GPU 1 of a two-GPU machine."""

    index = 1


@pytest.mark.parametrize("entry", ["using", "install"])
def test_pool_of_another_device_is_refused(pool, entry):
    foreign = cupool.Pool(_SecondDevice("8MiB"))
    before = cupy.cuda.get_allocator()
    with pytest.raises(ValueError, match="device 1.*current device is 0"):
        if entry == "using":
            with cupool.using(foreign):
                pass
        else:
            cupool.install(foreign)
    assert cupy.cuda.get_allocator() is before and not hooks.installed()
    assert hooks.using_pools() == ()


def test_wrong_kinds_of_pool_are_refused():
    with pytest.raises(TypeError, match="cupool.Pool"):
        with cupool.using("sim"):
            pass
    with pytest.raises(ValueError, match="pinned host memory"):
        with cupool.using(cupool.PinnedPool("sim", capacity="4MiB")):
            pass
    with pytest.raises(TypeError, match="cupy must be"):
        cupool.install(cupy="yes")
    assert not hooks.installed()


def test_default_pool_is_made_once(monkeypatch):
    monkeypatch.setenv("CUPOOL_CONF", "device=sim,capacity=32MiB")
    assert cupool.default_pool() is cupool.default_pool()


@pytest.mark.parametrize(
    "conf,match",
    [
        ("max_sise=80%", "unknown key 'max_sise'.*known keys"),
        ("max_size=lots", "max_size: cannot parse 'lots'"),
        ("max_size=80%,max_size=70%", "given twice"),
        ("max_size", "not key=value"),
        ("memory_fraction=2", "memory_fraction: must be in"),
        ("device=tpu", "device: must be auto, sim or cuda"),
    ],
)
def test_bad_cupool_conf_is_a_clear_error(monkeypatch, conf, match):
    monkeypatch.setenv("CUPOOL_CONF", conf)
    with pytest.raises(ValueError, match="CUPOOL_CONF") as ei:
        cupool.default_pool()
    assert ei.match(match)
    assert hooks.existing_pool() is None  # no default pool was left behind


def test_cupool_conf_that_parses_but_cannot_make_a_pool(monkeypatch):
    monkeypatch.setenv("CUPOOL_CONF", "device=sim,capacity=8MiB,initial_size=16MiB")
    with pytest.raises(ValueError, match="CUPOOL_CONF.*initial_size"):
        cupool.default_pool()


def test_parse_conf_values():
    assert parse_conf("max_size=80%, initial_size=2GB,") == {"max_size": "80%", "initial_size": "2GB"}
    assert parse_conf("memory_fraction=0.5,device=SIM") == {"memory_fraction": 0.5, "device": "sim"}
    assert parse_conf("") == {}


def test_stats_stay_exact_through_the_fast_path():
    """Parked frees and the folded accounting log give the same books as a model."""
    pool = cupool.Pool("sim", capacity="64MiB")
    rng = np.random.default_rng(1)
    held, model_req, model_n, peak_n, peak_req, peak_bytes = [], 0, 0, 0, 0, 0
    model_bytes = 0
    for step in range(9000):  # long enough to fold through numpy as well as in Python
        if held and (rng.random() < 0.5 or len(held) > 40):
            a = held.pop(int(rng.integers(len(held))))
            model_req -= a.size
            model_bytes -= a.nbytes
            model_n -= 1
            if step % 2:
                a.free()  # an explicit free; otherwise the drop below frees it
            del a
        else:
            n = int(rng.choice([0, 100, 512, 1000, 4096, 70_000]))
            a = pool.malloc(n)
            held.append(a)
            model_req += n
            model_bytes += a.nbytes
            model_n += 1
            peak_n, peak_req = max(peak_n, model_n), max(peak_req, model_req)
            peak_bytes = max(peak_bytes, model_bytes)
        if step % 997 == 0:
            s = pool.stats()
            assert s["allocation.all.current"] == model_n and s["requested_bytes.small_pool.current"] == model_req
    s = pool.stats()
    assert s["allocation.all.current"] == model_n == s["allocation.small_pool.current"]
    assert s["requested_bytes.all.current"] == model_req
    assert s["allocated_bytes.all.current"] == model_bytes
    assert s["allocation.all.peak"] == peak_n and s["requested_bytes.all.peak"] == peak_req
    assert s["allocated_bytes.all.peak"] == peak_bytes
    assert s["allocation.all.allocated"] - s["allocation.all.freed"] == model_n
    pool.check()


@needs_gpu
def test_cupy_workload_on_a_gpu_matches_cupys_own_pool():
    def workload():
        rs = cupy.random.RandomState(7)
        a = rs.standard_normal((512, 512), dtype=np.float32)
        b = (a * 2 + 1).sum(axis=0)
        c = a @ a.T
        f = cupy.fft.fft(a[0])
        s = cupy.sort(a[:, 3])
        return [cupy.asnumpy(v) for v in (b, c, f, s)]

    expected = workload()
    pool = cupool.Pool("cuda")
    with cupool.using(pool):
        got = workload()
        assert pool.stats()["allocation.all.allocated"] > 0
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e, g)


def test_a_failed_install_changes_nothing(pool, monkeypatch):
    """E.g. under NUMBA_ENABLE_CUDASIM, where the Numba plugin cannot be imported."""
    before = cupy.cuda.get_allocator()
    monkeypatch.setitem(sys.modules, "cupool.hooks.numba", None)  # makes the import fail
    with pytest.raises(ImportError):
        cupool.install(pool)
    assert cupy.cuda.get_allocator() is before and not cupool.hooks.installed()
    with pytest.raises(RuntimeError, match="not installed"):
        cupool.uninstall()


def test_install_and_uninstall_inside_using_are_refused_clearly(pool):
    with cupool.using(pool):
        with pytest.raises(RuntimeError, match="outside"):
            cupool.install(pool)
    assert not cupool.hooks.installed()
    cupool.install(pool, numba=False)
    with cupool.using(pool):
        with pytest.raises(RuntimeError, match="outside"):
            cupool.uninstall()
    assert cupool.hooks.installed()
    cupool.uninstall()


def test_an_allocator_keeps_its_pool_alive():
    """``set_allocator(cupy_allocator(Pool(...)))``: nobody else holds the pool, which must not close."""
    import gc

    alloc = cupool.cupy_allocator(cupool.Pool("sim", capacity="64MiB"))
    gc.collect()
    with cupy.cuda.using_allocator(alloc):
        x = cupy.empty((1000,), dtype=cupy.float32)  # a closed pool would refuse this
    assert not alloc.pool.closed
    assert x.data.ptr and alloc.pool.stats()["allocation.all.current"] == 1
    del x
    assert alloc.pool.stats()["allocation.all.current"] == 0


# -- the function path: CuPy's PythonFunctionAllocator, called here as CuPy calls it --------------


def function_path(pool):
    alloc = cupool.cupy_allocator(pool, path="function")
    return alloc, alloc.malloc_func, alloc.free_func


def test_function_path_is_cupys_python_function_allocator_and_keeps_its_pool():
    import gc

    alloc, malloc, free = function_path(cupool.Pool("sim", capacity="64MiB"))
    gc.collect()
    assert isinstance(alloc, cupy.cuda.memory.PythonFunctionAllocator) and callable(alloc)
    assert not alloc.pool.closed
    ptr = malloc(1000, 0)  # a closed pool would refuse this
    assert alloc.pool.stats()["allocation.all.current"] == 1
    free(ptr, 0)
    assert alloc.pool.stats()["allocation.all.current"] == 0


@pytest.mark.parametrize("expandable", [None, False], ids=["default", "plain"])
def test_function_path_hands_out_disjoint_aligned_blocks_and_exact_stats(expandable):
    pool = cupool.Pool("sim", capacity="64MiB", expandable_segments=expandable)
    _, malloc, free = function_path(pool)
    sizes = [1, 256, 512, 1000, 300_000, 3 * MiB, 12 * MiB]
    ptrs = [malloc(n, 0) for n in sizes]
    spans = sorted(zip(ptrs, sizes))
    assert in_live_blocks(pool, spans) and all(p % 512 == 0 for p, _ in spans)
    assert all(p0 + n0 <= p1 for (p0, n0), (p1, _) in zip(spans, spans[1:]))
    s = pool.stats()
    assert s["allocation.all.current"] == len(sizes)
    assert s["requested_bytes.all.current"] == sum(sizes)
    for p in ptrs[::2] + ptrs[1::2]:
        free(p, 0)
    s = pool.stats()
    assert s["allocation.all.current"] == 0 and s["requested_bytes.all.current"] == 0
    assert s["allocation.all.allocated"] == s["allocation.all.freed"] == len(sizes)
    pool.check()


def test_function_path_out_of_memory_reaches_the_caller_and_changes_nothing():
    pool = cupool.Pool("sim", capacity="8MiB")
    _, malloc, free = function_path(pool)
    keep = malloc(1000, 0)
    before = pool.stats()
    with pytest.raises(cupool.OutOfMemoryError, match="16.0 MiB|16 MiB"):
        malloc(16 * MiB, 0)
    after = pool.stats()
    assert after["allocation.all.current"] == before["allocation.all.current"] == 1
    assert after["num_ooms"] == before["num_ooms"] + 1
    free(keep, 0)
    pool.check()


def test_function_path_refuses_a_double_free_and_a_foreign_pointer_clearly(pool):
    _, malloc, free = function_path(pool)
    ptr = malloc(4096, 0)
    other = malloc(100, 0)
    free(ptr, 0)
    with pytest.raises(cupool.DoubleFreeError, match=f"{ptr:#x}.*already freed"):
        free(ptr, 0)
    stranger = cupool.Pool("sim", capacity="8MiB").malloc(100)
    with pytest.raises(cupool.ForeignAllocationError, match=f"{stranger.ptr:#x}.*none of this pool's segments"):
        free(stranger.ptr, 0)
    assert pool.stats()["allocation.all.current"] == 1  # the refusals changed nothing
    free(other, 0)
    assert pool.stats()["allocation.all.current"] == 0
    pool.check()


def test_function_path_refuses_another_devices_request(pool):
    _, malloc, _ = function_path(pool)
    with pytest.raises(ValueError, match="device 1.*belongs to device 0"):
        malloc(100, 1)
    assert pool.stats()["allocation.all.allocated"] == 0


def test_function_path_free_inside_the_pools_lock_is_queued_not_deadlocked(pool):
    """As when CuPy's finalizer runs during a collection that interrupted this pool's malloc."""
    _, malloc, free = function_path(pool)
    ptr = malloc(1000, 0)
    done = threading.Event()

    def free_while_held():
        with pool.hold():  # this thread holds the lock, as malloc would
            free(ptr, 0)  # waiting for the lock here would hang forever
            done.set()

    t = threading.Thread(target=free_while_held, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set()
    assert pool.stats()["allocation.all.current"] == 0  # applied by the next holder
    pool.check()


def test_function_path_is_thread_safe(pool):
    """Threads allocate and free through the two functions; no block is handed out twice and the books balance."""
    _, malloc, free = function_path(pool)
    errors, per_thread = [], 3000

    def worker(tag):
        rng = np.random.default_rng(tag)
        mine = []
        try:
            for _ in range(per_thread):
                if mine and rng.random() < 0.5:
                    p = mine.pop(int(rng.integers(len(mine))))
                    if pool.device.bytes_at(p, 1)[0] != tag:
                        errors.append(f"block {p:#x} was overwritten while thread {tag} held it")
                    free(p, 0)
                else:
                    p = malloc(int(rng.choice([1, 512, 4000, 70_000])), 0)
                    pool.device.bytes_at(p, 1)[0] = tag
                    mine.append(p)
            for p in mine:
                free(p, 0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(tag,)) for tag in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = pool.stats()
    assert s["allocation.all.current"] == 0
    assert s["allocation.all.allocated"] == s["allocation.all.freed"] > 0
    pool.check()


def test_unknown_path_and_pinned_pool_are_refused():
    with pytest.raises(ValueError, match="path must be one of 'pointer', 'unowned', 'function'"):
        cupool.cupy_allocator(cupool.Pool("sim", capacity="8MiB"), path="c")
    with pytest.raises(ValueError, match="pinned host memory"):
        cupool.cupy_allocator(cupool.PinnedPool("sim", capacity="4MiB"), path="function")


def test_function_path_without_a_pool_uses_the_default_pool(monkeypatch):
    monkeypatch.setenv("CUPOOL_CONF", "device=sim,capacity=32MiB")
    alloc = cupool.cupy_allocator(path="function")
    ptr = alloc.malloc_func(1000, 0)
    assert alloc.pool is cupool.default_pool()
    assert cupool.default_pool().stats()["allocation.all.current"] == 1
    alloc.free_func(ptr, 0)
    assert cupool.default_pool().stats()["allocation.all.current"] == 0


@pytest.mark.skipif(HAS_GPU, reason="on a GPU the function path serves CuPy (tested below)")
def test_function_path_cannot_serve_cupy_without_a_gpu(pool):
    """CuPy asks the CUDA runtime for the current device before calling malloc_func."""
    alloc, _, _ = function_path(pool)
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
        with cupy.cuda.using_allocator(alloc):
            cupy.empty((10,), np.float32)
    assert pool.stats()["allocation.all.allocated"] == 0


@needs_gpu
@pytest.mark.parametrize("path", cupool.hooks.cupy.PATHS)
def test_each_path_serves_cupy_on_a_gpu_with_exact_stats(path):
    pool = cupool.Pool("cuda")
    with cupy.cuda.using_allocator(cupool.cupy_allocator(pool, path=path)):
        xs = [cupy.ones((n,), np.float32) for n in (1, 256, 300_000)]
        with cupy.cuda.Stream(non_blocking=True):
            y = cupy.arange(1000)
        assert pool.stats()["allocation.all.current"] == 4
        assert all(float(x.sum()) == x.size for x in xs) and int(y.sum()) == 499_500
    del xs, y
    assert pool.stats()["allocation.all.current"] == 0
    pool.check()


def test_function_path_routed_by_device_on_a_gpu_machine(monkeypatch):
    """With a GPU, ``cupy_allocator(path="function")`` routes on the device id CuPy passes."""
    monkeypatch.setattr(cupool.hooks.cupy, "gpu_available", lambda: True)
    monkeypatch.setenv("CUPOOL_CONF", "device=sim,capacity=32MiB")
    alloc = cupool.cupy_allocator(path="function")
    ptr = alloc.malloc_func(1000, 0)
    assert cupool.default_pool(0).stats()["allocation.all.current"] == 1
    with pytest.raises(cupool.InvalidFreeError, match="no cupool allocator has served device 3"):
        alloc.free_func(ptr, 3)
    alloc.free_func(ptr, 0)
    assert cupool.default_pool(0).stats()["allocation.all.current"] == 0
    with pytest.raises(cupool.DoubleFreeError):
        alloc.free_func(ptr, 0)
