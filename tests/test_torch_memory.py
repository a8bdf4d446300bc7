"""PyTorch's one-call memory helpers (issue 20, "what users reach for"): cupool.memory_allocated() and friends."""

import contextlib

import pytest

import cupool
from cupool import hooks

MiB = 1 << 20


@pytest.fixture(autouse=True)
def no_default_pools(monkeypatch):
    """Each test starts with no default pool and no CUPOOL_CONF, and leaves none behind."""
    hooks.reset_default_pools()
    monkeypatch.delenv("CUPOOL_CONF", raising=False)
    yield
    hooks.reset_default_pools()


def figures(pool):
    s = pool.stats()
    return (
        s["allocated_bytes.all.current"], s["allocated_bytes.all.peak"],
        s["reserved_bytes.all.current"], s["reserved_bytes.all.peak"],
    )


def helpers(device=None):
    return (
        cupool.memory_allocated(device), cupool.max_memory_allocated(device),
        cupool.memory_reserved(device), cupool.max_memory_reserved(device),
    )


# Reserved MiB after a and b, then after a is freed and the cache emptied. Plain segments: a
# segment of its own for a (12 MiB) and a 20 MiB medium one for b; empty_cache gives a's back.
# Expandable (the default): the stream's large region maps 12 MiB for a, then grows by two
# granules for b (16 MiB); a's free granules, wholly free, go back on empty_cache as PyTorch's
# expandable segments unmap the pages of any free block, leaving b's two granules (4 MiB).
@pytest.mark.parametrize("expandable,held,kept", [
    (False, 32, 20),
    (None, 16, 4),  # once a known defect: empty_cache() gave back free tails only, not a's granules
], ids=["plain", "default"])
def test_the_helpers_read_the_pool_this_thread_allocates_from(expandable, held, kept):
    pool = cupool.Pool("sim", capacity="256MiB", expandable_segments=expandable)
    with cupool.using(pool):
        a = pool.malloc(12 * MiB)
        b = pool.malloc(3 * MiB)
        assert helpers() == figures(pool) == (15 * MiB, 15 * MiB, held * MiB, held * MiB)
        a.free()
        pool.empty_cache()
        assert helpers() == figures(pool) == (3 * MiB, 15 * MiB, kept * MiB, held * MiB)
        assert helpers(0) == helpers("sim:0") == helpers("sim") == helpers()
        cupool.reset_peak_memory_stats()
        assert helpers() == (3 * MiB, 3 * MiB, kept * MiB, kept * MiB)
        del b


def test_the_default_pool_is_read_when_nothing_else_routes():
    pool = cupool.default_pool()
    a = pool.malloc(MiB)
    assert cupool.memory_allocated() == MiB and cupool.memory_reserved() == 2 * MiB  # one small segment
    del a


def test_asking_makes_no_pool_and_answers_zero():
    """As torch answers 0 before CUDA is initialised: a default pool may reserve initial_size at once."""
    with cupool.sim_device(5):
        assert helpers() == (0, 0, 0, 0)
        cupool.reset_peak_memory_stats()
        assert hooks.existing_pool() is None


def test_mem_get_info_honours_the_default_pools_limit(monkeypatch):
    monkeypatch.setenv("CUPOOL_CONF", "device=sim,capacity=64MiB,max_size=50%")
    assert cupool.mem_get_info() == (32 * MiB, 32 * MiB)  # made the default pool, as torch initialises CUDA
    pool = cupool.default_pool()
    a = pool.malloc(12 * MiB)
    assert cupool.mem_get_info(0) == (20 * MiB, 32 * MiB)
    a.free()  # cached, not free: torch's free leaves the allocator's cache out too
    assert cupool.mem_get_info() == (20 * MiB, 32 * MiB)
    pool.empty_cache()
    assert cupool.mem_get_info() == (32 * MiB, 32 * MiB)


def test_mem_get_info_is_bounded_by_what_the_device_has_free():
    pool = cupool.Pool("sim", capacity="64MiB")
    other = cupool.Pool(pool.device)  # another user of the same device
    x = other.malloc(48 * MiB)
    with cupool.using(pool):
        assert cupool.mem_get_info() == (16 * MiB, 64 * MiB)
    del x


