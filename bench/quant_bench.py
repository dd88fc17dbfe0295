"""Quantized LLM weights (int8_wo, fp8, int4_wo, int4_awq) against bf16, on a LLaVA-1.5-7B-shaped decoder with
random weights, all in one run.

For bf16 and each method, through the in-flight scheduler as ``llava_bench.py`` measures them: batch-1 decode
ms/step and its roofline (the bytes a step must read: the stored weights, their scales, the bf16 embedding table
and output head, and the KV cache at the average context, over the copy bandwidth measured in the same run),
batch-32 decode ms/step, the throughput of 32 concurrent 128-token requests, and the time to first token of one
prompt of 576 image features + 32 text tokens (the LLM's part: the features are given, the vision encoder's time,
the same for every method, is in ``llava_bench.py``). On CUDA also a captured graph of a batch-1 and of a 32-row
step's matrix products alone (what the weight bytes cost through the chosen kernels), which kernel each product
shape chose (printed after each method's row), and with ``--profile`` a kernel profile of one decode step (32 rows, or
the row counts given). Where the GPU can launch kernels as programmatic dependents (`exporter.llm.triton_launch`,
the default there), each method's batch-1 step and products are measured again launched plainly, side by side.

The quantized models are made from the bf16 one on the GPU, one weight at a time; int4_awq calibrates on random
token ids (this run measures speed; the tests measure accuracy). Prints a table with the issue's targets and
writes ``$OUT/quant_bench.json`` (after each method: a run cut short keeps what it measured).

    python bench/quant_bench.py                         # on a CUDA GPU: bf16 and all four methods
    python bench/quant_bench.py --methods int4_wo fp8   # bf16 and a subset
    python bench/quant_bench.py --methods int8_wo --profile   # and where a bs32 step's time goes, by kernel
    python bench/quant_bench.py --methods int8_wo --profile 1 32   # the same for a bs1 and a bs32 step
    python bench/quant_bench.py --tiny                  # a tiny shape on the CPU in float32: a smoke test
"""

from __future__ import annotations

import argparse
import time

import torch
from llava_bench import (
    FULL,
    IMAGE_FEATURES,
    PROMPT_TOKENS,
    TINY,
    _measure_decode,
    _measure_throughput,
    _measure_ttft,
    copy_bandwidth,
    save_result,
)

from exporter.llm import gemv
from exporter.llm.config import QUANT_METHODS, DecoderConfig, QuantConfig
from exporter.llm.generate import SamplingParams
from exporter.llm.model import Decoder
from exporter.llm.quant import QuantLinear
from exporter.llm.quant.convert import quantize_decoder_weights
from exporter.llm.triton_launch import dependent_launch, set_dependent_launch, supported
from exporter.runtime.scheduler import Scheduler

# the targets on the H100: batch-1 decode ms/step
DECODE_TARGET_MS = {"int8_wo": 2.8, "fp8": 2.8, "int4_wo": 1.6, "int4_awq": 1.6}
CALIBRATION_ROWS, CALIBRATION_LENGTH = 4, 512
_LAUNCHES = ("dependent_launch", "plain_launch")  # how the step's Triton kernels launch (`triton_launch`)


def _other_launch(launch: str) -> str:
    """The one of `_LAUNCHES` that is not ``launch``."""
    return next(other for other in _LAUNCHES if other != launch)


def random_weights(shape: dict, device: torch.device, dtype: torch.dtype) -> tuple[DecoderConfig, dict]:
    """A Llama decoder of ``shape["llm"]`` (LLaVA-1.5's LLM for FULL) with random canonical weights."""
    llm = shape["llm"]
    config = DecoderConfig(
        num_layers=llm["num_hidden_layers"], hidden_size=llm["hidden_size"], ffn_hidden_size=llm["intermediate_size"],
        num_attention_heads=llm["num_attention_heads"], num_query_groups=llm["num_key_value_heads"],
        head_dim=llm["hidden_size"] // llm["num_attention_heads"], vocab_size=llm["vocab_size"],
        normalization="rmsnorm", norm_epsilon=1e-6, activation="swiglu", bias=False, position_embedding_type="rope",
        max_position_embeddings=4096, share_embeddings_and_output_weights=False)
    with torch.device("meta"):
        names = Decoder(config).state_dict()
    generator = torch.Generator(device).manual_seed(0)
    weights = {}
    for name, meta in names.items():
        if name.endswith("layernorm.weight"):
            weights[name] = torch.ones(meta.shape, device=device, dtype=dtype)
        else:
            weights[name] = torch.randn(meta.shape, device=device, dtype=dtype, generator=generator) * 0.02
    return config, weights


