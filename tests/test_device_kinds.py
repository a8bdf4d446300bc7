"""The registry of device kinds (``cupool.device.kinds``) drives every reading of a device name (issue 27).

Each kind parses, a bad name is refused naming the string, and ``auto`` resolves
through the table.  A kind registered here (a sim device under another name) then
works through ``Pool``, ``PinnedPool``, ``CUPOOL_CONF``, ``cupool info`` and its help,
the Dask plugin's check and ``cupool.validate`` with no other edit: the proof that a
new kind is one entry (and its device class).
"""

from __future__ import annotations

import numpy as np
import pytest

import cupool
import cupool.device
from cupool._dask_arguments import check_pool_arguments
from cupool.cli import main
from cupool.config import ENV_VAR
from cupool.device import (
    KINDS,
    CudaDevice,
    DeviceKind,
    SimDevice,
    SimPinnedDevice,
    parse_device,
    pinned_device_beside,
    split_device,
)
from cupool.device.kinds import AUTO, auto_kind, forms, kind_of, names, register
from cupool.errors import DeviceNameError, NoDeviceError
from cupool.hooks.routing import reset_default_pools
from cupool.settings import BY_NAME
from cupool.validate.records import Context

MiB = 1 << 20


# ------------------------------------------------------------------ the table drives parsing
@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_kind_parses_with_and_without_an_index(name):
    assert split_device(name) == (name, None)
    assert split_device(f" {name.upper()}:3 ") == (name, 3)
    assert parse_device(f"{name}:2", None, note_fallback=False, present=False) == (name, 2)


@pytest.mark.parametrize("bad", ["tpu", "auto:1", "gpu:0", "", ":1", "sim0"])
def test_a_bad_name_is_a_device_name_error_naming_the_string_and_every_form(bad):
    with pytest.raises(DeviceNameError) as e:
        split_device(bad)
    assert repr(bad) in str(e.value)
    assert all(f"'{form}'" in str(e.value) for form in forms())


@pytest.mark.parametrize("bad", ["sim:x", "cuda:-1", "sim:²", "cuda::1"])
def test_a_bad_index_names_the_string(bad):
    with pytest.raises(DeviceNameError, match="must be a non-negative integer") as e:
        split_device(bad)
    assert repr(bad) in str(e.value)


def test_forms_and_names_come_from_the_table_in_its_order():
    assert names() == (AUTO, *KINDS) and names()[:3] == ("auto", "sim", "cuda")
    assert forms() == ("auto", "sim", "sim:N", "cuda", "cuda:N")


def test_auto_is_the_gpu_kind_when_a_gpu_is_usable_else_the_one_that_needs_none(monkeypatch):
    assert auto_kind(True).name == "cuda" and auto_kind(False).name == "sim"
    monkeypatch.setattr(cupool.device, "cuda_available", lambda: False)
    assert parse_device("auto", "8MiB", note_fallback=False) == ("sim", 0)
    with pytest.raises(NoDeviceError, match="use 'sim' or 'auto'"):  # the kinds that need no GPU, then auto
        parse_device("cuda:1", None)


def test_capacity_is_refused_for_a_kind_that_takes_none_naming_those_that_do():
    with pytest.raises(ValueError, match="capacity: only the sim device has a configurable size; use max_size on a GPU"):
        parse_device("cuda", "1GiB", present=False)


def test_a_device_is_traced_back_to_its_kind_through_its_class():
    assert kind_of(SimDevice("8MiB")).name == "sim"
    assert kind_of(SimPinnedDevice("8MiB")).name == "sim"  # a subclass: the most derived class a kind names
    assert KINDS["cuda"].device_class is CudaDevice and KINDS["cuda"].needs_gpu and not KINDS["cuda"].sized


@pytest.mark.parametrize("name", ["auto", "sim", "Twin", "tw:in", "", "twin-2"])
def test_register_refuses_a_name_a_device_string_cannot_carry_or_one_taken(name):
    with pytest.raises(ValueError, match=repr(name)):
        register(DeviceKind(name, "x", SimDevice, SimDevice, SimDevice))
    assert name not in KINDS or name == "sim"


