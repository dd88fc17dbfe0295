"""Ours against transformers on a LLaVA-1.5-7B-shaped model with random bf16 weights, measured in one run.

Both sides share the same weights and prompts. Measured: copy bandwidth (the decode roofline), CLIP-L/336 at
batch 1 and 8, time to first token for one image + 32 text tokens, decode ms/step at batch 1, 8 and 32, and the
throughput of 32 concurrent 128-token requests through the in-flight scheduler; on CUDA also where a decode step's
time goes (``breakdown.py``). Prints a table with ratios and writes ``$OUT/llava_bench.json``.

    python bench/llava_bench.py            # on a CUDA GPU, the real shape in bf16
    python bench/llava_bench.py --tiny     # a tiny shape on the CPU in float32: checks that the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the clone's root: `tools` is not installed

from exporter.llm.config import DecoderConfig
from exporter.llm.generate import SamplingParams
from exporter.llm.model import Decoder
from exporter.perception.vision_encoder import build_vision_encoder
from exporter.runtime.cuda_graphs import GraphedCall
from exporter.runtime.scheduler import Scheduler
from tools.nemo_writer import hf_llama_to_nemo

FULL = {"vision": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       image_size=336, patch_size=14),
        "llm": dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32)}
TINY = {"vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       image_size=28, patch_size=14),
        "llm": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4)}
PROMPT_TOKENS, NEW_TOKENS, IMAGE_TOKEN, IMAGE_FEATURES = 32, 128, 32000, 576


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device, warm: int = 2, reps: int = 5) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after ``warm`` runs."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, elements: int) -> float:
    """Device-to-device copy bandwidth in TB/s (bytes read + written), the input of the decode roofline."""
    source = torch.randn(elements, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() * 2 / timed(lambda: target.copy_(source), device, 3, 10) / 1e9


def build_models(shape: dict, device: torch.device, dtype: torch.dtype):
    """transformers' LLaVA and ours (decoder + vision encoder) sharing the same random weights."""
    vision = CLIPVisionConfig(**shape["vision"])
    text = LlamaConfig(**shape["llm"], max_position_embeddings=4096)
    image_token = min(IMAGE_TOKEN, shape["llm"]["vocab_size"] - 1)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlavaForConditionalGeneration(config).to(dtype).eval()
    llm_weights = {k.replace("model.language_model.", "model."): v for k, v in hf.state_dict().items()
                   if k.startswith("model.language_model.") or k == "lm_head.weight"}
    heads = shape["llm"]["num_attention_heads"]
    canonical = hf_llama_to_nemo(llm_weights, heads, shape["llm"]["num_key_value_heads"])
    nemo_cfg = {"num_layers": text.num_hidden_layers, "hidden_size": text.hidden_size,
                "ffn_hidden_size": text.intermediate_size, "num_attention_heads": heads,
                "num_query_groups": text.num_key_value_heads, "normalization": "rmsnorm",
                "layernorm_epsilon": text.rms_norm_eps, "activation": "fast-swiglu", "bias": False,
                "position_embedding_type": "rope", "rotary_base": 10000, "max_position_embeddings": 4096,
                "share_embeddings_and_output_weights": False}
    decoder = Decoder.from_state_dict(DecoderConfig.from_nemo(nemo_cfg, vocab_size=text.vocab_size), canonical)
    projector = hf.model.multi_modal_projector
    encoder = vision_encoder(vision, text.hidden_size, hf.model.vision_tower, projector.linear_1, projector.linear_2,
                             dtype).to(device)
    return hf, decoder, encoder, image_token


def vision_encoder(vision: CLIPVisionConfig, hidden_size: int, tower: torch.nn.Module, linear_1: torch.nn.Linear,
                   linear_2: torch.nn.Linear, dtype: torch.dtype):
    """Ours (``VisionEncoder``: the tower trimmed after LLaVA's feature layer, the mlp2x_gelu projector) from
    transformers' CLIP tower and projector layers."""
    prefix = "embedding.word_embeddings."
    vision_weights = {f"{prefix}vision_encoder.{k}": v for k, v in tower.state_dict().items()}
    vision_weights.update({f"{prefix}adapter_layer.mm_projector_adapter.mm_projector.{i}.{p}": getattr(layer, p)
                           for i, layer in ((0, linear_1), (2, linear_2)) for p in ("weight", "bias")})
    mm_cfg = {"hidden_size": hidden_size, "mm_cfg": {
        "mm_mlp_adapter_type": "mlp2x_gelu",
        "vision_encoder": {"model_type": "clip", "hidden_size": vision.hidden_size,
                           "num_layers": vision.num_hidden_layers, "num_attention_heads": vision.num_attention_heads,
                           "ffn_hidden_size": vision.intermediate_size, "patch_dim": vision.patch_size,
                           "image_size": vision.image_size, "crop_size": [vision.image_size] * 2,
                           "hidden_act": vision.hidden_act, "layernorm_epsilon": vision.layer_norm_eps,
                           "vision_select_layer": -2, "vision_select_feature": "patch", "freeze": False}}}
    return build_vision_encoder(mm_cfg, vision_weights, dtype=dtype)


