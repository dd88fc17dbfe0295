"""The in-flight scheduler on the CPU: admission into free slots, slot reuse, per-request parameters, stop
conditions, streaming order, cancellation and failures, each checked against generate() run on the request alone."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from exporter.llm.generate import SamplingParams
from exporter.llm.model import Decoder
from exporter.llm.sampling import POSITION
from exporter.llm.tokenizer import Tokenizer
from exporter.runtime.scheduler import RequestCancelled, Scheduler, generate
from support.decoders import SCHEDULER_VOCAB, scheduler_decoder
from support.decoding import run_until_idle


@pytest.fixture(scope="module")
def model() -> Decoder:
    return scheduler_decoder()


def _prompt(model: Decoder, seed: int, length: int) -> tuple[torch.Tensor, list[int]]:
    ids = torch.randint(3, SCHEDULER_VOCAB, (length,), generator=torch.Generator().manual_seed(seed))
    return model.embed(ids), ids.tolist()


def _alone(model: Decoder, prompt, ids, params: SamplingParams) -> list[int]:
    return generate(model, [prompt], [ids], [params], eos_id=None)[0][0]


REQUESTS = [
    (1, 5, SamplingParams(max_output_len=12)),
    (2, 9, SamplingParams(max_output_len=7, repetition_penalty=1.3)),
    (3, 3, SamplingParams(max_output_len=10, top_k=0, top_p=0.9, temperature=0.8, seed=11)),
    (4, 14, SamplingParams(max_output_len=4)),
    (5, 6, SamplingParams(max_output_len=9, top_k=5, temperature=1.5, seed=3)),
]


def test_requests_share_few_slots_and_each_gets_its_own_answer(model):
    scheduler = Scheduler(model, max_slots=2, max_seq_len=64, eos_id=None)
    occupancy: list[int] = []
    handles = []
    for seed, length, params in REQUESTS:
        prompt, ids = _prompt(model, seed, length)
        handles.append((scheduler.submit(prompt, ids, params), prompt, ids, params))
    while scheduler.step():
        occupancy.append(sum(slot is not None for slot in scheduler.slots))
    assert max(occupancy) == 2 and len(occupancy) < sum(p.max_output_len for *_, p in REQUESTS)
    for handle, prompt, ids, params in handles:
        assert handle.result(timeout=0) == _alone(model, prompt, ids, params)


def test_newcomers_join_a_running_batch(model):
    scheduler = Scheduler(model, max_slots=4, max_seq_len=64, eos_id=None)
    first = scheduler.submit(*_prompt(model, 7, 5), SamplingParams(max_output_len=20))
    for _ in range(5):
        scheduler.step()
    late_prompt, late_ids = _prompt(model, 8, 11)
    late = scheduler.submit(late_prompt, late_ids, SamplingParams(max_output_len=6))
    scheduler.step()  # the step queued ahead of this one runs first; the newcomer is admitted at the next
    scheduler.step()
    assert sum(slot is not None for slot in scheduler.slots) == 2  # admitted between steps, decoding jointly
    run_until_idle(scheduler)
    assert late.result(timeout=0) == _alone(model, late_prompt, late_ids, SamplingParams(max_output_len=6))
    assert len(first.result(timeout=0)) == 20


def test_stop_conditions(model):
    prompt, ids = _prompt(model, 9, 6)
    full = _alone(model, prompt, ids, SamplingParams(max_output_len=10))
    end_id = full[4]
    stop_at = full.index(end_id)
    scheduler = Scheduler(model, max_slots=2, max_seq_len=64, eos_id=None)
    by_end_id = scheduler.submit(prompt, ids, SamplingParams(max_output_len=10, end_id=end_id))
    by_eos = Scheduler(model, max_slots=1, max_seq_len=64, eos_id=end_id)
    by_eos_handle = by_eos.submit(prompt, ids, SamplingParams(max_output_len=10))
    run_until_idle(scheduler)
    run_until_idle(by_eos)
    assert by_end_id.result(timeout=0) == full[:stop_at] == by_eos_handle.result(timeout=0)


class LetterTokenizer(Tokenizer):
    """Token i reads as one letter (a..z cycling), for stop strings."""

    bos_id, eos_id, pad_id, vocab_size = None, None, None, SCHEDULER_VOCAB

    def encode(self, text, add_bos=False):
        raise NotImplementedError

    def decode(self, ids, skip_special=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def token_to_id(self, token):
        return None

    def save(self, directory):
        return {}


def test_stop_strings_end_a_request_like_generate(model):
    tokenizer = LetterTokenizer()
    prompt, ids = _prompt(model, 10, 5)
    full = _alone(model, prompt, ids, SamplingParams(max_output_len=12))
    params = SamplingParams(max_output_len=12, stop=(tokenizer.decode(full[3:5]),))
    expected = generate(model, [prompt], [ids], [params], eos_id=None, tokenizer=tokenizer)[0][0]
    scheduler = Scheduler(model, max_slots=2, max_seq_len=64, eos_id=None, tokenizer=tokenizer)
    handle = scheduler.submit(prompt, ids, params)
    run_until_idle(scheduler)
    assert handle.result(timeout=0) == expected and len(expected) < 12


def test_streaming_callback_sees_tokens_in_order(model):
    scheduler = Scheduler(model, max_slots=2, max_seq_len=64, eos_id=None)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    handles = [scheduler.submit(*_prompt(model, 20 + k, 4 + k), SamplingParams(max_output_len=8),
                                on_token=streamed[k].append) for k in (0, 1)]
    run_until_idle(scheduler)
    for k, handle in enumerate(handles):
        assert streamed[k] == handle.result(timeout=0) and len(streamed[k]) == 8



def test_on_finish_is_called_once_after_the_last_token_with_the_handle_done(model):
    """A stream's end mark (``Pipeline.stream`` puts it from ``on_finish``, no thread waiting per stream)."""
    scheduler = Scheduler(model, max_slots=2, max_seq_len=64, eos_id=None)
    events: list = []
    handle = scheduler.submit(*_prompt(model, 30, 5), SamplingParams(max_output_len=6), on_token=events.append)
    handle.on_finish = lambda: events.append(("end", handle.done))
    cancelled = scheduler.submit(*_prompt(model, 31, 5), SamplingParams(max_output_len=6))
    cancelled.on_finish = lambda: events.append("cancelled")
    cancelled.cancel()
    run_until_idle(scheduler)
    assert events == ["cancelled", *handle.result(timeout=0), ("end", True)]

