"""The paged KV cache on a LLaVA-1.5-7B-shaped model (Llama-2-7B decoder, CLIP-L/336 tower, random bf16 weights),
measured in one run, beside the numbers of the static cache it replaced (docs/performance.md, issue 14).

Parts (each runs on its own: one that fails prints its error and the others still run):
- decode ms/step at 1 row (608-position prompt, 128 new tokens), and at 64 and 128 rows with the bf16 and the fp8
  KV cache, against the step's roofline: the weights a step reads plus the KV bytes its rows attend (each row's
  positions, float8 half the bytes), over the device-to-device copy bandwidth measured in the same run;
- 128 concurrent image requests (608-position prompts, 128 new tokens) in one scheduler: completed, errors, tok/s,
  the most requests waiting and the largest share of the pool in use;
- a 16,384-position prompt admitted while 16 requests decode: their per-token latency p50/p99 against the same 16
  decoding alone, and the long prompt's time to first token against the same prompt alone; the steps it took
  beside them (their chunk sized from the measured step times, ``ChunkPacer``) and what the pacer measured;
  such steps timed at three points of the prompt for chunks of 64, 128, 256 positions and the chunk budget, and
  from them the schedule one step at a time that keeps every step within 2x the rows' own (its TTFT against the
  prompt's lone prefill); the budget's step profiled by kernel kind; the chunk kernel's configurations the
  autotuner chose;
- time to first token end to end through the Pipeline (image + question, `max_output_len=1`): a first question
  (the encoder runs, the whole prompt is prefilled) and a second question about an image already seen (encoder
  cache hit, the prompt's blocks up to the question reused), each with its median time by phase: the Pipeline's
  host phases (``Pipeline.on_phase``) and the scheduler's milestones on the request's handle;
- 16 questions about one new image sent together (one ``Pipeline.run``, one new token each, 16 rows): the time until
  all are answered and the prompt positions the burst prefilled, against one prompt's length.

    python bench/paged_bench.py            # CUDA (the H100), a few minutes; prints the table, writes $OUT/paged_bench.json
    python bench/paged_bench.py --parts long mixed ttft   # some parts only (an A/B of a change in ~1 minute)
    python bench/paged_bench.py --tiny     # tiny shapes on the CPU in float32: checks that the script runs
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import random
import string
import time
import traceback
import warnings
from collections.abc import Callable, Collection, Iterator

import numpy as np
import torch
from llava_bench import FULL as LLAVA
from llava_bench import TINY as LLAVA_TINY
from llava_bench import bench_main, copy_bandwidth, kv_bytes_per_token, save_result, synchronize, vision_encoder
from mixed_decode import FULL, TINY
from mixed_decode import decoder as random_decoder
from transformers import CLIPVisionConfig, CLIPVisionModel

from exporter.engine import Engine, EngineLimits
from exporter.llm import paged_triton
from exporter.llm.generate import SamplingParams
from exporter.llm.model import Decoder
from exporter.llm.tokenizer import SentencePieceTokenizer
from exporter.models.neva import ImagePerception
from exporter.models.templates import get_template
from exporter.runtime import Pipeline, Request
from exporter.runtime.chunk_pacing import MIXED_STEP_LIMIT, ChunkPacer, padded_size, plan_counts
from exporter.runtime.cuda_graphs import ForwardStep, Piece
from exporter.runtime.kv_cache import KVCacheOptions
from exporter.runtime.pipeline import PHASES
from exporter.runtime.scheduler import Scheduler

# the scheduler's part of a request's TTFT, between the handle's milestones (submitted, taken up by the loop,
# admitted, its first prefill step's launch begun, its last one's launch returned, first token choice queued, first
# token read) and the answer back in the caller: the host's launch phases against the wait for the device
SCHEDULER_PHASES = ("loop wake-up", "admission (prefix match, blocks)", "planning (host)",
                    "prefill steps launched (host)", "first token choice queued (host)",
                    "waiting for the device + first token read", "answer returned")
# the static cache's numbers on the same H100 (docs/performance.md; the second question's from issue 14)
BEFORE = {"decode_bs1_ms": 5.55, "ttft_first_ms": 17.44, "ttft_second_ms": 18.7}
CONTEXT, NEW_TOKENS = 608, 128
LIMIT_SWEEP = (2.0, 1.8, 1.7)  # the chunk pacer's limits the long prompt's part is run again at (CUDA)
MIXED_CHUNKS = (64, 128, 256)  # chunk sizes the mixed part times beside the rows, with the chunk budget's own
TARGET_P99_RATIO = 2.0  # issue 14: the decoding rows' per-token p99 beside a long prompt, times their own
# the parts, in the order they run: the bf16 cache's decode rows (1, 64, 128), 128 concurrent requests, the long
# prompt beside decoding rows, the same at the pacer limits of LIMIT_SWEEP, the mixed steps timed alone; the fp8
# cache's decode rows; the TTFT questions; questions about one image sent together
PARTS = ("decode", "concurrent", "long", "long_limits", "mixed", "fp8", "ttft", "burst")
SIZES = {"full": dict(rows=(64, 128), concurrent=128, long=16_384, beside=16, steps=32, ttft_repeats=10, burst=16),
         "tiny": dict(rows=(4, 8), concurrent=16, long=2_048, beside=4, steps=8, ttft_repeats=3, burst=4)}


def run(tiny: bool, parts: Collection[str] = PARTS) -> dict:
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    sizes = SIZES["tiny" if tiny else "full"]
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "dtype": str(dtype), "before": BEFORE}
    result["copy_TBps"] = copy_bandwidth(device, 2 * 1024**3 // (64 if tiny else 1))
    model = random_decoder(TINY if tiny else FULL, device, dtype)
    head = model.embedding.word_embeddings.weight.numel() * model.dtype.itemsize
    result["weights_read_GB"] = (sum(t.numel() * t.element_size() for t in model.state_dict().values()) - head) / 1e9
    long_len = sizes["long"]
    if set(parts) - {"fp8", "ttft", "burst"}:
        part(result, "bf16", lambda: _scheduler_parts(model, sizes, result, "auto", CONTEXT + NEW_TOKENS + long_len,
                                                      parts))
    if "fp8" in parts:
        part(result, "fp8", lambda: _scheduler_parts(model, sizes, result, "fp8", CONTEXT + 256, parts))
    if "ttft" in parts:
        part(result, "ttft", lambda: _ttft(model, LLAVA_TINY if tiny else LLAVA, sizes["ttft_repeats"]))
    if "burst" in parts:
        part(result, "burst", lambda: _burst(model, LLAVA_TINY if tiny else LLAVA, sizes["burst"]))
    return result


def part(result: dict, name: str, fn: Callable[[], dict | None]) -> None:
    """Run one part; its failure is recorded (and printed) instead of ending the run. Each part's time is printed
    and the results so far saved as it ends, so a run cut short by its time limit keeps them."""
    started = time.perf_counter()
    try:
        result.update(fn() or {})
    except Exception as error:  # noqa: BLE001 - the other parts still run
        traceback.print_exc()
        result[f"{name}_error"] = repr(error)[:500]
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        result[f"{name}_part_s"] = time.perf_counter() - started
        save_result("paged_bench", result)
        print(f"part {name}: {result[f'{name}_part_s']:.1f} s", flush=True)


def _scheduler_parts(model: Decoder, sizes: dict, result: dict, kv_dtype: str, max_seq_len: int,
                     parts: Collection[str]) -> dict:
    """Decode rows (and with the bf16 cache batch 1, the 128 requests, the long prompt and the mixed steps, those of
    ``parts``) on one scheduler."""
    scheduler = Scheduler(model, max_slots=max(sizes["rows"]), max_seq_len=max_seq_len, eos_id=None,
                          kv_cache=KVCacheOptions(dtype=kv_dtype))
    if kv_dtype == "auto":
        scheduler.warm_up()  # every step graph captured first, as a served engine has them: no capture is timed
    # the fp8 part times decode steps only: each graph is captured when first used, by a step before the timed ones
    # (with every graph captured first, the fp8 part took 246 s of the third H100 run's ~8 minutes)
    print(f"warm-up ({kv_dtype} KV): {scheduler.capture_stats.get('before', 0)} graphs in "
          f"{scheduler.capture_stats.get('before_s', 0.0):.1f} s", flush=True)
    out = {f"pool_blocks_{kv_dtype}": scheduler.pool.capacity, "block_size": scheduler.block_size}
    kv_token = kv_bytes_per_token(model) // (2 if kv_dtype == "fp8" else 1)
    try:
        # the fp8 scheduler is built for its decode rows; the bf16 one times them (and batch 1) as a part of its own
        rows_list = sizes["rows"] if kv_dtype == "fp8" else (1, *sizes["rows"]) if "decode" in parts else ()
        for rows in rows_list:
            steps = NEW_TOKENS - 1 if rows == 1 else sizes["steps"]
            ms, context = decode_ms(scheduler, rows, steps)
            roofline = (result["weights_read_GB"] * 1e9 + rows * context * kv_token) / (result["copy_TBps"] * 1e12)
            out[f"decode_{kv_dtype}_{rows}_ms"] = ms
            out[f"decode_{kv_dtype}_{rows}_roofline_ms"] = roofline * 1e3
        if rows_list and paged_triton.available() and scheduler.model.device.type == "cuda":
            model_config = scheduler.model.config
            tuned = paged_triton.decode_kernel(kv_dtype == "fp8",
                                               model_config.num_attention_heads // model_config.num_query_groups)
            out[f"decode_configs_{kv_dtype}"] = sorted(f"rows up to {key[0]}: {config}"
                                                       for key, config in tuned.cache.items())
        if kv_dtype == "auto":
            if "concurrent" in parts:
                part(out, "concurrent", lambda: _concurrent(scheduler, sizes["concurrent"]))
            if "long" in parts:
                part(out, "long", lambda: _long_prompt(scheduler, sizes["long"], sizes["beside"]))
            if scheduler.pacer is not None and "long_limits" in parts:
                part(out, "long_limits", lambda: _limit_sweep(scheduler, sizes["long"], sizes["beside"]))
            if "mixed" in parts:
                part(out, "mixed", lambda: _mixed_steps(scheduler, sizes["long"], sizes["beside"],
                                                        scheduler.chunk_budget(decoding=True)))
            if paged_triton.available() and scheduler.model.device.type == "cuda":
                out["chunk_configs"] = sorted({f"splits {key[3]}: {config}"
                                               for key, config in paged_triton._chunk_tuned.cache.items()})
    finally:
        scheduler.stop()
    return out


def _prompts(model: Decoder, count: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(model.device).manual_seed(seed)
    return torch.randn(count, length, model.config.hidden_size, device=model.device, dtype=model.dtype,
                       generator=generator) * 0.02


def decode_ms(scheduler: Scheduler, rows: int, steps: int) -> tuple[float, float]:
    """Steady ms per decode step with ``rows`` requests of CONTEXT-position prompts all decoding, and the mean
    positions a row attends over the timed steps. The prompts are admitted with a large chunk budget first."""
    prompts = _prompts(scheduler.model, rows, CONTEXT, seed=rows)
    params = SamplingParams(max_output_len=steps + 64)
    handles = [scheduler.submit(prompts[i], [-1] * CONTEXT, params) for i in range(rows)]
    # a larger chunk budget (eager steps), also beside the rows already decoding, admits them quickly; 4096 keeps
    # its activations within the reserve's room
    budgets = scheduler.max_num_tokens, scheduler.decode_chunk_tokens
    scheduler.max_num_tokens = scheduler.decode_chunk_tokens = min(rows * CONTEXT, 4096)
    try:
        while scheduler.prefilling or scheduler.waiting:
            scheduler.step()
    finally:
        scheduler.max_num_tokens, scheduler.decode_chunk_tokens = budgets
    for _ in range(2):
        scheduler.step()
    started = sum(handle.first_token_at is not None for handle in handles)
    assert started == rows, f"{started} of {rows} rows decode (the pool is too small?)"
    first = CONTEXT + sum(len(handle.tokens) for handle in handles) / rows
    synchronize(scheduler.model.device)
    start = time.perf_counter()
    for _ in range(steps):
        scheduler.step()
    synchronize(scheduler.model.device)
    elapsed = (time.perf_counter() - start) * 1e3 / steps
    for handle in handles:
        handle.cancel()
    while scheduler.step():
        pass
    return elapsed, first + steps / 2 + 1


def _concurrent(scheduler: Scheduler, count: int) -> dict:
    """``count`` image-sized requests submitted at once, each to its last token."""
    prompts = _prompts(scheduler.model, count, CONTEXT, seed=7)
    start = time.perf_counter()
    handles = [scheduler.submit(prompts[i], [-1] * CONTEXT, SamplingParams(max_output_len=NEW_TOKENS))
               for i in range(count)]
    waiting, used = 0, 0.0
    while scheduler.step():
        stats = scheduler.stats()
        waiting, used = max(waiting, stats.waiting), max(used, stats.kv_used_fraction)
    synchronize(scheduler.model.device)
    elapsed = time.perf_counter() - start
    errors = [handle.error for handle in handles if handle.error is not None]
    tokens = sum(len(handle.tokens) for handle in handles)
    return {"concurrent_requests": count, "concurrent_completed": sum(len(h.tokens) == NEW_TOKENS for h in handles),
            "concurrent_errors": len(errors), "concurrent_first_error": repr(errors[0])[:300] if errors else None,
            "concurrent_s": elapsed, "concurrent_tok_s": tokens / elapsed, "concurrent_max_waiting": waiting,
            "concurrent_max_kv_used": used}


def _long_prompt(scheduler: Scheduler, length: int, beside: int) -> dict:
    """Per-token latency of ``beside`` decoding requests alone and while a ``length``-position prompt is
    prefilled; the long prompt's time to first token alone and while they decode."""
    device = scheduler.model.device
    long_prompt = _prompts(scheduler.model, 1, length, seed=11)[0]

    def decode_rows(with_long: bool) -> tuple[list[float], float | None]:
        times: list[list[float]] = [[] for _ in range(beside)]
        prompts = _prompts(scheduler.model, beside, CONTEXT, seed=13)
        handles = [scheduler.submit(prompts[i], [-1] * CONTEXT, SamplingParams(max_output_len=2 * NEW_TOKENS),
                                    on_token=lambda _, mine=times[i]: mine.append(time.perf_counter()))
                   for i in range(beside)]
        while scheduler.prefilling or scheduler.waiting or any(len(t) < 8 for t in times):
            scheduler.step()
        window_start = time.perf_counter()
        ttft = None
        if with_long:
            steps = scheduler.decode_steps
            handle = scheduler.submit(long_prompt, [-1] * length, SamplingParams(max_output_len=1))
            while not handle.done:
                scheduler.step()
            synchronize(device)
            ttft = (handle.first_token_at - handle.submitted_at) * 1e3
            paced["long_steps_beside"] = scheduler.decode_steps - steps
        else:
            for _ in range(64):
                scheduler.step()
        window_end = time.perf_counter()
        for handle in handles:
            handle.cancel()
        while scheduler.step():
            pass
        gaps = [(b - a) * 1e3 for mine in times for a, b in zip(mine, mine[1:]) if window_start <= a and b <= window_end]
        return gaps, ttft

    paced: dict = {}
    solo_gaps, _ = decode_rows(with_long=False)
    during_gaps, during_ttft = decode_rows(with_long=True)
    pacer = scheduler.pacer
    if pacer is not None:  # what the chunk budget beside the rows was computed from, at the prompt's end
        paced.update(long_pacer_rows_alone_ms=pacer.alone_s.get(beside, float("nan")) * 1e3,
                     long_pacer_unit_us=(pacer.unit_s or float("nan")) * 1e6,
                     long_pacer_last_budget=pacer.budget(beside, scheduler.chunk_budget(decoding=True)))
    alone = scheduler.submit(long_prompt, [-1] * length, SamplingParams(max_output_len=1))
    while scheduler.step():
        pass
    solo_ttft = (alone.first_token_at - alone.submitted_at) * 1e3
    return {"long_len": length, "long_beside_rows": beside,
            "long_rows_solo_p50_ms": _percentile(solo_gaps, 50), "long_rows_solo_p99_ms": _percentile(solo_gaps, 99),
            "long_rows_during_p50_ms": _percentile(during_gaps, 50),
            "long_rows_during_p99_ms": _percentile(during_gaps, 99),
            "long_ttft_solo_ms": solo_ttft, "long_ttft_during_ms": during_ttft, **paced}


