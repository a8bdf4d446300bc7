"""``python -m cupool.validate`` without a GPU: its logic, its checks on sim, and the no-GPU run end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import importlib.util
import textwrap
from datetime import datetime
from pathlib import Path

import cupy
import numpy as np
import pytest

from conftest import HAS_GPU
from cupool.device import SimDevice
from cupool.validate import CHECKS, FAILED, PASSED, SKIPPED, Check, Context, Result, Table, main, run_checks
from cupool.validate import bench, extras, memory, moves, suites, workload
from cupool.validate.report import environment, render
from cupool.validate.results import TARGETS, to_json

ROOT = Path(__file__).resolve().parent.parent


def sim(tmp_path: Path, **kw) -> Context:
    return Context(device="sim", workdir=tmp_path, stem="report", quick=True, **kw)


# -------------------------------------------------------------- bit-for-bit comparison
def seeded_workload(seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    return [a @ a.T, np.sort(a[:, 0]), np.fft.fft(a[0]), np.array([np.nan, -0.0])]


def test_identical_runs_compare_equal_nans_included():
    assert workload.compare_outputs(seeded_workload(), seeded_workload()) == []


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda out: out[0].__setitem__((3, 4), np.nextafter(out[0][3, 4], np.inf)),  # one ulp
         r"result 0 \(float32\[64, 64\]\): 1 of 16384 bytes differ"),
        (lambda out: out[3].__setitem__(1, 0.0), r"result 3 \(float64\[2\]\): 1 of 16 bytes differ"),  # -0.0 is not 0.0
        (lambda out: out.__setitem__(1, out[1].astype(np.float64)), "result 1: float64.*float32"),
        (lambda out: out.pop(), "3 results where 4"),
    ],
)
def test_any_difference_bit_for_bit_is_named(change, message):
    got = seeded_workload()
    change(got)
    diffs = workload.compare_outputs(seeded_workload(), got)
    assert len(diffs) == 1 and re.search(message, diffs[0]), diffs


def test_candidates_run_after_the_reference_and_a_raising_one_fails_alone():
    calls = []

    def ref():
        calls.append("ref")
        return seeded_workload()

    def good():
        calls.append("good")
        return seeded_workload()

    def off_by_one_seed():
        calls.append("bad")
        return seeded_workload(4)

    def broken():
        calls.append("broken")
        raise MemoryError("cupool: out of memory")

    diffs = workload.run_candidates(ref, {"good": good, "bad": off_by_one_seed, "broken": broken, "again": good})
    assert calls == ["ref", "good", "bad", "broken", "good"]
    assert diffs["good"] == diffs["again"] == []
    assert len(diffs["bad"]) == 3  # the -0.0/NaN pair is the same whatever the seed
    assert diffs["broken"] == ["raised MemoryError: cupool: out of memory"]


# ------------------------------------------------------------------- benchmarks' logic
def test_samples_are_interleaved_and_medians_taken():
    order = []
    values = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 2.0, 9.0])}

    def sample(name):
        def run():
            order.append(name)
            return next(values[name])

        return run

    med = bench.interleaved_medians({"a": sample("a"), "b": sample("b")}, repeat=3)
    assert order == ["a", "b"] * 3
    assert med == {"a": 3.0, "b": 2.0}


def test_the_fastest_path_is_chosen_among_those_that_passed():
    med = {"CuPy MemoryPool": 1.0, "pointer": 2.0, "function": 1.5}
    assert bench.fastest_passing(med, ("pointer", "function")) == "function"
    assert bench.fastest_passing(med, ("pointer",)) == "pointer"  # the faster one gave wrong results
    assert bench.fastest_passing(med, ()) is None
    assert bench.fastest_passing(med, ("rmm-only",)) is None


# ------------------------------------------------------------------------ test suites
SUITE = {
    "conftest.py": """
        import pytest
        needs_gpu = pytest.mark.skipif(False, reason="needs a CUDA GPU (none is usable on this machine)")
    """,
    "test_cpu.py": """
        def test_plain():
            pass
    """,
    "test_gpu.py": """
        import pytest
        from conftest import needs_gpu

        @needs_gpu
        def test_on_gpu():
            pass

        @pytest.mark.gpu
        def test_marked():
            pass

        @needs_gpu
        def test_gpu_bug():
            assert 1 == 2

        @pytest.mark.skipif(True, reason="on a GPU this one runs elsewhere")
        def test_skipped_on_a_gpu():
            pass
    """,
    "conformance/test_conf.py": """
        import pytest

        @pytest.mark.parametrize("kind", ["sim", pytest.param("cuda", marks=pytest.mark.skipif(True, reason="no GPU"))])
        def test_kind(kind):
            pass

        @pytest.fixture
        def broken():
            raise RuntimeError("setup failed")

        def test_error(broken):
            pass
    """,
}


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    root = tmp_path / "checkout" / "tests"
    for name, text in SUITE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def test_gpu_tests_runs_only_what_needs_a_gpu_and_names_the_failure(suite, tmp_path):
    r = suites.gpu_tests(sim(tmp_path, tests=suite))
    assert r.status == FAILED
    # test_plain and test_skipped_on_a_gpu are left out: neither needs a GPU
    assert (r.figures["passed"], r.figures["failed"], r.figures["skipped"]) == (2, 1, 0)
    assert "tests.test_gpu::test_gpu_bug" in r.details and "test_conf" not in r.details
    assert r.commands == ["python -m pytest -q -p cupool.validate.gpu_only --ignore=tests/conformance tests"]


def test_conformance_counts_errors_and_refuses_skips(suite, tmp_path):
    r = suites.conformance(sim(tmp_path, tests=suite))
    assert r.status == FAILED
    assert (r.figures["passed"], r.figures["errors"], r.figures["skipped"]) == (1, 1, 1)
    assert "conformance.test_conf::test_error" in r.details
    assert "skipped for want of a GPU on a GPU machine: conformance.test_conf::test_kind[cuda]" in r.details


def test_a_skip_that_does_not_want_a_gpu_is_listed_but_passes(suite, tmp_path):
    (suite / "conformance" / "test_conf.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\n"
        "def test_sim_only():\n    pytest.skip('only the sim devices promise page-exact accounting')\n"
    )
    r = suites.conformance(sim(tmp_path, tests=suite))
    assert r.status == PASSED, r.details
    assert "skipped where they do not apply: conformance.test_conf::test_sim_only (only the sim devices" in r.details


def test_a_clean_suite_passes(suite, tmp_path):
    (suite / "test_gpu.py").write_text(textwrap.dedent(SUITE["test_gpu.py"]).replace("1 == 2", "1 == 1"))
    r = suites.gpu_tests(sim(tmp_path, tests=suite))
    assert r.status == PASSED and r.summary == "3 passed, 0 failed, 0 errors, 0 skipped"


def test_a_suite_killed_at_its_time_limit_fails_and_says_so(suite, tmp_path):
    slow = "import pytest, time\n\n@pytest.mark.gpu\ndef test_slow():\n    time.sleep(60)\n"
    (suite / "test_gpu.py").write_text(slow)
    r = suites.gpu_tests(sim(tmp_path, tests=suite, timeout=1))  # its one test sleeps 60 s: any limit kills it
    assert r.status == FAILED and "killed at its time limit" in r.details


def test_without_the_test_suite_the_suites_are_skipped_not_failed(tmp_path):
    for check in (suites.gpu_tests, suites.conformance):
        r = check(sim(tmp_path, tests=None))
        assert r.status == SKIPPED and "installed without its tests" in r.summary
    assert suites.find_tests() == ROOT / "tests"  # a source checkout has them
    assert suites.find_tests(tmp_path) is None  # a folder that is no test suite


def test_numba_modules_are_looked_up_without_importing_them():
    found, missing = suites.available_modules(("numba.cuda.tests.cudadrv.test_emm_plugins", "numba.cuda.tests.nope"))
    assert found == ["numba.cuda.tests.cudadrv.test_emm_plugins"]
    assert missing == ["numba.cuda.tests.nope"]
    assert suites.available_modules(("no_such_package.tests",)) == ([], ["no_such_package.tests"])


def run_of(outcomes: dict[str, str]) -> suites.SuiteRun:
    return suites.SuiteRun("python -m pytest", 0, outcomes)


def test_numba_counts_side_by_side_and_only_new_failures_count():
    default = run_of({"cudadrv.test_emm::A::t1": "passed", "cudadrv.test_emm::A::t2": "failed",
                      "cudapy.test_array::B::t3": "passed", "cudapy.test_array::B::t4": "skipped"})
    same = suites.compare_numba(run_of(dict(default.outcomes)), default)
    assert same.status == PASSED  # t2 fails under Numba's own manager too
    assert same.tables[0].rows == [("cudadrv.test_emm", "1 / 1 / 0", "1 / 1 / 0"),
                                   ("cudapy.test_array", "1 / 0 / 1", "1 / 0 / 1")]
    worse = suites.compare_numba(run_of(default.outcomes | {"cudapy.test_array::B::t3": "errors"}), default)
    assert worse.status == FAILED and "fail only under cupool.numba: cudapy.test_array::B::t3" in worse.details
    nothing = suites.compare_numba(suites.SuiteRun("x", 4, {}, tail="ERROR: module not found"), default)
    assert nothing.status == FAILED and "no test ran with cupool.numba" in nothing.details
    all_fail = run_of({"cudadrv.test_emm::A::t1": "failed"})
    dead = suites.compare_numba(all_fail, all_fail)
    assert dead.status == FAILED and "Numba cannot run CUDA code here" in dead.details


def test_numba_runs_both_managers_in_subprocesses_and_lists_missing_modules(tmp_path, monkeypatch):
    """Without a GPU Numba's tests fail alike under both managers, which is no failure of cupool's."""
    pytest.importorskip("filecheck", reason="Numba's CUDA test helpers import filecheck")
    modules = ("numba.cuda.tests.cudadrv.test_emm_plugins", "numba.cuda.tests.no_such_module")
    monkeypatch.setattr(suites, "NUMBA_MODULES", modules)
    r = suites.numba_tests(sim(tmp_path, timeout=120))
    assert r.commands[0].endswith(
        "NUMBA_CUDA_MEMORY_MANAGER=cupool.numba python -m pytest -q -p cupool.validate.numba_shim "
        "--import-mode=importlib --pyargs " + modules[0]
    )
    assert "NUMBA_CUDA_MEMORY_MANAGER" not in r.commands[1]
    (row,) = r.tables[0].rows
    assert row[0] == "cudadrv.test_emm_plugins" and row[1] == row[2]
    assert "not in this Numba, so not run: numba.cuda.tests.no_such_module" in r.details
    assert r.status == (FAILED if r.figures["default passed"] == 0 else PASSED)


def test_without_filecheck_numbas_tests_are_not_run_and_the_report_says_why(tmp_path, monkeypatch):
    """The GPU image lacked filecheck (2026-11-22): every Numba test module failed to import, under both managers."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "filecheck" else real(name, *a))
    r = suites.numba_tests(sim(tmp_path, timeout=120))
    assert r.status == FAILED and "pip install filecheck" in r.details


