"""cupool.torch mirrors torch.cuda.memory (issue 36 #11): the helpers, the devices they take, and the history.

torch is not needed: a ``torch.device`` is stood in for by an object with its
``type`` and ``index``, which is all cupool reads of one.
"""

from __future__ import annotations

import pickle
import types

import pytest

import cupool
import cupool.torch as ct
from cupool import hooks
from cupool.errors import DeviceNameError, NoDeviceError

MiB = 1 << 20
HELPERS = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
           "reset_peak_memory_stats", "mem_get_info", "empty_cache", "memory_stats", "memory_summary")


def torch_device(kind: str, index: int | None = None) -> object:
    """What cupool reads of a ``torch.device("cuda:1")``: its type and index."""
    return types.SimpleNamespace(type=kind, index=index)


@pytest.fixture
def pools():
    """torch served from sim:0 and sim:1 (``use``), with a block of 3 MiB on 0 and 5 MiB on 1."""
    hooks.reset_default_pools()
    p0, p1 = cupool.Pool("sim", capacity="64MiB"), cupool.Pool("sim:1", capacity="64MiB")
    ct.use(p0)
    ct.use(p1)
    held = [p0.malloc(3 * MiB), p1.malloc(5 * MiB)]
    yield p0, p1
    del held
    for stop in (0, 1):
        ct.record_memory_history(None, stop)
    ct.use(None)
    hooks.reset_default_pools()


def test_cupool_torch_has_every_helper_of_torch_cuda_memory():
    assert [name for name in HELPERS if not callable(getattr(ct, name, None))] == []
    assert set(HELPERS) | {"record_memory_history", "dump_snapshot"} <= set(ct.__all__)


@pytest.mark.parametrize("name,key", [
    ("memory_allocated", "allocated_bytes.all.current"), ("max_memory_allocated", "allocated_bytes.all.peak"),
    ("memory_reserved", "reserved_bytes.all.current"), ("max_memory_reserved", "reserved_bytes.all.peak"),
])
def test_each_figure_takes_an_index_a_name_and_a_torch_device(pools, name, key):
    p0, p1 = pools
    helper = getattr(ct, name)
    for pool, names in ((p0, (None, 0, "cuda", "cuda:0", torch_device("cuda"), torch_device("cuda", 0))),
                        (p1, (1, "cuda:1", "sim:1", torch_device("cuda", 1)))):
        assert [helper(d) for d in names] == [pool.stats()[key]] * len(names), name
    assert ct.memory_allocated(1) == 5 * MiB and ct.memory_allocated("cuda:0") == 3 * MiB


def test_the_rest_take_every_form_too(pools):
    p0, p1 = pools
    for d in (1, "cuda:1", torch_device("cuda", 1)):
        assert ct.memory_stats(d) == dict(sorted(p1.stats().items()))
        assert ct.mem_get_info(d) == (64 * MiB - p1.stats()["reserved_bytes.all.current"], 64 * MiB)
        assert "cupool memory summary" in ct.memory_summary(d)
    a = p1.malloc(20 * MiB)
    del a
    assert ct.max_memory_allocated(torch_device("cuda", 1)) == 25 * MiB
    ct.reset_peak_memory_stats("cuda:1")
    assert ct.max_memory_allocated(1) == 5 * MiB and ct.max_memory_allocated(0) == 3 * MiB  # device 0 untouched
    reserved = [p.stats()["reserved_bytes.all.current"] for p in pools]
    given = ct.empty_cache(torch_device("cuda", 1))
    assert given >= 20 * MiB and [p.stats()["reserved_bytes.all.current"] for p in pools] == [
        reserved[0], reserved[1] - given]


def test_empty_cache_with_no_device_empties_every_pool_serving_torch(pools):
    p0, p1 = pools
    for p in pools:
        del_me = p.malloc(8 * MiB)
        del del_me
    reserved = [p.stats()["reserved_bytes.all.current"] for p in pools]
    given = ct.empty_cache()
    after = [p.stats()["reserved_bytes.all.current"] for p in pools]
    assert min(r - a for r, a in zip(reserved, after)) >= 8 * MiB and given == sum(reserved) - sum(after)


def test_what_names_no_torch_device_is_refused(pools):
    with pytest.raises(ValueError, match="not a CUDA device"):
        ct.memory_allocated(torch_device("cpu"))
    with pytest.raises(DeviceNameError, match=r"cupool\.torch\.memory_stats\(\).*'cuda0'"):
        ct.memory_stats("cuda0")
    with pytest.raises(TypeError, match=r"cupool\.torch\.mem_get_info\(\).*1\.5"):
        ct.mem_get_info(1.5)
    with pytest.raises(NoDeviceError, match="device 7 does not exist"):
        ct.memory_reserved("cuda:7")  # no pool is made for a device the machine lacks
    assert hooks.existing_pool(7) is None


def test_pool_snapshot_carries_device_traces_while_recorded(pools):
    p0, p1 = pools
    assert "device_traces" not in p1.snapshot()
    with p1.record():
        a = p1.malloc(2 * MiB)
        snap = p1.snapshot()
        assert len(snap["device_traces"]) == 2 and snap["device_traces"][0] == []
        allocs = [e for e in snap["device_traces"][1] if e["action"] == "alloc"]
        assert a.ptr in [e["addr"] for e in allocs]
        del a
    assert "device_traces" not in p1.snapshot()


def test_record_memory_history_and_dump_snapshot(pools, tmp_path):
    p0, _ = pools
    ct.record_memory_history(device="cuda:0", max_entries=100)
    a = p0.malloc(1 * MiB)
    addr = a.ptr
    a.free()
    assert [e["action"] for e in p0.snapshot()["device_traces"][0] if e["addr"] == addr][-3:] == [
        "alloc", "free_requested", "free_completed"]
    path = tmp_path / "snap.pickle"
    assert ct.dump_snapshot(path, 0) >= 3
    with open(path, "rb") as fh:
        dumped = pickle.load(fh)
    assert addr in [e["addr"] for e in dumped["device_traces"][0]] and dumped["segments"]
    ct.record_memory_history(None)  # stops (the current device: 0)
    assert "device_traces" not in p0.snapshot()
    with pytest.warns(UserWarning, match="no events"):
        assert ct.dump_snapshot(tmp_path / "empty.pickle") == 0
    with pytest.raises(ValueError, match="enabled must be"):
        ct.record_memory_history("yes")
    with pytest.raises(ValueError, match="capacity"):
        ct.record_memory_history(max_entries=0)
    assert "device_traces" not in p0.snapshot()  # a refused call starts nothing


def test_pytorch_is_named_where_users_look(capsys):
    """The README's title line, the package's description and ``cupool --help`` (issue 36 #13)."""
    import re
    from pathlib import Path

    from cupool.cli import main

    root = Path(__file__).resolve().parent.parent
    title = next(line for line in (root / "README.md").read_text().splitlines() if line.startswith("**"))
    description = re.search(r'^description = "(.*)"$', (root / "pyproject.toml").read_text(), re.M)
    with pytest.raises(SystemExit):
        main(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert description is not None
    for where in (title, description.group(1), said, cupool.__doc__.splitlines()[0]):
        assert "CuPy, Numba and PyTorch" in where, where
