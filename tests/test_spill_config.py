"""What the README promises of spilling (issue 20 #6): a bad spill path fails when the pool is made,
and ``pool.spill()`` shows in ``pool.scheduler.decisions``."""

import os

import numpy as np
import pytest

import cupool
from cupool import HDF5Tier, SimDevice

MiB = 1 << 20


def filled(pool, n, size=2 * MiB):
    ms = []
    for i in range(n):
        m = pool.movable(size)
        a = m.array(dtype=np.uint8)
        a[:] = i + 1
        del a
        ms.append(m)
    return ms


def test_pool_spill_is_recorded_as_decisions():
    # Plain segments: each spilled buffer empties a segment of its own, which goes back (bytes_released).
    pool = cupool.Pool("sim", capacity="64MiB", spill="host", defrag_threshold=None, expandable_segments=False)
    ms = filled(pool, 4, 8 * MiB)  # four 8 MiB segments of their own
    events = []
    pool.subscribe(events.append)
    assert pool.spill("16MiB") == 16 * MiB
    decisions = list(pool.scheduler.decisions)
    assert [(d.step, d.policy, d.bytes_freed, d.bytes_released, d.progress) for d in decisions] == [
        ("spill", "lru", 8 * MiB, 8 * MiB, True),
        ("spill", "lru", 8 * MiB, 8 * MiB, True),
    ]
    assert decisions[0].usage == pytest.approx(0.5) and decisions[1].usage == pytest.approx(0.375)
    # The program's own call, not the ladder: spill events, and no reclaim:spill annotation.
    kinds = [e[1] for e in events]
    assert kinds.count("spill") == 2 and not any(k.startswith("reclaim:") for k in kinds)
    assert pool.stats()["reserved_bytes.all.current"] == 16 * MiB
    for i, m in enumerate(ms):
        assert (m.array(dtype=np.uint8) == i + 1).all()


def test_a_spill_with_nothing_to_spill_records_nothing():
    pool = cupool.Pool("sim", capacity="64MiB", spill="host")
    ms = filled(pool, 2)
    leases = [m.array() for m in ms]  # leased: nothing may spill
    assert pool.spill() == 0 and list(pool.scheduler.decisions) == []
    del leases


@pytest.mark.parametrize("where", ["missing", "file"])
def test_a_spill_path_in_no_folder_is_refused_when_the_pool_is_made(tmp_path, where):
    if where == "missing":
        path, folder, why = tmp_path / "no" / "dir" / "x.h5", tmp_path / "no" / "dir", "does not exist"
    else:
        (tmp_path / "plain").write_text("not a folder")
        path, folder, why = tmp_path / "plain" / "x.h5", tmp_path / "plain", "is not a folder"
    device = SimDevice(capacity=64 * MiB)
    with pytest.raises(ValueError) as ei:
        cupool.Pool(device, spill=str(path), initial_size="8MiB")
    assert str(path) in str(ei.value) and f"{str(folder)!r} {why}" in str(ei.value)
    assert device.mem_info()[0] == 64 * MiB  # nothing was reserved: the initial segment was never made
    with pytest.raises(ValueError, match=why):
        HDF5Tier(path)
    assert not folder.is_dir() or list(folder.iterdir()) == []


def test_a_folder_as_the_spill_path_is_refused(tmp_path):
    (tmp_path / "s.h5").mkdir()
    with pytest.raises(ValueError, match=r"is a folder; name a file in it"):
        cupool.Pool("sim", capacity="64MiB", spill=str(tmp_path / "s.h5"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write in any folder, so no folder is unwritable to it")
def test_an_unwritable_folder_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="may not create files in"):
            cupool.Pool("sim", capacity="64MiB", spill=str(folder / "x.h5"))
    finally:
        folder.chmod(0o700)


def test_a_good_spill_path_still_makes_no_file_until_a_spill(tmp_path):
    path = tmp_path / "x.h5"
    pool = cupool.Pool("sim", capacity="64MiB", spill=path)
    assert not path.exists()
    ms = filled(pool, 2)
    assert pool.spill() == 4 * MiB and path.exists()
    del ms, pool
