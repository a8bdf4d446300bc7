"""cupool on a real Dask cluster: two worker processes on the sim device, one cluster for the module."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from typing import Any

import pytest

distributed = pytest.importorskip("distributed", reason="cupool.dask needs distributed (pip install distributed, or '.[dask]' in cupool's checkout)")
cloudpickle = pytest.importorskip("cloudpickle", reason="distributed ships functions with cloudpickle")

from conftest import HAS_GPU

import cupool
import cupool.dask as cdask
from cupool import hooks
from cupool.replay import replay

# The workers cannot import this file, so its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

MiB = 1 << 20
CONFIG: dict[str, Any] = {"device": "sim", "capacity": "256MiB", "max_size": "50%"}


@pytest.fixture(scope="module")
def client():
    plugin = cdask.CupoolSetup(**CONFIG)
    with distributed.LocalCluster(
        n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None, plugins={plugin}
    ) as cluster, distributed.Client(cluster) as c:
        yield c


@pytest.fixture
def workers(client):
    return sorted(client.scheduler_info()["workers"])


# ---------------------------------------------------------------- run in the workers
def _pool_id() -> int:
    return id(cdask.worker_pool())


def _hold(nbytes: int):
    """A task whose result, an array over the worker's pool, stays in worker memory while its future lives."""
    return cupool.hooks.current_pool().empty(nbytes, "uint8")


def _live_bytes() -> int | float:
    return cdask.worker_pool().stats()["allocated_bytes.all.current"]


def _cupy_allocation(nbytes: int) -> dict:
    import cupy

    pool = cdask.worker_pool()
    before = pool.stats()["allocation.all.current"]
    x = cupy.empty(nbytes, dtype=cupy.uint8)
    segments = [(s["address"], s["total_size"]) for s in pool.snapshot()["segments"]]
    return {
        "worker": distributed.get_worker().address,
        "inside": any(a <= x.data.ptr and x.data.ptr + nbytes <= a + n for a, n in segments),
        "new": pool.stats()["allocation.all.current"] - before,
    }


def _malloc_and_free(n: int) -> None:
    pool = cdask.worker_pool()
    for a in [pool.malloc(4096) for _ in range(n)]:
        pool.free(a)


def _setup_again(dask_worker) -> dict:
    plugin = dask_worker.plugins["cupool"]
    before = cdask.worker_pool()
    plugin.setup(dask_worker)
    pickle.loads(pickle.dumps(plugin)).setup(dask_worker)  # a copy, as a second registration would bring
    same = cdask.worker_pool() is before and not before.closed
    cdask.CupoolSetup(**{**CONFIG, "max_size": "25%"}).setup(dask_worker)  # other arguments: a new pool
    after = cdask.worker_pool()
    replaced = {"old_closed": before.closed, "limit": after.limit, "routed": hooks.current_pool() is after}
    plugin.setup(dask_worker)  # and back, for the tests that follow
    return {"same": same, "replaced": replaced, "limit": cdask.worker_pool().limit}


def _keep_pool(dask_worker) -> None:
    dask_worker.cupool_test_pool = cdask.worker_pool()


def _state(dask_worker) -> dict:
    kept = dask_worker.cupool_test_pool
    try:
        pool = cdask.worker_pool()
    except RuntimeError:
        pool = None
    return {
        "kept_closed": kept.closed,
        "installed": hooks.installed(),
        "pool": pool is not None,
        "new": pool is not None and pool is not kept,
        "routed": pool is not None and hooks.current_pool() is pool,
        "limit": None if pool is None else pool.limit,
    }


