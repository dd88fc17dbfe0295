"""A Mixtral-8x7B-shaped mixture-of-experts decode step on CUDA, at batch 1 and 8, against its roofline.

Mixtral-8x7B in bfloat16 is 93 GB, more than an H100 holds, so the model has `--layers` (default 8) of its 32
layers, with its exact shapes (hidden 4096, 32 heads / 8 KV groups, 8 experts of FFN 14336, top-2, vocab 32000)
and random weights. Measured, per decode step: the serving path (the scheduler's captured steps, the experts in
the grouped Triton kernel), the same steps run eagerly with the experts looped on the host (the baseline), and one
MoE layer alone, captured. The roofline of a step is the bytes it must read, the weights of the experts its
tokens chose (counted from the routers), attention, router, norms, the LM head and the KV cache, over the measured
copy bandwidth. The last line scales the step to all 32 layers at the same fraction of the roofline.

    python bench/moe_bench.py            # on the H100, about 3 minutes; writes $OUT/moe_bench.json
    python bench/moe_bench.py --tiny     # tiny shapes on the CPU (a smoke test, no timing value)
"""

from __future__ import annotations

import argparse

import torch
from llava_bench import copy_bandwidth, kv_bytes_per_token, save_result, scheduler_decode, timed

from exporter.llm import moe_triton
from exporter.llm.config import DecoderConfig
from exporter.llm.model import Decoder, Router

MIXTRAL = dict(hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8, head_dim=128,
               vocab_size=32000, num_moe_experts=8, moe_router_topk=2, rotary_base=1e6)
TINY = dict(hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2, head_dim=16,
            vocab_size=256, num_moe_experts=8, moe_router_topk=2, rotary_base=1e6)
FULL_LAYERS = 32


def build(shape: dict, layers: int, device: torch.device, dtype: torch.dtype) -> Decoder:
    """The decoder with random weights made on the device (matrices N(0, 1/fan_in), norms 1)."""
    config = DecoderConfig(num_layers=layers, normalization="rmsnorm", activation="swiglu", bias=False,
                           position_embedding_type="rope", max_position_embeddings=4096, **shape)
    with torch.device("meta"):
        shapes = {name: tensor.shape for name, tensor in Decoder(config).state_dict().items()}
    generator = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, size in shapes.items():
        if len(size) == 1:
            weights[name] = torch.ones(size, dtype=dtype, device=device)
        else:
            weights[name] = (torch.randn(size, generator=generator, device=device, dtype=torch.float32)
                             / size[-1] ** 0.5).to(dtype)
    return Decoder.from_state_dict(config, weights)


def step_bytes(decoder: Decoder, distinct_experts: float, batch: int, context: float) -> dict[str, float]:
    """Bytes one decode step must read: the experts chosen in one layer, everything per layer (those experts,
    attention, router, norms, the layer's KV cache) and once per step (final norm, LM head)."""
    c, size = decoder.config, decoder.dtype.itemsize
    layer = decoder.decoder.layers[0]
    expert = sum(t[0].numel() for t in (layer.mlp.experts.linear_fc1.weight, layer.mlp.experts.linear_fc2.weight))
    dense = sum(p.numel() for name, p in layer.named_parameters() if "experts" not in name)
    experts = distinct_experts * expert * size
    kv = batch * context * kv_bytes_per_token(decoder) / c.num_layers
    return {"experts": experts, "per_layer": experts + dense * size + kv,
            "once": (c.vocab_size + 1) * c.hidden_size * size}


class ExpertCounter:
    """Counts the distinct experts each decode step's router calls choose (forward hooks; eager runs only)."""

    def __init__(self, decoder: Decoder, batch: int):
        self.batch = batch
        self.counts: list[int] = []
        self.hooks = [m.register_forward_hook(self._hook) for m in decoder.modules() if isinstance(m, Router)]

    def _hook(self, module, inputs, output) -> None:
        if output[1].shape[0] == self.batch:  # one token per request: a decode step, not a prefill
            self.counts.append(int(output[1].unique().numel()))

    def mean(self) -> float:
        for hook in self.hooks:
            hook.remove()
        return sum(self.counts) / len(self.counts)


