"""The paged KV cache on the CPU, float32, against the static cache (`Decoder.new_kv_cache`, the path before it):
paged, chunked and prefix-shared generation give exactly the reference's greedy tokens; blocks are freed, cached
and reused; copy-on-write; requests wait while the pool is full; beams and sampled rows mixed in; the chunks
beside decoding rows follow the step times fed to the chunk pacer."""

from __future__ import annotations

from array import array

import pytest
import torch

from exporter.llm.config import DecoderConfig
from exporter.llm.generate import SamplingParams
from exporter.llm.model import Decoder, select_llm_weights
from exporter.llm.paged_attention import FP8_DTYPE, PagedBatch, PagedKVCache, paged_attention
from exporter.llm.paged_triton import split_count
from exporter.models import PromptLayout
from exporter.runtime.chunk_pacing import MIXED_STEP_LIMIT, SMALLEST_SHARE, ChunkPacer, chunk_cost
from exporter.runtime.cuda_graphs import Piece, chunk_bucket_sizes
from exporter.runtime.kv_cache import BlockPool, KVCacheOptions, prefix_keys
from exporter.runtime.pipeline import MediaNumbers, prompt_prefix
from exporter.runtime.scheduler import DECODE_CHUNK_TOKENS, Scheduler, generate
from support.decoders import (
    LONG_CONFIG,
    SCHEDULER_VOCAB,
    make_tiny_gpt_weights,
    random_ids,
    unit_scale_decoder,
)
from support.decoding import record_steps, reference_beam_search, run_until_idle, static_greedy


@pytest.fixture(scope="module")
def model() -> Decoder:
    weights = {k: v for k, v in make_tiny_gpt_weights(LONG_CONFIG, vocab=SCHEDULER_VOCAB, seed=3).items()
               if not k.endswith(".bias")}
    return Decoder.from_state_dict(DecoderConfig.from_nemo(LONG_CONFIG, vocab_size=SCHEDULER_VOCAB),
                                   select_llm_weights(weights))


def _embeds(model: Decoder, ids: list[int]) -> torch.Tensor:
    return model.embed(torch.tensor(ids))


def _scheduler(model: Decoder, *, block_size: int = 4, max_num_tokens: int = 512, kv_cache_bytes: int | None = None,
               reuse: bool = True, **kwargs) -> Scheduler:
    options = KVCacheOptions(block_size=block_size, max_bytes=kv_cache_bytes, enable_reuse=reuse)
    kwargs = {"max_slots": 4, "max_seq_len": 96, "eos_id": None, **kwargs}
    return Scheduler(model, kv_cache=options, max_num_tokens=max_num_tokens, **kwargs)


def _block_bytes(model: Decoder, block_size: int) -> int:
    c = model.config
    return 2 * c.num_layers * block_size * c.num_query_groups * c.head_dim * 4


# --- host bookkeeping --------------------------------------------------------------------------------------------


def test_the_kernels_split_keys_into_the_most_parts_that_fit_one_wave():
    assert split_count(32, 264, 16) == 8  # not 9: 288 programs would start a second wave for 24 of them
    assert split_count(96, 264, 16) == 2 and split_count(192, 264, 16) == 1
    assert split_count(2048, 264, 16) == 1 and split_count(1, 264, 16) == 16


