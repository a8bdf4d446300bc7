"""The GPU checks of issue 27 (``cupool.validate.upstreams``, ``cupool.validate.torch_checks``) rehearsed here:
the upstream checks run on the sim device, the torch checks skip with their reason, and the comparisons
they make on a GPU are fed made-up runs."""

from __future__ import annotations

import importlib.util

from cupool.validate import torch_child
from cupool.validate.records import FAILED, PASSED, SKIPPED, Context
from cupool.validate.runner import _select, run_checks
from cupool.validate.torch_checks import compare_training, timing_result, torch_cupy_shared
from cupool.validate.upstreams import async_release, managed_streaming

SIM = Context(device="sim", quick=True)


def test_async_release_on_sim_makes_no_device_synchronization_where_device_makes_them():
    r = async_release(SIM)
    assert r.status == PASSED
    assert r.figures == {"async: device synchronizations in 5 rounds": 0,
                         "device: device synchronizations in 5 rounds": 5}


def test_managed_streaming_on_sim_prefetches_what_fits_and_nothing_past_the_capacity():
    r = managed_streaming(SIM)
    assert r.status == PASSED, r.details
    assert r.figures["prefetched (MiB)"] == r.figures["working set (MiB)"] == 32
    assert r.figures["working set (MiB)"] <= r.figures["free before (MiB)"] / 4
    assert r.figures["past capacity: prefetched (MiB)"] == 512
    assert r.figures["past capacity: not prefetched (MiB)"] == r.figures["past capacity: oversubscribed (MiB)"] == 256


def test_the_torch_checks_skip_with_their_reason_on_sim():
    r = torch_cupy_shared(SIM)
    assert r.status == SKIPPED
    if importlib.util.find_spec("torch") is None:
        assert r.summary == "torch is not installed here: the torch checks run torch's CUDA allocator"
    else:
        assert "needs a GPU" in r.summary


def test_the_checks_are_registered_and_run_or_skip_on_sim():
    names = ["torch-cupy-shared", "torch-alloc-timing", "async-release", "managed-streaming"]
    checks = _select(",".join(names), None)
    assert [c.name for c in checks] == names
    results = run_checks(SIM, [c for c in checks if c.name.startswith("torch")], None)
    assert [r.status for r in results] == [SKIPPED, SKIPPED]
    assert all(r.summary for r in results)


def _run(losses=("0x1.0p+0", "0x1.8p-1"), params="a" * 64, cupy="b" * 64, **extra):
    return {"losses": list(losses), "params": params, "cupy": cupy, **extra}


def test_compare_training_names_what_differs():
    own = _run()
    assert compare_training(own, _run(one_pool=True)) == []
    problems = compare_training(own, _run(losses=("0x1.0p+0", "0x1.9p-1"), cupy="c" * 64, one_pool=False))
    assert problems == [
        "the losses differ from step 1",
        "CuPy's results differ (sha256 bbbbbbbbbbbb on their own allocators, cccccccccccc on cupool)",
        "torch was not served from the pool cupool.install() gave CuPy",
    ]


def test_timing_result_gives_ratios_and_the_targets_missed():
    medians = {"cupool": {"4096": 6.0, "1048576": 3.0}, "torch": {"4096": 2.0, "1048576": 2.0},
               "rmm": {"4096": 7.0, "1048576": 2.0}}
    r = timing_result(medians, [], ["note"])
    assert r.status == PASSED
    assert r.figures["cupool / torch, 4,096 B (x)"] == 3.0
    assert r.figures["cupool / rmm, 1,048,576 B (x)"] == 1.5
    assert r.summary == "2 target(s) missed: cupool / torch at 4,096 B is 3.00x (target <= 2.0)"
    assert r.details.endswith("note")
    assert timing_result({}, ["the timing on cupool failed"], []).status == FAILED


def test_the_child_refuses_an_unknown_mode_with_its_usage(capsys):
    assert torch_child.main(["train", "tf"]) == 2
    assert "usage: python -m cupool.validate.torch_child MODE ALLOCATOR" in capsys.readouterr().err