def test_cancelled_request_frees_its_slot_and_others_continue(model):
    scheduler = Scheduler(model, max_slots=1, max_seq_len=64, eos_id=None)
    seen: list[int] = []

    def cancel_after_three(token: int) -> None:
        seen.append(token)
        if len(seen) == 3:
            victim.cancel()

    victim = scheduler.submit(*_prompt(model, 30, 5), SamplingParams(max_output_len=40), on_token=cancel_after_three)
    prompt, ids = _prompt(model, 31, 7)
    waiting = scheduler.submit(prompt, ids, SamplingParams(max_output_len=5))
    steps = run_until_idle(scheduler)
    with pytest.raises(RequestCancelled, match="after 3 tokens"):
        victim.result(timeout=0)
    assert waiting.result(timeout=0) == _alone(model, prompt, ids, SamplingParams(max_output_len=5))
    assert steps < 40


def test_background_loop_serves_concurrent_submitters(model):
    scheduler = Scheduler(model, max_slots=3, max_seq_len=64, eos_id=None)
    scheduler.start()
    try:
        results: dict[int, list[int]] = {}

        def client(k: int) -> None:
            prompt, ids = _prompt(model, 40 + k, 3 + k)
            results[k] = scheduler.submit(prompt, ids, SamplingParams(max_output_len=6)).result(timeout=60)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        scheduler.stop()
    for k in range(6):
        prompt, ids = _prompt(model, 40 + k, 3 + k)
        assert results[k] == _alone(model, prompt, ids, SamplingParams(max_output_len=6))