def _wait_for(client, fn, expected, timeout=10.0):
    """Poll ``client.run(fn)`` until it returns ``expected`` (futures are released asynchronously)."""
    deadline = time.monotonic() + timeout
    while (got := client.run(fn)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


# ---------------------------------------------------------------- the tests
def test_importing_cupool_does_not_import_dask():
    code = "import sys, cupool; assert 'cupool.dask' not in sys.modules and 'distributed' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr


def test_each_worker_has_its_own_installed_pool(client, workers):
    ids = client.run(_pool_id)
    assert sorted(ids) == workers and len(workers) == 2
    routed = client.run(lambda: hooks.installed() and hooks.current_pool() is cdask.worker_pool())
    assert routed == {w: True for w in workers}
    limits = client.run(lambda: cdask.worker_pool().limit)
    assert limits == {w: 128 * MiB for w in workers}


def test_a_task_allocates_from_its_workers_pool_and_stats_add_up(client, workers):
    sizes = {workers[0]: 1 * MiB, workers[1]: 3 * MiB}
    futures = [client.submit(_hold, n, workers=[w], pure=False) for w, n in sizes.items()]
    distributed.wait(futures)
    who = client.who_has(futures)
    assert [list(who[f.key]) for f in futures] == [[w] for w in sizes]  # each result stays where it was made
    s = cdask.stats(client)
    assert sorted(s.workers) == workers
    for w, n in sizes.items():
        assert s.workers[w]["allocated_bytes.all.current"] == n
        assert s.workers[w]["allocation.all.current"] == 1
    for name, value in s.total.items():
        assert value == sum(stats[name] for stats in s.workers.values()), name
    assert s.total["allocated_bytes.all.current"] == 4 * MiB and s.total["allocation.all.current"] == 2
    assert s.total["limit"] == 2 * 128 * MiB
    assert "num_device_alloc" in s.total and "reserved_bytes.all.freed" in s.total
    unsummed = ("fragmentation", "cache_hit_rate", "largest_free_block")
    assert not [n for n in s.total if n.endswith(".peak") or n in unsummed]
    del futures
    assert _wait_for(client, _live_bytes, {w: 0 for w in workers}) == {w: 0 for w in workers}


def test_cupy_arrays_in_tasks_come_from_the_workers_pool(client, workers):
    pytest.importorskip("cupy", reason="CuPy is what the installed hook serves")
    for w in workers:
        got = client.submit(_cupy_allocation, 5000, workers=[w], pure=False).result()
        assert got == {"worker": w, "inside": True, "new": 1}


def test_empty_cache_gives_back_every_workers_free_segments(client, workers):
    # From empty pools: with holes left by earlier tests, the 30 MiB would be stitched from them
    # and its range given back at its free (Note [Stitch before grow]), leaving nothing cached.
    cdask.empty_cache(client)
    client.run(lambda: cdask.worker_pool().free(cdask.worker_pool().malloc(30 * MiB)))
    reserved = {w: s["reserved_bytes.all.current"] for w, s in cdask.stats(client).workers.items()}
    assert all(r >= 30 * MiB for r in reserved.values())
    assert cdask.empty_cache(client) == reserved
    assert cdask.stats(client).total["reserved_bytes.all.current"] == 0


def test_traces_are_collected_per_worker_and_replay(client, workers, tmp_path):
    calls = {workers[0]: 3, workers[1]: 5}
    with cdask.record(client, tmp_path / "traces") as rec:
        distributed.wait([client.submit(_malloc_and_free, n, workers=[w], pure=False) for w, n in calls.items()])
    assert sorted(rec.paths) == workers
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == sorted(p.name for p in rec.paths.values())
    for w, n in calls.items():
        path = rec.paths[w]
        assert path.name == w.rpartition("://")[2].replace(":", "-") + ".h5"
        trace = cupool.load_trace(path)
        counts = trace.counts()
        assert counts["alloc"] == counts["free"] == n
        assert trace.config["device"] == "sim" and trace.config["limit"] == 128 * MiB
        result = replay(trace, engine="pool")
        assert result.events == len(trace) and result.ooms == 0 and result.unmatched_frees == 0
    assert rec.stop() == rec.paths  # stopping again changes nothing


def test_a_recording_will_not_overwrite_traces(client, workers, tmp_path):
    first = cdask.record(client, tmp_path)
    first.start()
    paths = first.stop()
    stamps = {p: p.stat().st_mtime_ns for p in paths.values()}
    with pytest.raises(FileExistsError, match="will not overwrite"):
        cdask.record(client, tmp_path).start()
    assert {p: p.stat().st_mtime_ns for p in paths.values()} == stamps


def test_a_second_recording_into_one_folder_is_refused_up_front_and_loses_nothing(client, workers, tmp_path):
    """Issue 21 #9: the second stop() raised a raw FileExistsError, and its other traces were gone."""
    first = cdask.record(client, tmp_path)
    first.start()
    second = cdask.record(client, tmp_path)
    with pytest.raises(FileExistsError, match="another recording into"):
        second.start()
    distributed.wait([client.submit(_malloc_and_free, 2, workers=[w], pure=False) for w in workers])
    paths = first.stop()
    assert sorted(paths) == workers and sorted(tmp_path.iterdir()) == sorted(paths.values())
    for path in paths.values():
        assert cupool.load_trace(path).counts()["alloc"] == 2
    assert second.stop() == {}  # it never started


def test_a_trace_that_cannot_be_written_is_kept_and_the_others_are_written(client, workers, tmp_path, monkeypatch):
    rec = cdask.record(client, tmp_path).start()
    write = cdask.ClusterRecording._write

    def full_disk_for_the_first(self, path, data):
        if path == self.path_of(workers[0]):
            raise OSError(28, "No space left on device")
        write(self, path, data)

    monkeypatch.setattr(cdask.ClusterRecording, "_write", full_disk_for_the_first)
    with pytest.raises(RuntimeError, match=r"1 worker\(s\).*No space left.*in \.unsaved"):
        rec.stop()
    assert list(rec.paths) == [workers[1]] and list(rec.unsaved) == [workers[0]]
    assert rec.unsaved[workers[0]][:8] == b"\x89HDF\r\n\x1a\n"  # the whole trace file, to write elsewhere
    assert sorted(tmp_path.iterdir()) == [rec.paths[workers[1]]]  # no empty claim, no temporary file left


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"capacity": 0}, ValueError, "capacity must be a positive int"),
        ({"flush_interval": -1}, ValueError, "flush_interval"),
        ({"bogus": 1}, TypeError, "bogus"),
    ],
)
def test_bad_recording_options_fail_on_the_client(client, tmp_path, options, error, match):
    with pytest.raises(error, match=f"cupool.dask.record: .*{match}"):
        cdask.record(client, tmp_path / "never", **options)
    assert not (tmp_path / "never").exists()


BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"defrag_threshold": 2}, ValueError, r"defrag_threshold must be in \[0, 1\)"),
    ({"max_size": "lots"}, ValueError, "max_size: cannot parse 'lots'"),
    ({"bogus": 1, "max_size": "1GB"}, TypeError, "unknown argument.*'bogus'"),
    ({"initial_size": "1GiB", "max_size": "64MiB"}, ValueError, "initial_size 1 GiB is above the pool's limit"),
    ({"device": "sim", "capacity": "64MiB", "initial_size": "128MiB"}, ValueError, "initial_size 128 MiB is above"),
    ({"device": "tpu"}, ValueError, "device must be 'auto'.*, got 'tpu'"),
    ({"device": "cuda", "capacity": "1GiB"}, ValueError, "capacity: only the sim device"),
    ({"device": cupool.SimDevice("8MiB")}, TypeError, "device must be 'auto'.*each worker makes its own"),
    ({"spill": "/scratch/spill.h5"}, ValueError, r"spill path '/scratch/spill.h5' has no \{worker\}"),
    ({"spill": "/scratch/spill-{worker}.txt"}, ValueError, "spill must be None, 'host', a path ending in .h5"),
    ({"spill": cupool.HostTier}, TypeError, "spill must be None, 'host' or a path.*a tier object cannot be shared"),
    ({"spill_policy": "random"}, ValueError, "spill_policy must be one of"),
    ({"track_sites": "yes"}, TypeError, "track_sites must be True or False"),
    ({"memory_fraction": 1.5}, ValueError, r"memory_fraction must be in \(0, 1\]"),
    ({"cupy": "yes"}, TypeError, "cupy must be True, False or None"),
    # Pool's keywords pass through (stitch alone is fine now: expandable segments are on by default)
    ({"expandable_segments": False, "stitch": True}, ValueError, "stitch=True .* needs expandable_segments=True"),
]


@pytest.mark.parametrize("options, error, match", BAD, ids=[str(sorted(o))[:40] for o, _, _ in BAD])
def test_a_bad_argument_fails_on_the_client_naming_it(client, options, error, match):
    before = client.run(_pool_id)
    with pytest.raises(error, match=f"^CupoolSetup: {match}"):
        client.register_plugin(cdask.CupoolSetup(**options))
    assert client.run(_pool_id) == before


