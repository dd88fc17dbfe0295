"""Where the time of one prefill (1 image + 32 tokens) and one batch-1 decode step goes, on the bench's model.

Prints the CUDA kernels taking the most time (torch.profiler), to explain the gaps in docs/performance.md.

    python bench/profile_steps.py [--tiny]
"""

from __future__ import annotations

import argparse

import torch
from llava_bench import FULL, TINY, build_models
from torch.profiler import ProfilerActivity, profile

from exporter.llm.generate import SamplingParams
from exporter.runtime.scheduler import Scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    _, decoder, _, _ = build_models(TINY if args.tiny else FULL, device, dtype)
    prompt = torch.randn(608, decoder.config.hidden_size, device=device, dtype=dtype) * 0.02
    scheduler = Scheduler(decoder, max_slots=1, max_seq_len=800, eos_id=None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with torch.inference_mode():
        for label, steps in (("prefill 608 tokens", 0), ("decode batch 1", 8)):
            for attempt in range(2):  # the first run warms up (and captures the decode graph)
                handle = scheduler.submit(prompt, [-1] * 608, SamplingParams(max_output_len=steps + 1))
                if steps:
                    scheduler.step()
                with profile(activities=activities) as prof:
                    while scheduler.step():
                        pass
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                handle.result()
            print(f"== {label}")
            print(prof.key_averages().table(sort_by=sort, row_limit=12))


if __name__ == "__main__":
    main()
