"""The virtual-memory device layer: the memfd sim is faithful, the rules hold, bad input changes nothing."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import needs_gpu
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from cupool.device.cuda_vmm import CudaVirtualMemory
from cupool.device.sim_vmm import SimVirtualMemory
from cupool.device.vmm import GRANULE, VirtualMemoryError, VirtualMemoryUnsupported, RANGE_GAP, address_arena
from cupool.errors import DeviceOutOfMemory, DriverError
from cupool.testing.cuda_double import CudaDouble

MiB = 1 << 20


@pytest.fixture
def vm():
    with SimVirtualMemory("16MiB") as v:
        yield v


def mapped(vm, addr, chunk):
    m = vm.map(addr, chunk)
    vm.set_access(m.addr, m.nbytes)
    return vm.bytes_at(m.addr, m.nbytes)


def state(vm):
    return vm.ranges(), [(c.id, c.nbytes) for c in vm.chunks()], vm.mappings(), vm.in_use


def test_granularity_is_cudas_two_mebibytes(vm):
    assert vm.granularity == GRANULE == 2 * MiB


def test_bytes_written_through_one_mapping_are_read_through_another(vm):
    chunk = vm.create(2 * GRANULE)
    a, b = vm.reserve(2 * GRANULE), vm.reserve(8 * GRANULE)
    va, vb = mapped(vm, a, chunk), mapped(vm, b + 3 * GRANULE, chunk)
    pattern = np.random.default_rng(0).integers(0, 256, chunk.nbytes, dtype=np.uint8)
    va[:] = pattern
    assert np.array_equal(vb, pattern)
    vb[:GRANULE] = 0xAB  # and back the other way
    assert (va[:GRANULE] == 0xAB).all()


def test_part_of_a_chunk_cannot_be_mapped_as_the_cuda_driver_refuses_it(vm):
    """An H100 (driver 580) answers CUDA_ERROR_NOT_SUPPORTED to a prefix or an offset; so does the sim."""
    chunk = vm.create(2 * GRANULE)
    r = vm.reserve(2 * GRANULE)
    before = state(vm)
    with pytest.raises(TypeError):
        vm.map(r, chunk, GRANULE, GRANULE)
    with pytest.raises(TypeError):
        vm.map(r, chunk, nbytes=GRANULE)
    assert state(vm) == before


def test_capacity_counts_physical_granules_not_addresses(vm):
    huge = vm.reserve(1 << 40)  # a terabyte of addresses costs nothing
    chunks = [vm.create(GRANULE) for _ in range(8)]
    assert vm.in_use == vm.capacity == 16 * MiB
    before = state(vm)
    with pytest.raises(DeviceOutOfMemory, match="free"):
        vm.create(GRANULE)
    assert state(vm) == before
    for i, c in enumerate(chunks):  # scatter them across the terabyte
        mapped(vm, huge + i * (1 << 36), c)[:] = i
    vm.unmap(huge, GRANULE)
    vm.release(chunks[0])
    vm.create(GRANULE)  # released granules are free again


def test_remapping_a_chunk_at_a_new_address_keeps_its_bytes(vm):
    chunk = vm.create(2 * GRANULE)
    old = vm.reserve(2 * GRANULE)
    mapped(vm, old, chunk)[:] = np.arange(2 * GRANULE, dtype=np.uint64).view(np.uint8)[: 2 * GRANULE]
    expect = vm.bytes_at(old, chunk.nbytes).copy()
    vm.unmap(old, chunk.nbytes)
    vm.free_range(old)
    new = vm.reserve(4 * GRANULE)
    assert np.array_equal(mapped(vm, new + 2 * GRANULE, chunk), expect)


def test_released_granules_are_reused_and_come_back_zeroed(vm):
    c = vm.create(GRANULE)
    a = vm.reserve(GRANULE)
    mapped(vm, a, c)[:] = 0xFF
    vm.unmap(a, GRANULE)
    vm.release(c)
    c2 = vm.create(GRANULE)
    assert c2.handle == c.handle  # the same range of the memfd
    assert (mapped(vm, a, c2) == 0).all()  # its pages were punched out


@pytest.mark.parametrize(
    "op, error",
    [
        (lambda vm, r, c: vm.reserve(GRANULE + 4096), VirtualMemoryError),
        (lambda vm, r, c: vm.reserve(0), VirtualMemoryError),
        (lambda vm, r, c: vm.create(GRANULE // 2), VirtualMemoryError),
        (lambda vm, r, c: vm.create(2.0 * GRANULE), TypeError),
        (lambda vm, r, c: vm.map(r + 4096, c), VirtualMemoryError),  # misaligned address
        (lambda vm, r, c: vm.map(r, c), VirtualMemoryError),  # over the mapping already there
        (lambda vm, r, c: vm.map(r + 3 * GRANULE, c), VirtualMemoryError),  # past the range's end
        (lambda vm, r, c: vm.map(r + 64 * GRANULE, c), VirtualMemoryError),  # in no range
        (lambda vm, r, c: vm.unmap(r + 2 * GRANULE, GRANULE), VirtualMemoryError),  # not mapped
        (lambda vm, r, c: vm.unmap(r, GRANULE), VirtualMemoryError),  # half a mapping
        (lambda vm, r, c: vm.set_access(r, 3 * GRANULE), VirtualMemoryError),
        (lambda vm, r, c: vm.release(c), VirtualMemoryError),  # still mapped
        (lambda vm, r, c: vm.free_range(r), VirtualMemoryError),  # still has mappings
        (lambda vm, r, c: vm.free_range(r + GRANULE), VirtualMemoryError),  # not a range's base
        (lambda vm, r, c: vm.create(16 * MiB), DeviceOutOfMemory),
        (lambda vm, r, c: vm.map(r, "chunk"), TypeError),
        (lambda vm, r, c: vm.bytes_at(r + 2 * GRANULE, 1), VirtualMemoryError),  # unmapped: refused, no segfault
    ],
)
def test_bad_input_raises_and_changes_nothing(vm, op, error):
    r = vm.reserve(4 * GRANULE)
    c = vm.create(2 * GRANULE)
    mapped(vm, r, c)[:] = 5
    before = state(vm)
    with pytest.raises(error):
        op(vm, r, c)
    assert state(vm) == before
    assert (vm.bytes_at(r, c.nbytes) == 5).all()


def test_a_chunk_of_another_device_or_released_is_refused(vm):
    with SimVirtualMemory("4MiB") as other:
        foreign = other.create(GRANULE)
        with pytest.raises(VirtualMemoryError, match="not of this device"):
            vm.map(vm.reserve(GRANULE), foreign)
    c = vm.create(GRANULE)
    vm.release(c)
    with pytest.raises(VirtualMemoryError, match="released"):
        vm.release(c)


def test_a_mapping_is_inaccessible_until_set_access(vm):
    r = vm.reserve(GRANULE)
    vm.map(r, vm.create(GRANULE))
    with pytest.raises(VirtualMemoryError, match="no access"):
        vm.bytes_at(r, 1)


def test_unmap_takes_several_contiguous_mappings_at_once(vm):
    r = vm.reserve(4 * GRANULE)
    for i in range(3):
        mapped(vm, r + i * GRANULE, vm.create(GRANULE))
    vm.unmap(r, 3 * GRANULE)
    assert vm.mappings() == []


def test_close_gives_everything_back_and_refuses_more():
    vm = SimVirtualMemory("8MiB")
    mapped(vm, vm.reserve(GRANULE), vm.create(GRANULE))
    vm.close()
    assert state(vm) == ([], [], [], 0)
    vm.close()
    with pytest.raises(VirtualMemoryError, match="closed"):
        vm.reserve(GRANULE)


def test_touching_unmapped_memory_faults_as_on_a_gpu():
    """Run apart: the access must kill the process with SIGSEGV, like an illegal address on a GPU."""
    code = textwrap.dedent(
        """
        import ctypes
        from cupool.device.sim_vmm import SimVirtualMemory
        vm = SimVirtualMemory("4MiB")
        r = vm.reserve(2 << 20)
        m = vm.map(r, vm.create(2 << 20))
        vm.set_access(r, m.nbytes)
        ctypes.c_uint8.from_address(r).value = 1
        vm.unmap(r, m.nbytes)
        print("unmapped", flush=True)
        ctypes.c_uint8.from_address(r).value = 2
        print("survived", flush=True)
        """
    )
    env = {**os.environ, "PYTHONFAULTHANDLER": ""}
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=60)
    assert "unmapped" in p.stdout and "survived" not in p.stdout
    assert p.returncode < 0  # killed by a signal


def test_a_dropped_instance_gives_back_its_file_and_addresses():
    fds = len(os.listdir("/proc/self/fd"))
    vm = SimVirtualMemory("8MiB")
    r = vm.reserve(GRANULE)
    mapped(vm, r, vm.create(GRANULE))[:] = 1
    del vm
    assert len(os.listdir("/proc/self/fd")) == fds
    with open("/proc/self/maps") as f:
        assert f"{r:x}-" not in f.read()


def test_no_memfd_means_no_virtual_memory(monkeypatch):
    monkeypatch.delattr(os, "memfd_create")
    with pytest.raises(VirtualMemoryUnsupported, match="memfd"):
        SimVirtualMemory("4MiB")


# -- the CUDA backend, against a fake driver module ------------------------------


def test_cuda_backend_calls_the_driver_as_documented():
    """On the CUDA double, which refuses what the driver refuses (an allocation that is not pinned memory
    on its GPU, an access other than read-write, a reservation not of whole granules, a map at an offset)."""
    double = CudaDouble(f"{64 * GRANULE}")
    vm = CudaVirtualMemory(0, driver=double.driver)
    assert (vm.granularity, vm.capacity) == (GRANULE, 64 * GRANULE)
    mark = double.log.mark()
    r = vm.reserve(4 * GRANULE)
    c = vm.create(2 * GRANULE)
    vm.map(r + GRANULE, c)
    vm.set_access(r + GRANULE, 2 * GRANULE)
    vm.unmap(r + GRANULE, 2 * GRANULE)
    vm.release(c)
    vm.free_range(r)
    vm.close()
    calls = [(c.name, c.nbytes) for c in double.log.since(mark) if not c.name.startswith("cuCtx")]
    # One arena of addresses is reserved for every range, and freed at close (Note [Address arena])
    arena = address_arena(vm.capacity)
    assert calls == [
        ("cuMemAddressReserve", arena), ("cuMemCreate", 2 * GRANULE), ("cuMemMap", 2 * GRANULE),
        ("cuMemSetAccess", 2 * GRANULE), ("cuMemUnmap", 2 * GRANULE), ("cuMemRelease", 2 * GRANULE),
        ("cuMemAddressFree", arena), ("cuDevicePrimaryCtxRelease", 0),
    ]
    # every memory call ran inside the primary context, and the caller's was restored
    assert double.log.count("cuCtxPushCurrent", since=mark) == 7 and double.driver.contexts == []
    assert double.driver.reserved == {} and double.driver.retained == 0
    with pytest.raises(DriverError, match="cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE"):
        CudaVirtualMemory(1, driver=double.driver)  # the double is one GPU


def test_cuda_backend_maps_driver_out_of_memory_and_keeps_its_books():
    double = CudaDouble(f"{2 * GRANULE}")
    vm = CudaVirtualMemory(0, capacity=16 * GRANULE, driver=double.driver)
    vm.create(GRANULE)
    with pytest.raises(DeviceOutOfMemory, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"):
        vm.create(2 * GRANULE)  # within capacity, but the driver has no more
    assert vm.in_use == GRANULE and len(vm.chunks()) == 1
    with pytest.raises(DeviceOutOfMemory):
        vm.create(16 * GRANULE)  # past capacity: refused before the driver is asked


def test_a_gpu_without_virtual_memory_is_refused():
    double = CudaDouble()
    double.driver.vmm_supported = 0
    with pytest.raises(VirtualMemoryUnsupported, match="cuda:0 does not support"):
        CudaVirtualMemory(0, driver=double.driver)


def test_missing_driver_bindings_say_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(VirtualMemoryUnsupported, match=r"pip install .cuda-bindings>=12. \(or .\.\[vmm\]. in cupool.s checkout\)"):
        CudaVirtualMemory(0)


# -- the state machine ---------------------------------------------------------------

G = 64 << 10  # a small granule keeps the machine fast; the rules do not depend on its size
CAPACITY = 12 * G


class VirtualMemoryMachine(RuleBasedStateMachine):
    """Random reserve/create/map/unmap/release/free against a model; bytes must survive everything."""

    def __init__(self):
        super().__init__()
        self.vm = SimVirtualMemory(CAPACITY, granularity=G)
        self.ranges: dict[int, int] = {}  # addr -> nbytes
        self.chunks = []  # live chunks
        self.content: dict[int, list[int]] = {}  # chunk id -> the byte each granule holds
        self.maps: dict[int, tuple] = {}  # addr -> (nbytes, chunk)
        self.fill = 0

    def teardown(self):
        self.vm.close()

    def expect_refusal(self, op, error=VirtualMemoryError):
        before = state(self.vm)
        with pytest.raises(error):
            op()
        assert state(self.vm) == before

    @initialize()
    def start_with_a_range_and_chunks(self):
        self.reserve(8, False)
        self.create(2)
        self.create(1)

    @rule(granules=st.integers(1, 6), misaligned=st.sampled_from([False, False, False, True]))
    def reserve(self, granules, misaligned):
        if misaligned:
            self.expect_refusal(lambda: self.vm.reserve(granules * G + 4096))
        else:
            addr = self.vm.reserve(granules * G)
            self.ranges[addr] = granules * G

    @precondition(lambda self: self.ranges)
    @rule(data=st.data())
    def free_range(self, data):
        addr = data.draw(st.sampled_from(sorted(self.ranges)))
        if any(addr <= a < addr + self.ranges[addr] for a in self.maps):
            self.expect_refusal(lambda: self.vm.free_range(addr))
        else:
            self.vm.free_range(addr)
            del self.ranges[addr]

    @rule(granules=st.integers(1, 3))
    def create(self, granules):
        if sum(c.nbytes for c in self.chunks) + granules * G > CAPACITY:
            self.expect_refusal(lambda: self.vm.create(granules * G), DeviceOutOfMemory)
        else:
            c = self.vm.create(granules * G)
            self.chunks.append(c)
            self.content[c.id] = [0] * granules

    @precondition(lambda self: self.chunks)
    @rule(data=st.data())
    def release(self, data):
        c = data.draw(st.sampled_from(self.chunks))
        if any(ch is c for _, ch in self.maps.values()):
            self.expect_refusal(lambda: self.vm.release(c))
        else:
            self.vm.release(c)
            self.chunks.remove(c)
            del self.content[c.id]

    def free_granules(self, base):
        return [base + i * G for i in range(self.ranges[base] // G)
                if not any(a <= base + i * G < a + n for a, (n, _) in self.maps.items())]

    @precondition(lambda self: self.ranges and self.chunks)
    @rule(data=st.data())
    def map(self, data):
        base = data.draw(st.sampled_from(sorted(self.ranges)))
        c = data.draw(st.sampled_from(self.chunks))
        free = self.free_granules(base)
        count = c.nbytes // G
        if free and data.draw(st.integers(0, 3)):  # mostly into free granules, sometimes anywhere
            at = data.draw(st.sampled_from(free))
        else:
            at = base + data.draw(st.integers(0, self.ranges[base] // G - 1)) * G
        nbytes = count * G
        fits = at + nbytes <= base + self.ranges[base]
        overlaps = any(a < at + nbytes and at < a + n for a, (n, _) in self.maps.items())
        if not fits or overlaps:
            self.expect_refusal(lambda: self.vm.map(at, c))
            return
        self.vm.map(at, c)
        self.vm.set_access(at, nbytes)
        self.maps[at] = (nbytes, c)
        view = self.vm.bytes_at(at, nbytes)
        for g in range(count):  # a fresh pattern, which every other mapping of c must now show too
            self.fill = self.fill % 255 + 1
            view[g * G : (g + 1) * G] = self.fill
            self.content[c.id][g] = self.fill

    @precondition(lambda self: self.maps)
    @rule(data=st.data())
    def unmap(self, data):
        addr = data.draw(st.sampled_from(sorted(self.maps)))
        nbytes = self.maps[addr][0]
        if data.draw(st.booleans()) and nbytes > G:
            self.expect_refusal(lambda: self.vm.unmap(addr, nbytes - G))  # part of a mapping
        else:
            self.vm.unmap(addr, nbytes)
            del self.maps[addr]

    @precondition(lambda self: self.ranges)
    @rule(data=st.data())
    def bad_map(self, data):
        base = data.draw(st.sampled_from(sorted(self.ranges)))
        target = data.draw(st.sampled_from(["misaligned", "unmapped-unmap", "released"]))
        if target == "misaligned" and self.chunks:
            self.expect_refusal(lambda: self.vm.map(base + 4096, self.chunks[0]))
        elif target == "unmapped-unmap":
            free = self.free_granules(base)
            if free:
                self.expect_refusal(lambda: self.vm.unmap(free[0], G))
        else:
            gone = SimVirtualMemory(G, granularity=G)
            c = gone.create(G)
            gone.close()
            self.expect_refusal(lambda: self.vm.map(base, c))

    @invariant()
    def books_match_the_model(self):
        assert dict(self.vm.ranges()) == self.ranges
        assert {c.id for c in self.vm.chunks()} == {c.id for c in self.chunks}
        assert self.vm.in_use == sum(c.nbytes for c in self.chunks) <= CAPACITY
        ms = self.vm.mappings()
        assert {m.addr: (m.nbytes, m.chunk) for m in ms} == self.maps
        live = {c.id for c in self.vm.chunks()}
        for prev, m in itertools.pairwise(ms):
            assert prev.end <= m.addr  # every mapped granule is one mapping's ...
        assert all(m.chunk.id in live and m.chunk.live for m in ms)  # ... of exactly one live chunk

    @invariant()
    def every_mapping_shows_its_chunks_bytes(self):
        for addr, (nbytes, c) in self.maps.items():
            view = self.vm.bytes_at(addr, nbytes)
            for g in range(nbytes // G):
                want = self.content[c.id][g]
                assert view[g * G] == want and view[(g + 1) * G - 1] == want
                assert (view[g * G : (g + 1) * G] == want).all()


TestVirtualMemoryMachine = VirtualMemoryMachine.TestCase


@needs_gpu
def test_cuda_virtual_memory_on_a_real_gpu():
    """The driver really aliases: bytes written through one mapping read back through another."""
    cp = pytest.importorskip("cupy")
    with CudaVirtualMemory(0) as vm:
        assert vm.granularity % GRANULE == 0 or GRANULE % vm.granularity == 0
        g = max(vm.granularity, GRANULE)
        chunk = vm.create(2 * g)
        a, b = vm.reserve(2 * g), vm.reserve(8 * g)
        for addr in (a, b + 3 * g):
            vm.set_access(vm.map(addr, chunk).addr, 2 * g)

        def view(addr):
            mem = cp.cuda.UnownedMemory(addr, 2 * g, vm)
            return cp.ndarray((2 * g,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))

        pattern = cp.random.default_rng(0).integers(0, 256, 2 * g, dtype=cp.uint8)
        view(a)[:] = pattern
        assert bool((view(b + 3 * g) == pattern).all())
        vm.unmap(b + 3 * g, 2 * g)
        vm.set_access(vm.map(b, chunk).addr, 2 * g)  # remapped at a new place, bytes kept
        assert bool((view(b) == pattern).all())
        cp.cuda.Device().synchronize()
        vm.unmap(a, 2 * g)
        vm.unmap(b, 2 * g)
        vm.release(chunk)
        vm.free_range(a)
        vm.free_range(b)
        assert vm.in_use == 0 and not vm.mappings()


def test_a_file_size_limit_is_an_out_of_memory_not_an_oserror():
    """The sim's virtual memory is a memfd, which ``ulimit -f`` caps: a pool on it must say out of memory
    (it raised a bare OSError), with its books intact (found when expandable segments became the default)."""
    import subprocess
    import sys

    script = r"""
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))
import cupool
p = cupool.Pool("sim", capacity="64MiB")
try:
    p.malloc(1000)