@pytest.mark.parametrize(
    "options",
    [
        {"device": "cuda", "max_size": "80%", "initial_size": "2GB"},  # no GPU here; the workers may have one
        {"initial_size": "2GB", "max_size": "30%"},  # fits a large enough GPU: only the worker can tell
        {"device": "sim", "spill": "host", "release_threshold": "1MiB", "defrag_threshold": None},
        {"spill": "/scratch/spill-{worker}.h5"},  # the tier makes its file only when it first spills
        {"device": "sim", "capacity": "64MiB", "expandable_segments": True, "stitch": True},
    ],
)
def test_good_arguments_pass_the_client_check_and_pickle(options, tmp_path):
    plugin = cdask.CupoolSetup(**options)
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy.key == plugin.key and repr(copy) == repr(plugin) and copy.name == "cupool"
    assert not (tmp_path / "probe").exists()


def test_the_worker_fills_in_its_spill_file(tmp_path):
    plugin = cdask.CupoolSetup("sim", capacity="8MiB", spill=tmp_path / "spill-{worker}.h5")
    pool = plugin.make_pool("10.0.0.1-8786")
    try:
        assert pool.scheduler.tier.path == tmp_path / "spill-10.0.0.1-8786.h5"
    finally:
        pool.close()


def test_setting_up_twice_in_a_worker_keeps_one_pool_and_other_arguments_replace_it(client, workers):
    got = client.run(_setup_again)
    replaced = {"old_closed": True, "limit": 64 * MiB, "routed": True}
    assert got == {w: {"same": True, "replaced": replaced, "limit": 128 * MiB} for w in workers}


def test_registering_an_identical_setup_again_changes_nothing(client, workers):
    """Issue 20 #4: re-running a notebook cell replaced every pool; stats() then said 0 with arrays alive."""
    before = client.run(_pool_id)
    futures = [client.submit(_hold, 3 * MiB, workers=[w], pure=False) for w in workers]
    distributed.wait(futures)
    reserved = {w: s["reserved_bytes.all.current"] for w, s in cdask.stats(client).workers.items()}
    client.register_plugin(cdask.CupoolSetup(**CONFIG))
    client.register_plugin(cdask.CupoolSetup(**{**CONFIG, "expandable_segments": None}))  # a default: the same
    assert client.run(_pool_id) == before
    s = cdask.stats(client)
    assert {w: f["allocated_bytes.all.current"] for w, f in s.workers.items()} == {w: 3 * MiB for w in workers}
    assert {w: f["reserved_bytes.all.current"] for w, f in s.workers.items()} == reserved
    assert s.total["retired_allocated_bytes"] == 0
    del futures
    assert _wait_for(client, _live_bytes, {w: 0 for w in workers}) == {w: 0 for w in workers}


def _retired_total(client) -> tuple[int, int]:
    total = cdask.stats(client).total
    return total["retired_allocated_bytes"], total["retired_reserved_bytes"]


def test_teardown_closes_the_pool_and_registering_again_replaces_it(client, workers, tmp_path):
    client.run(_keep_pool)
    held = client.submit(_hold, 5 * MiB, workers=[workers[0]], pure=False)
    distributed.wait(held)
    try:
        client.register_plugin(cdask.CupoolSetup(**{**CONFIG, "max_size": "25%"}))
        state = client.run(_state)
        alive = {"kept_closed": True, "installed": True, "pool": True, "new": True, "routed": True, "limit": 64 * MiB}
        assert state == {w: alive for w in workers}
        # The old pool's memory that an array still holds stays in the figures until the array dies.
        s = cdask.stats(client)
        assert s.workers[workers[0]]["retired_allocated_bytes"] == 5 * MiB
        assert s.workers[workers[0]]["retired_reserved_bytes"] >= 5 * MiB
        assert s.workers[workers[1]]["retired_allocated_bytes"] == 0
        assert s.total["retired_allocated_bytes"] == 5 * MiB and s.total["allocated_bytes.all.current"] == 0
        del held
        deadline = time.monotonic() + 10
        while _retired_total(client) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _retired_total(client) == (0, 0)
        client.run(_keep_pool)
        client.unregister_worker_plugin("cupool")
        gone = {"kept_closed": True, "installed": False, "pool": False, "new": False, "routed": False, "limit": None}
        # A worker leaves on its own event loop after the teardown returns (CupoolSetup.teardown defers
        # _leave, so that a registration right after can keep the pool): wait for it, as for futures.
        assert _wait_for(client, _state, {w: gone for w in workers}) == {w: gone for w in workers}
        with pytest.raises(RuntimeError, match="no CupoolSetup is set up"):
            cdask.stats(client)
        with pytest.raises(RuntimeError, match="no CupoolSetup is set up"):
            cdask.record(client, tmp_path).start()
        assert list(tmp_path.iterdir()) == []
    finally:
        client.register_plugin(cdask.CupoolSetup(**CONFIG))
    assert client.run(lambda: cdask.worker_pool().limit) == {w: 128 * MiB for w in workers}


