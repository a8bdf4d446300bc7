"""``dask worker ... --preload cupool.dask --cupool-max-size 80%``: real ``dask worker`` processes against a
local scheduler on 127.0.0.1, each bounded in time."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest

distributed = pytest.importorskip("distributed", reason="cupool.dask needs distributed (pip install distributed, or '.[dask]' in cupool's checkout)")

cloudpickle = pytest.importorskip("cloudpickle", reason="distributed ships functions with cloudpickle")

from distributed.core import Status

from conftest import HAS_GPU

import cupool
import cupool.dask as cdask

# The workers cannot import this file, so its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

MiB = 1 << 20
WORKER = [sys.executable, "-m", "distributed.cli.dask_worker"]
#: Worker processes are started with this, and killed if they outlive it.
LIMIT = 90


def _worker_command(address: str, *options: str, nanny: bool = True) -> list[str]:
    extra = [] if nanny else ["--no-nanny"]
    return [*WORKER, address, "--nthreads", "1", "--no-dashboard", *extra, "--preload", "cupool.dask", *options]


@pytest.fixture(scope="module")
def scheduler():
    with distributed.LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=None) as cluster:
        yield cluster.scheduler_address


def test_a_worker_started_with_the_preload_has_its_pool(scheduler):
    options = ["--cupool-device", "sim", "--cupool-capacity", "256MiB", "--cupool-max-size", "50%",
               "--cupool-release-threshold", "4MiB", "--cupool-expandable-segments"]
    proc = subprocess.Popen(_worker_command(scheduler, *options), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        with distributed.Client(scheduler, timeout=LIMIT) as client:
            client.wait_for_workers(1, timeout=LIMIT)
            (worker,) = client.scheduler_info()["workers"]
            config = client.run(lambda: cdask.worker_pool().config)[worker]
            assert config["limit"] == 128 * MiB and config["device"].startswith("sim")
            assert config["release_threshold"] == 4 * MiB and config["expandable_segments"] is True
            assert client.run(lambda: cdask.worker_pool() is cupool.hooks.current_pool())[worker]
            before = client.run(lambda: id(cdask.worker_pool()))
            # The same setup from a client (a notebook's) keeps the pool; another one replaces it.
            client.register_plugin(cdask.CupoolSetup(
                "sim", capacity="256MiB", max_size="50%", release_threshold="4MiB", expandable_segments=True
            ))
            assert client.run(lambda: id(cdask.worker_pool())) == before
            client.register_plugin(cdask.CupoolSetup("sim", capacity="256MiB", max_size="25%"))
            assert client.run(lambda: cdask.worker_pool().limit) == {worker: 64 * MiB}
            client.unregister_worker_plugin("cupool")
            client.retire_workers([worker], close_workers=True)
        out = proc.communicate(timeout=LIMIT)[0]
    finally:
        proc.kill()
    assert "Run preload setup: cupool.dask" in out


@pytest.mark.parametrize(
    "options, message",
    [
        (["--cupool-max-size", "lots"], "Invalid value for '--cupool-max-size': cannot parse 'lots' as a size"),
        (["--cupool-defrag-threshold", "2"], "Invalid value for '--cupool-defrag-threshold'"),
        (["--cupool-bogus", "1"], "No such option '--cupool-bogus'"),
        (["--cupool-device", "sim", "--cupool-capacity", "64MiB", "--cupool-initial-size", "128MiB"],
         "--preload cupool.dask: CupoolSetup: initial_size 128 MiB is above the pool's limit 64 MiB"),
        (["--cupool-spill", "/scratch/spill.h5"], r"spill path '/scratch/spill.h5' has no {worker}"),
        (["--cupool-device", "tpu"], "--preload cupool.dask: CupoolSetup: device must be 'auto'"),
        (["--no-cupool-expandable-segments", "--cupool-stitch"], "stitch=True remaps granules of expandable"),
    ],
)
def test_bad_options_are_refused_as_the_command_line_is_read(options, message):
    """What distributed does with a preload's options in the ``dask worker`` process, before any worker starts."""
    with pytest.raises(click.UsageError) as err:
        cdask.dask_setup.make_context("dask_setup", list(options))
    assert message in err.value.format_message()


class _Worker:
    """Takes the plugin that ``dask_setup`` adds, as ``Worker.plugin_add`` would (its pool is made in this process)."""

    address = "tcp://127.0.0.1:1"
    status = Status.closed  # so that a teardown closes the pool at once
    nanny = None

    def __init__(self) -> None:
        self.plugins: dict[str, cdask.CupoolSetup] = {}

    async def plugin_add(self, plugin: cdask.CupoolSetup, name: str, catch_errors: bool) -> None:
        plugin.setup(self)
        self.plugins[name] = plugin


#: The preload's hooks are left off in this process (``_preload_plugin``), and so in the setups it is compared with.
NO_HOOKS = {"cupy": False, "numba": False}


