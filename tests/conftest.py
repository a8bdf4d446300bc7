import gc
import os

import pytest
from hypothesis import HealthCheck, settings

import cupool
from cupool.device import cuda_available

settings.register_profile(
    "ci",
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", max_examples=1000, stateful_step_count=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_GPU = cuda_available()
_skip_without_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (none is usable on this machine)")


def needs_gpu(obj):
    """Marks ``obj`` ``gpu`` (so ``pytest -m gpu`` selects it) and skips it, saying why, without one."""
    return pytest.mark.gpu(_skip_without_gpu(obj))


@pytest.fixture
def pool():
    """A small sim pool: 64 MiB of simulated device memory."""
    return cupool.Pool("sim", capacity="64MiB")


def pytest_collection_finish(session):
    """Move what importing the tests made (numba, hypothesis, torch, the modules) out of the
    collector's sight: the pools' reclaim ladders run ``gc.collect()`` on every out-of-memory,
    and a full collection over those objects cost 50-300 ms each, most of the suite's time in
    the state machines.  What the tests themselves make is collected as before."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The same, before each test: what earlier tests imported lazily (the move kernel's Numba objects, some
    60,000; the replay engine, h5py, matplotlib) and what module-scoped fixtures hold would otherwise be
    walked by every full collection in every later test.  The garbage of earlier tests is collected first,
    so nothing collectable is frozen; what this test and its own fixtures make stays in the collector's
    sight, and frozen objects still die by reference counting."""
    gc.collect()
    gc.freeze()
