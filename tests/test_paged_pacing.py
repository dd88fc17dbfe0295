"""The chunk budget beside decoding rows from measured step times (`ChunkPacer`), on the CPU: fed times, it keeps a
mixed step within `MIXED_STEP_LIMIT` times the rows' own step, never above the chunk the step graphs were captured
for; measures only steps the host waited for back to back; and the scheduler's chunks follow it, the tokens still
the static cache's in float32."""

from __future__ import annotations

import pytest
import torch

from exporter.llm.config import DecoderConfig
from exporter.llm.generate import SamplingParams
from exporter.llm.model import Decoder, select_llm_weights
from exporter.runtime.chunk_pacing import MIXED_STEP_LIMIT, SMALLEST_SHARE, WAITED_S, ChunkPacer
from exporter.runtime.kv_cache import KVCacheOptions
from exporter.runtime.scheduler import DECODE_CHUNK_TOKENS, Scheduler
from support.decoders import LONG_CONFIG, SCHEDULER_VOCAB, make_tiny_gpt_weights, random_ids
from support.decoding import record_steps, run_until_idle, static_greedy

ALONE_S = 0.0077  # the H100's 16-row decode step


def test_the_budget_keeps_a_mixed_step_within_the_limit_of_the_rows_own_step():
    pacer = ChunkPacer()
    assert pacer.budget(16, 384) == 384  # nothing measured: the largest budget
    pacer.measured(16, 0.0, ALONE_S)
    assert pacer.budget(16, 384) == 384  # no mixed step measured yet
    pacer.measured(16, 300.0, ALONE_S + 300 * 40e-6)  # 40 us a unit beside the rows
    allowed = (MIXED_STEP_LIMIT - 1) * ALONE_S / 40e-6
    assert pacer.budget(16, 384) == int(allowed) < 384
    assert pacer.budget(16, 100) == 100  # never above the captured chunk
    assert pacer.budget(8, 384) == int(allowed)  # 8 rows alone never measured: the nearest rows measured
    pacer.measured(8, 0.0, ALONE_S * 0.75)
    assert pacer.budget(8, 384) == int(allowed * 0.75)  # rows of a shorter step take a smaller chunk
    assert pacer.budget(12, 384) == int(allowed * 0.75)  # as near to 8 as to 16: the fewer rows, the smaller


def test_the_running_averages_follow_the_step_times():
    pacer = ChunkPacer()
    pacer.measured(16, 0.0, ALONE_S)
    pacer.measured(16, 200.0, ALONE_S + 200 * 20e-6)
    budgets = [pacer.budget(16, 400)]
    for _ in range(20):  # the chunk's keys get longer: each unit costs twice as much
        pacer.measured(16, 200.0, ALONE_S + 200 * 40e-6)
        budgets.append(pacer.budget(16, 400))
    assert all(a > b for a, b in zip(budgets[:3], budgets[1:4]))  # it moves at once
    assert budgets[-1] == pytest.approx((MIXED_STEP_LIMIT - 1) * ALONE_S / 40e-6, rel=0.01)
    pacer.measured(16, 200.0, ALONE_S / 2)  # faster than the rows alone (noise): no negative cost
    assert pacer.unit_s > 0
    for _ in range(40):
        pacer.measured(16, 200.0, 1.0)  # very slow mixed steps: a quarter of the largest chunk still
    assert pacer.budget(16, 384) == 384 // SMALLEST_SHARE == 96


