"""Tensor parallel on the CPU: the split's math against NeMo's own TP shards, a split decoder in two gloo processes
against the whole one, and deploy_triton.py --num_gpus 2 serving the tokens TP=1 gives, from a TP=2-sharded .nemo
and from an unsharded one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from exporter import TensorRTMMExporter
from exporter.checkpoint import NemoCheckpoint
from exporter.engine.errors import EngineError
from exporter.llm.config import DecoderConfig, QuantConfig
from exporter.llm.model import Decoder, select_llm_weights
from exporter.llm.tensor_parallel import (
    MULTICAST_OFF,
    Shard,
    TensorParallel,
    adopt_nemo_shard,
    check_tensor_parallel,
    split_weights,
)
from query import NemoQueryMultimodal
from support.decoders import make_tiny_gpt_weights
from support.media import random_image
from support.ports import free_port
from support.servers import poll_ready, stop_server
from support.tokenizer_files import tokenizer_file
from support.vlm import build_vlm
from tools.nemo_writer import write_nemo

REPO = Path(__file__).resolve().parents[1]
QUESTION = "What is in the picture?"


def _gpt_config(**overrides) -> dict:
    config = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 48, "num_attention_heads": 8,
              "num_query_groups": 4, "kv_channels": 4, "activation": "fast-swiglu", "normalization": "rmsnorm",
              "bias": True, "position_embedding_type": "rope", "rotary_percentage": 1.0, "rotary_base": 10000,
              "share_embeddings_and_output_weights": False, "layernorm_epsilon": 1e-5,
              "max_position_embeddings": 128, "tokenizer": {"library": "sentencepiece", "model": "tokenizer.model"}}
    return {**config, **overrides}


def _tied(weights: dict) -> dict:
    return {k: v for k, v in weights.items() if k != "output_layer.weight"}


@pytest.mark.parametrize("mcore,activation", [(True, "fast-swiglu"), (False, "swiglu"), (True, "gelu")])
def test_split_equals_nemo_tp_shards(tmp_path, mcore, activation):
    """Each rank's part split from the whole weights equals the same rank's file of NeMo's TP=2 checkpoint,
    read alone (gated fc1 `[gate_r; up_r]`, per-group QKV rows, proj/fc2 columns, head rows, tied weights)."""
    cfg = _gpt_config(activation=activation, share_embeddings_and_output_weights=activation == "gelu")
    whole = make_tiny_gpt_weights(cfg)
    whole = {k: v for k, v in whole.items() if "mm_projector" not in k}
    if cfg["share_embeddings_and_output_weights"]:
        whole = _tied(whole)
    nemo = write_nemo(tmp_path / "m.nemo", cfg, whole, tp_size=2, mcore=mcore)
    checkpoint = NemoCheckpoint(nemo)
    assert checkpoint.layout == "tp_shards" and checkpoint.tp_size == 2
    merged = checkpoint.state_dict()
    config = DecoderConfig.from_nemo(checkpoint.config, vocab_size=64)
    for rank in range(2):
        shard = Shard(rank, 2)
        split = dict(split_weights(merged, config, shard))
        adopted = dict(adopt_nemo_shard(checkpoint.rank_state_dict(rank), merged["embedding.word_embeddings.weight"],
                                        config, shard))
        assert split.keys() == adopted.keys()
        for name in split:
            torch.testing.assert_close(split[name], adopted[name], rtol=0, atol=0, msg=name)
        assert ("embedding.word_embeddings.weight" in split) == (rank == 0)
        bias = split["decoder.layers.0.mlp.linear_fc2.bias"]
        assert bool(bias.any()) == (rank == 0)  # row-parallel biases: rank 0's, added once after the sum
        Decoder.from_state_dict(config, split, shard=shard)  # names and shapes fit the rank's decoder


def test_refusals():
    config = DecoderConfig.from_nemo(_gpt_config(), vocab_size=64)
    with pytest.raises(ValueError, match="must divide the model's num_query_groups"):
        check_tensor_parallel(config, 8)
    with pytest.raises(ValueError, match="must divide the model's num_attention_heads"):
        check_tensor_parallel(DecoderConfig.from_nemo(_gpt_config(num_attention_heads=6, num_query_groups=6),
                                                      vocab_size=64), 4)
    from dataclasses import replace

    with pytest.raises(ValueError, match="does not support quantized weights"):
        check_tensor_parallel(replace(config, quantization=QuantConfig("int8_wo")), 2)
    check_tensor_parallel(config, 4)
    with pytest.raises(RuntimeError, match="runs only in its group"):
        whole = select_llm_weights(make_tiny_gpt_weights(_gpt_config()))
        part = Decoder.from_state_dict(config, dict(split_weights(whole, config, Shard(0, 2))), shard=Shard(0, 2))
        part(torch.zeros(1, 3, 32))


def _rank_logits(rank: int, port: int, config: DecoderConfig, whole: dict, embeds: torch.Tensor, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shard = Shard(rank, 2)
    model = Decoder.from_state_dict(config, dict(split_weights(whole, config, shard)), shard=shard)
    model.tp = TensorParallel(shard, dist.group.WORLD, None)
    with torch.inference_mode():
        logits = model(embeds)
    torch.save(logits, out / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("overrides", [
    {},
    {"normalization": "layernorm", "activation": "gelu", "position_embedding_type": "learned_absolute",
     "share_embeddings_and_output_weights": True},
    {"name": "megatron_falcon_gpt", "mcore_customization_config": {"parallel_attention": True},
     "normalization": "layernorm", "activation": "gelu", "bias": False},
])
def test_split_decoder_in_two_gloo_processes(tmp_path, overrides):
    """A decoder split over two gloo processes gives the whole decoder's float32 logits (a vocabulary of 63: the
    head padded to 2 x 32 rows, the padding cut). Seeded: the sums of the two ranks round differently from the
    whole decoder's, by up to ~2e-5 on some random draws."""
    torch.manual_seed(0)
    cfg = _gpt_config(**overrides)
    weights = select_llm_weights(make_tiny_gpt_weights(cfg, vocab=63))
    if cfg["share_embeddings_and_output_weights"]:
        weights = _tied(weights)
    if cfg.get("mcore_customization_config"):
        weights = {k: v for k, v in weights.items() if "pre_mlp_layernorm" not in k and not k.endswith("bias")}
        weights.update({f"decoder.layers.{i}.input_layernorm.bias": torch.randn(32) for i in range(2)})
    if cfg["normalization"] == "layernorm":
        weights.update({k.replace(".weight", ".bias"): torch.randn(32) for k in list(weights)
                        if k.endswith("layernorm.weight") and k.replace(".weight", ".bias") not in weights})
    if cfg["position_embedding_type"] == "learned_absolute":
        weights["embedding.position_embeddings.weight"] = torch.randn(128, 32)
    config = DecoderConfig.from_nemo(cfg, vocab_size=63)
    whole = Decoder.from_state_dict(config, weights)
    embeds = whole.embed(torch.tensor([[5, 9, 2, 40, 62, 7]]))
    expected = whole(embeds)
    mp.start_processes(_rank_logits, args=(free_port(), config, weights, embeds, tmp_path), nprocs=2,
                       start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.shape == expected.shape == (1, 6, 63)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_export_checks(tmp_path):
    vlm = build_vlm(tmp_path / "m", tokenizer_file(tmp_path))
    exporter = TensorRTMMExporter(tmp_path / "engine", device="cpu", load_model=False)
    with pytest.raises(EngineError, match="must divide the model's num_attention_heads"):
        exporter.export(vlm.nemo, model_type="neva", dtype="float32", tensor_parallel_size=3, load_model=False)
    with pytest.raises(EngineError, match="neither quantized weights nor LoRA adapters"):
        exporter.export(vlm.nemo, model_type="neva", dtype="float32", tensor_parallel_size=2, load_model=False,
                        quantization="int8_wo")
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        exporter.export(vlm.nemo, model_type="neva", tensor_parallel_size=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same tiny Neva as one weights file and as NeMo's TP=2 shards, and TP=1's answers (float32, greedy)."""
    root = tmp_path_factory.mktemp("tp")
    sp = tokenizer_file(root)
    plain = build_vlm(root / "plain", sp)
    sharded = build_vlm(root / "sharded", sp, tp_size=2)
    images = [np.asarray(random_image(seed)) for seed in range(3)]
    reference = TensorRTMMExporter(root / "tp1", device="cpu")
    reference.export(plain.nemo, model_type="neva", dtype="float32", max_batch_size=2, max_input_len=256,
                     max_output_len=12, max_multimodal_len=64)
    expected = [reference.forward([QUESTION], [image], max_output_len=12)[0][0] for image in images]
    reference.close()
    return root, plain.nemo, sharded.nemo, images, expected


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def _rank_processes(server: subprocess.Popen) -> list[int]:
    return [pid for pid in _children(server.pid)
            if b"exporter.runtime.tensor_parallel" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _gone(pids: list[int], timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in pids):
            return True
        time.sleep(0.2)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.parametrize("source,device", [
    ("sharded", "cpu"), ("unsharded", "cpu"), ("exported", "cpu"),
    pytest.param("sharded", "cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                             reason="needs 2 GPUs (nvidia-h200-x2)")),
])
def test_deploy_triton_num_gpus_2_serves_tp1_tokens(checkpoints, source, device):
    """deploy_triton.py --num_gpus 2: a real PyTriton server over two ranks (gloo processes on the CPU, or NCCL on
    two GPUs) answers as TP=1 on the CPU, token for token, exporting a TP=2-sharded .nemo or an unsharded one, or
    serving the exported engine (at its own size, no --num_gpus); the other rank runs with NVLink multicast off, and
    dies with the server (SIGINT, or SIGKILL); when it dies first, the server stops."""
    root, plain, sharded, images, expected = checkpoints
    repository = root / f"repo-{source}-{device}"
    if source == "exported":
        TensorRTMMExporter(repository, device="cpu", load_model=False).export(
            plain, model_type="neva", dtype="float32", max_batch_size=2, max_input_len=256, max_output_len=12,
            max_multimodal_len=64, tensor_parallel_size=2, load_model=False)
    http_port, grpc_port = free_port(), free_port()
    export = [] if source == "exported" else \
        ["-vc", str(sharded if source == "sharded" else plain), "-mt", "neva", "--num_gpus", "2"]
    command = [sys.executable, str(REPO / "scripts/deploy_triton.py"), *export, "-tmn", "tiny", "-tmr",
               str(repository), "-dt", "float32", "-mbs", "2", "-mil", "256", "-mol", "12", "-mml", "64", "-trp",
               str(http_port), "--grpc_port", str(grpc_port), "-tha", "127.0.0.1", "--device", device]
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log = root / f"server-{source}-{device}.log"
    with log.open("w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        poll_ready(server, f"http://127.0.0.1:{http_port}/v2/models/tiny/ready", timeout_s=240)
        client = NemoQueryMultimodal(f"127.0.0.1:{http_port}", "tiny", "neva")
        answers = [client.query(QUESTION, image, max_output_len=12)[0][0] for image in images]
        ranks = _rank_processes(server)
        assert len(ranks) == 1
        environment = Path(f"/proc/{ranks[0]}/environ").read_bytes().split(b"\0")
        for name, value in MULTICAST_OFF.items():
            assert f"{name}={value}".encode() in environment
        if source == "exported":
            os.kill(ranks[0], signal.SIGKILL)
            assert server.wait(timeout=60) == 1
            assert "the model cannot run without it" in log.read_text()
    finally:
        if server.poll() is None and source != "unsharded":
            assert stop_server(server, 60) == 0, log.read_text()[-3000:]
        elif server.poll() is None:
            server.send_signal(signal.SIGKILL)
            server.wait()
    assert answers == expected, log.read_text()[-3000:]
    assert _gone(ranks), "the other rank outlived the server"
    files = sorted(path.name for path in (repository / "llm_engine").glob("*.safetensors"))
    assert files == ["model.rank0.safetensors", "model.rank1.safetensors"]
    assert '"tensor_parallel_size": 2' in (repository / "manifest.json").read_text()


def test_in_process_batch_and_beams_as_tp1(checkpoints, monkeypatch):
    """TensorRTMMExporter over a TP=2 engine (its other rank a child process) answers a batch of two images and a
    beam search as TP=1; the export read the sharded .nemo rank by rank (the LLM's tensors never merged)."""
    root, plain, sharded, images, _ = checkpoints
    read_ranks = []
    original = NemoCheckpoint.rank_state_dict
    monkeypatch.setattr(NemoCheckpoint, "rank_state_dict",
                        lambda self, rank, select=None: read_ranks.append(rank) or original(self, rank, select))
    options = dict(model_type="neva", dtype="float32", max_batch_size=2, max_input_len=256, max_output_len=24,
                   max_multimodal_len=128, max_beam_width=2)
    answers = {}
    for size, source in ((1, plain), (2, sharded)):
        exporter = TensorRTMMExporter(root / f"beams-tp{size}", device="cpu")
        exporter.export(source, tensor_parallel_size=size, **options)
        try:
            answers[size] = (exporter.forward([QUESTION] * 2, images[:2], max_output_len=8),
                             exporter.forward([QUESTION], images[2:], max_output_len=24, num_beams=2))
        finally:
            exporter.close()
    assert read_ranks == [0, 1]
    assert answers[2] == answers[1]


def test_tp_bench_runs_tiny(tmp_path):
    """bench/tp_bench.py at its tiny shape over two gloo processes, through the scheduler: the table, and TP=2's
    tokens equal TP=1's."""
    env = {**os.environ, "OUT": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(REPO / "bench/tp_bench.py"), "--tiny", "--check_tokens", "16"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TP=2" in done.stdout and "16/16" in done.stdout, done.stdout
    result = json.loads((tmp_path / "tp_bench.json").read_text())["runs"]["TP=2"]
    assert result["equal_prefix"] == "16/16" and result["ms"] > 0 and result["peer_all_reduce"] is False
