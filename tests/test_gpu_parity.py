"""On CUDA (skipped elsewhere): float32 greedy tokens through the scheduler's captured decode steps equal the CPU's,
and bfloat16 logits stay within 2e-2 relative error of float32."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_gpt_weights
from exporter.llm.config import DecoderConfig
from exporter.llm.generate import SamplingParams, generate
from exporter.llm.model import Decoder, select_llm_weights
from exporter.runtime.scheduler import Scheduler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CONFIG = {
    "num_layers": 3, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4, "num_query_groups": 2,
    "activation": "fast-swiglu", "normalization": "rmsnorm", "bias": False, "position_embedding_type": "rope",
    "share_embeddings_and_output_weights": False, "layernorm_epsilon": 1e-5, "max_position_embeddings": 256,
}


def _decoder(device: str, dtype: torch.dtype) -> Decoder:
    weights = {k: v for k, v in make_tiny_gpt_weights(CONFIG, vocab=128, seed=3).items() if not k.endswith(".bias")}
    weights = {k: v * 0.3 for k, v in select_llm_weights(weights).items()}
    return Decoder.from_state_dict(DecoderConfig.from_nemo(CONFIG, vocab_size=128), weights, dtype=dtype,
                                   device=device)


def test_float32_greedy_tokens_equal_the_cpu():
    cpu, gpu = _decoder("cpu", torch.float32), _decoder("cuda", torch.float32)
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 14)]
    params = SamplingParams(max_output_len=20)
    expected = [generate(cpu, [cpu.embed(p)], [p.tolist()], [params])[0][0] for p in prompts]
    scheduler = Scheduler(gpu, max_slots=4, max_seq_len=64, eos_id=None, use_cuda_graphs=True)
    handles = [scheduler.submit(gpu.embed(p.cuda()), p.tolist(), params) for p in prompts]
    while scheduler.step():
        pass
    assert [h.result() for h in handles] == expected
    assert scheduler.decode.graphed.graphs, "the decode steps did not run as CUDA graphs"


def test_bfloat16_logits_within_2e_2_of_float32():
    full, half = _decoder("cuda", torch.float32), _decoder("cuda", torch.bfloat16)
    ids = torch.randint(3, 128, (2, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    reference = full(full.embed(ids)).float()
    error = (half(half.embed(ids)).float() - reference).norm() / reference.norm()
    assert error < 2e-2, f"relative error {error:.3e}"
