"""LoRA adapters behind real servers on loopback: Triton's `lora_uids` (raw HTTP JSON and `NemoQueryMultimodal`),
the OpenAI front's `model: "<name>:<uid>"`, and `deploy_triton.py --lora_checkpoint_path` with `query.py
--lora_task_uids`. Answers are checked token for token against transformers with each adapter merged (test_lora.py
checks the same engine in process)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from deploy import DeployPyTriton
from deploy.openai import OpenAIServer, create_app
from exporter import TensorRTMMExporter
from query import NemoQueryMultimodal, QueryError
from support.lora import nemo_config, with_adapter, write_adapter
from support.media import data_url, random_image
from support.neva_reference import reference_tokens
from support.openai_front import assert_error_object, chat, client
from support.ports import free_port
from support.servers import (
    REPO,
    assert_short_error,
    http_infer,
    json_tensor,
    poll_ready,
    post,
    stop_server,
    wait_until_ready,
)
from support.tokenizer_files import tokenizer_file
from support.vlm import build_vlm

MODEL = "neva"
QUESTION = "describe the image"
STEPS = 8
LIMITS = {"max_batch_size": 4, "max_input_len": 256, "max_output_len": 16, "max_multimodal_len": 4 * 16}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(exporter, Triton HTTP URL, OpenAI base URL, expected answer per uid, image PNG, adapters) of a tiny Neva
    exported with adapters "a" and "b" and served in this process; adapter "c" is left for the script test."""
    root = tmp_path_factory.mktemp("lora_serving")
    vlm = build_vlm(root / "vlm", tokenizer_file(root))
    config = nemo_config(vlm)
    adapters = {"a": write_adapter(root / "a", config, seed=21, rank=4, alpha=8.0),
                "b": write_adapter(root / "b", config, seed=22, rank=2, alpha=None, tp_size=2),
                "c": write_adapter(root / "c", config, seed=23, rank=4, alpha=4.0)}
    exporter = TensorRTMMExporter(root / "engine", device="cpu")
    exporter.export(vlm.nemo, model_type="neva", dtype="float32", **LIMITS,
                    lora_checkpoint_path=f"a:{adapters['a'].path},b:{adapters['b'].path}")
    image = random_image(5)
    tokenizer = exporter.engine.tokenizer
    expected = {uid: tokenizer.decode(reference_tokens(with_adapter(vlm, adapters.get(uid)), QUESTION, image,
                                                       STEPS)).strip()
                for uid in ("a", "b", "c", None)}
    assert len(set(expected.values())) == 4  # each adapter changes the answer: the checks below can fail
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    http_port = free_port()
    deployer = DeployPyTriton(exporter, MODEL, max_batch_size=4, http_port=http_port, grpc_port=free_port(),
                              address="127.0.0.1")
    deployer.deploy()
    openai_server = OpenAIServer(create_app(exporter, MODEL), host="127.0.0.1", port=free_port())
    try:
        deployer.run()
        openai_server.start()
        yield exporter, f"127.0.0.1:{http_port}", openai_server.url, expected, buffer.getvalue(), adapters
    finally:
        openai_server.stop()
        deployer.stop()


def _rows(uids: list[list[str]], png: bytes) -> list[dict]:
    """A raw Triton request: one prompt per entry of `uids`, each row carrying that entry as its lora_uids."""
    url = data_url(png)
    rows = len(uids)
    return [json_tensor("input_text", np.array([[QUESTION.encode()]] * rows, dtype=object)),
            json_tensor("input_media_bytes", np.array([[url.encode()]] * rows, dtype=object)),
            json_tensor("max_output_len", np.full((rows, 1), STEPS, dtype=np.int64)),
            json_tensor("lora_uids", np.array([[uid.encode() for uid in row] for row in uids], dtype=object))]


def _outputs(body: dict) -> list[str]:
    (output,) = body["outputs"]
    return output["data"]


def test_triton_lora_uids_per_row_and_nemo_style(served):
    """One uid per row, or NeMo's list of one uid per prompt in every row; "-1" is no adapter."""
    _, http_url, _, expected, png, _ = served
    want = [expected["a"], expected["b"], expected[None]]
    status, body = http_infer(http_url, MODEL, _rows([["a"], ["b"], ["-1"]], png))
    assert status == 200 and _outputs(body) == want, body
    status, body = http_infer(http_url, MODEL, _rows([["a", "b", "-1"]] * 3, png))
    assert status == 200 and _outputs(body) == want, body