def test_limits_are_refused(model):
    scheduler = Scheduler(model, max_slots=2, max_seq_len=16, eos_id=None, max_beam_width=2)
    prompt, ids = _prompt(model, 50, 10)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        scheduler.submit(prompt, ids, SamplingParams(max_output_len=10))
    with pytest.raises(ValueError, match="num_beams=3 is over max_beam_width=2"):
        scheduler.submit(prompt, ids, SamplingParams(max_output_len=2, num_beams=3))
    with pytest.raises(ValueError, match="on_token streams one sequence"):
        scheduler.submit(prompt, ids, SamplingParams(max_output_len=2, num_beams=2), on_token=print)
    with pytest.raises(ValueError, match=r"max_beam_width \(3\) must be between 1 and max_slots \(2\)"):
        Scheduler(model, max_slots=2, max_seq_len=16, eos_id=None, max_beam_width=3)


def test_admission_fills_the_lowest_free_slots(model):
    scheduler = Scheduler(model, max_slots=3, max_seq_len=64, eos_id=None)
    short = scheduler.submit(*_prompt(model, 60, 4), SamplingParams(max_output_len=2))
    scheduler.submit(*_prompt(model, 61, 4), SamplingParams(max_output_len=30))
    third = scheduler.submit(*_prompt(model, 62, 4), SamplingParams(max_output_len=2))
    for _ in range(3):  # the prompts with their first tokens, then two decode steps (one read per step)
        scheduler.step()
    assert short.done and third.done and scheduler.slots[1] is not None  # slots 0 and 2 free, 1 busy
    late = [(*_prompt(model, 63 + k, 5 + k), SamplingParams(max_output_len=4 + k)) for k in range(2)]
    handles = [scheduler.submit(*request) for request in late]
    scheduler.step()
    assert scheduler.slots[0] is not None and scheduler.slots[2] is not None  # both around the busy row
    run_until_idle(scheduler)
    for handle, (prompt, ids, params) in zip(handles, late):
        assert handle.result(timeout=0) == _alone(model, prompt, ids, params)


def test_gathering_more_positions_than_the_furthest_changes_nothing(model):
    scheduler = Scheduler(model, max_slots=2, max_seq_len=200, eos_id=None)
    for seed, length in ((70, 9), (71, 23)):
        scheduler.submit(*_prompt(model, seed, length), SamplingParams(max_output_len=50))
    for _ in range(3):
        scheduler.step()
    state = scheduler.chooser.snapshot()
    furthest = int(scheduler.chooser.ints[POSITION, :2].max()) + 1
    with torch.inference_mode():
        exact = scheduler.forward._compute(2, None, False, span=furthest)
        scheduler.chooser.restore(state)
        spanned = scheduler.forward._compute(2, None, False, span=scheduler.max_seq_len)
    torch.testing.assert_close(spanned, exact, rtol=1e-5, atol=1e-5)


def test_steps_queued_ahead_leave_the_tokens_unchanged(model):
    """Greedy requests ending at different steps, with a newcomer and a cancellation: the step queued ahead of
    the host never changes what a request gets."""
    scheduler = Scheduler(model, max_slots=3, max_seq_len=64, eos_id=None)
    requests = [(*_prompt(model, 100 + k, 3 + 2 * k), SamplingParams(max_output_len=4 + 5 * k)) for k in range(4)]
    handles = [scheduler.submit(*requests[k]) for k in range(3)]
    streamed: list[int] = []

    def cancel_after_two(token: int) -> None:
        streamed.append(token)
        if len(streamed) == 2:
            victim.cancel()

    for step in range(60):
        if step == 6:
            handles.append(scheduler.submit(*requests[3]))
            victim = scheduler.submit(*_prompt(model, 110, 4), SamplingParams(max_output_len=30),
                                      on_token=cancel_after_two)
        if not scheduler.step():
            break
    assert scheduler.steps_queued_ahead == scheduler.decode_steps - 1  # all but the very first
    for handle, (prompt, ids, params) in zip(handles, requests):
        assert handle.result(timeout=0) == _alone(model, prompt, ids, params)
    with pytest.raises(RequestCancelled, match="after 2 tokens"):
        victim.result(timeout=0)


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(model):
    scheduler = Scheduler(model, max_slots=2, max_seq_len=64, eos_id=None)
    forward = scheduler.forward

    class Broken:
        def launch(self, *args, **kwargs):
            raise RuntimeError("device lost")

    scheduler.forward = Broken()
    scheduler.start()
    try:
        broken = scheduler.submit(*_prompt(model, 80, 4), SamplingParams(max_output_len=5))
        with pytest.raises(RuntimeError, match="device lost"):
            broken.result(timeout=30)
        scheduler.forward = forward
        prompt, ids = _prompt(model, 81, 6)
        assert scheduler.submit(prompt, ids, SamplingParams(max_output_len=5)).result(timeout=30) == _alone(
            model, prompt, ids, SamplingParams(max_output_len=5))
    finally:
        scheduler.stop()


