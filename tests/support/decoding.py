"""Reference decoding and comparisons: uncached beam search, static-cache greedy, transformers' greedy, the
scheduler's captured steps, and the relative error the numeric checks bound."""

from __future__ import annotations

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from exporter.llm import Decoder, SamplingParams
from exporter.llm.sampling import TokenChooser
from exporter.runtime.cuda_graphs import ForwardStep, Piece
from exporter.runtime.scheduler import Scheduler


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """`|ours - reference| / |reference|` (Frobenius norms, in float32)."""
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()


def run_until_idle(scheduler: Scheduler) -> int:
    """Step `scheduler` until it has nothing left to do; the number of steps (fewer than 10,000)."""
    steps = 0
    while scheduler.step():
        steps += 1
        assert steps < 10_000
    return steps


def record_steps(scheduler: Scheduler) -> list[tuple[int, int]]:
    """From now on, each step `scheduler` launches appends (decode rows, prompt positions of its chunk) to the list
    returned."""
    steps: list[tuple[int, int]] = []
    launch = scheduler.forward.launch

    def recording(rows, furthest, pieces=(), *args, **kwargs):
        steps.append((rows, sum(len(piece.embeds) for piece in pieces)))
        return launch(rows, furthest, pieces, *args, **kwargs)

    scheduler.forward.launch = recording
    return steps


def captured_decode_logits(model, ids: torch.Tensor, start: int, kv_scales: torch.Tensor | None = None):
    """Logits `[B, T - start, V]` of positions `start..T-1` of token rows `ids [B, T]` as the scheduler's steps
    compute them: `ids[:, :start]` prefilled as prompt pieces into a paged KV cache (float8 with `kv_scales`), then
    one decode step per further token (captured CUDA graphs on CUDA). Returns the logits and the step (for its
    graph count)."""
    rows, length = ids.shape
    block_size = 16
    width = -(-length // block_size) + 1
    cache = model.new_paged_kv_cache(1 + rows * width, block_size, kv_scales)
    tables = torch.arange(1, 1 + rows * width, dtype=torch.int32).view(rows, width)
    chooser = TokenChooser(rows, model.config.vocab_size, model.device)
    step = ForwardStep(model, cache, tables.to(model.device), chooser, max_chunk=max(start * rows, 32))
    ids = ids.to(model.device)
    step.launch(0, 0, [Piece(model.embed(ids[row, :start]), 0, tables[row].tolist()) for row in range(rows)])
    logits = [step.launch(rows, t + 1, tokens=ids[:, t].tolist(), positions=[t] * rows)[0].logits.clone()
              for t in range(start, length)]
    return torch.stack(logits, 1), step



@torch.inference_mode()
def static_greedy(model: Decoder, embeds: torch.Tensor, count: int) -> list[int]:
    """Greedy tokens through the static cache: one prefill, then one decode step per token (no paging)."""
    length = len(embeds)
    cache = model.new_kv_cache(1, length + count)
    logits = model(embeds[None], kv_cache=cache)[0, -1]
    tokens = []
    for step in range(count):
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] > 1e-4, "a near-tie: pick another prompt"  # well posed in float32
        tokens.append(int(logits.argmax()))
        position = length + step
        logits = model(model.embed(torch.tensor([[tokens[-1]]])), torch.tensor([[position]]), cache,
                       kv_len=position + 1)[0, -1]
    return tokens



@torch.no_grad()
def reference_beam_search(
    model: Decoder, prompt: list[int], params: SamplingParams, eos_id=None, tokenizer=None
) -> list[list[int]]:
    """Beam search as documented, recomputing every beam's whole sequence at each step (no cache), with
    transformers' repetition penalty and stop strings found in the whole decoded answer."""
    width = params.num_beams
    end_ids = {params.end_id if params.end_id is not None else eos_id, *params.stop_token_ids} - {None}
    beams, scores, finished = [[]], [0.0], []

    def finish(score: float, tokens: list[int], length: int) -> None:
        finished.append((score / length, tokens))
        finished.sort(key=lambda hypothesis: hypothesis[0], reverse=True)
        del finished[width:]

    for _ in range(params.max_output_len):
        candidates = []
        for beam, score in zip(beams, scores):
            ids = torch.tensor([prompt + beam])
            logits = model(model.embed(ids))[:, -1].float()
            logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, logits)[0]
            candidates += [(score + lp, beam, token) for token, lp in enumerate(logits.log_softmax(-1).tolist())]
        candidates.sort(key=lambda candidate: candidate[0], reverse=True)
        live = []
        for rank, (value, beam, token) in enumerate(candidates[: 2 * width]):
            if len(live) == width:
                break
            tokens = beam + [token]
            stopped = token not in end_ids and any(s in tokenizer.decode(tokens, skip_special=False)
                                                   for s in params.stop)
            if token in end_ids or stopped:
                if rank < width:
                    finish(value, tokens if stopped else beam, len(tokens))
                continue
            live.append((value, tokens))
        if not live:
            break
        scores, beams = [value for value, _ in live], [tokens for _, tokens in live]
        if len(beams[0]) == params.max_output_len:
            for score, tokens in live:
                finish(score, tokens, len(tokens))
            break
        if len(finished) == width and finished[-1][0] >= max(scores) / len(beams[0]):
            break
    return [tokens for _, tokens in finished]



def check_logits_and_cache(ours: Decoder, hf: torch.nn.Module, seed: int = 1) -> None:
    """Full-sequence logits match; prefill + one-token decode steps through the KV cache match too."""
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        reference = hf(ids).logits
        assert relative_error(ours(ours.embed(ids)), reference) < 1e-5
        cache = ours.new_kv_cache(2, 16)
        prefill = ours(ours.embed(ids[:, :8]), torch.arange(8).expand(2, 8), cache, kv_len=8)
        steps = [
            ours(ours.embed(ids[:, t : t + 1]), torch.full((2, 1), t), cache, kv_len=t + 1)
            for t in range(8, 12)
        ]
    assert relative_error(torch.cat([prefill, *steps], dim=1), reference) < 1e-5



def hf_greedy(
    hf: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos_id: int | None, **kwargs
) -> list:
    """transformers' greedy answer to `prompt` (ids), cut at `eos_id`."""
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_id,
        pad_token_id=0,
        **kwargs,
    )[0, len(prompt) :].tolist()
    return out[: out.index(eos_id)] if eos_id in out else out
