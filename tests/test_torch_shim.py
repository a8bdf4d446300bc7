"""cupool.torch: PyTorch's pluggable-allocator functions, called through ctypes on the sim device.

torch itself is not needed: the C functions are what torch calls, and the two
torch calls cupool makes (``CUDAPluggableAllocator``, ``change_current_allocator``)
are checked against a small fake ``torch.cuda.memory`` put in ``sys.modules``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import shutil
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

import cupool
import cupool.torch as ct
from cupool.errors import DeviceNameError, NoDeviceError, OutOfMemoryError, TorchAllocatorError
from cupool import hooks
from cupool.hooks import scopes

MiB = 1 << 20

if ct.shim_status()[0] != "built":
    pytest.skip(f"the torch shim is not built here: {ct.shim_status()[1]}", allow_module_level=True)


@pytest.fixture(scope="module")
def lib():
    s = ct.shim()
    dll = ctypes.CDLL(s.path)
    alloc = getattr(dll, s.alloc)
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = getattr(dll, s.free)
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return types.SimpleNamespace(alloc=alloc, free=free, path=s.path, torch_alloc=s.torch_alloc)


@pytest.fixture
def pool():
    p = cupool.Pool("sim", capacity="64MiB")
    ct.use(p)
    yield p
    ct.use(None)
    assert ct.live_blocks() == 0
    p.check()


def test_shim_names_the_library_and_its_functions():
    s = ct.shim()
    assert s.path.endswith(".so") and (s.alloc, s.free) == ("cupool_torch_alloc", "cupool_torch_free")
    assert s.torch_alloc == "cupool_torch_alloc_or_throw"


def test_allocate_write_read_free(lib, pool):
    ptr = lib.alloc(4096, 0, None)
    assert ptr and ct.live_blocks() == 1
    data = np.arange(4096, dtype=np.uint8)
    pool.device.from_host(ptr, data)
    assert np.array_equal(pool.device.to_host(ptr, 4096), data)
    assert pool.stats()["allocated_bytes.all.current"] >= 4096
    lib.free(ptr, 4096, 0, None)
    assert pool.stats()["allocated_bytes.all.current"] == 0 and ct.live_blocks() == 0


def test_many_threads_allocate_and_free_at_once(lib, pool):
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                n = int(rng.integers(1, 64 * 1024))
                ptr = lib.alloc(n, 0, None)
                assert ptr, ct.last_error()
                pool.device.from_host(ptr, np.full(n, seed, np.uint8))
                assert (pool.device.to_host(ptr, n) == seed).all()
                lib.free(ptr, n, 0, None)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = pool.stats()
    assert s["allocated_bytes.all.current"] == 0 and s["allocation.all.allocated"] >= 8 * 200


def test_use_switches_pools_while_threads_allocate_and_each_block_goes_home(lib, pool):
    other = cupool.Pool("sim", capacity="64MiB")
    stop = threading.Event()
    errors: list[object] = []

    def work(stream: int) -> None:
        while not stop.is_set():
            ptr = lib.alloc(4096, 0, stream)
            if not ptr:
                errors.append(ct.last_error())
                return
            lib.free(ptr, 4096, 0, stream)

    threads = [threading.Thread(target=work, args=(s,)) for s in (0, 1, 2, 3)]
    for t in threads:
        t.start()
    held = []
    for i in range(200):
        ct.use(other if i % 2 else pool)
        held.append(lib.alloc(512, 0, i % 3))
    stop.set()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.stats()["allocated_bytes.all.current"] > 0 and other.stats()["allocated_bytes.all.current"] > 0
    for i, ptr in enumerate(held):
        lib.free(ptr, 512, 0, i % 3)
    for p in (pool, other):
        assert p.stats()["allocated_bytes.all.current"] == 0
        p.check()


def test_a_block_freed_on_one_stream_is_not_reused_at_once_on_another(lib, pool):
    a = lib.alloc(4096, 0, 1)
    assert pool.snapshot()["segments"][0]["stream"] == 1
    pool.device.enqueue(1)  # a kernel using the block is in flight on stream 1
    lib.free(a, 4096, 0, 1)
    b = lib.alloc(4096, 0, 2)  # stream 2 may not take it yet
    assert b != a
    c = lib.alloc(4096, 0, 1)  # stream 1 may, at once
    assert c == a
    for ptr, stream in ((b, 2), (c, 1)):
        lib.free(ptr, 4096, 0, stream)


def test_a_refusal_returns_null_and_says_why(lib, pool):
    assert lib.alloc(128 * MiB, 0, None) is None  # more than the pool's capacity
    error = ct.last_error()
    assert isinstance(error, OutOfMemoryError) and error.requested == 128 * MiB
    assert pool.stats()["allocated_bytes.all.current"] == 0


def test_the_last_error_is_this_threads(lib, pool):
    assert lib.alloc(128 * MiB, 0, None) is None
    seen = []
    t = threading.Thread(target=lambda: seen.append(ct.last_error()))
    t.start()
    t.join()
    assert seen == [None] and isinstance(ct.last_error(), OutOfMemoryError)


def test_a_free_of_an_unknown_pointer_is_logged_not_fatal(lib, pool, caplog):
    ptr = lib.alloc(4096, 0, None)
    with caplog.at_level(logging.WARNING, logger="cupool.torch"):
        lib.free(0x1234, 16, 0, None)
        lib.free(ptr + 64, 16, 0, None)  # inside a live block, but not one handed out
    assert [r.message.count("did not serve") for r in caplog.records] == [1, 1]
    lib.free(ptr, 4096, 0, None)  # the real one still frees
    lib.free(ptr, 4096, 0, None)  # a second free: logged, nothing breaks
    assert pool.stats()["allocated_bytes.all.current"] == 0


def test_without_use_torch_is_served_by_the_default_pool(lib):
    ct.use(None)
    ptr = lib.alloc(1000, 0, None)
    assert ptr and ct.memory_stats(0)["allocated_bytes.all.current"] >= 1000
    assert cupool.default_pool(0).stats()["allocated_bytes.all.current"] >= 1000
    lib.free(ptr, 1000, 0, None)
    assert ct.live_blocks() == 0


def test_memory_stats_and_summary_are_cupools_books(lib, pool):
    ptr = lib.alloc(3 * MiB, 0, None)
    stats = ct.memory_stats(0)
    assert list(stats) == sorted(stats) and stats["allocated_bytes.all.current"] == pool.stats()["allocated_bytes.all.current"]
    assert "cupool memory summary" in ct.memory_summary(0)
    lib.free(ptr, 3 * MiB, 0, None)
    with pytest.raises(DeviceNameError, match="device must be"):
        ct.memory_stats("0")


def test_use_refuses_what_is_not_a_device_pool():
    with pytest.raises(TypeError, match="cupool.Pool"):
        ct.use("sim")
    with pytest.raises(ValueError, match="pinned"):
        ct.use(cupool.PinnedPool())


def test_without_the_shim_cupool_says_why(monkeypatch):
    from cupool.hooks import torch as front

    monkeypatch.setattr(front, "_registered", [])
    monkeypatch.setattr(front, "compiled_module", lambda name: (None, "not compiled at install: no working C compiler"))
    with pytest.raises(TorchAllocatorError, match="not built here .*no working C compiler"):
        ct.shim()
    assert ct.shim_status() == ("not built", "not compiled at install: no working C compiler")
    assert ct.live_blocks() == 0


def test_cupool_torch_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import cupool.torch; cupool.torch.shim(); print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.stdout.strip() == "ok", r.stderr


# --------------------------------------------------------- torch's side, faked
class FakeMemory(types.ModuleType):
    """``torch.cuda.memory`` as far as cupool uses it: torch refuses a swap once its allocator is in use."""

    def __init__(self, initialized: bool) -> None:
        super().__init__("torch.cuda.memory")
        self.initialized = initialized
        self.current = None

    class CUDAPluggableAllocator:
        def __init__(self, path: str, alloc: str, free: str) -> None:
            self.args = (path, alloc, free)

    def change_current_allocator(self, allocator) -> None:
        if self.initialized:
            raise RuntimeError("Can't swap an already initialized allocator")
        self.current = allocator


class CpuMemory(FakeMemory):
    """A CPU-only torch's ``torch.cuda.memory``: the allocator class is there, the C function it calls is not."""

    class CUDAPluggableAllocator:
        def __init__(self, path: str, alloc: str, free: str) -> None:
            raise AttributeError("module 'torch._C' has no attribute '_cuda_customAllocator'")