@pytest.mark.skipif(HAS_GPU, reason="the check needs workers without a GPU")
def test_a_pool_the_worker_cannot_make_fails_registration_on_the_client(client, workers):
    try:
        with pytest.raises(RuntimeError, match="no usable CUDA GPU"):
            client.register_plugin(cdask.CupoolSetup("cuda"))
        assert client.run(lambda: hooks.installed()) == {w: False for w in workers}
    finally:
        client.register_plugin(cdask.CupoolSetup(**CONFIG))
    assert client.run(lambda: cdask.worker_pool().limit) == {w: 128 * MiB for w in workers}


def test_a_spill_folder_is_checked_in_the_worker_not_on_the_client(client, workers, tmp_path):
    """The client's machine may lack a folder that the workers' have: only the workers can tell."""
    plugin = cdask.CupoolSetup(**CONFIG, spill=tmp_path / "missing" / "spill-{worker}.h5")  # accepted here
    try:
        with pytest.raises(ValueError, match="its folder .*missing' does not exist"):
            client.register_plugin(plugin)
    finally:
        client.register_plugin(cdask.CupoolSetup(**CONFIG))
    assert client.run(lambda: cdask.worker_pool().limit) == {w: 128 * MiB for w in workers}


def test_workers_sharing_a_process_share_its_pool_and_count_it_once():
    assert not hooks.installed()
    plugin = cdask.CupoolSetup("sim", capacity="64MiB", initial_size="8MiB")
    with distributed.LocalCluster(
        n_workers=2, processes=False, threads_per_worker=1, dashboard_address=":0", worker_dashboard_address=":0",
        plugins={plugin},
    ) as cluster, distributed.Client(cluster) as c:
        pool = cdask.worker_pool()  # the workers run in this process
        assert hooks.installed() and hooks.current_pool() is pool
        assert len(set(c.run(_pool_id).values())) == 1
        x = c.submit(_hold, MiB, pure=False)
        distributed.wait(x)
        s = cdask.stats(c)
        assert len(s.workers) == 2 and all(w["allocated_bytes.all.current"] == MiB for w in s.workers.values())
        assert s.total["allocated_bytes.all.current"] == MiB and s.total["limit"] == 64 * MiB
        reserved = pool.stats()["reserved_bytes.all.current"]
        c.register_plugin(cdask.CupoolSetup("sim", capacity="64MiB", initial_size="8MiB"))  # identical: no change
        assert cdask.worker_pool() is pool and not pool.closed
        in_use = pool.device.capacity - pool.device.mem_info()[0]  # mapped granules too, not only device.used
        assert pool.stats()["reserved_bytes.all.current"] == reserved and in_use == reserved
        # Issue 21 #9: other arguments raised RuntimeError on the client, yet both workers got the new pool.
        c.register_plugin(cdask.CupoolSetup("sim", capacity="64MiB", max_size="50%"))
        new = cdask.worker_pool()
        assert new is not pool and pool.closed and hooks.current_pool() is new and new.limit == 32 * MiB
        assert set(c.run(_pool_id).values()) == {id(new)}
        s = cdask.stats(c)
        assert s.total["limit"] == 32 * MiB and s.total["retired_allocated_bytes"] == MiB
        del x
    assert new.closed and not hooks.installed()
