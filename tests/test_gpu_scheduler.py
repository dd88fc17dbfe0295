"""On CUDA (skipped elsewhere): greedy, sampled and beam-search rows decoded together in captured steps, each next
step queued before the host reads the last, give what each request gets alone (eagerly, on the same GPU), and the
greedy and beam answers are the CPU's."""

from __future__ import annotations

import threading

import pytest
import torch

from exporter.llm.generate import SamplingParams
from exporter.runtime.scheduler import Scheduler, generate
from support.decoders import PARITY_VOCAB, parity_decoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PARAMS = [
    SamplingParams(max_output_len=16),
    SamplingParams(max_output_len=10, num_beams=3, repetition_penalty=1.3),
    SamplingParams(max_output_len=14, top_k=0, top_p=0.9, temperature=0.9, seed=5),
    SamplingParams(max_output_len=12, num_beams=2),
    SamplingParams(max_output_len=9, top_k=8, temperature=1.4, seed=2, repetition_penalty=1.2),
    SamplingParams(max_output_len=11, repetition_penalty=1.5),
]


@torch.inference_mode()
def test_mixed_rows_in_captured_steps_equal_each_alone():
    gpu = parity_decoder("cuda", torch.float32)
    prompts = [torch.randint(3, PARITY_VOCAB, (n,), generator=torch.Generator().manual_seed(n))
               for n in (5, 9, 14, 7, 4, 11)]
    alone = [generate(gpu, [gpu.embed(p.cuda())], [p.tolist()], [params])[0] for p, params in zip(prompts, PARAMS)]
    scheduler = Scheduler(gpu, max_slots=8, max_seq_len=64, eos_id=None, use_cuda_graphs=True, max_beam_width=3)
    scheduler.warm_up()
    captured = scheduler.forward.graph_count
    handles = [scheduler.submit(gpu.embed(p.cuda()), p.tolist(), params) for p, params in zip(prompts, PARAMS)][:3]
    for _ in range(4):
        scheduler.step()
    handles += [scheduler.submit(gpu.embed(p.cuda()), p.tolist(), params) for p, params in zip(prompts[3:], PARAMS[3:])]
    while scheduler.step():
        pass
    assert [handle.results() for handle in handles] == alone
    assert captured > 0 and scheduler.forward.graph_count == captured  # the warm-up captured every step it ran
    assert scheduler.steps_queued_ahead == scheduler.decode_steps - 1

    cpu = parity_decoder("cpu", torch.float32)
    for prompt, params, results in zip(prompts, PARAMS, alone):
        if params.greedy or params.num_beams > 1:
            assert generate(cpu, [cpu.embed(prompt)], [prompt.tolist()], [params])[0] == results


@torch.inference_mode()
def test_served_warm_up_captures_the_rest_in_the_background_and_answers_stay_the_same():
    """A server's warm-up: the first request's graphs before serving, the others by the scheduler's thread when
    idle; requests before, during and after those captures get what they get alone."""
    gpu = parity_decoder("cuda", torch.float32)
    prompts = [torch.randint(3, PARITY_VOCAB, (n,), generator=torch.Generator().manual_seed(n))
               for n in (5, 9, 14, 7, 4, 11)]
    alone = [generate(gpu, [gpu.embed(p.cuda())], [p.tolist()], [params])[0] for p, params in zip(prompts, PARAMS)]
    scheduler = Scheduler(gpu, max_slots=8, max_seq_len=64, eos_id=None, use_cuda_graphs=True, max_beam_width=3)
    done = threading.Event()
    scheduler.on_captured = done.set
    scheduler.warm_up(rest_in_background=True)
    assert sorted(scheduler.forward.graphs) == sorted(scheduler.forward.first_keys())
    scheduler.start()
    try:
        handles = [scheduler.submit(gpu.embed(p.cuda()), p.tolist(), params) for p, params in zip(prompts, PARAMS)]
        assert [handle.results(timeout=120) for handle in handles] == alone  # padded or eager steps
        scheduler.capture_in_background()  # as a server does once READY
        assert done.wait(300), "the background captures did not finish"
        assert sorted(scheduler.forward.graphs) == sorted(scheduler.forward.graph_keys())
        eager = scheduler.forward.eager_steps
        handles = [scheduler.submit(gpu.embed(p.cuda()), p.tolist(), params) for p, params in zip(prompts, PARAMS)]
        assert [handle.results(timeout=120) for handle in handles] == alone
        assert scheduler.forward.eager_steps == eager  # every step replayed a graph
    finally:
        scheduler.stop()