def test_stop_ends_unfinished_requests(model):
    scheduler = Scheduler(model, max_slots=1, max_seq_len=64, eos_id=None)
    running = scheduler.submit(*_prompt(model, 90, 4), SamplingParams(max_output_len=30))
    queued = scheduler.submit(*_prompt(model, 91, 4), SamplingParams(max_output_len=30))
    scheduler.step()
    scheduler.stop()
    for handle in (running, queued):
        with pytest.raises(RequestCancelled, match="stopped"):
            handle.result(timeout=0)


def test_bad_prompts_are_refused_with_the_reason(model):
    scheduler = Scheduler(model, max_slots=1, max_seq_len=64, eos_id=None)
    prompt, ids = _prompt(model, 95, 6)
    with pytest.raises(ValueError, match=r"\[T, 32\]"):
        scheduler.submit(prompt[:, :16], ids, SamplingParams())
    with pytest.raises(ValueError, match="6 embeddings but 5 token ids"):
        scheduler.submit(prompt, ids[:5], SamplingParams())
    with pytest.raises(ValueError, match="no tokenizer"):
        scheduler.submit(prompt, ids, SamplingParams(stop=("x",)))


MIXED = [
    (120, 5, SamplingParams(max_output_len=12)),
    (121, 8, SamplingParams(max_output_len=9, num_beams=3)),
    (122, 3, SamplingParams(max_output_len=10, top_k=0, top_p=0.9, temperature=0.8, seed=11)),
    (123, 6, SamplingParams(max_output_len=7, num_beams=2, repetition_penalty=1.4)),
    (124, 11, SamplingParams(max_output_len=8, repetition_penalty=1.3)),
    (125, 4, SamplingParams(max_output_len=11, top_k=6, temperature=1.5, seed=3, repetition_penalty=1.2)),
    (126, 7, SamplingParams(max_output_len=6, num_beams=3, end_id=9)),
]


def _results_alone(model, prompt, ids, params, **kwargs) -> list[list[int]]:
    return generate(model, [prompt], [ids], [params], eos_id=None, **kwargs)[0]


def test_beam_and_sampled_requests_mixed_into_a_greedy_batch_get_their_answers_alone(model):
    """Beam searches, seeded samples and penalised rows join and leave a running greedy batch (some arriving
    late, some waiting for rows): each gets what it gets alone, and every decode step but the first is queued
    before the host reads the one before it."""
    scheduler = Scheduler(model, max_slots=6, max_seq_len=64, eos_id=None, max_beam_width=3)
    requests = [(*_prompt(model, seed, length), params) for seed, length, params in MIXED]
    handles = [scheduler.submit(*request) for request in requests[:4]]
    rows_in_use = []
    for step in range(200):
        if step == 3:
            handles += [scheduler.submit(*request) for request in requests[4:]]
        if not scheduler.step():
            break
        rows_in_use.append(scheduler.stats().running_rows)
    assert max(rows_in_use) >= 5 and scheduler.stats().running_rows == 0
    for handle, (prompt, ids, params) in zip(handles, requests):
        assert handle.results(timeout=0) == _results_alone(model, prompt, ids, params)
        assert len(handle.results(timeout=0)) == params.num_beams
    assert scheduler.steps_queued_ahead == scheduler.decode_steps - 1


