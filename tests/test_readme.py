"""README.md as a newcomer runs it: every file and extra it names exists, and its Python API example, serve command,
queries and curl requests run as written (on free ports and in temporary engine folders) and print what the README
says they print."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from support.ports import free_port
from support.servers import poll_ready, stop_server

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
SERVED_ENGINE, API_ENGINE = "/tmp/demo_engine_served", "/tmp/demo_engine_api"
_PAIR = re.compile(r'"(\w+)":\s*\[?"([\w.-]+)"')  # "key": "value", or "key": ["value", ...]


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.MULTILINE | re.DOTALL)


def _commands(block: str) -> list[tuple[str, str | None]]:
    """A bash block's commands (a command runs on until its quotes close) and the `# output` line after each."""
    commands: list[tuple[str, str | None]] = []
    pending = ""
    for line in block.replace("\\\n", " ").splitlines():
        if not pending and line.startswith("# "):
            if commands and commands[-1][1] is None:
                commands[-1] = (commands[-1][0], line[2:])
            continue
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if pending.strip():
            commands.append((re.sub(r"\s+#\s[^'\"]*$", "", pending).strip(), None))
        pending = ""
    return commands


def _python_outputs(block: str) -> list[str]:
    """The `# output` comments of a Python block's print lines."""
    return [line.rsplit("# ", 1)[1] for line in block.splitlines() if line.startswith("print(") and "# " in line]


def test_every_file_and_install_the_readme_names_exists():
    named = set(re.findall(r"(?<![\w/.-])((?:demo|configs|scripts|tools|docs|tests|\.ci)/[\w./-]*\w)", README))
    named |= {link.split("#")[0] for link in re.findall(r"\]\(([^)#:]+(?:#[\w-]+)?)\)", README)}
    missing = sorted(path for path in named if not (REPO / path).exists())
    assert not missing, f"README names files that do not exist: {missing}"
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for named_extras in re.findall(r'"\.\[([\w,]+)\]"', README):
        assert set(named_extras.split(",")) <= extras, named_extras
    assert "What shape is this?" in README and "What color is the shape?" in README  # the demo's questions
    assert SERVED_ENGINE in README and API_ENGINE in README  # the API example and the server use their own folders


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `python` is this interpreter
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _run(command: str, env: dict[str, str]) -> str:
    done = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done.stdout


def _check_output(command: str, output: str, expected: str | None) -> None:
    """Plain text must match; a JSON line must hold every `"key": "value"` pair the README shows."""
    if expected is None:
        return
    if expected.startswith("{"):
        shown = {pair for pair in _PAIR.findall(expected) if "..." not in pair[1]}  # "..." stands for what varies
        assert shown and shown <= set(_PAIR.findall(output)), (command, output)
    else:
        assert output.strip() == expected, (command, output)


def test_the_python_api_example_runs(tmp_path):
    (block,) = [b for b in _blocks("python") if "TensorRTMMExporter" in b]
    code = block.replace(API_ENGINE, str(tmp_path / "engine"))
    output = _run(f"python - <<'EOF'\n{code}EOF", _environment())
    assert output.splitlines() == _python_outputs(block)


def test_the_serve_query_and_curl_commands_run(tmp_path):
    commands = [command for block in _blocks("bash") for command in _commands(block)]
    (serve,) = [c for c, _ in commands if c.startswith("python scripts/deploy_triton.py")]
    clients = [(c, out) for c, out in commands if c.startswith(("python scripts/query.py", "curl "))]
    assert len(clients) >= 4 and all(out is not None for _, out in clients), clients
    ports = {"8000": free_port(), "8001": free_port(), "9000": free_port()}

    def local(command: str) -> str:
        for port, free in ports.items():
            command = command.replace(f"localhost:{port}", f"localhost:{free}")
        return command

    server_command = serve.replace(SERVED_ENGINE, str(tmp_path / "engine")).replace(
        "--openai_port 9000", f"--openai_port {ports['9000']}")
    server_command += f" --triton_port {ports['8000']} --grpc_port {ports['8001']} --metrics_port {free_port()}"
    env = _environment()
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(["bash", "-c", f"exec {server_command}"], cwd=REPO, env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        try:
            poll_ready(server, f"http://127.0.0.1:{ports['9000']}/v1/health/ready")
        except AssertionError:
            pytest.fail(f"the README's server did not come up:\n{log.read_text()[-4000:]}")
        for command, expected in clients:
            _check_output(command, _run(local(command), env), expected)
        (client_block,) = [b for b in _blocks("python") if "NemoQueryMultimodal" in b]
        output = _run(f"python - <<'EOF'\n{local(client_block)}EOF", env)
        assert output.splitlines() == _python_outputs(client_block)
    finally:
        assert stop_server(server) == 0, log.read_text()[-3000:]