def stored_gb(decoder: Decoder) -> float:
    return sum(t.numel() * t.element_size() for t in decoder.state_dict().values()) / 1e9


def products_ms(decoder: Decoder, rows: int) -> float:
    """A captured graph of a `rows`-row decode step's matrix products alone (each layer's four modules and the
    head, with the kernels they chose at this row count; fc2 reads fc1's `[gate; up]` as in the step, so where its
    kernel does not compute SwiGLU itself the activation kernel is in), replayed: the floor the weight bytes set
    through these kernels."""
    from breakdown import _per_call_ms

    c = decoder.config
    hidden = torch.randn(rows, c.hidden_size, device=decoder.device, dtype=decoder.dtype)
    gate_up = torch.randn(rows, 2 * c.ffn_hidden_size, device=decoder.device, dtype=decoder.dtype)

    def products() -> None:
        for layer in decoder.decoder.layers:
            layer.self_attention.linear_qkv(hidden)
            layer.self_attention.linear_proj(hidden)
            layer.mlp.linear_fc1(hidden)
            layer.mlp.linear_fc2(gate_up, gated_silu=layer.mlp._activated)
        gemv.linear(hidden, decoder.output_layer.weight)

    products()  # times the candidates of each shape, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        products()
    return _per_call_ms(graph.replay)


def decode_step_profile(decoder: Decoder, batch: int, device: torch.device) -> dict:
    """A torch.profiler breakdown of one `batch`-row decode step through the scheduler (captured steps; eager
    where the profiler sees no kernel of the graphs): GPU us a step by kernel kind, and the top kernels."""
    from breakdown import _kernel_profile

    context = PROMPT_TOKENS + IMAGE_FEATURES
    prompt = torch.randn(batch, context, decoder.config.hidden_size, device=device, dtype=decoder.dtype) * 0.02
    profile: dict = {}
    for graphs in (True, False):
        scheduler = Scheduler(decoder, max_slots=batch, max_seq_len=context + 64, eos_id=None,
                              use_cuda_graphs=graphs)
        for row in prompt:
            scheduler.submit(row, [-1] * context, SamplingParams(max_output_len=32))
        while scheduler.prefilling or scheduler.waiting:
            scheduler.step()
        scheduler.step()  # captures the step (and times any candidate not seen yet)
        profile = _kernel_profile(f"decode_bs{batch}", scheduler.step, calls=5, top=25)
        profile[f"profiled_bs{batch}"] = "captured step" if graphs else "eager step"
        while scheduler.step():
            pass
        if sum(profile[f"breakdown_decode_bs{batch}_kernel_us_by_kind"].values()) > 0:
            break
    return profile


def measure(name: str, decoder: Decoder, device: torch.device, copy_tbps: float, tiny: bool,
            profile: list[int]) -> dict:
    result = {"method": name, "copy_TBps": copy_tbps, "weight_GB": stored_gb(decoder)}
    start = time.perf_counter()
    _measure_decode(result, None, decoder, 1, device, tiny)
    _measure_decode(result, None, decoder, 32, device, tiny)
    _measure_throughput(result, None, decoder, device, tiny)
    features = torch.randn(1, IMAGE_FEATURES, decoder.config.hidden_size, device=device, dtype=decoder.dtype) * 0.02
    _measure_ttft(result, None, decoder, lambda pixels: features, 0, 1, device, decoder.dtype)
    if device.type == "cuda":
        for rows in (1, 32):
            result[f"products_ms_bs{rows}"] = products_ms(decoder, rows)
        if supported(device):  # the batch-1 step and its products again, launched the other way
            default = dependent_launch(device)
            result["launch"] = _LAUNCHES[0] if default else _LAUNCHES[1]
            other = _other_launch(result["launch"])
            set_dependent_launch(not default)
            try:
                beside = {"weight_GB": result["weight_GB"], "copy_TBps": copy_tbps}
                _measure_decode(beside, None, decoder, 1, device, tiny)
                result[f"decode_ms_bs1_{other}"] = beside["decode_ms_bs1_ours"]
                result[f"products_ms_bs1_{other}"] = products_ms(decoder, 1)
            finally:
                set_dependent_launch(None)
        for rows in profile:
            result.update(decode_step_profile(decoder, rows, device))
    result["measure_s"] = time.perf_counter() - start
    return result