def test_junit_outcomes_keep_the_worse_of_a_repeated_case(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname=".T" name="a" file="x/cudadrv/test_m.py"/>'
        '<testcase classname=".T" name="a" file="x/cudadrv/test_m.py"><error message="teardown"/></testcase>'
        '<testcase classname="" name="numba.cuda.tests.bad"><error message="collection"/></testcase>'
        '<testcase classname=".T" name="s" file="x/cudadrv/test_m.py"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    assert suites.read_junit(xml) == {
        "cudadrv.test_m::T::a": "errors",
        "numba.cuda.tests.bad": "errors",
        "cudadrv.test_m::T::s": "skipped",
    }


# --------------------------------------------------------------- checks on the sim device
def test_move_kernel_check_matches_memmove_on_sim(tmp_path):
    r = memory.move_kernel(sim(tmp_path))
    assert r.status == PASSED and r.figures["different"] == 0 and r.figures["move lists"] == 13


def test_move_kernel_check_catches_a_kernel_that_gets_it_wrong(tmp_path, monkeypatch):
    real = SimDevice.execute_moves

    def drops_the_last_move(self, src, dst, n):
        real(self, src[:-1], dst[:-1], n[:-1])

    monkeypatch.setattr(SimDevice, "execute_moves", drops_the_last_move)
    r = memory.move_kernel(sim(tmp_path))
    assert r.status == FAILED and "different from memmove" in r.details and r.figures["different"] >= 1