def test_triton_unknown_uid_fails_alone_with_a_short_error(served):
    _, http_url, _, expected, png, _ = served
    status, body = http_infer(http_url, MODEL, _rows([["nope"]], png))
    assert status == 400
    assert_short_error(body["error"])
    assert "unknown LoRA adapter 'nope'; served adapters: 'a', 'b'" in body["error"]
    status, body = http_infer(http_url, MODEL, _rows([["a", "b"]] * 3, png))
    assert status == 400 and "lora_uids holds 2 uids for 3 prompts" in body["error"]
    status, body = http_infer(http_url, MODEL, _rows([["b"]], png))
    assert status == 200 and _outputs(body) == [expected["b"]]


def test_the_client_sends_one_uid_per_prompt(served):
    _, http_url, _, expected, png, _ = served
    image = Image.open(io.BytesIO(png))
    with NemoQueryMultimodal(http_url, MODEL, "neva") as query:
        answers = query.query([QUESTION] * 3, image, max_output_len=STEPS, lora_uids=["b", "-1", "a"])
        assert answers.tolist() == [[expected["b"]], [expected[None]], [expected["a"]]]
        assert query.query(QUESTION, image, max_output_len=STEPS, lora_uids=["a"]).tolist() == [[expected["a"]]]
        with pytest.raises(QueryError, match="unknown LoRA adapter 'c'"):
            query.query(QUESTION, image, max_output_len=STEPS, lora_uids=["c"])


def test_openai_model_names_the_adapter(served):
    _, _, url, expected, png, _ = served
    assert [model.id for model in client(url).models.list()] == [MODEL, f"{MODEL}:a", f"{MODEL}:b"]
    for uid in ("a", "b", None):
        model = MODEL if uid is None else f"{MODEL}:{uid}"
        answer = chat(url, QUESTION, png, model=model, max_tokens=STEPS)
        assert answer.choices[0].message.content == expected[uid] and answer.model == model
    status, body = post(f"{url}/chat/completions", {"model": f"{MODEL}:zzz", "messages": [
        {"role": "user", "content": QUESTION}]})
    assert_error_object(status, body, 404, "neva:zzz", "'neva:a'")
    assert body["error"]["code"] == "model_not_found"


def test_deploy_script_adds_adapters_to_a_served_engine_and_query_names_them(served, tmp_path):
    """`deploy_triton.py` serving the exported repository with `-lcp c:<path>` serves a, b and c; `query.py -lt`
    picks one; the OpenAI front lists all three."""
    exporter, _, _, expected, png, adapters = served
    (tmp_path / "image.png").write_bytes(png)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    http_port, openai_port = free_port(), free_port()
    deploy = [sys.executable, str(REPO / "scripts/deploy_triton.py"), "-tmn", MODEL, "-tmr", str(exporter.model_dir),
              "-trp", str(http_port), "--grpc_port", str(free_port()), "--metrics_port", str(free_port()),
              "-mbs", "2", "--device", "cpu", "--openai_port", str(openai_port),
              "-lcp", f"c:{adapters['c'].path}"]
    server = subprocess.Popen(deploy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_ready(f"127.0.0.1:{http_port}", MODEL, server)
        url = f"http://127.0.0.1:{openai_port}/v1"
        poll_ready(server, url + "/health/ready")
        assert [model.id for model in client(url).models.list()] == [MODEL, f"{MODEL}:a", f"{MODEL}:b",
                                                                      f"{MODEL}:c"]
        for uid in ("c", "a"):
            answer = subprocess.run([sys.executable, str(REPO / "scripts/query.py"), "-u", f"127.0.0.1:{http_port}",
                                     "-mn", MODEL, "-mt", "neva", "-im", str(tmp_path / "image.png"), "-int",
                                     QUESTION, "-mol", str(STEPS), "-lt", uid], env=env, capture_output=True,
                                    text=True, timeout=120)
            assert answer.returncode == 0, answer.stderr
            assert answer.stdout.strip() == expected[uid]
        failed = subprocess.run([sys.executable, str(REPO / "scripts/query.py"), "-u", f"127.0.0.1:{http_port}",
                                 "-mn", MODEL, "-mt", "neva", "-int", QUESTION, "-mol", "4", "-lt", "zzz"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert failed.returncode == 1 and "unknown LoRA adapter 'zzz'" in failed.stderr
    finally:
        stop_server(server, 120)
    assert server.returncode == 0, server.stderr.read()