def _limit_sweep(scheduler: Scheduler, length: int, beside: int) -> dict:
    """The long prompt's part again with the chunk pacer held to each of `LIMIT_SWEEP` (a mixed step's most times
    the rows' own): its trade-off between the rows' per-token p99 and the prompt's TTFT, beside the default's."""
    pacer, measured = scheduler.pacer, {}
    default = pacer.limit
    try:
        for limit in LIMIT_SWEEP:
            pacer.limit = limit
            run = _long_prompt(scheduler, length, beside)
            measured[str(limit)] = {
                "p99_ratio": run["long_rows_during_p99_ms"] / run["long_rows_solo_p99_ms"],
                "ttft_ratio": run["long_ttft_during_ms"] / run["long_ttft_solo_ms"],
                "steps_beside": run.get("long_steps_beside"), **run}
    finally:
        pacer.limit = default
    return {"long_at_limits": measured}


def _mixed_steps(scheduler: Scheduler, length: int, beside: int, budget: int) -> dict:
    """The step of ``beside`` decode rows (CONTEXT positions each) and a prompt chunk, against each part alone, for
    chunks of ``MIXED_CHUNKS`` positions (those below ``budget``, the chunk budget beside decoding rows) and of
    ``budget``, at three points of a ``length``-position prompt (median device ms, CUDA events; the graphs warm_up
    captured), and at the last point the combined step with the budget's chunk by kernel kind and its costliest
    kernels (profiler, ``breakdown._kernel_profile``)."""
    forward, size, device = scheduler.forward, scheduler.block_size, scheduler.model.device
    rows_blocks = -(-(CONTEXT + 1) // size)
    held = scheduler.pool.allocate(beside * rows_blocks + -(-length // size))
    tables = [held[r * rows_blocks: (r + 1) * rows_blocks] for r in range(beside)]
    scheduler.tables.set(0, tables)
    prompt_blocks = held[beside * rows_blocks:]
    embeds = torch.zeros(budget, scheduler.model.config.hidden_size, dtype=scheduler.model.dtype, device=device)
    decode_args = dict(tokens=[1] * beside, positions=[CONTEXT] * beside)

    def timed_step(rows: int, start: int | None, count: int) -> float:
        pieces = [] if start is None else [Piece(embeds[:count], start, prompt_blocks)]
        args = decode_args if rows else {}
        times = []
        for _ in range(12):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
            synchronize(device)
            began = time.perf_counter()
            if events:
                events[0].record()
            forward.launch(rows, CONTEXT + 1, pieces, **args)
            if events:
                events[1].record()
            synchronize(device)
            times.append(events[0].elapsed_time(events[1]) if events else (time.perf_counter() - began) * 1e3)
        return float(np.median(times[2:]))

    chunks = sorted({count for count in MIXED_CHUNKS if count < budget} | {budget})
    by_chunk: dict[str, dict[str, dict[str, float]]] = {}
    out: dict = {"mixed_rows": beside, "mixed_chunk": budget, "mixed_len": length,
                 "mixed_key_equivalent": scheduler.key_equivalent,
                 "mixed_chunk_sizes": [size for size in forward.chunk_buckets if size <= budget],
                 "mixed_rows_alone_ms": timed_step(beside, None, 0), "mixed_by_chunk": by_chunk}
    try:
        for count in chunks:
            by_chunk[str(count)] = {str(start): {"chunk_alone_ms": timed_step(0, start, count),
                                                 "together_ms": timed_step(beside, start, count)}
                                    for start in (0, length // 2, length - budget)}
        if device.type == "cuda":
            from breakdown import _kernel_profile

            out.update(_kernel_profile("mixed", lambda: forward.launch(
                beside, CONTEXT + 1, [Piece(embeds, length - budget, prompt_blocks)], **decode_args)))
    finally:
        scheduler.chooser.release(0, beside)
        scheduler.tables.clear(0, beside)
        scheduler.pool.release(held)
    return out


def _measured_steps(result: dict) -> tuple[float, int, Callable[[int, int], float]] | None:
    """From the mixed part: the rows' step alone (ms), the prompt's length, and a step's ms beside the rows with a
    chunk of the measured sizes at a prompt position (the chunk's extra time interpolated between the measured
    points); None where the part did not run."""
    by_chunk, alone, length = (result.get(key) for key in ("mixed_by_chunk", "mixed_rows_alone_ms", "mixed_len"))
    if not by_chunk or not alone or not length:
        return None
    extra = {int(count): ([int(start) for start in points],
                          [points[start]["together_ms"] - alone for start in points])
             for count, points in by_chunk.items()}

    def step_ms(count: int, done: int) -> float:
        return alone + max(float(np.interp(done, *extra[count])), 0.0)

    return alone, length, step_ms


def _schedule(result: dict, alone: float, limit: float, step_times: list[float]) -> dict:
    total = sum(step_times)
    schedule = {"limit": limit, "steps": len(step_times), "total_ms": total,
                "longest_step_ratio": max(step_times) / alone,
                "p99_step_ratio": _percentile(step_times, 99) / alone}
    if result.get("long_ttft_solo_ms"):
        schedule["ttft_ratio"] = total / result["long_ttft_solo_ms"]
    return schedule


def serial_schedule(result: dict, limit: float = TARGET_P99_RATIO) -> dict | None:
    """What the mixed part's measured steps allow one step at a time: its ``mixed_len``-position prompt prefilled
    beside the rows in chunks of the measured sizes, each step the largest chunk whose step (the rows' step alone
    plus the chunk's extra time beside them, interpolated between the measured points of the prompt) stays within
    ``limit`` times the rows' step alone, or the smallest chunk where none does. Its steps, total, longest and p99
    step against the rows' alone, and against the prompt's lone prefill where the long part measured it."""
    measured = _measured_steps(result)
    if measured is None:
        return None
    alone, length, step_ms = measured
    sizes = sorted(int(count) for count in result["mixed_by_chunk"])
    done, times = 0, []
    while done < length:
        count = max([size for size in sizes if step_ms(size, done) <= limit * alone], default=sizes[0])
        times.append(step_ms(count, done))
        done += count
    return _schedule(result, alone, limit, times)


def paced_schedule(result: dict, limit: float = MIXED_STEP_LIMIT, count_padding: bool = True) -> dict | None:
    """The engine's own pacing replayed over the mixed part's measured steps: ``ChunkPacer`` (held to ``limit``) and
    ``plan_counts`` (the step graphs' chunk sizes beside the rows, ``mixed_chunk_sizes``, their padding counted in
    the cost unless ``count_padding`` is off, as before it was) choose each chunk of the prompt, whose step is the
    measured one of the smallest measured chunk at least its padded size; the pacer is fed those times. A model of
    the long part's run: no noise, no host time. As ``serial_schedule`` returns."""
    measured = _measured_steps(result)
    if measured is None or not result.get("mixed_key_equivalent") or not result.get("mixed_chunk_sizes"):
        return None
    alone, length, step_ms = measured
    measured_sizes = sorted(int(count) for count in result["mixed_by_chunk"])
    graph_sizes, most = result["mixed_chunk_sizes"], result["mixed_chunk"]
    pacer = ChunkPacer(limit)
    pacer.measured(result["mixed_rows"], 0.0, alone / 1e3)
    done, times = 0, []
    while done < length:
        (count,), cost = plan_counts([(done, length - done)], pacer.budget(result["mixed_rows"], most),
                                     result["mixed_key_equivalent"], graph_sizes if count_padding else ())
        padded = padded_size(count, graph_sizes)
        times.append(step_ms(min([size for size in measured_sizes if size >= padded], default=most), done))
        pacer.measured(result["mixed_rows"], cost, times[-1] / 1e3)
        done += count
    return _schedule(result, alone, limit, times)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _tokenizer(vocab: int) -> SentencePieceTokenizer:
    """A BPE tokenizer trained on made-up words (the model's weights are random: any ids below its vocabulary)."""
    import sentencepiece

    rng = random.Random(0)
    letters = string.ascii_lowercase[:12]
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(2000)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(3000)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab,
                                             model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                             minloglevel=2)
    return SentencePieceTokenizer(model.getvalue())


def _image_pipeline(model: Decoder, shape: dict, max_batch_size: int) -> tuple[Pipeline, int]:
    """A Neva Pipeline over ``model`` with a random CLIP tower of ``shape``, and its image size."""
    vision = CLIPVisionConfig(**shape["vision"])
    torch.manual_seed(0)
    hidden = model.config.hidden_size
    tower = CLIPVisionModel(vision)
    linear_1, linear_2 = torch.nn.Linear(vision.hidden_size, hidden), torch.nn.Linear(hidden, hidden)
    encoder = vision_encoder(vision, hidden, tower, linear_1, linear_2, model.dtype).to(model.device)
    limits = EngineLimits(max_input_len=1024, max_output_len=8, max_batch_size=max_batch_size,
                          max_multimodal_len=encoder.tokens_per_image)
    engine = Engine({"model_type": "neva", "modality": "vision"}, limits, model,
                    _tokenizer(min(1000, model.config.vocab_size - 8)), get_template("v1"),
                    ImagePerception(encoder, encoder.preprocessor()))
    return Pipeline(engine), vision.image_size


def _burst(model: Decoder, shape: dict, count: int, repeats: int = 3) -> dict:
    """``count`` questions about one new image sent together in one ``Pipeline.run`` (one new token each), on a
    Pipeline of ``count`` rows, ``repeats`` times: the time until all are answered (median ms) and the prompt
    positions each burst prefilled, against one prompt's length."""
    pipeline, size = _image_pipeline(model, shape, count)
    rng = np.random.default_rng(1)
    params = SamplingParams(max_output_len=1)
    lengths: list[int] = []
    pipeline.submitted.append(lambda handle: lengths.append(len(handle.prompt)))
    try:
        scheduler = pipeline.scheduler
        times, prefilled = [], []
        for round_ in range(repeats + 1):  # the first round warms up
            image = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            before, start = scheduler.prefilled_positions, time.perf_counter()
            answers = pipeline.run([Request(f"Question {k}: what is thing {k} in it?", image, params)
                                    for k in range(count)])
            if errors := [answer for answer in answers if isinstance(answer, Exception)]:
                raise errors[0]
            if round_:
                times.append((time.perf_counter() - start) * 1e3)
                prefilled.append(scheduler.prefilled_positions - before)
        return {"burst_questions": count, "burst_ms": float(np.median(times)),
                "burst_prefilled_positions": int(np.median(prefilled)),
                "burst_prompt_len": int(np.median(lengths))}
    finally:
        pipeline.close()


def _ttft(model: Decoder, shape: dict, repeats: int) -> dict:
    """First and second questions about images, end to end through a Pipeline (median ms)."""
    pipeline, size = _image_pipeline(model, shape, 1)
    rng = np.random.default_rng(0)
    phases: dict[str, float] = {}
    handles: list = []
    lengths: list[int] = []
    pipeline.on_phase = lambda name, seconds: phases.__setitem__(name, phases.get(name, 0.0) + seconds * 1e3)
    pipeline.submitted.append(handles.append)

    def ask(question: str, image: np.ndarray) -> dict[str, float]:
        """One question's TTFT and its phases (ms): the Pipeline's host phases, then the scheduler's milestones."""
        phases.clear()
        handles.clear()
        start = time.monotonic()  # the clock of the handle's milestones
        (completion,) = pipeline.run([Request(question, image, SamplingParams(max_output_len=1))])
        end = time.monotonic()
        if isinstance(completion, Exception):
            raise completion
        (handle,) = handles
        lengths.append(len(handle.prompt))
        milestones = (handle.submitted_at, handle.taken_up_at, handle.admitted_at, handle.prefill_started_at,
                      handle.prefill_launched_at, handle.prompt_queued_at, handle.first_token_at, end)
        times = {"total": (end - start) * 1e3, **phases}
        times.update({name: (later - earlier) * 1e3
                      for name, earlier, later in zip(SCHEDULER_PHASES, milestones, milestones[1:])})
        return times

    try:
        images = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(repeats + 2)]
        questions = {"first": [(f"Describe image {k} in detail.", image) for k, image in enumerate(images[2:])],
                     "second": [(f"What colour is thing {k} in it?", images[2]) for k in range(repeats)]}
        for image in images[:2]:  # warm: compile, capture, autotune
            ask("Describe the image.", image)
            ask("What is in it?", image)
        scheduler = pipeline.scheduler
        parts = {}  # per question kind: its runs, the positions one prefilled (median) and its prompt's length
        with _syncs_recorded(model.device) as syncs:
            for name, asked in questions.items():
                before = scheduler.prefilled_positions
                runs = [ask(*question) for question in asked]
                parts[name] = (runs, round((scheduler.prefilled_positions - before) / repeats),
                               int(np.median(lengths[-repeats:])))
    finally:
        pipeline.close()
    result: dict = {"ttft_host_syncs": syncs}
    for name, (runs, prefilled, length) in parts.items():
        result[f"ttft_{name}_ms"] = float(np.median([times["total"] for times in runs]))
        result[f"ttft_{name}_phases_ms"] = {phase: float(np.median([times.get(phase, 0.0) for times in runs]))
                                            for phase in (*PHASES, *SCHEDULER_PHASES) if any(phase in t for t in runs)}
        result[f"ttft_{name}_reused_positions"] = length - prefilled
        # its prefill step alone on an idle device (the graph the questions replayed), and by kernel kind
        result[f"ttft_{name}_step_ms"] = prefill_step_ms(scheduler.forward, length - prefilled, prefilled)
        if model.device.type == "cuda":
            from breakdown import _kernel_profile

            piece = _null_piece(scheduler.forward, length - prefilled, prefilled)
            result.update(_kernel_profile(f"ttft_{name}_step", lambda: scheduler.forward.launch(0, 0, [piece])))
    return result


@contextlib.contextmanager
def _syncs_recorded(device: torch.device) -> Iterator[dict[str, int]]:
    """Count the host's synchronizing CUDA calls inside the block, by the line of Python that made them (CUDA's
    sync debug mode; on the CPU nothing is counted). Event waits (a step's token read) are not counted."""
    syncs: dict[str, int] = {}
    if device.type != "cuda":
        yield syncs
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchronizing" in str(warning.message):
            where = f"{os.path.relpath(warning.filename)}:{warning.lineno}"
            syncs[where] = syncs.get(where, 0) + 1


def _null_piece(step: ForwardStep, start: int, count: int) -> Piece:
    """A prompt piece of ``count`` zero embeddings after ``start`` positions, in the null block (its contents do
    not matter for timing)."""
    embeds = torch.zeros(count, step.model.config.hidden_size, dtype=step.model.dtype, device=step.model.device)
    return Piece(embeds, start, [0] * step.tables.shape[1])


def prefill_step_ms(step: ForwardStep, start: int, count: int, repeats: int = 10) -> dict[str, float]:
    """One step prefilling ``count`` positions after ``start`` (the scheduler's graph of its chunk bucket) on an
    idle device, median ms: the host's launch call, and the device's time for the step (CUDA events)."""
    device = step.model.device
    piece = _null_piece(step, start, count)
    host, busy = [], []
    for _ in range(repeats + 2):
        synchronize(device)
        began = time.perf_counter()
        if device.type == "cuda":
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        step.launch(0, 0, [piece])
        host.append((time.perf_counter() - began) * 1e3)
        if device.type == "cuda":
            events[1].record()
        synchronize(device)
        busy.append(events[0].elapsed_time(events[1]) if device.type == "cuda" else host[-1])
    return {"positions": count, "after": start, "host_launch_ms": float(np.median(host[2:])),
            "device_ms": float(np.median(busy[2:]))}


def report(result: dict) -> str:
    def value(key: str, digits: int = 2) -> str:
        number = result.get(key)
        return "-" if number is None else f"{number:.{digits}f}"

    rows = [f"device {result['device']}, {result['dtype']}, copy {result['copy_TBps']:.2f} TB/s, weights a step reads "
            f"{result['weights_read_GB']:.2f} GB, pool {result.get('pool_blocks_auto', '-')} blocks (bf16 KV) / "
            f"{result.get('pool_blocks_fp8', '-')} (fp8 KV) of {result.get('block_size', '-')} positions",
            f"{'metric':44} {'before':>8} {'now':>9} {'roofline':>9} {'roof/now':>9}  target"]

    def line(label: str, before: str, now_key: str, target: str, roofline_key: str | None = None) -> None:
        now, roof = result.get(now_key), result.get(roofline_key) if roofline_key else None
        ratio = f"{roof / now:9.2f}" if now and roof else f"{'':9}"
        rows.append(f"{label:44} {before:>8} {value(now_key):>9} {value(roofline_key) if roof else '':>9} {ratio}  "
                    f"{target}")

    line("decode 1 row ms/step (bf16 KV)", f"{BEFORE['decode_bs1_ms']:.2f}", "decode_auto_1_ms", "<= 5.6",
         "decode_auto_1_roofline_ms")
    for kv in ("auto", "fp8"):
        for rows_count in sorted({int(k.split("_")[2]) for k in result if k.startswith(f"decode_{kv}_")} - {1}):
            line(f"decode {rows_count} rows ms/step ({'bf16' if kv == 'auto' else 'fp8'} KV)", "-",
                 f"decode_{kv}_{rows_count}_ms", "roof/now >= 0.80", f"decode_{kv}_{rows_count}_roofline_ms")
    largest = max((int(k.split("_")[2]) for k in result if k.startswith("decode_fp8_") and k.endswith("_ms")
                   and "roofline" not in k), default=None)
    if largest and result.get(f"decode_auto_{largest}_ms"):
        cut = 1 - result[f"decode_fp8_{largest}_ms"] / result[f"decode_auto_{largest}_ms"]
        rows.append(f"{'fp8 KV cuts the ' + str(largest) + '-row step by':44} {'':8} {cut:9.1%} {'':19}  >= 30%")
    line("TTFT first question (image + text) ms", f"{BEFORE['ttft_first_ms']:.2f}", "ttft_first_ms", "")
    line("TTFT second question, same image ms", f"{BEFORE['ttft_second_ms']:.2f}", "ttft_second_ms", "<= 6")
    rows.append(f"  positions reused per second question: {value('ttft_second_reused_positions', 0)}")
    for name in ("first", "second"):
        breakdown = result.get(f"ttft_{name}_phases_ms") or {}
        rows.append(f"  {name} question's TTFT by phase, median ms: "
                    + ", ".join(f"{phase} {ms:.2f}" for phase, ms in breakdown.items()))
        alone = result.get(f"ttft_{name}_step_ms")
        if alone:
            rows.append(f"  {name} question's prefill step alone ({alone['positions']} positions after "
                        f"{alone['after']}): host launch {alone['host_launch_ms']:.2f} ms, device "
                        f"{alone['device_ms']:.2f} ms")
    syncs = result.get("ttft_host_syncs")
    if syncs is not None:
        rows.append("  synchronizing host calls during the timed questions: "
                    + (", ".join(f"{where} x{count}" for where, count in syncs.items()) or "none"))
    if "burst_ms" in result:
        rows.append(f"{result['burst_questions']} questions about one new image sent together: all answered in "
                    f"{result['burst_ms']:.1f} ms, {result['burst_prefilled_positions']} positions prefilled "
                    f"(one prompt: {result['burst_prompt_len']})")
    rows.append(f"{result.get('concurrent_requests', '-')} concurrent requests ({CONTEXT} + {NEW_TOKENS}): "
                f"{result.get('concurrent_completed', '-')} completed, {result.get('concurrent_errors', '-')} errors, "
                f"{value('concurrent_s')} s, {value('concurrent_tok_s', 0)} tok/s, at most "
                f"{result.get('concurrent_max_waiting', '-')} waiting, KV pool at most "
                f"{value('concurrent_max_kv_used')} used")
    if "long_len" in result:
        solo, during = result["long_rows_solo_p99_ms"], result["long_rows_during_p99_ms"]
        rows.append(f"{result['long_beside_rows']} rows decoding, per-token ms p50/p99: alone "
                    f"{value('long_rows_solo_p50_ms')}/{value('long_rows_solo_p99_ms')}, while a "
                    f"{result['long_len']}-position prompt is prefilled {value('long_rows_during_p50_ms')}/"
                    f"{value('long_rows_during_p99_ms')} (p99 x{during / solo:.2f}, target <= 2)")
        rows.append(f"{result['long_len']}-position prompt TTFT ms: alone {value('long_ttft_solo_ms', 1)}, while "
                    f"{result['long_beside_rows']} rows decode {value('long_ttft_during_ms', 1)} (x"
                    f"{result['long_ttft_during_ms'] / result['long_ttft_solo_ms']:.2f}, target <= 1.3)")
        for limit, run in result.get("long_at_limits", {}).items():
            rows.append(f"  with a mixed step held to x{limit} the rows' own: rows' p99 x{run['p99_ratio']:.2f}, "
                        f"prompt TTFT x{run['ttft_ratio']:.2f} ({run['steps_beside']} steps beside them)")
        if "long_steps_beside" in result:
            rows.append(f"  it took {result['long_steps_beside']} steps beside them (mean chunk "
                        f"{result['long_len'] / max(result['long_steps_beside'], 1):.0f} positions)"
                        + (f"; pacer at its end: rows alone {value('long_pacer_rows_alone_ms')} ms, "
                           f"{value('long_pacer_unit_us', 1)} us a chunk_cost unit beside them, budget "
                           f"{result['long_pacer_last_budget']}" if "long_pacer_last_budget" in result else ""))
    if "mixed_rows_alone_ms" in result:
        rows.append(f"one step, device ms: {result['mixed_rows']} decode rows alone "
                    f"{result['mixed_rows_alone_ms']:.2f}; a C-position chunk after P positions alone / beside them:")
        for count, points in result.get("mixed_by_chunk", {}).items():
            rows.append(f"  C={count}: " + ", ".join(f"P={start} {times['chunk_alone_ms']:.2f} / "
                                                     f"{times['together_ms']:.2f}" for start, times in points.items()))
        for label, schedule in (("one step at a time from these steps, each <=", serial_schedule(result)),
                                ("the engine's pacer replayed over them, limit", paced_schedule(result))):
            if schedule:
                rows.append(f"  {label} x{schedule['limit']:.2f} the rows' alone: {schedule['steps']} steps, "
                            f"{schedule['total_ms']:.1f} ms (step p99 x{schedule['p99_step_ratio']:.2f}, longest "
                            f"x{schedule['longest_step_ratio']:.2f})"
                            + (f", x{schedule['ttft_ratio']:.2f} the prompt's lone prefill (target <= 1.3)"
                               if "ttft_ratio" in schedule else ""))
    if "breakdown_mixed_kernel_us_by_kind" in result:
        rows.append("  the step beside them at the last P by kernel kind, us: "
                    + ", ".join(f"{kind} {us:.0f}" for kind, us in result["breakdown_mixed_kernel_us_by_kind"].items()))
        rows += [f"    {line}" for line in result["breakdown_mixed_top_kernels_us"]]
    rows += [f"chunk kernel configuration chosen, {line}" for line in result.get("chunk_configs", [])]
    for kv in ("auto", "fp8"):
        rows += [f"decode kernel configuration chosen ({kv} KV), {line}"
                 for line in result.get(f"decode_configs_{kv}", [])]
    rows += [f"{key}: {result[key]}" for key in sorted(result) if key.endswith("_error")]
    return "\n".join(rows)


def _add_parts_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="the parts to run (default: all)")


if __name__ == "__main__":
    bench_main(__doc__, "paged_bench", run, report, _add_parts_option)