def test_memmove_reference_is_memmove():
    data = np.arange(16, dtype=np.uint8)
    assert memory.memmove_reference(data, [(0, 2, 8)]).tolist()[:10] == [0, 1, 0, 1, 2, 3, 4, 5, 6, 7]
    assert memory.memmove_reference(data, [(2, 0, 8)]).tolist()[:8] == list(range(2, 10))


def test_compaction_check_measures_and_catches_corruption(tmp_path, monkeypatch):
    r = memory.compaction_bandwidth(sim(tmp_path))
    assert r.status == PASSED and r.figures["moves (GB/s)"] > 0 and r.figures["moves / copy (x)"] > 0
    assert [row[0] for row in r.tables[0].rows] == ["numpy copy in host memory", "compaction, moves only",
                                                     "compaction, end to end"]
    monkeypatch.setattr(SimDevice, "execute_moves", lambda self, src, dst, n: None)  # the bytes never move
    assert memory.compaction_bandwidth(sim(tmp_path)).status == FAILED


def test_pinned_and_spill_checks_pass_on_sim(tmp_path):
    r = memory.pinned(sim(tmp_path))
    assert r.status == PASSED, r.details
    assert set(r.figures) == {f"{k} {d} device (GB/s)" for k in ("pinned", "pageable") for d in ("to", "from")}
    r = memory.spill(sim(tmp_path))
    assert r.status == PASSED, r.details
    rows = r.tables[0].rows
    assert [row[0] for row in rows] == ["host", "HDF5"] and all(row[-1] == "yes" for row in rows)


