"""Decode ms/step with LoRA adapters served per row, against the base model alone, measured in one run.

A LLaVA-1.5-7B-shaped decoder (random bf16 weights, `mixed_decode.decoder`) on CUDA; 4 adapters of rank 16 on all
four targets (QKV, attention output, fc1, fc2; max_lora_rank 16); prompts of 608 positions, 64 new tokens, greedy,
through the in-flight scheduler with CUDA graphs (`mixed_decode.measure`). Cases: the base model alone (no LoRA
bank); the bank with no adapter rows; 32 rows spread over the 4 adapters (8 each) with the Triton kernels
(`exporter.llm.lora_kernels`, the CUDA path) and with the gathered batched products; batch 1 alone and with an
adapter. Then the LoRA part alone: the 128 LoRA updates of one 32-row decode step (32 layers x 4 projections, random
inputs) captured in one CUDA graph, with the 4 adapters, with every row naming no adapter (the kernels' early exit:
what launching them costs), and each projection's 32 updates alone. Target (issue 22): 32 rows over 4 adapters at
most 1.25x the base model's step. Prints the tables and writes ``$OUT/lora_bench.json``; about 3 minutes on an
H100.

    python bench/lora_bench.py            # CUDA, the real shape
    python bench/lora_bench.py --tiny     # a tiny shape on the CPU: checks that the script runs
"""

from __future__ import annotations

from dataclasses import replace

import torch
from llava_bench import bench_main, timed
from mixed_decode import CONTEXT, FULL, GREEDY, TINY, decoder, measure

from exporter.llm import lora_layers
from exporter.llm.lora_layers import LORA_MODULES, LoraBank, lora_shape
from exporter.llm.model import Decoder
from exporter.runtime.cuda_graphs import capture

ADAPTERS, RANK, ROWS, NEW_TOKENS = 4, 16, 32, 64
TARGET = 1.25


def attach_adapters(model: Decoder, count: int, rank: int) -> list[str]:
    """A LoRA bank on ``model`` with ``count`` random adapters of ``rank`` on every module; their uids."""
    bank = LoraBank(model, tuple(LORA_MODULES), rank, count)
    generator = torch.Generator(model.device).manual_seed(1)
    for index in range(count):
        weights = {}
        for layer in range(model.config.num_layers):
            for module in LORA_MODULES:
                out_features, in_features = lora_shape(model.config, module)
                weights[layer, module] = (
                    torch.randn(rank, in_features, generator=generator, device=model.device) * 0.02,
                    torch.randn(out_features, rank, generator=generator, device=model.device) * 0.02)
        bank.add(f"task{index}", rank, 2.0, weights)
    return bank.uids


def lora_alone_ms(model: Decoder, slots: list[int], modules: tuple[str, ...] = tuple(LORA_MODULES)) -> float:
    """ms the LoRA updates of one decode step take alone: each adapted projection of ``modules`` in every layer on
    random inputs, row ``i`` naming slot ``slots[i]``; on CUDA replayed from one captured graph."""
    device, rows = model.device, len(slots)
    adapters = torch.tensor(slots, device=device)
    generator = torch.Generator(device).manual_seed(2)
    calls = []
    for (_, module), adapted in model.lora.slots.items():
        if module in modules:
            out_features, in_features = lora_shape(model.config, module)
            x = torch.randn(rows, 1, in_features, generator=generator, device=device).to(model.dtype)
            calls.append((adapted, torch.zeros(rows, 1, out_features, device=device, dtype=model.dtype), x))

    def updates() -> None:
        for adapted, y, x in calls:
            adapted(y, x, adapters)

    if device.type != "cuda":
        return timed(updates, device)
    graph, _ = capture(updates, torch.cuda.graph_pool_handle())
    return timed(lambda: [graph.replay() for _ in range(10)], device, reps=7) / 10


def lora_parts(model: Decoder, slots: list[int]) -> dict[str, float]:
    """`lora_alone_ms` with the rows' ``slots``, with no adapter rows, and for each projection alone."""
    parts = {"all": lora_alone_ms(model, slots), "no_adapter_rows": lora_alone_ms(model, [0] * len(slots))}
    parts.update({module: lora_alone_ms(model, slots, (module,)) for module in model.lora.modules})
    return parts