def run(tiny: bool, methods: list[str], profile: list[int] | None = None) -> dict:
    """Measures bf16, then each of `methods`: after each, prints its row and the kernels its products chose and
    saves the summary so far (a run its time limit cuts short keeps what it measured)."""
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shape = TINY if tiny else FULL
    summary: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "dtype": str(dtype), "rows": [], "kernel_choices": {}}
    summary["copy_TBps"] = copy_bandwidth(device, 2 * 1024**3 // (64 if tiny else 1))
    config, weights = random_weights(shape, device, dtype)
    print(HEADER, flush=True)

    def record(row: dict) -> None:
        summary["rows"].append(row)
        made = {key: name for key, name in gemv.choices().items() if key not in summary["kernel_choices"]}
        summary["kernel_choices"].update(made)
        print(report_row(row), flush=True)
        if made:
            print(report_choices(made), flush=True)
        for rows in profile or ():
            if f"breakdown_decode_bs{rows}_top_kernels_us" in row:
                print(report_profile(row, rows), flush=True)
        save_result("quant_bench", summary)

    with torch.inference_mode():
        record(measure("bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch."),
                       Decoder.from_state_dict(config, weights), device, summary["copy_TBps"], tiny, profile))
        length = CALIBRATION_LENGTH // (8 if tiny else 1)
        calibration = torch.randint(100, config.vocab_size - 1, (CALIBRATION_ROWS, length),
                                    generator=torch.Generator().manual_seed(0))
        for method in methods:
            start = time.perf_counter()
            stored = dict(weights)  # the quantized tensors replace the float ones in this dict only
            quantized_config = quantize_decoder_weights(config, stored, QuantConfig(method), calibration, device)
            decoder = Decoder.from_state_dict(quantized_config, stored)
            assert isinstance(decoder.decoder.layers[0].mlp.linear_fc1, QuantLinear)
            quantize_s = time.perf_counter() - start
            del stored
            try:
                row = measure(method, decoder, device, summary["copy_TBps"], tiny, profile)
            except Exception as error:  # noqa: BLE001 - one method's failure must not cost the others' rows
                row = {"method": method, "error": repr(error)[:500]}
            row["quantize_s"] = quantize_s
            record(row)
            del decoder
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return summary


COLUMNS = (("decode bs1 ms", "decode_ms_bs1_ours"), ("roofline ms", "decode_ms_bs1_roofline"),
           ("products ms", "products_ms_bs1"), ("decode bs32 ms", "decode_ms_bs32_ours"),
           ("products bs32 ms", "products_ms_bs32"),
           ("32x128 tok/s", "throughput_tok_s_ours"), ("TTFT ms", "ttft_ms_ours"), ("weights GB", "weight_GB"))


HEADER = f"{'method':9} " + "  ".join(label for label, _ in COLUMNS) + "  roofline/ours  (seconds)"


def report_row(row: dict) -> str:
    if "error" in row:
        return f"{row['method']:9} failed: {row['error']}"
    cells = [f"{row[key]:>{len(label)}.2f}" if key in row else " " * len(label) for label, key in COLUMNS]
    fraction = row["decode_ms_bs1_roofline"] / row["decode_ms_bs1_ours"]
    seconds = f"quantize {row['quantize_s']:.0f} s, " if "quantize_s" in row else ""
    timing = f"({seconds}measure {row['measure_s']:.0f} s)"
    return f"{row['method']:9} " + "  ".join(cells) + f"  {fraction:>13.2f}  {timing}"