def decode_ms(decoder: Decoder, batch: int, context: int, steps: int, graphs: bool) -> float:
    """Steady ms per decode step of `batch` requests with `context`-token prompts, through the scheduler."""
    prompt = torch.randn(batch, context, decoder.config.hidden_size, device=decoder.device, dtype=decoder.dtype)
    run = scheduler_decode(decoder, prompt * 0.02, steps, use_cuda_graphs=graphs)
    run()  # compiles, tunes and captures
    return sorted(run() for _ in range(3))[1]


def moe_layer_ms(decoder: Decoder, batch: int) -> float:
    """One MoE layer's experts (router + grouped kernels), captured in a CUDA graph where there is one."""
    mlp = decoder.decoder.layers[0].mlp
    x = torch.randn(batch, 1, decoder.config.hidden_size, device=decoder.device, dtype=decoder.dtype)
    if decoder.device.type != "cuda":
        return timed(lambda: mlp(x), decoder.device)
    from exporter.runtime.cuda_graphs import capture

    graph, _ = capture(lambda: mlp(x), torch.cuda.graph_pool_handle())
    return timed(graph.replay, decoder.device, 3, 20)


def run(tiny: bool, layers: int, context: int, steps: int) -> dict:
    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    decoder = build(TINY if tiny else MIXTRAL, layers, device, dtype)
    result: dict = {"layers": layers, "context": context, "steps": steps, "device": str(device),
                    "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "copy_TBps": copy_bandwidth(device, 2 * 1024**3 // (256 if tiny else 1))}
    bandwidth = result["copy_TBps"] * 1e12
    for batch in (1, 8):
        counter = ExpertCounter(decoder, batch)
        available = moe_triton.available
        moe_triton.available = lambda: False  # the baseline: experts looped on the host, steps run eagerly
        try:
            result[f"bs{batch}_loop_ms"] = decode_ms(decoder, batch, context, steps, graphs=False)
        finally:
            moe_triton.available = available
        distinct = counter.mean()
        result[f"bs{batch}_experts_per_layer"] = distinct
        result[f"bs{batch}_ms"] = decode_ms(decoder, batch, context, steps, graphs=True)
        parts = step_bytes(decoder, distinct, batch, context + steps / 2)
        step = layers * parts["per_layer"] + parts["once"]
        result[f"bs{batch}_GB_per_step"] = step / 1e9
        result[f"bs{batch}_roofline_ms"] = step / bandwidth * 1e3
        result[f"bs{batch}_moe_layer_ms"] = moe_layer_ms(decoder, batch)
        result[f"bs{batch}_moe_layer_roofline_ms"] = parts["experts"] / bandwidth * 1e3
        full = FULL_LAYERS * parts["per_layer"] + parts["once"]
        result[f"bs{batch}_full_model_roofline_ms"] = full / bandwidth * 1e3
        result[f"bs{batch}_full_model_ms_estimate"] = result[f"bs{batch}_ms"] * full / step
    return result


def report(result: dict) -> str:
    lines = [f"MoE decode, Mixtral-8x7B shapes, {result['layers']} of {FULL_LAYERS} layers, context "
             f"{result['context']}, {result['gpu']}, copy bandwidth {result['copy_TBps']:.2f} TB/s",
             f"{'batch':>5} {'experts/layer':>13} {'GB/step':>8} {'ms/step':>8} {'roofline':>9} {'% roof':>7} "
             f"{'loop ms':>8} {'loop/ours':>9} {'MoE layer ms':>12} {'its roofline':>12} {'32-layer ms':>11} "
             f"{'32-layer roof':>13}"]
    for batch in (1, 8):
        r = {k.removeprefix(f"bs{batch}_"): v for k, v in result.items() if k.startswith(f"bs{batch}_")}
        lines.append(f"{batch:>5} {r['experts_per_layer']:>13.2f} {r['GB_per_step']:>8.2f} {r['ms']:>8.3f} "
                     f"{r['roofline_ms']:>9.3f} {100 * r['roofline_ms'] / r['ms']:>6.1f}% {r['loop_ms']:>8.3f} "
                     f"{r['loop_ms'] / r['ms']:>9.2f} {r['moe_layer_ms']:>12.3f} {r['moe_layer_roofline_ms']:>12.3f} "
                     f"{r['full_model_ms_estimate']:>11.2f} {r['full_model_roofline_ms']:>13.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test, no timing value)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the 32 to build (8: 24 GB in bfloat16)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    args = parser.parse_args()
    result = run(args.tiny, args.layers, args.context, args.steps)
    save_result("moe_bench", result)
    print(report(result))


if __name__ == "__main__":
    main()
