"""Compiles cupool's fast path and its CuPy memory object with Cython, and PyTorch's allocator shim.

Everything else about the package (its name, packages, dependencies) is in
pyproject.toml; this file only adds the compiled modules, because setuptools takes
extension modules from ``setup()`` alone.

Which modules are compiled (dotted names, wherever they live), and the names of
the files a build leaves beside each one, are read from ``cupool/core/__init__.py``
(without importing cupool, whose dependencies a build does not have), so that the
build and the run-time choice of path read one list.  A module is built from its
``.py`` (the same file runs uncompiled) or its ``.pyx`` (compiled only), in the
list's order; it may cimport the modules listed before it.  A ``.cpp`` module
(written by hand, compiled only) goes to the C++ compiler as it is.  For each module the
build leaves, beside where the extension goes, either the extension and
``<extension>.source-sha256`` (the hash of the sources it was compiled from: at
import, an edited source is never shadowed silently by an older build), or
``<extension>.build-error`` saying why there is no extension (a line, then details).

Compiling is optional: without Cython, without a working C compiler, or when Cython
rejects the source, the install still succeeds, says so once on stderr (pip shows
it with ``-v``), and cupool runs uncompiled; ``cupool info`` gives the reason.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import io
import os
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CORE = ROOT / "cupool" / "core"


def _core_constants() -> dict[str, object]:
    """The literal constants that ``cupool/core/__init__.py`` assigns at its top level."""
    tree = ast.parse((CORE / "__init__.py").read_text(), "cupool/core/__init__.py")
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:  # not a literal: not one of the constants read here
                continue
    return out


_CONST = _core_constants()
MODULES = tuple(str(name) for name in _CONST["COMPILED_MODULES"])
SOURCE_SUFFIXES = tuple(str(s) for s in _CONST["SOURCE_SUFFIXES"])
SOURCE_HASH = str(_CONST["SOURCE_HASH_SUFFIX"])
BUILD_ERROR = str(_CONST["BUILD_ERROR_SUFFIX"])


def module_source(dotted: str) -> Path | None:
    """The ``.py``, ``.pyx`` or ``.cpp`` a listed module is built from (as cupool.core.module_source), if written."""
    base = ROOT.joinpath(*dotted.split("."))
    for suffix in SOURCE_SUFFIXES:
        if base.with_suffix(suffix).exists():
            return base.with_suffix(suffix)
    return None


def source_sha256(dotted: str, source: Path) -> str:
    """The hash cupool/core/__init__.py compares at import: the source, its augmenting .pxd if any,
    then the .pxd of each module listed before it (which it may cimport; a C++ source cimports none)."""
    h = hashlib.sha256(source.read_bytes())
    earlier = MODULES[:MODULES.index(dotted)] if source.suffix != ".cpp" else ()
    for pxd in [source.with_suffix(".pxd")] + [ROOT.joinpath(*d.split(".")).with_suffix(".pxd") for d in earlier]:
        if pxd.exists():
            h.update(pxd.read_bytes())
    return h.hexdigest()


def _warn(message: str) -> None:
    print(f"WARNING: cupool: {message}", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """``build_ext`` that cythonizes each module itself and never fails the install.

    A module that does not build leaves a ``.build-error`` note (and no extension)
    instead; one that builds leaves its source's hash.  Both are written beside the
    built extension and, in an in-place or editable build, beside the source too.
    """

    def run(self) -> None:
        # full module name -> (built?, the source's hash when built, else why not)
        self._outcome: dict[str, tuple[bool, str]] = {}
        try:
            super().run()
        except Exception as exc:  # a failure outside any one module: nothing more is built, say why
            for ext in self.extensions:
                self._outcome.setdefault(ext.name, (False, f"the build failed\n{exc}"))
        failed = [f"{name}: {text.splitlines()[0]}" for name, (ok, text) in self._outcome.items() if not ok]
        if failed:
            _warn(f"not compiled, cupool will run uncompiled (slower): {'; '.join(failed)} (the {BUILD_ERROR} "
                  "file beside each module says more)")
        self._leave_notes()

    def build_extension(self, ext: Extension) -> None:
        if ext.sources[0].endswith(".cpp"):  # C++ written by hand: no Cython
            # Always compiled, as the Cython modules are: an extension an earlier build left in
            # build/ (made with other compilers or flags) would otherwise count as up to date.
            self.force = True
            self._compile(ext, source_sha256(ext.name, ROOT / ext.sources[0]))
            return
        try:
            from Cython.Build import cythonize
        except ImportError:
            self._outcome[ext.name] = (False, "Cython is not installed (pip install cython, then reinstall cupool)")
            return
        digest = source_sha256(ext.name, ROOT / ext.sources[0])
        messages = io.StringIO()
        try:  # force: a C file left in build/ by an earlier build may look newer than an edited source
            with contextlib.redirect_stderr(messages):
                (cext,) = cythonize([ext], build_dir=os.path.join(self.build_temp, "cython"), quiet=True,
                                    force=True, compiler_directives={"language_level": "3"},
                                    include_path=[str(ROOT)])  # a module cimports those listed before it
        except Exception:  # Cython rejected the source: its messages say where
            self._outcome[ext.name] = (False, f"Cython could not compile {ext.sources[0]}\n{messages.getvalue()}")
            return
        finally:
            sys.stderr.write(messages.getvalue())
        ext.sources = cext.sources  # the generated C file; ext keeps what setuptools set on it
        self._compile(ext, digest)

    def _compile(self, ext: Extension, digest: str) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # CompileError, LinkError, a missing compiler (DistutilsExecError)
            self._outcome[ext.name] = (False, self._compiler_failure(exc))
            return
        self._outcome[ext.name] = (True, digest)

    def _compiler_failure(self, exc: Exception) -> str:
        """Why compiling failed: no working C compiler at all, or this module (a bug to report)."""
        with tempfile.TemporaryDirectory() as tmp:
            probe = os.path.join(tmp, "probe.c")
            Path(probe).write_text("int cupool_probe(void) { return 0; }\n")
            try:
                self.compiler.compile([probe], output_dir=tmp)
            except Exception:
                return f"no working C compiler\n{exc}"
        return f"the C compiler failed on this module\n{exc}"

    def _leave_notes(self) -> None:
        """The hash or the reason, beside the extension (and in place); no extension from an older build."""
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            name = self.get_ext_fullname(ext.name)
            built = os.path.join(self.build_lib, self.get_ext_filename(name))
            folders = {os.path.dirname(built)}
            if self.inplace:
                folders.add(build_py.get_package_dir(name.rpartition(".")[0]))
            ok, text = self._outcome.get(ext.name, (False, "not built"))
            for folder in folders:
                os.makedirs(folder, exist_ok=True)
                base = os.path.join(folder, os.path.basename(built))
                for old in [base + SOURCE_HASH, base + BUILD_ERROR] + ([] if ok else [base]):
                    if os.path.exists(old):
                        os.remove(old)
                Path(base + (SOURCE_HASH if ok else BUILD_ERROR)).write_text(text + "\n")


def _extensions() -> list[Extension]:
    """One extension per listed module whose source exists (a listed module may not be written yet)."""
    out = []
    for dotted in MODULES:
        source = module_source(dotted)
        if source is not None:
            cpp = source.suffix == ".cpp"  # linked as C++, so the C++ runtime (exceptions) comes with it
            out.append(Extension(dotted, [source.relative_to(ROOT).as_posix()], optional=True,
                                 language="c++" if cpp else None))
    return out


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
