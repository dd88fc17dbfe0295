"""The chunk pacer replayed over a paged_bench result's measured mixed steps, at several limits.

For each limit (a mixed step's most times the rows' own step): the pacer with the step graphs' padding counted in a
chunk's cost (the engine's), the same without it (as the engine paced before), and the best one step at a time
(``serial_schedule``). Each gives its steps, the p99 step against the rows' alone (what their per-token p99 follows)
and the prompt's TTFT against its lone prefill. A model: no noise, no host time.

    python bench/pacer_replay.py bench/results/paged_bench_h200_fourteenth_mixed.json

A result written before the bench recorded the chunk sizes and the key equivalent (``mixed_chunk_sizes``,
``mixed_key_equivalent``) and the mixed part's prompt length (``mixed_len``) takes them from the full shape the
bench runs, the default ``max_num_tokens`` and the long part's length.
"""

from __future__ import annotations

import argparse
import json

from mixed_decode import FULL
from paged_bench import paced_schedule, serial_schedule

from exporter.llm.config import DecoderConfig
from exporter.runtime.chunk_pacing import attention_key_equivalent
from exporter.runtime.cuda_graphs import chunk_bucket_sizes
from exporter.runtime.scheduler import DEFAULT_MAX_NUM_TOKENS

LIMITS = (1.7, 1.8, 1.9, 2.0)


def with_defaults(result: dict) -> dict:
    """``result`` with the keys an older paged_bench result lacks, from the full shape and the defaults."""
    return {"mixed_len": result.get("long_len"),
            "mixed_key_equivalent": attention_key_equivalent(DecoderConfig(**FULL)),
            "mixed_chunk_sizes": [size for size in chunk_bucket_sizes(DEFAULT_MAX_NUM_TOKENS)
                                  if size <= result.get("mixed_chunk", 0)],
            **result}


def report(result: dict, limits: tuple[float, ...] = LIMITS) -> str:
    def line(label: str, schedule: dict | None) -> str:
        if schedule is None:
            return f"  {label}: the result has no mixed part"
        ttft = f", TTFT x{schedule['ttft_ratio']:.2f}" if "ttft_ratio" in schedule else ""
        return (f"  {label}: {schedule['steps']} steps, step p99 x{schedule['p99_step_ratio']:.2f} "
                f"(longest x{schedule['longest_step_ratio']:.2f}){ttft}")

    rows = [f"{result.get('device', '?')}: a {result.get('mixed_len')}-position prompt beside "
            f"{result.get('mixed_rows')} decoding rows (their step alone {result.get('mixed_rows_alone_ms', 0):.2f} ms)"]
    for limit in limits:
        rows += [f"limit x{limit}:",
                 line("pacer, padding counted", paced_schedule(result, limit)),
                 line("pacer, padding not counted", paced_schedule(result, limit, count_padding=False)),
                 line("one step at a time, best", serial_schedule(result, limit))]
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", help="a paged_bench JSON result with its mixed part")
    parser.add_argument("--limits", nargs="+", type=float, default=list(LIMITS))
    options = parser.parse_args()
    with open(options.result) as stream:
        print(report(with_defaults(json.load(stream)), tuple(options.limits)))