# ------------------------------------------------------------------ a kind registered in a test
class TwinDevice(SimDevice):
    """A sim device under another name: all a new kind needs is its class and one entry."""

    kind = "twin"

    @property
    def name(self) -> str:
        return f"twin:{self.index}"


TWIN = DeviceKind(
    "twin", "a sim device under another name (a test's)", TwinDevice,
    lambda index, capacity: TwinDevice(capacity, index=index), lambda index, capacity: SimPinnedDevice(capacity),
    capacity="32MiB", pinned_capacity="8MiB",
)


@pytest.fixture
def twin():
    register(TWIN)
    reset_default_pools()
    yield TWIN
    del KINDS["twin"]
    reset_default_pools()


def test_a_registered_kind_makes_pools_by_name(twin):
    pool = cupool.Pool(device="twin:0")
    assert type(pool.device) is TwinDevice and pool.device.total == 32 * MiB  # the kind's default capacity
    a = pool.empty(1000, np.uint8)
    a[:] = 7
    assert int(a.sum()) == 7000 and pool.config["device"] == "twin:0"
    other = cupool.Pool("twin:1", capacity="16MiB")
    assert other.device.index == 1 and other.device.total == 16 * MiB
    pinned = cupool.PinnedPool("twin")
    assert type(pinned.device) is SimPinnedDevice and pinned.device.total == 8 * MiB
    beside = pinned_device_beside(other.device)
    assert type(beside) is SimPinnedDevice and beside.total == 16 * MiB


def test_a_registered_kind_is_named_in_errors_and_taken_by_cupool_conf(twin, monkeypatch):
    with pytest.raises(DeviceNameError, match="'twin' or 'twin:N', got 'tpu'"):
        split_device("tpu")
    assert BY_NAME["device"].parse("Twin") == "twin"
    with pytest.raises(ValueError, match="device: must be auto, sim, cuda or twin, got 'tpu'"):
        BY_NAME["device"].parse("tpu")
    monkeypatch.setenv(ENV_VAR, "device=twin,capacity=16MiB")
    assert cupool.default_pool().device.name == "twin:0"


def test_a_registered_kind_is_listed_by_cupool_info_and_its_help(twin, capsys):
    assert main(["info", "--device", "twin:2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("device          twin:2 (")
    kinds = out.split("device kinds\n")[1].split("configuration\n")[0]
    rows = dict(line.split(None, 1) for line in kinds.splitlines())
    assert list(rows) == list(names())
    assert rows["twin"] == "a sim device under another name (a test's); --capacity sizes it (default 32 MiB)"
    assert rows["sim"].startswith("the simulated device (host memory)")
    with pytest.raises(SystemExit):
        main(["info", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "auto, sim, sim:N, cuda, cuda:N, twin or twin:N" in help_text
    assert "the sim or twin device's size" in help_text


def test_a_registered_kind_passes_the_dask_check_and_rehearses_validate(twin):
    check_pool_arguments("twin", {"max_size": "50%"})  # checked on the very device a worker makes
    check_pool_arguments("twin:1", {"capacity": "16MiB"})
    with pytest.raises(ValueError, match="CupoolSetup: device must be .*'twin:N', got 'tpu'"):
        check_pool_arguments("tpu", {})
    assert Context(device="twin").rehearsal and not Context(device="cuda").rehearsal


# ------------------------------------------------------------------ which upstream runs (issue 27)
@pytest.mark.parametrize("upstream", ["device", "managed", "async"])
def test_info_and_config_name_the_upstream(monkeypatch, capsys, upstream):
    monkeypatch.setenv(ENV_VAR, f"upstream={upstream},expandable_segments=false")
    assert main(["info", "--device", "sim", "--capacity", "16MiB"]) == 0
    config = capsys.readouterr().out.split("configuration\n")[1].split("versions\n")[0]
    assert f"  upstream              {upstream}\n" in config
    assert cupool.Pool("sim", capacity="16MiB", upstream=upstream).config["upstream"] == upstream