def kv_bytes_per_token(decoder: Decoder) -> int:
    c = decoder.config
    return 2 * c.num_layers * c.num_query_groups * c.head_dim * decoder.dtype.itemsize


def run(tiny: bool) -> dict:
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shape = TINY if tiny else FULL
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype)}
    result["copy_TBps"] = copy_bandwidth(device, 2 * 1024**3 // (64 if tiny else 1))

    hf, decoder, encoder, image_token = build_models(shape, device, dtype)
    result["weight_GB"] = sum(t.numel() * t.element_size() for t in decoder.state_dict().values()) / 1e9
    size = shape["vision"]["image_size"]
    graphed_encoder = GraphedCall(encoder, (3, size, size), dtype, device, 8)

    with torch.inference_mode():
        for batch in (1, 8):
            pixels = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
            result[f"clip_ms_bs{batch}_ours"] = timed(lambda: graphed_encoder(pixels), device, 3, 10)
            result[f"clip_ms_bs{batch}_hf"] = timed(
                lambda: hf.model.vision_tower(pixels, output_hidden_states=True), device, 3, 10)
        _measure_ttft(result, hf, decoder, graphed_encoder, image_token, size, device, dtype)
        for batch in (1, 8, 32):
            _measure_decode(result, hf, decoder, batch, device, tiny)
        _measure_throughput(result, hf, decoder, device, tiny)
        if device.type == "cuda":
            from breakdown import decode_breakdown, prefill_breakdown

            try:  # a diagnosis: its failure must not cost the table
                result.update(prefill_breakdown(decoder, PROMPT_TOKENS + IMAGE_FEATURES))
                result.update(decode_breakdown(decoder, context=PROMPT_TOKENS + IMAGE_FEATURES + NEW_TOKENS // 2))
            except Exception as error:  # noqa: BLE001
                result["breakdown_error"] = repr(error)[:500]
    return result


def _text_ids(batch: int, vocab: int, device) -> torch.Tensor:
    return torch.randint(100, min(31000, vocab - 1), (batch, PROMPT_TOKENS), device=device,
                         generator=torch.Generator(device).manual_seed(batch))


def _measure_ttft(result, hf, decoder, graphed_encoder, image_token, size, device, dtype) -> None:
    """One image (placed after 5 text tokens) + 32 text tokens, until the first generated token."""
    ids = _text_ids(1, decoder.config.vocab_size, device)
    pixels = torch.randn(1, 3, size, size, device=device, dtype=dtype)
    scheduler = Scheduler(decoder, max_slots=1, max_seq_len=1024, eos_id=None)

    def ours() -> None:
        features = graphed_encoder(pixels)[0]
        embeds = torch.cat([decoder.embed(ids[0, :5]), features, decoder.embed(ids[0, 5:])])
        handle = scheduler.submit(embeds, [-1] * len(embeds), SamplingParams(max_output_len=1))
        while scheduler.step():
            pass
        handle.result()

    patches = graphed_encoder(pixels).shape[1]
    hf_ids = torch.cat([ids[:, :5], torch.full((1, patches), image_token, device=device), ids[:, 5:]], dim=1)

    def theirs() -> None:
        hf.generate(input_ids=hf_ids, pixel_values=pixels, attention_mask=torch.ones_like(hf_ids),
                    max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)

    result["ttft_ms_ours"] = timed(ours, device, 3, 10)
    if hf is not None:
        result["ttft_ms_hf"] = timed(theirs, device, 1, 5)


def scheduler_decode(decoder: Decoder, prompt: torch.Tensor, steps: int,
                     use_cuda_graphs: bool | None = None) -> Callable[[], float]:
    """A run of the rows of `prompt` `[B, T, H]` as B requests of `steps` new tokens through one scheduler; each
    call returns the steady ms per decode step (the steps until every prompt is prefilled left out)."""
    batch, context = prompt.shape[:2]
    scheduler = Scheduler(decoder, max_slots=batch, max_seq_len=context + steps + 1, eos_id=None,
                          use_cuda_graphs=use_cuda_graphs)

    def run() -> float:
        handles = [scheduler.submit(prompt[i], [-1] * context, SamplingParams(max_output_len=steps))
                   for i in range(batch)]
        while scheduler.prefilling or scheduler.waiting:  # admission: the prompts in chunks, the first tokens
            scheduler.step()
        synchronize(decoder.device)
        launched = scheduler.decode_steps
        start = time.perf_counter()
        while scheduler.step():
            pass
        synchronize(decoder.device)
        assert all(len(h.result()) == steps for h in handles)
        return (time.perf_counter() - start) * 1e3 / (scheduler.decode_steps - launched)

    return run


def _measure_decode(result, hf, decoder, batch: int, device, tiny: bool) -> None:
    """Steady decode ms/step at ``batch`` requests (608-token prompts): ours through the scheduler's captured
    steps, transformers' generate (all new tokens minus the first) with the same prompt embeddings."""
    steps = 16 if tiny else NEW_TOKENS
    context = PROMPT_TOKENS + IMAGE_FEATURES
    prompt = torch.randn(batch, context, decoder.config.hidden_size, device=device, dtype=decoder.dtype) * 0.02
    ours = scheduler_decode(decoder, prompt, steps)
    start = time.perf_counter()
    ours()  # compiles and captures the graphs
    result[f"first_run_s_bs{batch}"] = time.perf_counter() - start
    result[f"decode_ms_bs{batch}_ours"] = sorted(ours() for _ in range(3))[1]
    average_context = context + steps / 2
    roofline_bytes = result["weight_GB"] * 1e9 + batch * average_context * kv_bytes_per_token(decoder)
    result[f"decode_ms_bs{batch}_roofline"] = roofline_bytes / (result["copy_TBps"] * 1e12) * 1e3
    if hf is None:
        return

    mask = torch.ones(batch, context, dtype=torch.long, device=device)

    def generate(tokens: int) -> None:
        hf.generate(inputs_embeds=prompt, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                    do_sample=False, pad_token_id=0)

    first = timed(lambda: generate(1), device, 1, 3)
    full = timed(lambda: generate(steps), device, 1, 3)
    result[f"decode_ms_bs{batch}_hf"] = (full - first) / (steps - 1)


def _measure_throughput(result, hf, decoder, device, tiny: bool) -> None:
    """32 requests of 32 prompt tokens and 128 new tokens each, submitted at once; transformers generates the
    same 32 prompts as one batch."""
    requests, steps = 32, 16 if tiny else NEW_TOKENS
    ids = _text_ids(requests, decoder.config.vocab_size, device)
    scheduler = Scheduler(decoder, max_slots=requests, max_seq_len=PROMPT_TOKENS + steps + 1, eos_id=None)

    def ours() -> None:
        handles = [scheduler.submit(decoder.embed(ids[i]), ids[i].tolist(), SamplingParams(max_output_len=steps))
                   for i in range(requests)]
        while scheduler.step():
            pass
        assert sum(len(h.result()) for h in handles) == requests * steps

    def theirs() -> None:
        hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                    do_sample=False, pad_token_id=0)

    result["throughput_tok_s_ours"] = requests * steps / (timed(ours, device, 1, 3) / 1e3)
    if hf is not None:
        result["throughput_tok_s_hf"] = requests * steps / (timed(theirs, device, 1, 1) / 1e3)


def report(result: dict) -> str:
    rows = [("CLIP-L/336 bs1 ms", "clip_ms_bs1"), ("CLIP-L/336 bs8 ms", "clip_ms_bs8"),
            ("TTFT 1 image + 32 tokens ms", "ttft_ms"), ("decode bs1 ms/step", "decode_ms_bs1"),
            ("decode bs8 ms/step", "decode_ms_bs8"), ("decode bs32 ms/step", "decode_ms_bs32"),
            ("32 x 128-token requests tok/s", "throughput_tok_s")]
    lines = [f"device {result['device']}, {result['dtype']}, copy {result['copy_TBps']:.2f} TB/s, "
             f"LLM weights {result['weight_GB']:.2f} GB",
             f"{'metric':32} {'ours':>9} {'transformers':>13} {'ours/hf':>8} {'roofline':>9} {'roofline/ours':>14}"]
    for label, key in rows:
        ours, theirs = result[f"{key}_ours"], result[f"{key}_hf"]
        roof = result.get(f"{key}_roofline")
        roof_text = f"{roof:9.2f} {roof / ours:14.2f}" if roof else ""
        lines.append(f"{label:32} {ours:9.2f} {theirs:13.2f} {ours / theirs:8.2f} {roof_text}")
    for key in sorted(k for k in result if k.startswith(("breakdown_", "first_run_"))):
        value = result[key]
        lines.extend([key, *(f"    {v}" for v in value)] if isinstance(value, list) else [f"{key:44} {value}"])
    return "\n".join(lines)


def bench_main(doc: str, name: str, run_bench: Callable[..., dict], report_of: Callable[[dict], str],
               add_options: Callable[[argparse.ArgumentParser], object] | None = None) -> None:
    """A bench's command line: ``--tiny`` or not (and the options ``add_options`` adds, passed to ``run_bench`` by
    name), then ``$OUT/<name>.json`` written and the report printed."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test, no timing value)")
    if add_options is not None:
        add_options(parser)
    options = vars(parser.parse_args())
    result = run_bench(options.pop("tiny"), **options)
    save_result(name, result)
    print(report_of(result))


def save_result(name: str, result: dict) -> None:
    """Write a bench's result to ``$OUT/<name>.json`` (the current folder without ``OUT``)."""
    with open(os.path.join(os.environ.get("OUT", "."), f"{name}.json"), "w") as stream:
        json.dump(result, stream, indent=1)


if __name__ == "__main__":
    bench_main(__doc__, "llava_bench", run, report)