def test_only_steps_the_host_waited_for_back_to_back_are_measured():
    pacer = ChunkPacer()
    wait = 2 * WAITED_S
    pacer.read_back(16, 0.0, 0.0, wait, next_queued=True)  # the first: nothing before it
    assert pacer.alone_s == {}
    pacer.read_back(16, 0.0, 0.005, 0.0077 + wait, next_queued=True)
    assert pacer.alone_s[16] == pytest.approx(0.0077)
    pacer.read_back(16, 0.0, 0.020, 0.020 + WAITED_S / 2, next_queued=True)  # done before the host read it
    pacer.read_back(16, 0.0, 0.021, 0.030, next_queued=True)  # the step before's end is not known
    assert pacer.alone_s[16] == pytest.approx(0.0077)
    pacer.read_back(16, 0.0, 0.031, 0.0377, next_queued=False)  # measured; nothing queued after it
    assert pacer.alone_s[16] == pytest.approx(0.0077)
    pacer.read_back(16, 0.0, 0.050, 0.060, next_queued=True)  # the device was idle before it: not measured
    pacer.read_back(0, 100.0, 0.061, 0.070, next_queued=True)  # no decode row: not measured
    assert pacer.alone_s == {16: pytest.approx(0.0077)} and pacer.unit_s is None


@pytest.fixture(scope="module")
def model() -> Decoder:
    weights = {k: v for k, v in make_tiny_gpt_weights(LONG_CONFIG, vocab=SCHEDULER_VOCAB, seed=3).items()
               if not k.endswith(".bias")}
    return Decoder.from_state_dict(DecoderConfig.from_nemo(LONG_CONFIG, vocab_size=SCHEDULER_VOCAB),
                                   select_llm_weights(weights))


def test_the_scheduler_chunks_follow_the_measured_times_and_its_tokens_stay_the_static_caches(model):
    """The CPU scheduler measures nothing (a step's time there is its launch), so the times are fed: the chunks
    beside a decoding row are the budgets they give (attention cost left out, so a chunk is its budget), never
    above the captured largest chunk; fed a slower chunk mid-prompt, the chunks shrink; each decode step read
    back reports its rows and its chunk's cost."""
    scheduler = Scheduler(model, max_slots=2, max_seq_len=1100, eos_id=None, max_num_tokens=600,
                          kv_cache=KVCacheOptions(block_size=16))
    assert scheduler.pacer is None
    scheduler.key_equivalent = float("inf")
    pacer = scheduler.pacer = ChunkPacer()
    reads = []
    pacer.read_back = lambda *args: reads.append(args)  # only fed times count here
    pacer.measured(1, 0.0, 0.010)
    pacer.measured(1, 100.0, 0.010 + 100 * 1e-3)  # far slower than allowed (8 positions): the floor
    assert scheduler.chunk_budget(True, 1) == DECODE_CHUNK_TOKENS // SMALLEST_SHARE
    pacer.unit_s = 1e-6  # far cheaper: the captured largest chunk
    assert scheduler.chunk_budget(True, 1) == DECODE_CHUNK_TOKENS
    pacer.unit_s = (MIXED_STEP_LIMIT - 1) * 0.010 / 200.5  # 200 positions within the limit
    steps = record_steps(scheduler)
    short = random_ids(31, 10)
    decoding = scheduler.submit(model.embed(torch.tensor(short)), short, SamplingParams(max_output_len=40))
    scheduler.step()
    beside = random_ids(32, 1000)
    late = scheduler.submit(model.embed(torch.tensor(beside)), beside, SamplingParams(max_output_len=3))
    for _ in range(3):
        scheduler.step()
    pacer.unit_s = (MIXED_STEP_LIMIT - 1) * 0.010 / 120.5
    run_until_idle(scheduler)
    chunks = [chunk for rows, chunk in steps if chunk and rows]
    assert chunks[:3] == [200, 200, 200] and set(chunks[3:-1]) == {120} and sum(chunks) == 1000
    assert late.result(timeout=0) == static_greedy(model, model.embed(torch.tensor(beside)), 3)
    assert decoding.result(timeout=0) == static_greedy(model, model.embed(torch.tensor(short)), 40)
    mixed = [(rows, cost) for rows, cost, *_ in reads if cost]
    assert [cost for _, cost in mixed] == chunks and all(rows == 1 for rows, _ in mixed)