def test_trace_check_saves_a_trace_beside_the_report_that_replays(tmp_path):
    from cupool.replay import replay
    from cupool.trace import load_trace

    r = memory.trace(sim(tmp_path))
    path = tmp_path / "report-trace.h5"
    assert r.status == PASSED and r.commands == ["cupool replay report-trace.h5"]
    assert path.exists() and replay(load_trace(path)).events == r.figures["events"] > 0
    assert r.figures["recorded peak reserved"] == r.figures["replayed peak reserved"] > 0
    assert "reproduces the peaks" in r.summary


# ------------------------------------------- GPU checks' plumbing, with stand-ins for the GPU
class FakeCupyPool:
    """Stands in for ``cupy.cuda.MemoryPool``, which needs a GPU: pointers into one host buffer."""

    def __init__(self):
        self.arena = np.zeros(1 << 20, np.uint8)

    def malloc(self, nbytes):
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(self.arena.ctypes.data, nbytes, self, 0), 0)


@pytest.fixture
def no_gpu_stand_ins(monkeypatch):
    """CuPy's pool faked, and only the hook path that serves CuPy without a GPU."""
    monkeypatch.setattr(cupy.cuda, "MemoryPool", FakeCupyPool)
    for module in (bench, workload):
        monkeypatch.setattr(module, "PATHS", ("pointer",))


def test_hook_paths_measures_each_allocator_and_names_the_fastest_that_passed(tmp_path, no_gpu_stand_ins):
    ctx = sim(tmp_path)
    ctx.passing_paths = ("pointer",)
    before = cupy.cuda.get_allocator()
    r = bench.hook_paths(ctx)
    assert cupy.cuda.get_allocator() is before
    assert r.status == PASSED
    assert [row[0] for row in r.tables[0].rows] == ["CuPy MemoryPool", bench.FLOOR, "cupool path='pointer'"]
    assert [row[-1] for row in r.tables[0].rows] == ["yes (reference)", "not run", "yes"]
    assert r.summary.startswith("fastest path that passed the workload: 'pointer', ")
    f = r.figures
    assert f["pointer / CuPy (x)"] == pytest.approx(f["pointer (us)"] / f["CuPy MemoryPool (us)"])
    assert f["cupool / CuPy MemoryPool (x)"] == f["pointer / CuPy (x)"]  # the issue's ratio, for the JSON
    assert f["floor / CuPy MemoryPool (x)"] == pytest.approx(f[f"{bench.FLOOR} (us)"] / f["CuPy MemoryPool (us)"])
    assert "cupool / RMM (x)" not in f
    assert "RMM is not importable" in r.details
    ctx.passing_paths = None
    assert bench.hook_paths(ctx).summary == "cupy-workload did not run before it, so no path is chosen"