def test_prefix_keys_chain_every_position_before_them():
    a = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # full blocks only
    assert prefix_keys([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    changed_first = prefix_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # a block's key covers the blocks before it
    changed_second = prefix_keys([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert changed_second[0] == a[0] and changed_second[1] != a[1]
    image = [("img-a", 0, 0), ("img-a", 0, 1), ("img-a", 0, 2), ("img-a", 0, 3)]
    other = [("img-b", 0, 0), ("img-b", 0, 1), ("img-b", 0, 2), ("img-b", 0, 3)]
    assert prefix_keys([1, 2, 3, 4, *image], 4)[1] != prefix_keys([1, 2, 3, 4, *other], 4)[1]
    assert prefix_keys([1, 2, 3, 4, None, 6, 7, 8, 9, 10, 11, 12], 4) == a[:1]  # unknown content: the chain stops
    # a LoRA adapter changes every key and value: its uid salts the chain (test_lora.py serves the same prompt with
    # adapters a, b and none, then b again, reusing only b's blocks)
    assert prefix_keys([1, 2, 3, 4], 4, salt="a") != prefix_keys([1, 2, 3, 4], 4, salt="b") != a[:1]



def test_prefix_keys_of_packed_ints_and_of_other_items_never_collide():
    """Token ids are hashed as packed bytes, other items as their repr: the two forms are tagged apart, a block
    with an unknown position or an int past 64 bits takes the slow form, and equal content gives equal keys."""
    ids = list(range(1, 13))
    assert prefix_keys(ids, 4) == prefix_keys(tuple(ids), 4) and len(prefix_keys(ids, 4)) == 3
    assert prefix_keys([*ids[:8], None, 1, 1, 1], 4) == prefix_keys(ids, 4)[:2]
    words = ("abcdefghi", "fghi", "jk", "l")  # a repr of 32 bytes: the same bytes as 4 packed ints, hashed apart
    assert len(repr(words)) == 32
    assert prefix_keys(words, 4) != prefix_keys(array("q", repr(words).encode()).tolist(), 4)
    texts = ["1", "2", "3", "4"]
    assert prefix_keys(texts, 4) != prefix_keys([1, 2, 3, 4], 4)
    assert prefix_keys([1, 2, 3, 4, *texts], 4)[0] == prefix_keys(ids, 4)[0]  # a later slow block keeps the chain
    assert prefix_keys([1, 2, 3, 4, *texts], 4)[1] != prefix_keys([1, 2, 3, 4, 1, 2, 3, 4], 4)[1]
    big = [2**63, 2, 3, 4]  # not a 64-bit int: its repr
    assert prefix_keys(big, 4) == prefix_keys(list(big), 4) and prefix_keys(big, 4) != prefix_keys([0, 2, 3, 4], 4)
    assert prefix_keys([-1, 2, 3, 4], 4) != prefix_keys([2**64 - 1, 2, 3, 4], 4)  # the same 8 bytes unsigned
    assert prefix_keys([1, 2, 3, 4], 4, salt="ab") != prefix_keys([1, 2, 3, 4], 4, salt="a")


def _layout(*pieces) -> PromptLayout:
    """Token-id lists as they are, ints as that many feature positions."""
    return PromptLayout([piece if isinstance(piece, list) else torch.zeros(piece, 2) for piece in pieces])


def test_prompt_prefix_names_media_by_content_and_its_keys_match_only_the_same_prompt(monkeypatch):
    """The Pipeline's prefix items: the same text and media give the same block keys (reuse), another image, another
    feature block or another offset other keys, media without a key none past it."""
    numbers = MediaNumbers(size=2)
    monkeypatch.setattr("exporter.runtime.pipeline.MEDIA_NUMBERS", numbers)
    layout = _layout([1, 2, 3], 10, [4, 5], 7, [6, 7, 8])
    cat = prompt_prefix(layout, ["cat", "dog"])
    assert len(cat) == layout.length and cat[:3] == [1, 2, 3] and cat[13:15] == [4, 5]
    assert len(set(cat)) == len(cat) and all(item < 0 for item in cat[3:13] + cat[15:22])
    assert prompt_prefix(layout, ["cat", "dog"]) == cat and prefix_keys(cat, 4) == prefix_keys(list(cat), 4)
    dog = prompt_prefix(layout, ["dog", "cat"])  # the same images, in another order
    assert prefix_keys(dog, 4)[0] != prefix_keys(cat, 4)[0] and not set(dog[3:13]) & set(cat)
    question = prompt_prefix(_layout([1, 2, 3], 10, [4, 9], 7, [6, 7, 8]), ["cat", "dog"])
    assert prefix_keys(question, 4)[:3] == prefix_keys(cat, 4)[:3] and prefix_keys(question, 4)[3] != \
        prefix_keys(cat, 4)[3]  # the blocks before the first change are matched, none after
    assert prompt_prefix(layout, ["cat", None])[3:] == [None] * 10 + [4, 5] + [None] * 7 + [6, 7, 8]
    # a forgotten set of keys gets a new number: its positions never take another set's items
    prompt_prefix(layout, ["a"]), prompt_prefix(layout, ["b"])
    again = prompt_prefix(layout, ["cat", "dog"])
    assert again != cat and not set(again[3:]) & set(cat[3:]) - {4, 5, 6, 7, 8}
    # past the packed fields (a block of more features than its offset field counts) the items are the keys
    monkeypatch.setattr("exporter.runtime.pipeline._OFFSET_BITS", 3)
    assert prompt_prefix(layout, ["cat", "dog"])[3:5] == [(("cat", "dog"), 0, 0), (("cat", "dog"), 0, 1)]

def test_block_pool_counts_references_and_evicts_cached_blocks_oldest_first():
    pool = BlockPool(6)  # 5 usable blocks
    first = pool.allocate(3)
    assert first == [1, 2, 3] and pool.used == 3 and pool.available == 2
    pool.register(first[0], b"k0")
    pool.register(first[1], b"k1")
    pool.share(first[:2])  # a second request takes the prefix
    pool.release(first)
    assert pool.used == 2 and pool.lookup([b"k0", b"k1", b"k2"]) == first[:2]
    pool.release(first[:2])  # unreferenced, but kept for reuse: the later block goes first
    assert pool.used == 0 and len(pool.cached) == 2 and pool.available == 5
    assert pool.can_allocate(3, reused=first[:2]) and not pool.can_allocate(4, reused=first[:2])
    taken = pool.allocate(4)  # the 3 free blocks, then the cached block released first (the prompt's last)
    assert taken[3] == first[1] and pool.lookup([b"k0", b"k1"]) == [first[0]]
    with pytest.raises(RuntimeError, match="1 blocks left, 2 were asked for"):
        pool.allocate(2)


# --- generation against the static cache -------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_generation_equals_the_static_cache(model, block_size):
    prompts = [random_ids(10 + n, n) for n in (1, 4, 5, 17, 33)]
    scheduler = _scheduler(model, block_size=block_size, max_slots=3)
    handles = [scheduler.submit(_embeds(model, ids), ids, SamplingParams(max_output_len=9)) for ids in prompts]
    run_until_idle(scheduler)
    for ids, handle in zip(prompts, handles):
        assert handle.result(timeout=0) == static_greedy(model, _embeds(model, ids), 9)
    stats = scheduler.stats()
    assert stats.kv_blocks_used == 0 and stats.running_rows == 0  # every block back in the pool


def test_chunked_prefill_equals_unchunked_while_others_decode(model):
    """Prompts prefilled a few positions per step, joining requests that decode meanwhile: the same tokens, and
    no step prefills more than max_num_tokens positions."""
    scheduler = _scheduler(model, max_num_tokens=6)
    steps = record_steps(scheduler)
    early = random_ids(20, 5)
    handles = [(early, scheduler.submit(_embeds(model, early), early, SamplingParams(max_output_len=30)))]
    for _ in range(3):
        scheduler.step()
    for seed, length in ((21, 23), (22, 40), (23, 9)):
        ids = random_ids(seed, length)
        handles.append((ids, scheduler.submit(_embeds(model, ids), ids, SamplingParams(max_output_len=8))))
    run_until_idle(scheduler)
    chunks = [chunk for _, chunk in steps]
    assert max(chunks) <= 6 and sum(chunks) == 5 + 23 + 40 + 9
    for ids, handle in handles:
        assert handle.result(timeout=0) == static_greedy(model, _embeds(model, ids), len(handle.result(timeout=0)))
    assert scheduler.prefilled_positions == 5 + 23 + 40 + 9 and scheduler.reused_positions == 0
    for _, handle in handles[1:]:  # the milestones of a TTFT's phases, in order (40 positions: several steps)
        milestones = (handle.submitted_at, handle.taken_up_at, handle.admitted_at, handle.prefill_started_at,
                      handle.prefill_launched_at, handle.prompt_queued_at, handle.first_token_at)
        assert all(a <= b for a, b in zip(milestones, milestones[1:])), milestones
    long = handles[2][1]
    assert long.prefill_started_at < long.prefill_launched_at


def test_a_lone_prompt_takes_max_num_tokens_a_step_and_beside_decoding_rows_at_most_the_decode_budget(model):
    """The chunk policy (``Scheduler.chunk_budget``): alone, a prompt is prefilled ``max_num_tokens`` positions a
    step; while a row decodes, at most ``DECODE_CHUNK_TOKENS`` (attention cost left out here, so the chunks are the budgets).
    The tokens stay the static cache's, and the warm-up's graphs cover every step taken."""
    assert _scheduler(model, max_num_tokens=100).chunk_budget(decoding=True) == 100  # max_num_tokens: a hard cap
    scheduler = _scheduler(model, block_size=16, max_num_tokens=600, max_slots=2, max_seq_len=1100)
    assert scheduler.chunk_budget(decoding=False) == 600
    assert scheduler.chunk_budget(decoding=True) == DECODE_CHUNK_TOKENS == 384
    scheduler.key_equivalent = float("inf")
    steps = record_steps(scheduler)
    alone = random_ids(30, 1000)
    handle = scheduler.submit(_embeds(model, alone), alone, SamplingParams(max_output_len=3))
    run_until_idle(scheduler)
    assert [chunk for rows, chunk in steps if chunk] == [600, 400]
    assert handle.result(timeout=0) == static_greedy(model, _embeds(model, alone), 3)

    steps.clear()
    short = random_ids(31, 10)
    decoding = scheduler.submit(_embeds(model, short), short, SamplingParams(max_output_len=40))
    scheduler.step()
    beside = random_ids(32, 1000)
    late = scheduler.submit(_embeds(model, beside), beside, SamplingParams(max_output_len=3))
    run_until_idle(scheduler)
    assert [chunk for rows, chunk in steps if chunk and rows] == [384, 384, 232]
    assert late.result(timeout=0) == static_greedy(model, _embeds(model, beside), 3)
    assert decoding.result(timeout=0) == static_greedy(model, _embeds(model, short), 40)

    # warm_up captures every (row bucket, chunk bucket) those steps took, and no 600-token chunk beside rows
    forward = scheduler.forward
    forward.chunk_beside_rows = scheduler.chunk_budget(decoding=True)  # what warm_up sets
    captured = {key[:2] for key in forward.graph_keys()}
    for rows, chunk in steps:
        bucket = next(b for b in forward.buckets if b >= rows) if rows else 0
        assert (bucket, next(c for c in forward.chunk_buckets if c >= chunk) if chunk else 0) in captured
    assert (0, 600) in captured and (1, 600) not in captured and (1, 384) in captured
    # the default cap's buckets: an image prompt of ~600 positions pads to 640, not to the next power of two
    assert chunk_bucket_sizes(2048) == [32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048]


def test_the_scheduler_chunks_follow_the_measured_times_and_its_tokens_stay_the_static_caches(model):
    """The CPU scheduler measures nothing (a step's time there is its launch), so the times are fed: the chunks
    beside a decoding row are the budgets they give (attention cost left out, so a chunk is its budget), never
    above the captured largest chunk; fed a slower chunk mid-prompt, the chunks shrink; each decode step read
    back reports its rows and its chunk's cost."""
    scheduler = _scheduler(model, block_size=16, max_num_tokens=600, max_slots=2, max_seq_len=1100)
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
    decoding = scheduler.submit(_embeds(model, short), short, SamplingParams(max_output_len=40))
    scheduler.step()
    beside = random_ids(32, 1000)
    late = scheduler.submit(_embeds(model, beside), beside, SamplingParams(max_output_len=3))
    for _ in range(3):
        scheduler.step()
    pacer.unit_s = (MIXED_STEP_LIMIT - 1) * 0.010 / 120.5
    run_until_idle(scheduler)
    chunks = [chunk for rows, chunk in steps if chunk and rows]
    assert chunks[:3] == [200, 200, 200] and set(chunks[3:-1]) == {120} and sum(chunks) == 1000
    assert late.result(timeout=0) == static_greedy(model, _embeds(model, beside), 3)
    assert decoding.result(timeout=0) == static_greedy(model, _embeds(model, short), 40)
    mixed = [(rows, cost) for rows, cost, *_ in reads if cost]
    assert [cost for _, cost in mixed] == chunks and all(rows == 1 for rows, _ in mixed)


def test_beside_decoding_rows_a_chunk_fills_a_step_graphs_size_and_reports_its_padding(model):
    """With the step graphs' chunk sizes (as on CUDA; set here on the CPU), a chunk beside a decoding row is the
    largest whole size within the budget (128 of a 200 budget, not 200 run as 256), the prompt's last piece reports
    its padding to the pacer, a prompt alone is chunked as before, and the tokens are the static cache's."""
    scheduler = _scheduler(model, block_size=16, max_num_tokens=600, max_slots=2, max_seq_len=1100)
    scheduler.key_equivalent = float("inf")
    scheduler.padded_chunk_sizes = (32, 64, 128, 256, 384)
    pacer = scheduler.pacer = ChunkPacer()
    reads = []
    pacer.read_back = lambda *args: reads.append(args)
    pacer.measured(1, 0.0, 0.010)
    pacer.unit_s = (MIXED_STEP_LIMIT - 1) * 0.010 / 200.5  # 200 units beside a row
    steps = record_steps(scheduler)
    alone_ids = random_ids(36, 700)
    alone = scheduler.submit(_embeds(model, alone_ids), alone_ids, SamplingParams(max_output_len=2))
    scheduler.step()
    assert steps[0] == (0, 600)  # no row decoding: the max_num_tokens budget, no padding counted
    run_until_idle(scheduler)
    short = random_ids(37, 10)
    decoding = scheduler.submit(_embeds(model, short), short, SamplingParams(max_output_len=40))
    scheduler.step()
    beside = random_ids(38, 1000)
    late = scheduler.submit(_embeds(model, beside), beside, SamplingParams(max_output_len=3))
    del steps[:]
    run_until_idle(scheduler)
    chunks = [chunk for rows, chunk in steps if chunk and rows]
    assert chunks == [128] * 7 + [104] and sum(chunks) == 1000
    costs = [cost for _, cost, *_ in reads if cost]
    assert costs[-8:] == [128.0] * 8  # the last piece of 104 runs as 128
    assert late.result(timeout=0) == static_greedy(model, _embeds(model, beside), 3)
    assert decoding.result(timeout=0) == static_greedy(model, _embeds(model, short), 40)
    assert alone.result(timeout=0) == static_greedy(model, _embeds(model, alone_ids), 2)


def test_each_decode_step_read_back_reports_the_chunk_cost_its_pieces_spent(model):
    """With attention counted (a finite key equivalent), the cost a decode step reports to the pacer is the
    ``chunk_cost`` of the pieces launched with it (computed here from the launched pieces)."""
    scheduler = _scheduler(model, block_size=16, max_num_tokens=600, max_slots=3, max_seq_len=1100)
    scheduler.key_equivalent = 300.0
    pacer = scheduler.pacer = ChunkPacer()
    reads = []
    pacer.read_back = lambda *args: reads.append(args)
    pacer.measured(1, 0.0, 0.010)
    pacer.unit_s = (MIXED_STEP_LIMIT - 1) * 0.010 / 150.5  # 150 units beside a row
    launched = []
    launch = scheduler.forward.launch

    def recording(rows, furthest, pieces=(), *args, **kwargs):
        if rows:
            launched.append(sum(chunk_cost(len(piece.embeds), piece.start, 300.0) for piece in pieces))
        return launch(rows, furthest, pieces, *args, **kwargs)

    scheduler.forward.launch = recording
    short = random_ids(33, 10)
    decoding = scheduler.submit(_embeds(model, short), short, SamplingParams(max_output_len=30))
    scheduler.step()
    for seed, length in ((34, 700), (35, 90)):
        ids = random_ids(seed, length)
        scheduler.submit(_embeds(model, ids), ids, SamplingParams(max_output_len=2))
    run_until_idle(scheduler)
    assert decoding.result(timeout=0) == static_greedy(model, _embeds(model, short), 30)
    costs = [cost for _, cost, *_ in reads]
    assert costs == launched and sum(c > 0 for c in costs) > 3
    assert any(cost != int(cost) for cost in costs)  # attention counted


def test_a_request_takes_no_decode_step_past_its_last_token(model):
    """A request queued up to max_output_len is not launched again (the step once computed and dropped after the
    last token would hold the device from the next request): one token takes no decode step, n tokens n - 1."""
    scheduler = _scheduler(model)
    for length in (1, 5):
        ids = random_ids(40 + length, 12)
        before = scheduler.decode_steps
        handle = scheduler.submit(_embeds(model, ids), ids, SamplingParams(max_output_len=length))
        run_until_idle(scheduler)
        assert handle.result(timeout=0) == static_greedy(model, _embeds(model, ids), length)
        assert scheduler.decode_steps - before == length - 1


def test_a_16k_position_prompt_through_chunks_equals_the_static_cache(model):
    """A video-sized prompt (16,400 feature positions) prefilled in chunks while a short request decodes."""
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(16_400, LONG_CONFIG["hidden_size"], generator=generator)
    scheduler = _scheduler(model, block_size=32, max_num_tokens=2048, max_slots=2, max_seq_len=16_416)
    short = random_ids(30, 6)
    first = scheduler.submit(_embeds(model, short), short, SamplingParams(max_output_len=40))
    scheduler.step()
    long = scheduler.submit(features, [-1] * len(features), SamplingParams(max_output_len=4))
    steps = run_until_idle(scheduler)
    assert steps > 16_400 // 2048  # in chunks
    assert long.result(timeout=0) == static_greedy(model, features, 4)
    assert first.result(timeout=0) == static_greedy(model, _embeds(model, short), 40)


# --- prefix reuse -------------------------------------------------------------------------------------------------


def _media_prompt(model: Decoder, text: list[int], image: str, question: list[int]):
    """Text ids, 10 "feature" positions of an image (embeddings drawn from its name) and a question: the
    embeddings, the ids behind them and what each position holds."""
    seed = sum(image.encode())
    features = torch.randn(10, LONG_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(seed))
    embeds = torch.cat([_embeds(model, text), features, _embeds(model, question)])
    ids = text + [-1] * 10 + question
    prefix = text + [((image,), 0, offset) for offset in range(10)] + question
    return embeds, ids, prefix


def test_a_repeated_prompt_and_image_reuses_the_cached_blocks(model):
    scheduler = _scheduler(model, block_size=4)
    text, question = random_ids(40, 6), random_ids(41, 5)  # 6 + 10 + 5 = 21 positions: 5 full blocks
    embeds, ids, prefix = _media_prompt(model, text, "cat.png", question)
    expected = static_greedy(model, embeds, 8)
    first = scheduler.submit(embeds, ids, SamplingParams(max_output_len=8), prefix=prefix)
    run_until_idle(scheduler)
    assert first.result(timeout=0) == expected and scheduler.prefilled_positions == 21
    assert scheduler.stats().kv_blocks_cached == 5  # the prompt's full blocks stay for reuse

    again = scheduler.submit(embeds, ids, SamplingParams(max_output_len=8), prefix=prefix)
    run_until_idle(scheduler)
    assert again.result(timeout=0) == expected
    assert scheduler.reused_positions == 20 and scheduler.prefilled_positions == 21 + 1  # one position computed

    other_embeds, other_ids, other_prefix = _media_prompt(model, text, "dog.png", question)  # same text, other image
    other = scheduler.submit(other_embeds, other_ids, SamplingParams(max_output_len=8), prefix=other_prefix)
    run_until_idle(scheduler)
    assert other.result(timeout=0) == static_greedy(model, other_embeds, 8)
    assert scheduler.reused_positions == 20 + 4  # only the block of text before the image


def test_questions_about_one_image_sent_together_prefill_it_once(model):
    """Three questions about one image submitted at once: the first computes the text and image blocks, the others
    wait until those are indexed and reuse them, while a prompt about another image, behind them, goes ahead."""
    scheduler = _scheduler(model, block_size=4)
    text = random_ids(42, 6)  # 6 + 10 image positions: 4 full blocks shared; each question fills a fifth block
    prompts = [_media_prompt(model, text, "cat.png", random_ids(43 + index, 5)) for index in range(3)]
    other = _media_prompt(model, random_ids(47, 6), "dog.png", random_ids(48, 5))
    handles = [scheduler.submit(embeds, ids, SamplingParams(max_output_len=6), prefix=prefix)
               for embeds, ids, prefix in (prompts[0], prompts[1], prompts[2], other)]
    scheduler.step()
    assert list(scheduler.waiting) == handles[1:3]  # the first and the other image admitted, these two wait
    run_until_idle(scheduler)
    for handle, (embeds, _, _) in zip(handles, (*prompts, other)):
        assert handle.result(timeout=0) == static_greedy(model, embeds, 6)
    assert scheduler.reused_positions == 2 * 16 and scheduler.prefilled_positions == 21 + 2 * 5 + 21


def test_a_prompt_reused_whole_copies_its_last_block_before_writing(model):
    """Copy-on-write: a cached prompt of whole blocks is reused entirely; its last position is computed again into
    a copy of the last block, so the cached block stays as it was for the next request."""
    scheduler = _scheduler(model, block_size=4)
    ids = random_ids(50, 12)  # three full blocks
    expected = static_greedy(model, _embeds(model, ids), 6)
    handles = []
    for _ in range(3):
        handles.append(scheduler.submit(_embeds(model, ids), ids, SamplingParams(max_output_len=6), prefix=ids))
        scheduler.step()
        if len(handles) > 1:
            request = scheduler.slots[0]
            shared = scheduler.pool.lookup(prefix_keys(ids, 4))
            assert request.blocks.tables[0][:2] == shared[:2] and request.blocks.tables[0][2] != shared[2]
        run_until_idle(scheduler)
    assert all(handle.result(timeout=0) == expected for handle in handles)
    assert scheduler.reused_positions == 2 * 11 and scheduler.prefilled_positions == 12 + 2


def test_beams_share_the_prompt_and_copy_its_partial_block(model):
    """A beam search's rows share its prompt's blocks (here also reused from an earlier request); each row other
    than the first copies the partly filled last block before writing: the beams equal the reference search."""
    scheduler = _scheduler(model, block_size=4, max_slots=6, max_beam_width=3)
    ids = random_ids(60, 10)
    scheduler.submit(_embeds(model, ids), ids, SamplingParams(max_output_len=3), prefix=ids)
    run_until_idle(scheduler)
    params = SamplingParams(max_output_len=7, num_beams=3)
    beams = scheduler.submit(_embeds(model, ids), ids, params, prefix=ids)
    greedy_ids = random_ids(61, 7)
    greedy = scheduler.submit(_embeds(model, greedy_ids), greedy_ids, SamplingParams(max_output_len=12))
    scheduler.step()
    tables = scheduler.slots[0].blocks.tables
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # full prompt blocks shared (and reused)
    assert len({table[2] for table in tables}) == 3  # the partial one: the first row's and two copies
    run_until_idle(scheduler)
    assert beams.results(timeout=0) == reference_beam_search(model, ids, params)
    assert greedy.result(timeout=0) == static_greedy(model, _embeds(model, greedy_ids), 12)
    assert scheduler.reused_positions == 8


def test_reuse_off_and_requests_without_a_prefix_share_nothing(model):
    ids = random_ids(70, 12)
    for scheduler, prefix in ((_scheduler(model, reuse=False), ids), (_scheduler(model), None)):
        for _ in range(2):
            scheduler.submit(_embeds(model, ids), ids, SamplingParams(max_output_len=3), prefix=prefix)
            run_until_idle(scheduler)
        assert scheduler.reused_positions == 0 and scheduler.stats().kv_blocks_cached == 0


# --- a full pool ---------------------------------------------------------------------------------------------------


def test_requests_wait_while_the_pool_is_full_and_then_complete(model):
    # each request: 10 prompt + 10 new positions = 5 blocks of 4; the pool holds 8 blocks: one request at a time
    scheduler = _scheduler(model, block_size=4, kv_cache_bytes=8 * _block_bytes(model, 4), reuse=False)
    assert scheduler.pool.capacity == 8
    prompts = [random_ids(80 + k, 10) for k in range(3)]
    handles = [scheduler.submit(_embeds(model, ids), ids, SamplingParams(max_output_len=10)) for ids in prompts]
    scheduler.step()
    stats = scheduler.stats()
    assert stats.running_rows == 1 and stats.waiting == 2 and stats.kv_blocks_used == 5
    assert stats.kv_used_fraction == pytest.approx(5 / 8)
    used = []
    while scheduler.step():
        used.append(scheduler.stats().kv_blocks_used)
    assert max(used) <= 8 and scheduler.stats().kv_blocks_used == 0
    for ids, handle in zip(prompts, handles):
        assert handle.result(timeout=0) == static_greedy(model, _embeds(model, ids), 10)


def test_a_request_the_pool_can_never_hold_is_refused_with_the_option_to_change(model):
    scheduler = _scheduler(model, block_size=4, kv_cache_bytes=8 * _block_bytes(model, 4))
    ids = random_ids(90, 20)
    with pytest.raises(ValueError, match=r"needs 9 KV-cache blocks .* has 8; raise kv_cache_free_gpu_mem_fraction "
                                         r"\(or kv_cache_bytes\)"):
        scheduler.submit(_embeds(model, ids), ids, SamplingParams(max_output_len=16))
    with pytest.raises(ValueError, match="prefix names 3 positions, the prompt has 20"):
        scheduler.submit(_embeds(model, ids), ids, SamplingParams(max_output_len=2), prefix=ids[:3])


# --- mixed rows ----------------------------------------------------------------------------------------------------


def test_beams_and_sampled_rows_in_chunked_steps_get_their_answers_alone(model):
    requests = [
        (random_ids(100, 13), SamplingParams(max_output_len=9, num_beams=2)),
        (random_ids(101, 7), SamplingParams(max_output_len=10, top_k=0, top_p=0.9, temperature=0.8, seed=11)),
        (random_ids(102, 21), SamplingParams(max_output_len=8, repetition_penalty=1.3)),
        (random_ids(103, 5), SamplingParams(max_output_len=6, num_beams=3)),
    ]
    scheduler = _scheduler(model, block_size=4, max_num_tokens=5, max_slots=6, max_beam_width=3)
    handles = [scheduler.submit(_embeds(model, ids), ids, params, prefix=ids) for ids, params in requests]
    run_until_idle(scheduler)
    for (ids, params), handle in zip(requests, handles):
        assert handle.results(timeout=0) == generate(model, [_embeds(model, ids)], [ids], [params])[0]
        if params.num_beams > 1:
            assert handle.results(timeout=0) == reference_beam_search(model, ids, params)


# --- float8 --------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def test_a_float8_cache_quantizes_on_write_dequantizes_on_read_and_stays_close():
    """The float8 cache holds `value / scale` in e4m3 (layer 0, whose inputs are the same, byte for byte), attention
    over it equals attention over its values multiplied back, and the logits of a model with unit-scale
    activations stay within 5% of the float32 cache's."""
    model = unit_scale_decoder()
    ids = random_ids(110, 30)
    embeds = _embeds(model, ids)
    runs = {}
    for dtype in ("auto", "fp8"):
        scheduler = Scheduler(model, max_slots=1, max_seq_len=40, eos_id=None,
                              kv_cache=KVCacheOptions(block_size=8, dtype=dtype))
        table = scheduler.pool.allocate(4)
        inputs = scheduler.forward._chunk([Piece(embeds, 0, table)], 30)
        logits = model(inputs.embeds[:, None], inputs.positions[:, None],
                       PagedBatch(scheduler.cache, chunk=inputs.chunk))[:, 0]
        runs[dtype] = (scheduler.cache, table, logits)
    (plain, table, logits), (fp8, fp8_table, fp8_logits) = runs["auto"], runs["fp8"]
    assert plain.data.dtype == torch.float32 and fp8.data.dtype == FP8_DTYPE and table == fp8_table
    scales = fp8.scales[0][:, None, None, :, None]  # layer 0: [2, 1, 1, kv_heads, 1]
    quantized = (plain.data[0, :, table] / scales).clamp(-448, 448).to(FP8_DTYPE)
    assert torch.equal(quantized.view(torch.uint8), fp8.data[0, :, table].view(torch.uint8))

    dequantized = PagedKVCache(fp8.data.float() * fp8.scales[:, :, None, None, :, None])
    query = torch.randn(1, LONG_CONFIG["num_attention_heads"], LONG_CONFIG["kv_channels"])
    tables = torch.tensor([table], dtype=torch.int32)
    for cache in (fp8, dequantized):
        batch = PagedBatch(cache, rows=1, tables=tables, positions=torch.tensor([29]), span=30)
        runs[cache is fp8] = paged_attention(query, 1, batch, None)
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-5, atol=1e-6)

    error = (fp8_logits - logits).norm() / logits.norm()
    assert 0 < error < 5e-2, f"relative error {error:.3e}"


# --- through the pipeline ------------------------------------------------------------------------------------------


def test_questions_about_an_image_already_seen_reuse_its_blocks(tmp_path):
    """The demo Neva: a second question about the same image reuses the blocks of the template's text and the
    image's features; another image reuses only the text before it; the answers are those without reuse."""
    from pathlib import Path

    from exporter import TensorRTMMExporter

    repo = Path(__file__).resolve().parents[1]
    TensorRTMMExporter(tmp_path, device="cpu").export(repo / "demo" / "neva_demo.nemo", model_type="neva",
                                                      dtype="float32", max_batch_size=2, max_input_len=200,
                                                      max_output_len=8, max_multimodal_len=128)
    shared = TensorRTMMExporter(tmp_path, device="cpu")
    alone = TensorRTMMExporter(tmp_path, device="cpu", enable_kv_cache_reuse=False)
    red, blue = (str(repo / "demo" / "images" / name) for name in ("red_circle.png", "blue_triangle.png"))
    reused = []
    try:
        for question, image in (("What shape is this?", red), ("What color is the shape?", red),
                                ("What color is the shape?", blue), ("What color is the shape?", blue)):
            before = shared.pipeline.scheduler.reused_positions
            assert shared.forward(question, image, max_output_len=4) == alone.forward(question, image,
                                                                                      max_output_len=4)
            reused.append(shared.pipeline.scheduler.reused_positions - before)
    finally:
        shared.pipeline.close()
        alone.pipeline.close()
    first, same_image, other_image, repeated = reused
    assert first == 0 and same_image >= 64 and other_image < same_image and repeated >= same_image
    assert alone.pipeline.scheduler.reused_positions == 0
