"""The package's shape: imports flow one way, and no module uses another's private names.

Read from the source with ``ast`` (nothing is imported), so a lazy import inside a
function counts as much as one at the top: a cycle through a late import is still
a cycle in the design.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "cupool"
KERNELS = ROOT / "kernels"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        parts = ["cupool", *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    for path in sorted(KERNELS.rglob("*.py")):
        rel = path.relative_to(KERNELS).with_suffix("")
        parts = ["cupool", "kernels", *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(mod: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _target(name: str) -> str | None:
    """The cupool module an import of ``name`` lands in (the longest known prefix)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    """``path`` parsed, once for all of this module's tests (they walk every module: parsing was most of their time)."""
    return ast.parse(path.read_text(), str(path))


def _imports(mod: str, path: Path):
    """(imported module, imported names) for every cupool import in ``mod``, lazy ones included."""
    tree = _tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _resolve(mod, path, node)
            if not src.startswith("cupool"):
                continue
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                if sub in MODULES:  # `from . import hooks`: the module itself
                    yield sub, []
                else:
                    t = _target(src)
                    if t is not None:
                        yield t, [alias.name]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("cupool"):
                    t = _target(alias.name)
                    if t is not None:
                        yield t, []


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for target, _ in _imports(mod, path):
            if target != mod and not mod.startswith(target + ".") and target != "cupool":
                graph[mod].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_no_module_imports_another_modules_private_names():
    bad = []
    for mod, path in MODULES.items():
        for target, names in _imports(mod, path):
            if target == mod:
                continue
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    bad.append(f"{mod} imports {name} from {target}")
            if target.rpartition(".")[2].startswith("_") and not target.endswith("__init__"):
                # a private module may be used by its own package only
                owner = target.rpartition(".")[0]
                if not (mod == owner or mod.startswith(owner + ".")):
                    bad.append(f"{mod} imports the private module {target}")
    assert bad == []


def _own_private_names(tree: ast.AST) -> set[str]:
    """Underscore names a module defines itself: methods, classes, functions, attributes, slots."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_"):
            own.add(node.value)  # __slots__ entries
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
    return own


def _private_attribute_uses(path: Path) -> list[str]:
    """``x._name`` where ``_name`` is not one this module defines (it belongs to another module)."""
    tree = _tree(path)
    own = _own_private_names(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr in own:
                continue
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return out


#: Objects of other libraries whose underscore names are the documented way in.
_FOREIGN = {
    "._getframe",  # sys._getframe: the cheap way to find the allocating line
    "._memory_viz",  # torch.cuda._memory_viz, PyTorch's own snapshot renderer
    "._get_thread_local_allocator",  # cupy.cuda.memory: the only way to see using_allocator
    "._memory_manager",  # numba's driver: where its EMM plugin is kept
    "._record_memory_history",
    "._dump_snapshot",
    "._snapshot",
    "._C",  # torch._C: a CUDA build has the _cuda_customAllocator CUDAPluggableAllocator calls, a CPU one not
    "._exit",  # os._exit: how a nanny's child whose start failed ends (cupool.dask.dask_setup)
}


def test_no_module_reaches_into_another_objects_private_attributes():
    bad = []
    for path in MODULES.values():
        for use in _private_attribute_uses(path):
            if not any(use.endswith(f) for f in _FOREIGN):
                bad.append(use)
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_modules_stay_small(mod):
    lines = MODULES[mod].read_text().count("\n")
    assert lines <= 650, f"{mod} has {lines} lines"