def _preload_plugin(*options: str) -> cdask.CupoolSetup:
    """The plugin that ``--preload cupool.dask`` with ``options`` sets up in a worker (then torn down)."""
    ctx = cdask.dask_setup.make_context("dask_setup", [*options, "--no-cupool-cupy", "--no-cupool-numba"])
    worker = _Worker()
    asyncio.run(cdask.dask_setup.callback(worker, **ctx.params))
    plugin = worker.plugins["cupool"]
    assert cdask.worker_pool().closed is False
    plugin.teardown(worker)
    return plugin


def test_a_preload_without_segment_options_builds_pool_s_defaults():
    """The preload said --no-cupool-expandable-segments and --no-cupool-stitch unless told otherwise, so its
    workers got plain segments where Pool's defaults give expandable ones (and a client's identical setup
    replaced the preload's pool)."""
    sim = ("--cupool-device", "sim", "--cupool-capacity", "64MiB")
    plugin = _preload_plugin(*sim)
    assert plugin.key == cdask.CupoolSetup("sim", capacity="64MiB", **NO_HOOKS).key
    pool = plugin.make_pool("w")
    try:
        with cupool.Pool("sim", capacity="64MiB") as default:
            assert pool.config["expandable_segments"] == default.config["expandable_segments"]
            assert pool.config["stitch"] == default.config["stitch"]
    finally:
        pool.close()
    # The same sizes written another way are the same setup (once, "64MiB" and 64 << 20 were not).
    assert plugin.key == cdask.CupoolSetup("sim", capacity=64 << 20, **NO_HOOKS).key
    assert cdask.CupoolSetup("sim", max_size="1GiB").key == cdask.CupoolSetup("sim", max_size="1024 MiB").key
    assert cdask.CupoolSetup("sim", max_size="50%").key != cdask.CupoolSetup("sim", max_size="1GiB").key
    plain = _preload_plugin(*sim, "--no-cupool-expandable-segments")
    assert plain.key == cdask.CupoolSetup("sim", capacity="64MiB", expandable_segments=False, **NO_HOOKS).key
    assert plain.key != plugin.key


def test_a_bad_option_stops_dask_worker_before_it_starts():
    # No scheduler listens there: the command must fail reading its options, before it tries to connect.
    command = _worker_command("tcp://127.0.0.1:9", "--cupool-device", "sim", "--cupool-initial-size", "1TiB",
                              "--cupool-capacity", "1GiB")
    r = subprocess.run(command, capture_output=True, text=True, timeout=LIMIT, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--preload cupool.dask: CupoolSetup: initial_size 1 TiB is above the pool's limit 1 GiB" in r.stderr
    assert "Start worker" not in r.stderr


@pytest.mark.skipif(HAS_GPU, reason="the worker must lack a GPU for --cupool-device cuda to fail there")
@pytest.mark.parametrize("nanny", [False, True], ids=["no-nanny", "nanny"])
def test_a_worker_that_cannot_make_its_pool_says_why_once_and_fails(scheduler, nanny):
    """It printed the same traceback three times (the plugin's, the preload's, the worker's) and exited 0."""
    start = time.monotonic()
    r = subprocess.run(_worker_command(scheduler, "--cupool-device", "cuda", nanny=nanny), capture_output=True,
                       text=True, timeout=LIMIT, check=False)
    reason = "this worker cannot make its pool: device='cuda', but no usable CUDA GPU"
    assert r.stderr.count(reason) == 1, r.stderr[-4000:]
    assert r.stderr.count("no usable CUDA GPU") == 1, r.stderr[-4000:]  # no traceback repeats it
    # nor shows cupool's frames (its package's path: a checkout's folder may be named cupool too)
    assert str(Path(cupool.__file__).parent) + os.sep not in r.stderr, r.stderr[-4000:]
    assert r.returncode != 0, r.stderr[-4000:]
    assert "End worker" in r.stderr and "Restarting worker" not in r.stderr and time.monotonic() - start < LIMIT


def test_every_preload_option_has_help_and_python_m_cupool_dask_lists_it():
    """``python -m cupool.dask --help`` printed nothing: ``dask worker --help`` cannot show a preload's options."""
    options = [p for p in cdask.dask_setup.params if isinstance(p, click.Option) and p.name != "help"]
    assert len(options) >= 11
    for option in options:
        assert option.help and len(option.help) > 10, option.opts
    r = subprocess.run([sys.executable, "-m", "cupool.dask", "--help"], capture_output=True, text=True,
                       timeout=LIMIT, check=False)
    assert r.returncode == 0, r.stderr
    assert "--preload cupool.dask" in r.stdout
    for option in options:
        for name in (*option.opts, *option.secondary_opts):
            assert name in r.stdout, name
        assert " ".join(option.help.split()[:3]) in " ".join(r.stdout.split()), option.help
    # Options given are checked as dask worker checks them, and nothing is started.
    ok = subprocess.run([sys.executable, "-m", "cupool.dask", "--cupool-device", "sim", "--cupool-max-size", "50%"],
                        capture_output=True, text=True, timeout=LIMIT, check=False)
    assert ok.returncode == 0 and "CupoolSetup('sim', max_size='50%')" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "cupool.dask", "--cupool-max-size", "lots"], capture_output=True,
                         text=True, timeout=LIMIT, check=False)
    assert bad.returncode == 2 and "cannot parse 'lots' as a size" in bad.stderr, bad.stderr