def run(tiny: bool) -> dict:
    device = torch.device("cpu" if tiny else "cuda")
    model = decoder(TINY if tiny else FULL, device, torch.float32 if tiny else torch.bfloat16)
    context, steps = (24, 8) if tiny else (CONTEXT, NEW_TOKENS)
    result: dict = {"device": torch.cuda.get_device_name() if not tiny else "cpu (tiny: timings mean nothing)",
                    "adapters": ADAPTERS, "rank": RANK, "modules": list(LORA_MODULES), "context": context,
                    "new_tokens": steps}

    def step_ms(rows: int, uids: list[str | None] | None = None) -> float:
        requests = [replace(GREEDY, max_output_len=steps)] * rows
        return measure(model, rows, requests, context, steps, uids)["ms_per_step"]

    result["base_bs32"] = step_ms(ROWS)
    result["base_bs1"] = step_ms(1)
    uids = attach_adapters(model, ADAPTERS, RANK)
    spread = [uids[row % ADAPTERS] for row in range(ROWS)]
    result["no_adapter_rows_bs32"] = step_ms(ROWS)
    result["lora_bs32"] = step_ms(ROWS, spread)
    result["lora_bs1"] = step_ms(1, uids[:1])
    slots = [model.lora.acquire(uid) for uid in spread]  # each row's slot (held to the end: nothing is removed)
    result["lora_alone_ms"] = {"default": lora_parts(model, slots)}  # CUDA: the kernels; the CPU: batched
    if device.type == "cuda":
        lora_layers.CUDA_KERNEL = "bmm"
        try:
            result["lora_bs32_bmm"] = step_ms(ROWS, spread)
            result["lora_alone_ms"]["bmm"] = lora_parts(model, slots)
        finally:
            lora_layers.CUDA_KERNEL = "triton"
    return result


def report(result: dict) -> str:
    rows = [("base model alone", 32, "base_bs32", "base_bs32"),
            ("LoRA bank, no adapter rows", 32, "no_adapter_rows_bs32", "base_bs32"),
            (f"{ADAPTERS} adapters x {ROWS // ADAPTERS} rows", 32, "lora_bs32", "base_bs32"),
            (f"{ADAPTERS} adapters, batched products", 32, "lora_bs32_bmm", "base_bs32"),
            ("base model alone", 1, "base_bs1", "base_bs1"),
            ("one adapter", 1, "lora_bs1", "base_bs1")]
    lines = [f"device {result['device']}; {result['adapters']} adapters of rank {result['rank']} on "
             f"{', '.join(result['modules'])}; {result['new_tokens']} new tokens after {result['context']} positions",
             f"{'case':44} {'rows':>4} {'ms/step':>8} {'vs base':>8} {'+ms':>6}"]
    for label, batch, key, base in rows:
        if key in result:
            lines.append(f"{label:44} {batch:>4} {result[key]:>8.2f} {result[key] / result[base]:>8.2f} "
                         f"{result[key] - result[base]:>6.2f}")
    ratio = result["lora_bs32"] / result["base_bs32"]
    lines.append(f"target: {ADAPTERS} adapters over {ROWS} rows <= {TARGET}x the base step: {ratio:.2f}x "
                 f"({'met' if ratio <= TARGET else 'NOT met'})")
    alone = result["lora_alone_ms"]
    parts = list(alone["default"])
    lines.append(f"LoRA updates of one {ROWS}-row step alone, ms (CUDA: one captured graph; default: the kernels "
                 f"on CUDA, the batched products on the CPU):")
    lines.append(f"{'path':8} " + " ".join(f"{part:>15}" for part in parts))
    lines.extend(f"{kind:8} " + " ".join(f"{times[part]:>15.3f}" for part in parts) for kind, times in alone.items())
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main(__doc__, "lora_bench", lambda tiny: run(tiny or not torch.cuda.is_available()), report)