@pytest.fixture
def fake_torch(monkeypatch):
    def install(initialized: bool, cuda_built: bool = True) -> FakeMemory:
        memory = FakeMemory(initialized) if cuda_built else CpuMemory(initialized)
        cuda = types.ModuleType("torch.cuda")
        cuda.memory = memory
        torch = types.ModuleType("torch")
        torch.cuda = cuda
        torch.__version__ = "2.13.0" if cuda_built else "2.13.0+cpu"
        torch.version = types.SimpleNamespace(cuda="12.8" if cuda_built else None, hip=None)
        torch._C = types.SimpleNamespace(**({"_cuda_customAllocator": object()} if cuda_built else {}))
        for name, module in (("torch", torch), ("torch.cuda", cuda), ("torch.cuda.memory", memory)):
            monkeypatch.setitem(sys.modules, name, module)
        return memory

    yield install
    if scopes.installed():
        scopes.uninstall()
    ct.use(None)


def test_allocator_gives_torch_the_throwing_entry_point(fake_torch):
    fake_torch(False)
    s = ct.shim()
    assert ct.allocator().args == (s.path, s.torch_alloc, s.free)


def test_install_torch_switches_the_allocator_and_serves_the_given_pool(fake_torch, lib):
    memory = fake_torch(False)
    pool = cupool.Pool("sim", capacity="64MiB")
    assert cupool.install(pool, cupy=False, numba=False, torch=True) is pool
    assert memory.current is not None and memory.current.args[1] == "cupool_torch_alloc_or_throw"
    ptr = lib.alloc(4096, 0, None)
    assert pool.stats()["allocated_bytes.all.current"] >= 4096
    lib.free(ptr, 4096, 0, None)
    cupool.uninstall()
    assert ct.serving_pool(0) is cupool.default_pool(0)  # torch stays on cupool, on the default pool


