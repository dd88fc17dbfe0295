"""The project's import graph: no cycles among module-level imports of its packages (imports inside functions,
the lazy ones, and those under `if TYPE_CHECKING:` do not count), no test module imports another, and the GPU
tests import without the serving side's packages."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"exporter": REPO, "deploy": REPO, "query": REPO, "wire": REPO, "tools": REPO, "support": REPO / "tests"}


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of the packages."""
    modules = {}
    for package, parent in PACKAGES.items():
        for path in (parent / package).rglob("*.py"):
            parts = path.relative_to(parent).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(module: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The modules of the packages that `node` in `module` imports (a `from package import submodule` names the
    submodule only: its package is already being imported)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            parts = parts if modules[module].name == "__init__.py" else parts[:-1]
            base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{alias.name}" for alias in node.names]
        names = [name for name in names if name in modules] or [base]
    found = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def _module_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    imports = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            imports += _module_level_imports(node.body) + _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            imports += _module_level_imports(node.body) + _module_level_imports(node.orelse)
            for handler in node.handlers:
                imports += _module_level_imports(handler.body)
    return imports


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    order, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in order:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], order[other])
        if low[node] == order[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                components.append(sorted(component))

    for node in graph:
        if node not in order:
            visit(node)
    return components


def test_the_packages_import_without_cycles():
    modules = _modules()
    graph = {module: {target for node in _module_level_imports(ast.parse(path.read_text()).body)
                      for target in _imported(module, node, modules)}
             for module, path in modules.items()}
    assert len(graph) > 80 and sum(map(len, graph.values())) > 150  # the walk found the tree
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_test_module_imports_another():
    offenders = []
    for path in sorted((REPO / "tests").glob("*.py")):
        imports = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))]
        for node in imports:
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            offenders += [f"{path.name} imports {name}" for name in names
                          if name.split(".")[0].startswith("test_") or name.split(".")[0] == "conftest"]
    assert offenders == []


def test_the_gpu_tests_import_without_the_serving_packages():
    """The GPU test modules (and conftest) import where the serving side's packages are missing, as on a bare GPU
    machine that has torch, transformers and the engine's dependencies only: nothing they import at module level
    reaches PyTriton, Triton's client, PyAV, soundfile, openai or prometheus_client."""
    blocked = ("pytriton", "tritonclient", "av", "openai", "soundfile", "prometheus_client")
    gpu_tests = sorted(path.stem for path in (REPO / "tests").glob("test_*gpu*.py"))
    code = (
        "import importlib.abc, sys\n"
        "class Blocked(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}:\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Blocked())\n"
        f"for name in ['conftest', *{gpu_tests!r}]:\n"
        "    __import__(name)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])})
    assert gpu_tests and done.returncode == 0, done.stderr[-3000:]