def test_malloc_free_reports_flatness_and_the_ratio_to_cupy(tmp_path, no_gpu_stand_ins):
    r = bench.malloc_free(sim(tmp_path))
    assert r.status == PASSED and [row[0] for row in r.tables[0].rows] == ["1,000", "100,000"]
    assert r.figures["cupool 100k/1k (x)"] > 0 and r.figures["cupool/CuPy at 100,000 live (x)"] > 0
    f = r.figures
    assert f["cupool malloc+free / CuPy malloc+drop at 1,000 live (x)"] == pytest.approx(
        f["cupool malloc+free at 1,000 live (us)"] / f["CuPy malloc+drop at 1,000 live (us)"])


def test_workload_check_runs_install_and_each_path_and_flags_a_mismatch(tmp_path, no_gpu_stand_ins, monkeypatch):
    def fake_workload(cp):  # allocates through whatever CuPy has now, like the real one
        x = cp.empty(1000, cp.uint8)
        on_cupool = hasattr(cp.cuda.get_allocator(), "pool")
        del x
        return [np.full(4, on_cupool and wrong, np.int8)]

    wrong = False
    monkeypatch.setattr(workload, "cupy_workload", fake_workload)
    ctx = sim(tmp_path)
    r = workload.cupy_workload_check(ctx)
    assert r.status == PASSED and ctx.passing_paths == ("pointer",)
    rows = [row[:3] for row in r.tables[0].rows]
    assert rows == [("cupool.install()", "yes", 1), ("cupy_allocator(path='pointer')", "yes", 1)]
    wrong = True
    r = workload.cupy_workload_check(ctx)
    assert r.status == FAILED and ctx.passing_paths == ()
    assert "pointer: result 0 (int8[4]): 4 of 4 bytes differ" in r.details


# ----------------------------------------------------------------- runner and report
def test_a_check_that_raises_fails_alone_and_sim_skips_gpu_checks(tmp_path):
    def boom(ctx):
        raise RuntimeError("kernel launch failed")

    checks = [
        Check("boom", "Boom", boom, on_sim=True),
        Check("fine", "Fine", lambda ctx: Result(PASSED, summary="ok"), on_sim=True),
        Check("gpu", "GPU only", boom),
    ]
    heard = []
    results = run_checks(sim(tmp_path), checks, None, heard.append)
    assert heard == results
    assert [(r.name, r.status) for r in results] == [("boom", FAILED), ("fine", PASSED), ("gpu", SKIPPED)]
    assert "RuntimeError: kernel launch failed" in results[0].details and results[0].title == "Boom"
    assert "needs a GPU" in results[2].summary
    no_gpu = run_checks(Context(device="cuda"), checks, "no usable CUDA GPU (none here)")
    assert {r.status for r in no_gpu} == {SKIPPED}


def fake_results() -> list[Result]:
    return [
        Result(PASSED, summary="412 passed", commands=["python -m pytest -q tests"],
               figures={"passed": 412, "seconds": 81.25}, name="gpu-tests", title="GPU tests", seconds=81.3),
        Result(FAILED, summary="function path 1.31x | slow", details="fastest path: 'pointer'",
               tables=[Table(("allocator", "median"), [("CuPy MemoryPool", "1.102 us"), ("pointer", 1.2345)])],
               figures={"pointer / CuPy (x)": 1.12}, name="hook-paths", title="Hook paths", seconds=12.0),
        Result(SKIPPED, summary="RMM is not importable", name="rmm", title="RMM"),
    ]


