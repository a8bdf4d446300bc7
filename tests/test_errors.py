"""cupool.OutOfMemoryError: a MemoryError, CuPy's error too where CuPy is installed, picklable either way."""

import pickle
import subprocess
import sys
import textwrap

import pytest

import cupool
from cupool.errors import OutOfMemoryError

MiB = 1 << 20


def oom(pool: cupool.Pool) -> OutOfMemoryError:
    """The error a real pool raises for a request over its limit."""
    with pytest.raises(OutOfMemoryError) as info:
        pool.malloc(16 * MiB)
    return info.value


def fields(e: OutOfMemoryError) -> tuple:
    return (e.requested, e.reserved, e.allocated, e.limit, e.largest_free_block, e.fragmentation, e.device, e.reason)


def run_python(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_without_cupy_it_is_a_plain_memory_error_that_pickles():
    out = run_python(
        """
        import pickle, sys
        sys.modules["cupy"] = None  # as if CuPy were not installed: find_spec says so, import fails
        import cupool
        from cupool.errors import OutOfMemoryError
        assert OutOfMemoryError.__bases__ == (cupool.Error, MemoryError), OutOfMemoryError.__mro__
        pool = cupool.Pool("sim", capacity="8MiB")
        try:
            pool.malloc(16 << 20)
        except MemoryError as e:
            back = pickle.loads(pickle.dumps(e))
            assert type(back) is OutOfMemoryError and str(back) == str(e) and back.requested == 16 << 20
        print(sorted(m for m in sys.modules if m.startswith("cupy") and sys.modules[m] is not None))
        """
    )
    assert out.strip() == "[]"  # nothing of CuPy was loaded


def test_a_cupy_that_fails_to_load_leaves_cupool_working(tmp_path):
    broken = tmp_path / "cupy"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise OSError('libcudart.so: cannot open shared object file')\n")
    out = run_python(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import cupool
        print(cupool.OutOfMemoryError.__bases__ == (cupool.Error, MemoryError))
        """
    )
    assert out.strip() == "True"


def test_with_cupy_cupys_handlers_catch_it_and_the_refusal_changes_nothing():
    memory = pytest.importorskip("cupy.cuda.memory", reason="CuPy is not installed")
    assert issubclass(OutOfMemoryError, memory.OutOfMemoryError) and issubclass(OutOfMemoryError, MemoryError)
    pool = cupool.Pool("sim", capacity="8MiB")
    keep = pool.malloc(MiB)
    caught = None
    try:
        pool.malloc(16 * MiB)
    except memory.OutOfMemoryError as e:
        caught = e
    assert type(caught) is OutOfMemoryError
    assert str(caught).startswith("cupool: out of memory on sim: tried to allocate 16 MiB")
    assert caught.args == (str(caught),)
    assert fields(caught)[:4] == (16 * MiB, 2 * MiB, MiB, 8 * MiB)
    assert pool.stats()["allocation.all.current"] == 1 and not keep.freed
    pool.check()


def test_with_cupy_it_pickles_with_its_message_and_fields():
    memory = pytest.importorskip("cupy.cuda.memory", reason="CuPy is not installed")
    pool = cupool.Pool("sim", capacity="8MiB")
    keep = pool.malloc(3 * MiB)
    e = oom(pool)
    assert e.allocated == 3 * MiB and e.limit == 8 * MiB
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is OutOfMemoryError and isinstance(back, memory.OutOfMemoryError)
    assert str(back) == str(e) and fields(back) == fields(e)
    keep.free()


def test_with_cupy_made_by_hand_it_keeps_its_own_message():
    pytest.importorskip("cupy.cuda.memory", reason="CuPy is not installed")
    e = OutOfMemoryError(1000, reserved=2 * MiB, allocated=MiB, limit=None, device="sim", reason="a test")
    assert str(e) == (
        "cupool: out of memory on sim: tried to allocate 1000 B; reserved 2 MiB, allocated 1 MiB, limit none, "
        "largest free block 0 B, fragmentation 0.000 (a test)"
    )


def test_the_cuda_doubles_runtime_error_pickles_with_its_status():
    """Before: ``StandInRuntimeError(status, message)`` had no ``__reduce__``, so pickle and ``copy`` called it
    with the message alone and failed (TypeError), though every cupool error crosses process pools."""
    from cupool.errors import StandInRuntimeError

    e = StandInRuntimeError(2, "cudaErrorMemoryAllocation: out of memory")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is StandInRuntimeError and back.status == 2 and str(back) == str(e)


def test_every_exception_cupool_defines_lives_in_errors_under_one_root():
    """One root, one module: ``except cupool.Error`` catches whatever cupool raises (issue 18)."""
    import ast
    from pathlib import Path

    import cupool.errors

    root = Path(cupool.__file__).parent
    elsewhere = []
    for path in root.rglob("*.py"):
        if path.name == "errors.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if any(b.endswith(("Error", "Exception", "Warning")) or b == "MemoryError" for b in bases):
                    elsewhere.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    assert elsewhere == []
    defined = [v for v in vars(cupool.errors).values() if isinstance(v, type) and issubclass(v, BaseException)]
    assert len(defined) >= 12
    for cls in defined:
        if cls.__module__ == "cupool.errors" and cls is not cupool.errors.Error:
            assert issubclass(cls, cupool.Error), cls


def test_cupool_raises_no_bare_runtime_error():
    """Issue 25: 23 plain ``raise RuntimeError`` escaped ``except cupool.Error``; each is now a subclass
    (a ``RuntimeError`` too, so ``except RuntimeError`` still catches it)."""
    import ast
    from pathlib import Path

    root = Path(cupool.__file__).parent
    bare = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if getattr(target, "id", None) == "RuntimeError":
                    bare.append(f"{path.relative_to(root)}:{node.lineno}")
    assert bare == []


def test_a_call_that_would_deadlock_is_a_cupool_error():
    pool = cupool.Pool("sim", capacity="16MiB")
    with pool.hold():
        with pytest.raises(cupool.errors.DeadlockError, match="would deadlock") as caught:
            pool.malloc(1024)
    assert isinstance(caught.value, (cupool.Error, RuntimeError))
    with pytest.raises(cupool.errors.StateError):
        pool.stop_background_compaction()
