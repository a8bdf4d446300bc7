"""Several simulated devices: ``"sim:N"``, per-device default pools and device switching without a GPU.

Two defects this holds fixed: ``default_pool(1)`` without a GPU used to give a
pool whose ``device.index`` was 0 (so routing sent device 1's allocations to a
pool it then refused as belonging to device 0), and ``"sim:1"`` was rejected.
Every test here runs as if no GPU were present, also on a machine with one.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

import cupool
from cupool import hooks
from cupool.device import SimDevice, parse_device
from cupool.hooks import routing

MiB = 1 << 20


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    """No GPU, small default pools, none made yet, nothing installed; all undone afterwards."""
    monkeypatch.setattr(routing, "gpu_available", lambda: False)
    monkeypatch.setenv("CUPOOL_CONF", "capacity=32MiB")
    hooks.reset_default_pools()
    yield
    if hooks.installed():
        cupool.uninstall()
    hooks.reset_default_pools()


def test_default_pool_of_device_1_lives_on_sim_device_1():
    one, zero = cupool.default_pool(1), cupool.default_pool(0)
    assert one.device.index == 1 and one.device.name == "sim:1"
    assert zero.device.index == 0 and zero.device.name == "sim"
    assert one is not zero and one is cupool.default_pool(1)
    assert one.device.total == 32 * MiB  # CUPOOL_CONF applies to every device's pool
    a = one.malloc(1000)
    assert one.stats()["allocation.all.current"] == 1 and zero.stats()["allocation.all.current"] == 0
    a.free()


def test_cupool_conf_device_sim_keeps_the_index(monkeypatch):
    monkeypatch.setenv("CUPOOL_CONF", "device=sim,capacity=16MiB")
    pool = cupool.default_pool(3)
    assert pool.device.index == 3 and pool.device.total == 16 * MiB


@pytest.mark.parametrize(
    ("spec", "index", "name"),
    [("sim", 0, "sim"), ("sim:0", 0, "sim"), ("sim:1", 1, "sim:1"), (" SIM:12 ", 12, "sim:12")],
)
def test_pool_accepts_sim_devices_by_index(spec, index, name):
    pool = cupool.Pool(spec, capacity="8MiB")
    assert pool.device.index == index and pool.device.name == name
    assert pool.config["device"] == name and pool.snapshot()["segments"] == []
    assert parse_device(spec, None) == ("sim", index)


@pytest.mark.parametrize("spec", ["sim:x", "sim:-1", "sim:", "sim:1.5", "sim:1:2", "sim: 1", "sim:١", "simulated:1"])
def test_bad_sim_device_strings_are_refused_naming_the_text(spec):
    with pytest.raises(ValueError, match="device") as e:
        cupool.Pool(spec, capacity="8MiB")
    assert repr(spec.strip().lower()) in str(e.value) or repr(spec) in str(e.value)


@pytest.mark.parametrize(("bad", "error"), [(-1, ValueError), (1.0, TypeError), (True, TypeError), ("1", TypeError)])
def test_bad_device_indices_are_refused_and_change_nothing(bad, error):
    for lookup in (cupool.default_pool, hooks.current_pool, hooks.existing_pool):
        with pytest.raises(error, match=r"\(\): a device index"):
            lookup(bad)
    with pytest.raises(error, match=r"sim_device\(\): a device index"), cupool.sim_device(bad):
        pass
    with pytest.raises(error, match="index"):
        SimDevice("8MiB", index=bad)
    assert routing.current_device() == 0
    assert all(hooks.existing_pool(i) is None for i in range(3))  # a refused call made no default pool


def test_sim_device_needs_an_index():
    nothing: Any = None
    with pytest.raises(TypeError, match="a device index is an int, got None"), cupool.sim_device(nothing):
        pass


def test_sim_device_switches_the_current_device_and_restores_it():
    assert routing.current_device() == 0
    with cupool.sim_device(1) as index:
        assert index == 1 and routing.current_device() == 1
        assert cupool.default_pool() is cupool.default_pool(1) and hooks.current_pool().device.index == 1
        with cupool.sim_device(2):
            assert hooks.current_pool().device.name == "sim:2"
        assert routing.current_device() == 1
        with pytest.raises(RuntimeError, match="boom"), cupool.sim_device(0):
            raise RuntimeError("boom")
        assert routing.current_device() == 1
    assert routing.current_device() == 0 and cupool.default_pool().device.index == 0


def test_the_current_sim_device_is_per_thread():
    seen: dict[str, int] = {}
    with cupool.sim_device(1):
        t = threading.Thread(target=lambda: seen.setdefault("other", routing.current_device()))
        t.start()
        t.join()
        seen["this"] = routing.current_device()
    assert seen == {"other": 0, "this": 1}  # a new thread starts on device 0, as under CUDA


def test_sim_device_is_refused_when_a_gpu_is_in_use(monkeypatch):
    monkeypatch.setattr(routing, "gpu_available", lambda: True)
    with pytest.raises(RuntimeError, match=r"cupy\.cuda\.Device"), cupool.sim_device(1):
        pass


def test_using_routes_per_device_and_says_how_to_switch():
    one = cupool.Pool("sim:1", capacity="8MiB")
    with pytest.raises(ValueError, match=r"current device is 0.*cupool\.sim_device\(1\)"), cupool.using(one):
        pass
    with cupool.sim_device(1), cupool.using(one):
        assert hooks.current_pool() is one
        with cupool.sim_device(0):  # switching devices inside using(): device 0 keeps its own pool
            zero = hooks.current_pool()
            assert zero is cupool.default_pool(0) and zero is not one
        assert hooks.current_pool() is one and hooks.current_pool(0) is zero
    assert hooks.current_pool() is zero


def test_install_routes_each_sim_device_and_numba_follows():
    from cupool.numba import CupoolMemoryManager

    one = cupool.Pool("sim:1", capacity="8MiB")
    with pytest.raises(ValueError, match="belongs to device 1"):
        cupool.install(one, cupy=False, numba=False)
    assert not hooks.installed()
    with cupool.sim_device(1):
        assert cupool.install(one, cupy=False, numba=False) is one
    mm = CupoolMemoryManager(context=None)  # no context: it follows the current device
    assert mm.pool is cupool.default_pool(0)
    with cupool.sim_device(1):
        assert mm.pool is one
        p = mm.memalloc(4096)
        assert one.stats()["allocation.all.current"] == 1
        del p
    assert one.stats()["allocation.all.current"] == 0
    cupool.uninstall()
    with cupool.sim_device(1):
        assert hooks.current_pool() is cupool.default_pool(1) is not one