def test_report_has_the_date_environment_overview_and_each_check():
    env = {"python": "3.11.7", "cupy": "14.2.0 (cupy-cuda12x)", "device": "NVIDIA H100 80GB HBM3"}
    text = render(fake_results(), env, datetime(2026, 11, 22, 9, 30), 95.0, "python -m cupool.validate", None)
    assert text.startswith("## GPU validation, 2026-11-22 (NVIDIA H100 80GB HBM3)\n")
    assert "| cupy | 14.2.0 (cupy-cuda12x) |" in text
    assert "1 passed, 1 failed, 1 skipped." in text
    assert "| Hook paths | **FAILED** | function path 1.31x / slow | 12 |" in text  # a | would break the table
    assert "| RMM | skipped | RMM is not importable | 0 |" in text and "### RMM" not in text
    assert "### GPU tests: passed\n\n```bash\npython -m pytest -q tests\n```" in text
    assert "| passed | 412 |" in text and "| seconds | 81.2 |" in text
    assert "| pointer | 1.23 |" in text and "pointer / CuPy" not in text  # tables carry that check's figures
    assert "Incomplete" not in text and "Not run on a GPU" not in text
    partial = render(fake_results()[:1], env, datetime(2026, 11, 22), 5.0, "x", "no usable CUDA GPU (none)", planned=11)
    assert "**Incomplete:** 1 of 11 checks had run" in partial
    assert "**Not run on a GPU:** no usable CUDA GPU (none)" in partial
    assert partial.startswith("## GPU validation, 2026-11-22 (no GPU)")


def test_environment_names_versions_and_the_device(monkeypatch):
    rt = cupy.cuda.runtime
    fakes = {
        "getDeviceProperties": lambda i: {"name": b"NVIDIA H100 80GB HBM3", "major": 9, "minor": 0,
                                          "multiProcessorCount": 132},
        "memGetInfo": lambda: (80 << 30, 81559 << 20),
        "driverGetVersion": lambda: 12080,
        "runtimeGetVersion": lambda: 12060,
        "getDeviceCount": lambda: 1,
    }
    for name, fake in fakes.items():
        monkeypatch.setattr(rt, name, fake)
    env = environment(None)
    assert env["python"] and env["cupool"] and env["cupy"].endswith("(cupy-cuda12x)")
    assert env["numba-cuda"] == "not installed" or env["numba-cuda"][0].isdigit()
    assert env["device"] == "NVIDIA H100 80GB HBM3"
    assert env["device memory"] == "79.6 GiB (80 GiB free at the start)"
    assert env["compute capability"] == "9.0, 132 SMs" and env["CUDA driver / runtime"] == "12.8 / 12.6"

    def broken(i):
        raise rt.CUDARuntimeError(999)

    monkeypatch.setattr(rt, "getDeviceProperties", broken)
    assert environment(None)["device"].startswith("a GPU, whose properties could not be read (CUDARuntimeError")
    assert environment("no usable CUDA GPU (none)")["device"] == "no usable CUDA GPU (none)"


def test_every_check_has_a_unique_name_and_a_title():
    names = [c.name for c in CHECKS]
    assert len(set(names)) == len(names) == 20 and all(c.title for c in CHECKS)
    assert {c.name for c in CHECKS if c.on_sim} == {"move-kernel", "compaction-bandwidth", "compaction-moves", "vmm-latency",
                                                    "torch-summary", "pinned", "spill", "trace", "async-release",
                                                    "managed-streaming"}