def test_seeded_sampling_is_the_same_alone_and_in_any_batch(model):
    params = SamplingParams(max_output_len=12, top_k=0, top_p=0.95, temperature=1.3, seed=2024)
    prompt, ids = _prompt(model, 130, 6)
    alone = _results_alone(model, prompt, ids, params)
    scheduler = Scheduler(model, max_slots=4, max_seq_len=64, eos_id=None, max_beam_width=2)
    others = [scheduler.submit(*_prompt(model, 131 + k, 4 + k), SamplingParams(max_output_len=5 + 3 * k,
                                                                              top_k=4, seed=k))
              for k in range(3)]
    run_until_idle(scheduler)  # a batch that ran before: the request lands on other rows with other neighbours
    scheduler.submit(*_prompt(model, 135, 5), SamplingParams(max_output_len=4, num_beams=2))
    late = scheduler.submit(prompt, ids, params)
    unseeded = [scheduler.submit(prompt, ids, replace(params, seed=None)) for _ in range(2)]
    run_until_idle(scheduler)
    assert [late.result(timeout=0)] == alone and all(handle.done for handle in others)
    assert len({tuple(handle.result(timeout=0)) for handle in [late, *unseeded]}) == 3  # no seed: a random one
    assert _results_alone(model, prompt, ids, replace(params, seed=2025)) != alone


def test_a_stop_string_ending_a_continued_beam_rebuilds_the_search(model, monkeypatch):
    """The device continues the best beams that are no end token; when a stop string ends one of them the host
    rebuilds the search's rows and skips the step queued meanwhile, and the beams equal generate() alone."""
    tokenizer = LetterTokenizer()
    prompt, ids = _prompt(model, 140, 7)
    beams = _results_alone(model, prompt, ids, SamplingParams(max_output_len=8, num_beams=3))
    params = SamplingParams(max_output_len=8, num_beams=3, stop=(tokenizer.decode(beams[1][2:4]),))
    expected = _results_alone(model, prompt, ids, params, tokenizer=tokenizer)
    assert expected != beams
    rebuilt = []
    scheduler = Scheduler(model, max_slots=5, max_seq_len=64, eos_id=None, tokenizer=tokenizer, max_beam_width=3)
    rebuild = scheduler._rebuild
    monkeypatch.setattr(scheduler, "_rebuild", lambda request: (rebuilt.append(request), rebuild(request)))
    greedy_prompt, greedy_ids = _prompt(model, 141, 5)
    greedy = scheduler.submit(greedy_prompt, greedy_ids, SamplingParams(max_output_len=20))
    handle = scheduler.submit(prompt, ids, params)
    run_until_idle(scheduler)
    assert rebuilt and handle.results(timeout=0) == expected
    assert greedy.result(timeout=0) == _alone(model, greedy_prompt, greedy_ids, SamplingParams(max_output_len=20))


def test_a_beam_search_waits_for_enough_consecutive_free_rows(model):
    scheduler = Scheduler(model, max_slots=3, max_seq_len=64, eos_id=None, max_beam_width=3)
    short = scheduler.submit(*_prompt(model, 150, 4), SamplingParams(max_output_len=2))
    long = scheduler.submit(*_prompt(model, 151, 4), SamplingParams(max_output_len=12))
    prompt, ids = _prompt(model, 152, 6)
    wide = scheduler.submit(prompt, ids, SamplingParams(max_output_len=5, num_beams=2))
    behind = scheduler.submit(*_prompt(model, 153, 3), SamplingParams(max_output_len=3))
    scheduler.step()
    assert scheduler.slots[2] is None and len(scheduler.waiting) == 2  # one row free: the beam search waits
    while not long.done:
        scheduler.step()
        assert not behind.done or wide.done  # first come, first served: nobody overtakes the beam search
    run_until_idle(scheduler)
    assert short.done and wide.results(timeout=0) == _results_alone(model, prompt, ids, wide.params)
    assert behind.done