def test_a_device_of_another_kind_is_refused_by_name():
    cupool.default_pool()
    with pytest.raises(ValueError, match=r"'cuda:0'.*on sim"):
        cupool.memory_allocated("cuda:0")
    with pytest.raises(ValueError, match=r"mem_get_info\(\).*'cuda'"):
        cupool.mem_get_info("cuda")


@pytest.mark.parametrize(
    "device,exc,words",
    [
        (-1, ValueError, ">= 0"),
        (True, TypeError, "device must be"),
        (1.0, TypeError, "device must be"),
        ("gpu:0", ValueError, "'gpu:0'"),
        ("sim:x", ValueError, "'sim:x'"),
        ("sim:-1", ValueError, "'sim:-1'"),
    ],
)
def test_bad_devices_are_refused_naming_the_helper(device, exc, words):
    for helper in (cupool.memory_allocated, cupool.max_memory_reserved, cupool.reset_peak_memory_stats,
                   cupool.mem_get_info):
        with pytest.raises(exc, match=rf"{helper.__name__}\(\).*{words}"):
            helper(device)
    assert hooks.existing_pool() is None  # refused before any pool was made


def test_the_helpers_follow_the_current_sim_device():
    p1 = cupool.Pool("sim:1", capacity="64MiB")
    with cupool.sim_device(1), cupool.using(p1):
        a = p1.malloc(12 * MiB)
        assert cupool.memory_allocated() == cupool.memory_allocated(1) == cupool.memory_allocated("sim:1") == 12 * MiB
    assert cupool.memory_allocated() == 0  # device 0: no pool
    del a


# ------------------------------------------------------------------ issue 28
@pytest.mark.parametrize("device", ["sim:²", "sim:١", "cuda:³", "sim:1²"])
def test_device_strings_take_ascii_digits_only_and_the_error_names_the_string(device):
    """``str.isdigit`` takes '²' and '١', which ``int()`` then refused in words that named no device."""
    for helper in (cupool.memory_allocated, cupool.max_memory_allocated, cupool.memory_reserved,
                   cupool.max_memory_reserved, cupool.reset_peak_memory_stats, cupool.mem_get_info,
                   cupool.memory_summary):
        with pytest.raises(cupool.errors.DeviceNameError, match=rf"{helper.__name__}\(\).*{device!r}"):
            helper(device)
    with pytest.raises(cupool.errors.DeviceNameError, match=repr(device)):
        cupool.Pool(device, capacity="8MiB")
    assert hooks.existing_pool() is None  # refused before any pool was made


def test_memory_summary_takes_a_device_as_torchs_does():
    """``cupool.memory_summary()`` with no argument raised TypeError; torch's takes ``device=None``."""
    with cupool.sim_device(3):
        empty = cupool.memory_summary()
        assert "device 3 (no pool yet)" in empty and hooks.existing_pool() is None  # asking makes no pool
        assert "| Allocations           |       0    |       0    |       0    |       0    |" in empty
    pool = cupool.Pool("sim", capacity="64MiB")
    with cupool.using(pool):
        a = pool.malloc(3 * MiB)
        table = cupool.memory_summary()
        assert table == cupool.memory_summary(0) == cupool.memory_summary("sim:0") == cupool.memory_summary(pool)
        assert "| Allocated memory      |   3072 KiB |   3072 KiB |   3072 KiB |      0 B   |" in table
        assert cupool.memory_summary(device=None, abbreviated=True) == cupool.memory_summary(pool, abbreviated=True)
        with pytest.raises(ValueError, match=r"memory_summary\(\).*'cuda:0'.*on sim"):
            cupool.memory_summary("cuda:0")
        del a


@pytest.mark.parametrize("route", ["using", "install"])
def test_mem_get_info_refuses_a_closed_pool(route):
    """A closed pool hands out nothing, so it has no free memory to report; it reported its limit's worth."""
    pool = cupool.Pool("sim", capacity="64MiB")
    with contextlib.ExitStack() as stack:
        if route == "using":
            stack.enter_context(cupool.using(pool))
        else:
            cupool.install(pool, cupy=False, numba=False)
            stack.callback(cupool.uninstall)
        assert cupool.mem_get_info() == (64 * MiB, 64 * MiB)
        pool.close()
        with pytest.raises(cupool.ClosedError, match=r"mem_get_info\(\) on a closed pool"):
            cupool.mem_get_info()
        assert cupool.memory_allocated() == 0  # the figures of a closed pool can still be read