def test_a_rehearsal_on_sim_writes_the_report_and_the_trace(tmp_path, capsys):
    out = tmp_path / "nested" / "run.md"
    rc = main(["--device", "sim", "--quick", "--only", "move-kernel,trace,gpu-tests", "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0
    assert printed.out == out.read_text()
    assert "2 passed, 0 failed, 1 skipped." in printed.out
    assert "[3/3] trace: passed" in printed.err
    assert (tmp_path / "nested" / "run-trace.h5").exists()
    doc = json.loads((tmp_path / "nested" / "run.json").read_text())  # the same run, as JSON, beside the report
    assert doc["complete"] and doc["counts"] == {"passed": 2, "failed": 0, "skipped": 1}
    assert [c["name"] for c in doc["checks"]] == ["gpu-tests", "move-kernel", "trace"]
    assert doc["checks"][1]["figures"]["different"] == 0


def test_unknown_check_names_are_an_error(capsys):
    assert main(["--only", "move-kernal"]) == 2
    assert "unknown check(s) move-kernal" in capsys.readouterr().err


@pytest.mark.skipif(HAS_GPU, reason="on a GPU this would be the real run")
def test_without_a_gpu_it_says_so_skips_everything_and_exits_0(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "cupool.validate", "--out", "r.md"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "r.md").read_text()
    assert proc.stdout == report
    assert "(no GPU)" in report.splitlines()[0] and "**Not run on a GPU:** no usable CUDA GPU" in report
    assert f"0 passed, 0 failed, {len(CHECKS)} skipped." in report
    assert report.count("| skipped | no usable CUDA GPU |") == len(CHECKS)
    assert "| python |" in report and "| cupool |" in report and "| numba |" in report
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["gpu"] is False and doc["gpu_problem"].startswith("no usable CUDA GPU") and doc["complete"]
    assert doc["counts"] == {"passed": 0, "failed": 0, "skipped": len(CHECKS)}
    assert {c["status"] for c in doc["checks"]} == {"skipped"}
    assert all(c["summary"] == "no usable CUDA GPU" for c in doc["checks"])
    assert len(doc["targets"]) == len(TARGETS) and all(t["value"] is None for t in doc["targets"])
    assert all(t["why_not"] == f"the check {t['check']} was skipped: no usable CUDA GPU" for t in doc["targets"])


# ------------------------------------------------------------------- JSON beside the report
def test_json_has_each_check_and_the_issues_targets_with_bounds_and_reasons():
    results = fake_results() + [
        Result(PASSED, figures={"128 MiB in 32 moves: copy/moves (x)": 0.91, "1 GiB in 32 moves: copy/moves (x)": 0.7,
                                "4,096 moves of 4 KiB: moves (ms)": 0.41},
               name="compaction-moves", title="Moves", seconds=3.0),
        Result(PASSED, figures={"cupool / CuPy MemoryPool (x)": 1.3}, name="malloc-free", title="malloc"),
    ]
    doc = json.loads(to_json(results, {"python": "3.11"}, datetime(2026, 11, 24, 22, 0), 12.34, "cmd", None, 9))
    assert doc["schema"] == 1 and doc["started"] == "2026-11-24T22:00:00" and doc["seconds"] == 12.3
    assert doc["complete"] is False and doc["gpu"] is True and doc["environment"] == {"python": "3.11"}
    assert doc["counts"] == {"passed": 3, "failed": 1, "skipped": 1}
    hook = doc["checks"][1]
    assert hook["name"] == "hook-paths" and hook["status"] == "failed" and hook["figures"] == {"pointer / CuPy (x)": 1.12}
    assert hook["tables"] == [{"columns": ["allocator", "median"], "rows": [["CuPy MemoryPool", "1.102 us"],
                                                                          ["pointer", 1.2345]]}]
    targets = {t["name"]: t for t in doc["targets"]}
    assert targets["compaction, 128 MiB in 32 moves: moves / CuPy copy (x)"] | {} == {
        "name": "compaction, 128 MiB in 32 moves: moves / CuPy copy (x)", "check": "compaction-moves",
        "figure": "128 MiB in 32 moves: copy/moves (x)", "target": ">= 0.8", "value": 0.91, "met": True}
    assert targets["compaction, 1 GiB in 32 moves: moves / CuPy copy (x)"]["met"] is False
    assert targets["4,096 moves of 4 KiB (ms)"]["met"] is True
    floor = targets["cp.empty + drop: floor Python allocator / CuPy MemoryPool (x)"]
    assert floor["target"] is None and floor["met"] is None
    assert floor["why_not"] == "the check hook-paths failed without this figure"
    raw = targets["raw malloc + free: cupool / CuPy MemoryPool malloc (x)"]
    assert raw["value"] is None and "passed without this figure" in raw["why_not"]
    assert targets["pool.compact(), moves only / CuPy copy (x)"]["why_not"] == (
        "the check compaction-bandwidth did not run")


# ------------------------------------------------------------ the checks pending from the first GPU run
def test_compaction_moves_check_on_sim_times_each_pattern_and_checks_the_bytes(tmp_path):
    r = moves.compaction_moves(sim(tmp_path))
    assert r.status == PASSED, r.details
    labels = [p.label for p in moves.QUICK]
    assert [row[0] for row in r.tables[0].rows] == labels and all(row[-1] == "intact" for row in r.tables[0].rows)
    for label in labels:
        f = r.figures
        assert f[f"{label}: copy/moves (x)"] == pytest.approx(f[f"{label}: copy (ms)"] / f[f"{label}: moves (ms)"])


def test_compaction_moves_check_catches_moves_that_get_it_wrong(tmp_path, monkeypatch):
    real = SimDevice.execute_moves

    def drops_the_last_move(self, src, dst, nbytes):
        real(self, src[:-1], dst[:-1], nbytes[:-1])

    monkeypatch.setattr(SimDevice, "execute_moves", drops_the_last_move)
    r = moves.compaction_moves(sim(tmp_path))
    assert r.status == FAILED and r.details.startswith("moves left wrong bytes: 8 MiB in 32 moves, ")


def test_the_issues_patterns_and_targets():
    assert [(p.size * p.count, p.count, p.min_ratio, p.max_ms) for p in moves.PATTERNS] == [
        (128 << 20, 32, 0.8, None), (1 << 30, 32, 0.9, None), (16 << 20, 4096, None, 0.5)]


def test_vmm_latency_runs_bench_vmm_on_the_device_beside_malloc_and_free(tmp_path):
    ctx = sim(tmp_path, tests=ROOT / "tests")
    r = extras.vmm_latency(ctx)
    assert r.status == PASSED, r.details
    assert r.commands == ["python benchmarks/bench_vmm.py --device sim --granules 1 4 --repeats 3"]
    assert [row[0] for row in r.tables[0].rows] == [1, 4]
    f = r.figures
    assert f["(map+unmap)/(malloc+free), 1 granule(s) (x)"] == pytest.approx(
        (f["map, 1 granule(s) (us)"] + f["unmap, 1 granule(s) (us)"])
        / (f["malloc, 1 granule(s) (us)"] + f["free, 1 granule(s) (us)"]))
    assert extras.vmm_latency(sim(tmp_path, tests=tmp_path)).summary.startswith("the benchmarks are not available")


def test_expandable_runs_the_gpu_tests_of_virtual_memory_and_says_why_when_it_cannot(tmp_path, monkeypatch):
    root = tmp_path / "checkout" / "tests"
    root.mkdir(parents=True)
    (root / "conftest.py").write_text("")
    (root / "test_expandable.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_smoke():\n    pass\n\n"
                                             "def test_on_sim():\n    pass\n")
    (root / "test_vmm.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_real():\n    assert 0\n")
    monkeypatch.setattr(extras, "has_bindings", lambda: True)
    r = extras.expandable(sim(tmp_path, tests=root))
    assert r.status == FAILED and r.summary.startswith("1 passed, 1 failed")  # only the gpu-marked tests ran
    assert "test_vmm.py::test_real" in r.details and "-m gpu" in r.commands[0]
    monkeypatch.setattr(extras, "has_bindings", lambda: False)
    r = extras.expandable(sim(tmp_path, tests=root))
    assert r.status == SKIPPED and "pip install 'cuda-bindings>=12'" in r.summary
    assert extras.expandable(sim(tmp_path)).status == SKIPPED  # no test suite


def test_torch_summary_says_why_without_torch(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    r = extras.torch_summary(sim(tmp_path))
    assert r.status == SKIPPED and r.summary.startswith("torch is not importable here")


def test_torch_summary_reads_pool_stats_through_torchs_module_and_puts_it_back(tmp_path, monkeypatch):
    """A stand-in for torch.cuda.memory (torch is not in the test extra): its summary reads memory_stats."""
    from cupool import memory_summary

    class TorchMemory:
        @staticmethod
        def memory_stats(device=None):
            raise AssertionError("the check must have replaced memory_stats")

        def memory_summary(self, device=None):
            return "preamble from torch\n" + memory_summary(self.memory_stats(device))

    fake = TorchMemory()
    original = fake.memory_stats
    torch = type(sys)("torch")
    torch.cuda = type(sys)("torch.cuda")
    torch.cuda.memory = fake
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.cuda", torch.cuda)
    monkeypatch.setitem(sys.modules, "torch.cuda.memory", fake)
    r = extras.torch_summary(sim(tmp_path))
    assert r.status == PASSED, r.details
    assert fake.memory_stats is original