def report(summary: dict) -> str:
    lines = [f"device {summary['device']}, {summary['dtype']}, copy {summary['copy_TBps']:.2f} TB/s", HEADER,
             *(report_row(row) for row in summary["rows"])]
    rows = {row["method"]: row for row in summary["rows"] if "error" not in row}
    base = summary["rows"][0]
    lines.append("targets (issue 15, H100):")
    for method, row in rows.items():
        if method not in DECODE_TARGET_MS:
            continue
        decode = row["decode_ms_bs1_ours"]
        target = DECODE_TARGET_MS[method]
        checks = [f"decode bs1 {decode:.2f} <= {target} ms: {_verdict(decode <= target)}",
                  f"roofline/ours {row['decode_ms_bs1_roofline'] / decode:.2f} >= 0.80: "
                  f"{_verdict(row['decode_ms_bs1_roofline'] / decode >= 0.8)}",
                  f"32x128 tok/s {row['throughput_tok_s_ours']:.0f} >= bf16 {base['throughput_tok_s_ours']:.0f}: "
                  f"{_verdict(row['throughput_tok_s_ours'] >= base['throughput_tok_s_ours'])}"]
        if method == "fp8":
            checks.append(f"TTFT {row['ttft_ms_ours']:.2f} < bf16 {base['ttft_ms_ours']:.2f} ms: "
                          f"{_verdict(row['ttft_ms_ours'] < base['ttft_ms_ours'])}")
        lines.append(f"  {method:9} " + "; ".join(checks))
    for row in summary["rows"]:
        if "launch" in row:
            other = _other_launch(row["launch"])
            lines.append(f"  {row['method']:9} bs1 step (products) by {row['launch']} "
                         f"{row['decode_ms_bs1_ours']:.2f} ({row['products_ms_bs1']:.2f}) ms, by {other} "
                         f"{row[f'decode_ms_bs1_{other}']:.2f} ({row[f'products_ms_bs1_{other}']:.2f}) ms")
        if "products_ms_bs32" in row:
            lines.append(f"  {row['method']:9} bs32 step outside its products "
                         f"{row['decode_ms_bs32_ours'] - row['products_ms_bs32']:.2f} ms "
                         f"(bs1: {row['decode_ms_bs1_ours'] - row['products_ms_bs1']:.2f} ms)")
    lines.append(report_choices(summary["kernel_choices"]))
    return "\n".join(lines)


def report_choices(choices: dict[str, str]) -> str:
    """The kernel each product key chose (`act+` names: fc2's activation kernel, then that plain kernel)."""
    return "\n".join(["kernel choices (method N K group dtype rows [gated: fc2 reading [gate; up]] -> kernel):",
                      *(f"  {key} -> {name}" for key, name in sorted(choices.items()))])


def report_profile(row: dict, rows: int) -> str:
    """A method's decode step of ``rows`` rows by kernel: us a step by kind (and kernels a step), then the top
    kernels."""
    by_kind = row[f"breakdown_decode_bs{rows}_kernel_us_by_kind"]
    counts = row[f"breakdown_decode_bs{rows}_kernel_count_by_kind"]
    kinds = ", ".join(f"{kind} {us / 1e3:.2f} (x{counts.get(kind, 0):g})"
                      for kind, us in sorted(by_kind.items(), key=lambda item: -item[1]))
    return "\n".join([f"{row['method']} bs{rows} decode step ({row[f'profiled_bs{rows}']}), GPU ms a step: "
                      f"total {sum(by_kind.values()) / 1e3:.2f}; {kinds}",
                      *(f"  {line}" for line in row[f"breakdown_decode_bs{rows}_top_kernels_us"])])


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test, no timing value)")
    parser.add_argument("--methods", nargs="+", choices=QUANT_METHODS, default=list(QUANT_METHODS),
                        help="methods to measure beside bf16 (default: all)")
    parser.add_argument("--profile", nargs="*", type=int, metavar="ROWS",
                        help="also a torch.profiler breakdown of one decode step per method at each of these row "
                             "counts (none given: 32; CUDA)")
    args = parser.parse_args()
    summary = run(args.tiny, args.methods, [32] if args.profile == [] else args.profile or [])
    print(report(summary))


if __name__ == "__main__":
    main()
