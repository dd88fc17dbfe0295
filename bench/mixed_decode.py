"""Decode ms/step through the in-flight scheduler for batches that mix greedy, sampled and beam-search rows.

A Llama-2-7B-shaped decoder (random bf16 weights, vocab 32064) on CUDA; prompts of 608 positions (LLaVA-1.5's image
+ 32 tokens), 128 new tokens. Each mix fills ``rows`` KV rows and runs to the end; ms/step is the steady time over
the decode steps launched. Also printed: the share of steps queued before the host read the one before, and the
plain-greedy step time as ``bench/llava_bench.py`` measures it (for comparison with docs/performance.md).

    python bench/mixed_decode.py            # CUDA, the real shape; prints the table, writes $OUT/mixed_decode.json
    python bench/mixed_decode.py --tiny     # a tiny shape on the CPU: checks that the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import torch

from exporter.llm.config import DecoderConfig
from exporter.llm.generate import SamplingParams
from exporter.llm.model import Decoder
from exporter.runtime.scheduler import Scheduler

FULL = dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, num_query_groups=32,
            head_dim=128, vocab_size=32064)
TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
            head_dim=16, vocab_size=256)
CONTEXT, NEW_TOKENS = 608, 128
GREEDY = SamplingParams(max_output_len=NEW_TOKENS)
SAMPLED = SamplingParams(max_output_len=NEW_TOKENS, top_k=0, top_p=0.9, temperature=0.8, seed=1)
TOP_K = SamplingParams(max_output_len=NEW_TOKENS, top_k=50, temperature=1.0, seed=2, repetition_penalty=1.1)
BEAMS = SamplingParams(max_output_len=NEW_TOKENS, num_beams=4)


def mixes(rows: int) -> dict[str, list[SamplingParams]]:
    """Named request lists that fill ``rows`` rows."""
    quarter = max(rows // 4, 1)
    return {
        "greedy": [GREEDY] * rows,
        "sampled (top-p)": [SAMPLED] * rows,
        "greedy + 1 sampled": [GREEDY] * (rows - 1) + [SAMPLED],
        "greedy + 1 beam x4": [GREEDY] * (rows - 4) + [BEAMS] if rows >= 4 else [],
        "mixed: greedy, top-p, top-k+penalty, beams x4": (
            [GREEDY] * (rows - 2 * quarter - 4) + [SAMPLED] * quarter + [TOP_K] * quarter + [BEAMS]
            if rows >= 8 else []),
        "beams x4 only": [BEAMS] * (rows // 4),
    }


def decoder(shape: dict, device: torch.device, dtype: torch.dtype) -> Decoder:
    config = DecoderConfig(**shape)
    with torch.device("meta"):
        shapes = Decoder(config).state_dict()
    generator = torch.Generator(device).manual_seed(0)
    weights = {name: (torch.randn(t.shape, device=device, dtype=dtype, generator=generator) * 0.02
                      + (1.0 if "layernorm" in name else 0.0)) for name, t in shapes.items()}
    return Decoder.from_state_dict(config, weights)


def measure(model: Decoder, rows: int, requests: list[SamplingParams], context: int, steps: int,
            lora_uids: list[str | None] | None = None) -> dict:
    """ms per decode step with these requests admitted together (request i with LoRA adapter ``lora_uids[i]``), and
    the share of steps queued ahead."""
    device = model.device
    prompts = torch.randn(len(requests), context, model.config.hidden_size, device=device, dtype=model.dtype) * 0.02
    scheduler = Scheduler(model, max_slots=rows, max_seq_len=context + steps, eos_id=None,
                          max_beam_width=min(BEAMS.num_beams, rows))
    if device.type == "cuda":
        scheduler.warm_up()

    def run() -> tuple[float, int]:
        requests_ = [scheduler.submit(prompts[i], [-1] * context, params, lora_uid=lora_uids[i] if lora_uids else None)
                     for i, params in enumerate(requests)]
        while scheduler.prefilling or scheduler.waiting:  # admission: the prompts in chunks, the first tokens
            scheduler.step()
        launched = scheduler.decode_steps
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        while scheduler.step():
            pass
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert all(handle.done for handle in requests_)
        return (time.perf_counter() - start) * 1e3, scheduler.decode_steps - launched

    run()  # compiles what warm_up did not
    before = (scheduler.decode_steps, scheduler.steps_queued_ahead)
    timings = sorted(run() for _ in range(3))
    elapsed, launched = timings[1]
    ahead = (scheduler.steps_queued_ahead - before[1]) / (scheduler.decode_steps - before[0])
    used = sum(params.num_beams for params in requests)
    return {"rows": used, "ms_per_step": elapsed / launched, "steps": launched, "queued_ahead": ahead}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test, no timing value)")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32], help="KV rows (batch sizes) to fill")
    args = parser.parse_args()
    tiny = args.tiny or not torch.cuda.is_available()
    device = torch.device("cpu" if tiny else "cuda")
    model = decoder(TINY if tiny else FULL, device, torch.float32 if tiny else torch.bfloat16)
    context, steps = (24, 8) if tiny else (CONTEXT, NEW_TOKENS)
    results = {"device": torch.cuda.get_device_name() if not tiny else "cpu (tiny: timings mean nothing)"}
    lines = [f"device {results['device']}", f"{'mix':48} {'rows':>5} {'ms/step':>8} {'vs greedy':>9} {'ahead':>6}"]
    for rows in args.rows:
        baseline = None
        for name, requests in mixes(rows).items():
            if not requests:
                continue
            row = measure(model, rows, [replace(p, max_output_len=steps) for p in requests], context, steps)
            baseline = baseline or row["ms_per_step"]
            results[f"{name} @ {rows}"] = row
            lines.append(f"{name:48} {row['rows']:>5} {row['ms_per_step']:>8.2f} "
                         f"{row['ms_per_step'] / baseline:>9.2f} {row['queued_ahead']:>6.0%}")
    print("\n".join(lines))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "mixed_decode.json"), "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