except cupool.OutOfMemoryError:
    p.check()
    print("oom")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "oom", r.stdout + r.stderr


# ------------------------------------------------ Note [Address arena]
def test_ranges_come_first_fit_in_address_order_wherever_the_os_maps():
    """Linux maps top down, so the second of two reserved ranges landed below the first; a recording
    then broke best-fit ties unlike its replay (issue 25).  Ranges now come from one arena, in order."""
    with SimVirtualMemory(64 * GRANULE) as vm:
        gap = RANGE_GAP * GRANULE  # no two ranges touch
        a = vm.reserve(4 * GRANULE)
        b = vm.reserve(8 * GRANULE)
        c = vm.reserve(2 * GRANULE)
        assert a < b < c and b == a + 4 * GRANULE + gap and c == b + 8 * GRANULE + gap
        vm.free_range(a)
        assert vm.reserve(2 * GRANULE) == a  # the lowest range that fits, again
        assert vm.reserve(4 * GRANULE) == c + 2 * GRANULE + gap  # a's remainder is too small: the next one up
        assert vm.arena_fallback is None


def test_a_backend_that_refuses_an_arena_reserves_range_by_range():
    # less address space than an arena: the driver's out-of-memory
    vm = CudaVirtualMemory(0, driver=CudaDouble(f"{64 * GRANULE}", address_space=64 * GRANULE).driver)
    r = vm.reserve(4 * GRANULE)
    assert vm.arena_fallback is not None and "refused an arena" in vm.arena_fallback
    vm.free_range(r)
    assert vm.reserve(2 * GRANULE) == r  # a freed range is lent again before the backend is asked
    vm.close()
