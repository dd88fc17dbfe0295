"""On CUDA (skipped elsewhere): LoRA rows in captured decode steps (a late request joining with another adapter)
give what the CPU gives eagerly in float32, token for token; both CUDA products (gathered batched products, Triton
kernels) agree in bf16 at LLaVA-7B's projection shapes."""

from __future__ import annotations

import pytest
import torch

from exporter.llm import lora_layers
from exporter.llm.generate import SamplingParams
from exporter.llm.lora_layers import LORA_MODULES, LoraBank, LoraSlots, lora_shape
from exporter.runtime.scheduler import Scheduler
from support.decoders import PARITY_VOCAB, parity_decoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

UIDS = ["a", "b", None, "a", "b"]


def _with_adapters(device: str):
    model = parity_decoder(device, torch.float32)
    bank = LoraBank(model, tuple(LORA_MODULES), 8, 2)
    generator = torch.Generator().manual_seed(4)
    for uid, rank in (("a", 8), ("b", 3)):
        weights = {}
        for layer in range(model.config.num_layers):
            for module in LORA_MODULES:
                out_features, in_features = lora_shape(model.config, module)
                weights[layer, module] = (torch.randn(rank, in_features, generator=generator) * 0.3,
                                          torch.randn(out_features, rank, generator=generator) * 0.3)
        bank.add(uid, rank, 1.5, weights)
    return model


def _run(model, prompts, graphs: bool, late: int = 3) -> list[list[int]]:
    scheduler = Scheduler(model, max_slots=8, max_seq_len=64, eos_id=None, use_cuda_graphs=graphs)
    if graphs:
        scheduler.warm_up()
    params = SamplingParams(max_output_len=12)
    device = model.device
    handles = [scheduler.submit(model.embed(p.to(device)), p.tolist(), params, lora_uid=uid)
               for p, uid in zip(prompts[:late], UIDS)]
    for _ in range(3):
        scheduler.step()
    handles += [scheduler.submit(model.embed(p.to(device)), p.tolist(), params, lora_uid=uid)
                for p, uid in zip(prompts[late:], UIDS[late:])]
    while scheduler.step():
        pass
    return [handle.result() for handle in handles]


@torch.inference_mode()
def test_lora_rows_in_captured_steps_equal_the_cpu():
    prompts = [torch.randint(3, PARITY_VOCAB, (n,), generator=torch.Generator().manual_seed(n))
               for n in (5, 9, 14, 7, 4)]
    gpu = _with_adapters("cuda")
    graphed = _run(gpu, prompts, graphs=True)
    assert graphed == _run(gpu, prompts, graphs=False)
    assert graphed == _run(_with_adapters("cpu"), prompts, graphs=False)
    assert len({tuple(tokens) for tokens in graphed[:3]}) == 3  # a, b and none answer differently


@pytest.mark.parametrize("shape", ((4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)))
@torch.inference_mode()
def test_both_cuda_products_agree_in_bf16(shape):
    in_features, out_features = shape
    slots = LoraSlots(4, 16, in_features, out_features, torch.bfloat16, torch.device("cuda"))
    generator = torch.Generator("cuda").manual_seed(0)
    for slot, rank in enumerate((16, 8, 16, 4), start=1):
        slots.write(slot, torch.randn(rank, in_features, generator=generator, device="cuda") / in_features**0.5,
                    torch.randn(out_features, rank, generator=generator, device="cuda"), 2.0)
    adapters = torch.arange(32, device="cuda") % 5
    x = torch.randn(32, 1, in_features, generator=generator, device="cuda").bfloat16()
    y = torch.randn(32, 1, out_features, generator=generator, device="cuda").bfloat16()
    batched, kernels = slots.batched(y, x, adapters), slots.kernels(y, x, adapters)
    torch.testing.assert_close(kernels.float(), batched.float(), rtol=2e-2, atol=5e-2)
    assert torch.equal(kernels[0], y[0]) and torch.equal(batched[5], y[5])
    lora_layers.CUDA_KERNEL = "triton"
    try:
        assert torch.equal(slots(y, x, adapters), kernels)
    finally:
        lora_layers.CUDA_KERNEL = None