def test_install_too_late_says_so_and_changes_nothing(fake_torch):
    memory = fake_torch(True)
    pool = cupool.Pool("sim", capacity="64MiB")
    with pytest.raises(TorchAllocatorError, match="before the first CUDA tensor") as info:
        cupool.install(pool, cupy=False, numba=False, torch=True)
    assert isinstance(info.value, RuntimeError) and "already initialized" in str(info.value)
    assert memory.current is None and not scopes.installed() and ct.serving_pool(0) is not pool


def test_install_too_late_puts_cupys_allocator_back(fake_torch):
    cupy = pytest.importorskip("cupy")
    fake_torch(True)
    before = cupy.cuda.get_allocator()
    with pytest.raises(TorchAllocatorError):
        cupool.install(cupool.Pool("sim", capacity="64MiB"), cupy=True, numba=False, torch=True)
    assert cupy.cuda.get_allocator() is before and not scopes.installed()


def test_cupool_info_says_whether_the_shim_was_built(capsys):
    from cupool.cli import main

    assert main(["info"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("torch shim")]
    assert line.split()[2:] == f"{ct.shim_status()[0]} ({ct.shim_status()[1]})".split()


def test_install_leaves_torch_alone_by_default(fake_torch):
    memory = fake_torch(False)
    cupool.install(cupool.Pool("sim", capacity="64MiB"), cupy=False, numba=False)
    assert memory.current is None
    with pytest.raises(TypeError, match="torch must be True or False"):
        cupool.install(cupy=False, numba=False, torch=1)


# --------------------------------------------------------- the C++ entry point
_CATCHER = r"""
#include <cstddef>
#include <cstring>
#include <exception>
typedef void *(*alloc_fn)(size_t, int, void *);
// What torch's binding does with an exception from alloc: catch std::exception and keep its message.
extern "C" void *call(alloc_fn f, size_t n, char *what, size_t len) {
    try {
        return f(n, 0, nullptr);
    } catch (const std::exception &e) {
        std::strncpy(what, e.what(), len - 1);
        return nullptr;
    }
}
"""


def test_the_torch_entry_point_throws_cupools_reason_to_a_cpp_caller(lib, pool, tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler to build the C++ caller")
    (tmp_path / "catcher.cpp").write_text(_CATCHER)
    so = tmp_path / "catcher.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(so), str(tmp_path / "catcher.cpp")], check=True, timeout=120)
    call = ctypes.CDLL(str(so)).call
    call.restype = ctypes.c_void_p
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    throwing = ctypes.cast(getattr(ctypes.CDLL(lib.path), lib.torch_alloc), ctypes.c_void_p)
    what = ctypes.create_string_buffer(1024)
    ptr = call(throwing, 4096, what, 1024)
    assert ptr and what.value == b""
    lib.free(ptr, 4096, 0, None)
    assert call(throwing, 128 * MiB, what, 1024) is None
    message = what.value.decode()
    assert message.startswith("cupool could not allocate 134217728 bytes on device 0 for PyTorch: OutOfMemoryError")
    assert "out of memory" in message and isinstance(ct.last_error(), OutOfMemoryError)


# --------------------------------------------------------- devices that do not exist (issue 36 #4)
def test_a_device_that_does_not_exist_is_refused_not_made(lib):
    ct.use(None)
    cupool.hooks.reset_default_pools()
    try:
        assert lib.alloc(512, 7, None) is None
        error = ct.last_error()
        assert isinstance(error, NoDeviceError) and "device 7 does not exist" in str(error)
        assert cupool.hooks.existing_pool(7) is None  # no sim:7 made, with its own address space
        ptr = lib.alloc(512, 0, None)  # device 0 is there
        assert ptr
        lib.free(ptr, 512, 0, None)
        with cupool.sim_device(3):  # a sim device the program opened exists
            ptr = lib.alloc(512, 3, None)
            assert ptr and cupool.default_pool(3).stats()["allocated_bytes.all.current"] >= 512
            lib.free(ptr, 512, 3, None)
        ptr = lib.alloc(512, 3, None)  # and stays there, its pool made
        assert ptr
        lib.free(ptr, 512, 3, None)
        assert lib.alloc(512, -1, None) is None and "device -1 does not exist" in str(ct.last_error())
    finally:
        cupool.hooks.reset_default_pools()


def test_a_device_given_a_pool_by_use_exists(lib):
    p = cupool.Pool("sim:5", capacity="64MiB")
    ct.use(p)
    try:
        ptr = lib.alloc(4096, 5, None)
        assert ptr and p.stats()["allocated_bytes.all.current"] >= 4096
        lib.free(ptr, 4096, 5, None)
    finally:
        ct.use(None)


# --------------------------------------------------------- a torch without CUDA, or none (issue 36 #8)
def test_a_cpu_only_torch_is_refused_in_cupools_words(fake_torch):
    memory = fake_torch(False, cuda_built=False)
    with pytest.raises(TorchAllocatorError, match=r"PyTorch 2\.13\.0\+cpu is built without CUDA"):
        ct.allocator()
    pool = cupool.Pool("sim", capacity="64MiB")
    with pytest.raises(TorchAllocatorError, match="without CUDA"):
        cupool.install(pool, cupy=False, numba=False, torch=True)
    assert memory.current is None and not scopes.installed() and ct.serving_pool(0) is not pool


def test_a_cpu_only_torch_leaves_cupy_unhooked(fake_torch):
    cupy = pytest.importorskip("cupy")
    fake_torch(False, cuda_built=False)
    before = cupy.cuda.get_allocator()
    with pytest.raises(TorchAllocatorError, match="without CUDA"):
        cupool.install(cupool.Pool("sim", capacity="64MiB"), cupy=True, numba=False, torch=True)
    assert cupy.cuda.get_allocator() is before and not scopes.installed()


def test_without_torch_cupool_says_it_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # what Python does where torch is not installed
    with pytest.raises(TorchAllocatorError, match=r'PyTorch is not installed; pip install "\.\[torch\]"' ):
        ct.allocator()
    with pytest.raises(TorchAllocatorError, match="PyTorch is not installed"):
        cupool.install(cupool.Pool("sim", capacity="64MiB"), cupy=False, numba=False, torch=True)
    assert not scopes.installed()


def _info_torch_line(capsys) -> list[str]:
    from cupool.cli import main

    assert main(["info"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.split()[:1] == ["torch"] and "shim" not in ln]
    return line.split(None, 1)[1]


def test_cupool_info_says_which_torch_and_whether_it_has_cuda(fake_torch, capsys, monkeypatch):
    fake_torch(False, cuda_built=False)
    assert _info_torch_line(capsys) == "2.13.0+cpu (no CUDA: cupool cannot serve its tensors)"
    fake_torch(False)
    assert _info_torch_line(capsys) == "2.13.0 (CUDA 12.8)"
    monkeypatch.setitem(sys.modules, "torch", None)
    assert _info_torch_line(capsys) == "not installed (pip install \".[torch]\" in cupool's checkout)"


# --------------------------------------------------------- Ctrl-C inside the shim (issue 36 #3)
# Run in a child process, so that no signal can land in pytest: the main thread allocates and frees
# through the shim in a loop while a thread sends SIGINT 3-13 ms apart, each only once the last one
# has reached the loop as a KeyboardInterrupt (or five seconds have passed: then it was lost).
_SIGINTS = r"""
import ctypes, json, os, random, signal, sys, threading, time
import cupool, cupool.torch as ct

s = ct.shim()
dll = ctypes.CDLL(s.path)
alloc, free = getattr(dll, s.alloc), getattr(dll, s.free)
alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
pool = cupool.Pool("sim", capacity="256MiB")
ct.use(pool)
seen, done = threading.Event(), threading.Event()
out = {"sent": 0, "caught": 0, "lost": 0, "refused": [], "calls": 0}

def sender():
    rng = random.Random(int(sys.argv[1]))
    while out["sent"] < int(sys.argv[2]):
        time.sleep(rng.uniform(0.003, 0.013))
        seen.clear()
        out["sent"] += 1
        os.kill(os.getpid(), signal.SIGINT)
        if not seen.wait(5.0):  # a busy machine may be slow; five seconds late is lost
            out["lost"] += 1
            break
    done.set()

threading.Thread(target=sender, daemon=True).start()
while not done.is_set():
    try:
        while not done.is_set():
            out["calls"] += 1
            n = (1 + out["calls"] % 4) << 20  # large blocks: the arena's Python code runs in each call
            ptr = alloc(n, 0, None)
            if not ptr:
                out["refused"].append(repr(ct.last_error()))
                continue
            free(ptr, n, 0, None)
    except KeyboardInterrupt:
        out["caught"] += 1
        # The interrupt may have come between alloc and free: free what the shim still holds.
        for seg in pool.snapshot()["segments"]:
            for b in seg["blocks"]:
                if b["state"] == "active_allocated":
                    free(b["address"], b["size"], 0, None)
        seen.set()
signal.signal(signal.SIGINT, signal.SIG_IGN)
out["live"] = ct.live_blocks()
pool.check()
print(json.dumps(out))
"""


def test_ctrl_c_in_a_shim_allocation_reaches_the_program_and_is_no_refusal():
    r = subprocess.run([sys.executable, "-c", _SIGINTS, "36", "150"], capture_output=True, text=True, timeout=240,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["refused"] == [] and out["lost"] == 0
    assert out["caught"] == out["sent"] == 150 and out["calls"] > 150 and out["live"] == 0


_ALWAYS_INTERRUPTED = r"""
import ctypes, json
import cupool.torch as ct
from cupool.hooks import torch as front

s = ct.shim()
alloc = getattr(ctypes.CDLL(s.path), s.alloc)
alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
tries = []

def resolve(device):
    tries.append(device)
    raise KeyboardInterrupt

module = front._module()
module.register(resolve, front._report, front._unknown)
got = "no KeyboardInterrupt"
try:
    alloc(4096, 0, None)  # the re-armed interrupt is raised as it returns
    for _ in range(1000):
        pass
except KeyboardInterrupt:
    got = "KeyboardInterrupt"
print(json.dumps({"live": ct.live_blocks(), "tries": len(tries), "error": repr(ct.last_error()), "program": got}))
"""


def test_an_interrupt_on_every_try_is_a_refusal_not_a_hang():
    """A KeyboardInterrupt that comes back each time is no Ctrl-C landing by chance: refused, and still raised."""
    r = subprocess.run([sys.executable, "-c", _ALWAYS_INTERRUPTED], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out == {"live": 0, "tries": 101, "error": "KeyboardInterrupt()", "program": "KeyboardInterrupt"}


def test_the_helpers_answer_for_the_pool_the_shim_serves_from_even_once_its_default_pool_is_forgotten(lib):
    ct.use(None)
    hooks.reset_default_pools()
    try:
        with cupool.sim_device(3):
            ptr = lib.alloc(3 * MiB, 3, None)
        served = cupool.hooks.existing_pool(3)
        hooks.reset_default_pools()  # the shim keeps serving device 3 from `served`, which holds the block
        assert ct.memory_allocated(3) == 3 * MiB and ct.serving_pool(3) is served
        lib.free(ptr, 3 * MiB, 3, None)
        assert ct.empty_cache() >= 3 * MiB and served.stats()["reserved_bytes.all.current"] == 0
    finally:
        ct.use(None)
        hooks.reset_default_pools()


# --- Note [Hits without the GIL]: the C path the shim takes for parked blocks --------------------

#: The figures a hit and a park change, which the C path must keep exact (Note [Fast path]).
FIGURES = ("allocation.", "allocated_bytes.", "requested_bytes.", "segment.", "reserved_bytes.")


@pytest.fixture
def counted(lib):
    """The shim registered with a resolve whose ``lend`` and ``malloc_key`` count their calls: each
    is one allocation served through Python, with the GIL."""
    from cupool.hooks import torch as front

    module = front._module()
    calls = {"lend": 0, "malloc_key": 0}

    def counting(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return None if fn is None else call

    def resolve(device):
        pool, malloc_key, stream_key, lend, free_lent, state = front._resolve(device)
        return pool, counting("malloc_key", malloc_key), stream_key, counting("lend", lend), free_lent, state

    module.register(resolve, front._report, front._unknown)
    module.forget()
    yield calls
    module.register(front._resolve, front._report, front._unknown)
    module.forget()


def _pairs(lib, sizes, rounds, stream=None):
    for _ in range(rounds):
        for n in sizes:
            ptr = lib.alloc(n, 0, stream)
            assert ptr, ct.last_error()
            lib.free(ptr, n, 0, stream)


def _figures(pool):
    return {k: v for k, v in pool.stats().items() if k.startswith(FIGURES)}


def test_warm_small_blocks_are_served_and_parked_without_python_and_the_books_stay_exact(lib, pool, counted):
    sizes = [4096, 100, 1 << 20, 3900]  # 3900 and 4096: one stack (512-byte steps), two requested sizes
    _pairs(lib, sizes, 1)  # each block placed by best fit, then parked
    # Every size is new, so each request that misses gives the blocks parked before it back to the heap:
    # 3900 finds none of 4096's (Note [Cold stacks]).
    assert counted["lend"] == len(sizes)
    _pairs(lib, sizes, 1)  # 4096 (with 3900) is warm now: it took a parked block; 100 and 1 MiB are asked again
    through_python = counted["lend"]
    assert through_python == len(sizes) + 2
    _pairs(lib, sizes, 600)  # 4,800 log entries: past the fold's 4,096 once
    # A warm request is a C hit; the one that finds the log full goes through Python, which folds it.
    # (The shim runs only where the core is compiled: cupool.core's rule for COMPILED_MODULES.)
    assert counted["lend"] - through_python == 1
    # The books as a pool serving the same calls from Python keeps them.
    twin = cupool.Pool("sim", capacity="64MiB")
    for _ in range(602):
        for n in sizes:
            twin.malloc(n).free()
    assert _figures(pool) == _figures(twin)


def test_a_c_hit_writes_the_requested_size_the_snapshot_shows(lib, pool, counted):
    ptr = lib.alloc(4000, 0, None)
    lib.free(ptr, 4000, 0, None)
    ptr = lib.alloc(3900, 0, None)  # the same 4 KiB block, off its stack
    assert counted["lend"] == 1
    blocks = [b for s in pool.snapshot()["segments"] for b in s["blocks"] if b["address"] == ptr]
    assert [(b["size"], b["requested_size"], b["state"]) for b in blocks] == [(4096, 3900, "active_allocated")]
    assert pool.stats()["requested_bytes.all.current"] == 3900
    lib.free(ptr, 3900, 0, None)


def test_a_subscriber_that_wants_every_block_sends_each_call_through_python(lib, pool, counted):
    _pairs(lib, [4096], 2)
    events = []
    stop = pool.subscribe(events.append)
    try:
        before = counted["lend"]
        _pairs(lib, [4096], 10)
        assert counted["lend"] - before == 10
        assert [e[1] for e in events].count("alloc") == 10 and [e[1] for e in events].count("free") == 10
    finally:
        stop()
    # The subscriber's arrival gave the parked block to the heap (Note [Reads park nothing]): the
    # first pair after it goes through Python and parks its block, the other nine hit from C.
    before = counted["lend"]
    _pairs(lib, [4096], 10)
    assert counted["lend"] - before == 1


def test_a_pool_that_tracks_leak_sites_lends_nothing_and_keeps_each_allocation(lib, counted):
    p = cupool.Pool("sim", capacity="64MiB", track_sites=True)
    assert p.lending() is None
    ct.use(p)
    try:
        _pairs(lib, [4096], 5)
        assert counted["lend"] == 0 and counted["malloc_key"] == 5
        ptr = lib.alloc(4096, 0, None)
        assert ct.live_blocks() == 1 and p.stats()["allocation.all.current"] == 1
        lib.free(ptr, 4096, 0, None)
        assert p.stats()["allocation.all.current"] == 0
    finally:
        ct.use(None)
        p.check()


def test_a_pool_with_an_admission_check_lends_nothing(lib, pool, counted):
    pool.set_admission(lambda n, what: "refused by the test" if n > 8192 else None)
    assert pool.lending() is None
    ct.use(pool)  # the shim asks again, and gets the admitting malloc_key
    assert lib.alloc(16384, 0, None) is None
    assert "refused by the test" in str(ct.last_error())
    _pairs(lib, [4096], 3)
    assert counted["lend"] == 0 and counted["malloc_key"] == 4
    pool.set_admission(None)


def test_the_shim_lends_the_sizes_that_park_and_keeps_an_allocation_for_larger_ones(lib, pool, counted):
    from cupool.core.sizes import SMALL_MAX
    from cupool.hooks import torch as front

    assert front._module().LENDS_UP_TO == SMALL_MAX
    _pairs(lib, [SMALL_MAX + 1, 16 * MiB], 1)  # cached first: a large miss would unpark the small block
    _pairs(lib, [SMALL_MAX, SMALL_MAX + 1, 16 * MiB], 3)
    assert counted["lend"] == 1 and counted["malloc_key"] == 2 + 6  # the small block lent once, then C hits
    assert pool.stats()["allocation.all.current"] == 0
