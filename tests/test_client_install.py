"""Installs that fit the user: every import is declared in the install that needs it and nothing unused is declared;
the base install (the client and its CLI) goes into a fresh venv without torch or Triton's server and queries a
running server."""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest
import tomllib

from support.demo import demo_deployed

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
PROJECT = PYPROJECT["name"]
_PACKAGES = metadata.packages_distributions()
LOCAL = {"exporter", "deploy", "query", "wire", "tools", "support", "deploy_triton"} | {
    path.stem for folder in ("tests", "bench") for path in (REPO / folder).glob("*.py")}
# The install each part of the tree runs in ("" is the base install).
AREAS = {
    "": ["query", "wire", "scripts/query.py", "exporter/__init__.py", "exporter/media_safety.py"],
    "engine": ["exporter"],
    "serve": ["deploy", "scripts/deploy_triton.py"],
    "openai": ["deploy/openai"],
    "onnx": [],
    "test": ["tests", "tools", "bench"],
}
# Imported, but provided by something else than a declared requirement.
PROVIDED = {
    "triton_python_backend_utils": "Triton's Python backend, inside the server",
    "triton": "torch's CUDA builds (the GPU kernels import it under try/except); [test] declares it for the CPU",
    "nemo": "the NeMo reference venvs the audio tests build (tests/support/nemo_reference_env.py)",
}
# Declared, but used through another package rather than imported.
USED_THROUGH = {
    "onnx": "torch.onnx.export writes the ONNX files with it",
    "triton": "the engine's GPU kernels, which the tests run on the CPU under TRITON_INTERPRET=1",
}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _direct(extra: str) -> list[str]:
    """The requirements an install lists itself ("" the base)."""
    return PYPROJECT["optional-dependencies"][extra] if extra else PYPROJECT["dependencies"]


def _requirements(extra: str) -> set[str]:
    """The requirement names of an install: the base plus the extra and the extras it names, transitively."""
    names, todo = {_name(r) for r in _direct("")}, [extra] if extra else []
    while todo:
        for requirement in _direct(todo.pop()):
            if _name(requirement) == PROJECT:
                todo += requirement.split("[", 1)[1].rstrip("]").split(",")
            else:
                names.add(_name(requirement))
    return names


def _imports(paths: list[str]) -> dict[str, list[tuple[str, bool]]]:
    """Third-party top-level modules imported by the files under `paths` (less the folders of other areas inside
    them): module -> [(file, at module level)]."""
    found: dict[str, list[tuple[str, bool]]] = {}
    files = [file for path in paths for file in ((REPO / path).rglob("*.py") if (REPO / path).is_dir()
                                                 else [REPO / path])]
    others = [REPO / path for area in AREAS.values() for path in area if path not in paths]
    for file in [f for f in files if not any(o in f.parents and any(o.is_relative_to(REPO / p) for p in paths)
                                             for o in others)]:
        tree = ast.parse(file.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in {name.split(".")[0] for name in modules} - LOCAL - set(sys.stdlib_module_names):
                found.setdefault(module, []).append((str(file.relative_to(REPO)), id(node) in top_level))
    return found


@functools.cache
def _distributions(module: str) -> frozenset[str]:
    return frozenset(name.lower().replace("_", "-") for name in _PACKAGES.get(module, []))



def test_every_import_is_declared_and_nothing_unused():
    declared_anywhere = set().union(*(_requirements(extra) for extra in AREAS))
    problems = []
    for extra, paths in AREAS.items():
        install = _requirements(extra)
        for module, uses in _imports(paths).items():
            if module in PROVIDED:
                continue
            distributions = _distributions(module)
            if not distributions:
                problems.append(f"{module} (imported by {uses[0][0]}) is no installed distribution")
            elif not distributions & declared_anywhere:
                problems.append(f"{module} (imported by {uses[0][0]}) is not declared")
            elif any(at_top for _, at_top in uses) and not distributions & install:
                file = next(file for file, at_top in uses if at_top)
                problems.append(f"{module}, imported by {file}, is not in the {extra or 'base'} install")
        imported = {dist for module in _imports(paths) for dist in _distributions(module)}
        for requirement in sorted({_name(r) for r in _direct(extra)} - {PROJECT} - imported - set(USED_THROUGH)):
            problems.append(f"{requirement} is declared in [{extra or 'base'}] but nothing there imports it")
    assert not problems, "\n".join(problems)


def _index_reachable() -> bool:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        with urllib.request.urlopen(f"{index}/pip/", timeout=15):
            return True
    except OSError:
        return False


CLIENT_SCRIPT = """
import importlib.util, sys
from query import NemoQueryMultimodal
for absent in ("torch", "pytriton", "transformers", "tritonserver"):
    assert importlib.util.find_spec(absent) is None, absent
import query
assert query.__file__.startswith(sys.prefix), query.__file__
grpc_url, image = sys.argv[1], sys.argv[2]
with NemoQueryMultimodal(grpc_url, "demo", "neva", raw_pixels=True) as client:
    print(client.query("What shape is this?", image, max_output_len=4)[0][0])
print("".join(NemoQueryMultimodal(grpc_url, "demo", "neva").query_stream("What color is the shape?", image,
                                                                          max_output_len=4)))
"""


@pytest.mark.slow
def test_the_client_installs_alone_and_queries_a_server(tmp_path):
    """`pip install nemo-mm-deploy` (the base install) in a fresh venv: no torch, no PyTriton, and the CLI and the
    Python client answer from a running server over HTTP and gRPC (streaming too)."""
    if not _index_reachable():
        pytest.skip("no package index reachable: the client's dependencies cannot be installed")
    source = tmp_path / "source"
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy(REPO / name, source / name)
    for package in ("exporter", "deploy", "query", "wire"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = str(venv / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "--disable-pip-version-check", "-q", str(source)],
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    image = str(REPO / "demo" / "images" / "blue_triangle.png")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    with demo_deployed(tmp_path / "engine", max_batch_size=2, max_output_len=8, streaming=True) as (http, grpc, _):
        cli = subprocess.run([python, str(REPO / "scripts" / "query.py"), "-u", http, "-mn", "demo", "-mt", "neva",
                              "-im", image, "-int", "What color is the shape?", "-mol", "4"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert (cli.returncode, cli.stdout) == (0, "blue\n"), cli.stderr[-3000:]
        client = subprocess.run([python, "-c", CLIENT_SCRIPT, grpc, image], capture_output=True, text=True,
                                timeout=120, cwd=tmp_path, env=env)
        assert (client.returncode, client.stdout) == (0, "triangle\nblue\n"), client.stderr[-3000:]
