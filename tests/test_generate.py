"""Generation: greedy/sampling/beam semantics, per-request parameters in one batch, stops, validation.

The slow reference used here re-runs the whole sequence without a KV cache at every step.
"""

import math
import random
from dataclasses import replace

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from exporter.llm import LLM, Decoder, DecoderConfig, SamplingParams
from exporter.llm.generate import StopStrings
from exporter.llm.sampling import TOKEN, RowSetup, TokenChooser, penalize
from exporter.llm.tokenizer import SentencePieceTokenizer, Tokenizer
from exporter.runtime.scheduler import generate
from support.decoding import reference_beam_search
from support.tokenizer_files import train_sentencepiece

torch.set_num_threads(1)
VOCAB = 300


def random_decoder(seed: int = 0, **overrides) -> Decoder:
    fields = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        vocab_size=VOCAB,
    )
    config = DecoderConfig(**{**fields, **overrides})
    with torch.device("meta"):
        shapes = Decoder(config).state_dict()
    generator = torch.Generator().manual_seed(seed)
    weights = {
        name: torch.randn(t.shape, generator=generator) * 0.2 + (1.0 if "layernorm" in name else 0.0)
        for name, t in shapes.items()
    }
    return Decoder.from_state_dict(config, weights)


class LetterTokenizer(Tokenizer):
    """Token i reads as one letter; 0 (BOS) and 1 (EOS) are control tokens."""

    bos_id, eos_id, pad_id, vocab_size = 0, 1, None, VOCAB

    def encode(self, text, add_bos=False):
        return [self.bos_id] * add_bos + [ord(c) - ord("a") + 2 for c in text]

    def decode(self, ids, skip_special=True):
        return "".join(
            "^$"[i] if i < 2 else chr(ord("a") + (i - 2) % 26) for i in ids if i >= 2 or not skip_special
        )

    def token_to_id(self, token):
        return None

    def save(self, directory):
        return {}


def run(
    model: Decoder, prompts: list[list[int]], params, eos_id=None, tokenizer=None, media: dict | None = None
):
    """Generate from token-id prompts; `media` maps a prompt index to feature rows spliced at its -1 ids."""
    embeddings = []
    for i, ids in enumerate(prompts):
        embeds = model.embed(torch.tensor(ids).clamp(min=0))
        if media and i in media:
            embeds[torch.tensor(ids) == -1] = media[i]
        embeddings.append(embeds)
    params = params if isinstance(params, list) else [params] * len(prompts)
    return generate(model, embeddings, prompts, params, eos_id=eos_id, tokenizer=tokenizer)


@torch.no_grad()
def reference_greedy(model: Decoder, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(model.embed(torch.tensor([ids])))[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def sequence_log_prob(model: Decoder, prompt: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([prompt + continuation])
    log_probs = model(model.embed(ids))[0].float().log_softmax(-1)
    return sum(log_probs[len(prompt) - 1 + t, token].item() for t, token in enumerate(continuation))


PROMPTS = [[5, 17, 99, 250, 7], [42], [8, 9, 10, 11, 12, 13, 14, 15, 16]]


def test_greedy_matches_the_uncached_reference():
    model = random_decoder()
    outputs = run(model, PROMPTS, SamplingParams(max_output_len=8))
    assert [beams for beams in outputs] == [[reference_greedy(model, p, 8)] for p in PROMPTS]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_output_len=8, num_beams=1),
        SamplingParams(max_output_len=8, top_k=1, top_p=0.5, temperature=0.7, seed=3),
        SamplingParams(max_output_len=8, top_k=50, temperature=0.0, seed=3),
        SamplingParams(max_output_len=8, top_k=0, top_p=0.0, seed=3),
    ],
    ids=["num_beams=1", "top_k=1", "temperature=0", "top_k=0,top_p=0"],
)
def test_greedy_equivalent_settings(params):
    model = random_decoder()
    assert run(model, PROMPTS, params) == [[reference_greedy(model, p, 8)] for p in PROMPTS]


def test_seed_reproduces_and_different_seeds_differ():
    model = random_decoder()
    sampled = dict(max_output_len=10, top_k=0, top_p=0.95, temperature=1.0)
    first = run(model, PROMPTS, SamplingParams(**sampled, seed=11))
    assert run(model, PROMPTS, SamplingParams(**sampled, seed=11)) == first
    others = [run(model, PROMPTS, SamplingParams(**sampled, seed=s)) for s in range(5)]
    assert any(other != first for other in others)


def test_top_k_sampling_stays_in_the_top_k():
    model = random_decoder()
    prompt = PROMPTS[0]
    with torch.no_grad():
        allowed = set(model(model.embed(torch.tensor([prompt])))[0, -1].topk(3).indices.tolist())
    firsts = {
        run(model, [prompt], SamplingParams(max_output_len=1, top_k=3, seed=s))[0][0][0] for s in range(30)
    }
    assert firsts <= allowed and len(firsts) > 1


def _first_tokens(logits: torch.Tensor, params: SamplingParams, seeds: range) -> list[int]:
    """The token the device sampler picks from the same `logits [V]` for each seed (one row per seed)."""
    chooser = TokenChooser(len(seeds), len(logits), "cpu")
    chooser.set_rows(0, [RowSetup(greedy=params.greedy, temperature=params.temperature, top_k=params.top_k,
                                  top_p=params.top_p, repetition_penalty=1.0, seed=seed, position=4)
                         for seed in seeds])
    chooser.choose(logits.expand(len(seeds), -1), 0, full=True)
    return chooser.ints[TOKEN].tolist()


def test_top_p_keeps_the_smallest_set_reaching_top_p():
    probs = torch.tensor([0.125, 0.5, 0.0625, 0.3125])  # exact in binary: the boundary case is exact
    params = SamplingParams(top_k=0, temperature=1.0)
    at = set(_first_tokens(probs.log(), replace(params, top_p=0.8125), range(300)))
    above = set(_first_tokens(probs.log(), replace(params, top_p=0.8126), range(300)))
    assert at == {1, 3} and above == {0, 1, 3}


def test_samples_follow_the_distribution_and_do_not_depend_on_the_batch():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    params = SamplingParams(top_k=0, top_p=1.0, temperature=1.0)
    draws = _first_tokens(probs.log(), params, range(6000))
    frequencies = torch.bincount(torch.tensor(draws), minlength=4) / len(draws)
    assert (frequencies - probs).abs().max() < 0.02
    assert _first_tokens(probs.log(), params, range(4000, 4010)) == draws[4000:4010]


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    seen = [[4, 9, 9, 250, 17, 5], [], [0, 299, 42]]
    penalties = [1.7, 1.3, 0.6]
    mask = torch.zeros(3, VOCAB, dtype=torch.bool)
    for row, ids in enumerate(seen):
        mask[row, ids] = True
    ours = penalize(logits, mask, torch.tensor(penalties))
    for row, (ids, penalty) in enumerate(zip(seen, penalties)):
        reference = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids], dtype=torch.long),
                                                              logits[row : row + 1].clone())
        assert torch.equal(ours[row], reference[0])


def bigram_decoder() -> Decoder:
    """Attention and MLP output zero, so the next-token distribution depends only on the current token.

    From 10: 11 (p=.5) or 12 (p=.4). From 11: twenty tokens 20..39 (p=.05 each). From 12: 13 (p=.95).
    From 13: 14 (p=.9). From 14: EOS=2 (p=.9). Greedy takes 11 and ends up far below the 12-13-14 path.
    """
    config = DecoderConfig(
        num_layers=1,
        hidden_size=64,
        ffn_hidden_size=32,
        num_attention_heads=4,
        num_query_groups=4,
        head_dim=16,
        vocab_size=VOCAB,
    )
    with torch.device("meta"):
        shapes = Decoder(config).state_dict()
    weights = {
        name: torch.ones(t.shape) if "layernorm" in name else torch.zeros(t.shape)
        for name, t in shapes.items()
    }
    embedding = torch.zeros(VOCAB, 64)
    embedding[torch.arange(VOCAB), torch.arange(VOCAB).clamp(max=63)] = (
        1.0  # token t -> unit vector e_min(t,63)
    )
    next_probs = {
        10: {11: 0.5, 12: 0.4},
        11: {t: 0.05 for t in range(20, 40)},
        12: {13: 0.95},
        13: {14: 0.9},
        14: {2: 0.9},
    }
    head = torch.zeros(VOCAB, 64)
    for current, table in next_probs.items():
        head[:, current] = -30.0
        for token, p in table.items():
            head[token, current] = math.log(p)
    weights["embedding.word_embeddings.weight"] = embedding
    weights["output_layer.weight"] = head / 8.0  # the final RMSNorm scales a unit vector by sqrt(64)
    return Decoder.from_state_dict(config, weights)


def test_beam_search_beats_greedy_on_a_constructed_case():
    model = bigram_decoder()
    greedy = run(model, [[10]], SamplingParams(max_output_len=3))[0][0]
    beams = run(model, [[10]], SamplingParams(max_output_len=3, num_beams=2))[0]
    assert greedy[0] == 11 and beams[0] == [12, 13, 14]
    assert sequence_log_prob(model, [10], beams[0]) > sequence_log_prob(model, [10], greedy) + 1.0
    with_eos = run(model, [[10]], SamplingParams(max_output_len=6, num_beams=2), eos_id=2)[0]
    assert with_eos[0] == [12, 13, 14]  # ended by EOS, which is not returned


def test_beams_are_distinct_and_best_first():
    model = random_decoder(seed=2)
    beams = run(model, [PROMPTS[0]], SamplingParams(max_output_len=5, num_beams=4))[0]
    assert len(beams) == 4 and len({tuple(b) for b in beams}) == 4
    scores = [sequence_log_prob(model, PROMPTS[0], b) for b in beams]
    assert scores == sorted(scores, reverse=True)
    assert scores[0] >= sequence_log_prob(model, PROMPTS[0], reference_greedy(model, PROMPTS[0], 5)) - 1e-6


def test_mixed_requests_in_one_batch_equal_each_alone():
    model = random_decoder(seed=1)
    media = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 0.2
    prompts = [PROMPTS[0], [3, -1, -1, -1, 40, 41], PROMPTS[1], PROMPTS[2]]
    params = [
        SamplingParams(max_output_len=6),
        SamplingParams(
            max_output_len=9, top_k=20, top_p=0.9, temperature=0.8, seed=5, repetition_penalty=1.3
        ),
        SamplingParams(max_output_len=4, num_beams=3),
        SamplingParams(
            max_output_len=7, repetition_penalty=2.0, end_id=int(reference_greedy(model, PROMPTS[2], 3)[2])
        ),
    ]
    batched = run(model, prompts, params, media={1: media})
    alone = [
        run(model, [p], [sp], media={0: media} if i == 1 else None)[0]
        for i, (p, sp) in enumerate(zip(prompts, params))
    ]
    assert batched == alone
    assert [len(beams) for beams in batched] == [1, 1, 3, 1]
    assert len(batched[0][0]) == 6 and len(batched[3][0]) == 2  # max_output_len; stopped at its end_id


def test_eos_stops_and_is_not_returned():
    model = random_decoder()
    free = reference_greedy(model, PROMPTS[0], 10)
    eos = free[4]
    expected = free[: free.index(eos)]
    assert run(model, [PROMPTS[0]], SamplingParams(max_output_len=10), eos_id=eos) == [[expected]]
    assert run(model, [PROMPTS[0]], SamplingParams(max_output_len=10, end_id=eos), eos_id=None) == [
        [expected]
    ]


def test_stop_strings_stop_generation_and_are_cut_from_the_text():
    model = random_decoder()
    tokenizer = LetterTokenizer()
    prompt = tokenizer.encode("robot")
    free = reference_greedy(model, prompt, 12)
    stop = tokenizer.decode(free[5:7])
    end = next(j for j in range(len(free)) if stop in tokenizer.decode(free[: j + 1]))
    outputs = run(model, [prompt], SamplingParams(max_output_len=12, stop=(stop,)), tokenizer=tokenizer)
    assert outputs == [[free[: end + 1]]]

    text = LLM(model, tokenizer).generate(["robot"], max_output_len=12, stop=[stop, "never"], add_bos=False)[
        0
    ]
    assert text == tokenizer.decode(free[: end + 1]).split(stop)[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_p=1.5), r"top_p must be a number in \[0.0, 1.0\], got 1.5"),
        (dict(top_p=-0.1), "top_p"),
        (dict(temperature=-1.0), "temperature must be a number in"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(top_k=2.5), "top_k must be an integer"),
        (dict(num_beams=0), "num_beams must be an integer >= 1"),
        (dict(max_output_len=0), "max_output_len must be an integer >= 1"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be a number in \(0.0"),
        (dict(seed=-3), "seed must be an integer >= 0"),
        (dict(end_id=True), "end_id must be an integer"),
        (dict(stop=["ok", ""]), "stop must be a list of non-empty strings"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_invalid_generate_inputs_are_reported():
    model = random_decoder()
    embeds = model.embed(torch.tensor(PROMPTS[0]))
    with pytest.raises(ValueError, match="one per request"):
        generate(model, [embeds], [PROMPTS[0]], [])
    with pytest.raises(ValueError, match=r"must be a non-empty \[T, 64\] embedding tensor"):
        generate(model, [embeds[:, :10]], [PROMPTS[0]], [SamplingParams()])
    with pytest.raises(ValueError, match="5 embeddings but 4 token ids"):
        generate(model, [embeds], [PROMPTS[0][:4]], [SamplingParams()])
    with pytest.raises(ValueError, match="stop strings but no tokenizer"):
        generate(model, [embeds], [PROMPTS[0]], [SamplingParams(stop=("x",))])


def test_learned_positions_limit_the_sequence_length():
    model = random_decoder(
        position_embedding_type="learned_absolute",
        max_position_embeddings=12,
        normalization="layernorm",
        activation="gelu",
        bias=True,
    )
    assert len(run(model, [PROMPTS[0]], SamplingParams(max_output_len=7))[0][0]) == 7
    with pytest.raises(
        ValueError, match=r"prompt \(5\) \+ max_output_len \(8\) exceeds the model.s 12 learned position"
    ):
        run(model, [PROMPTS[0]], SamplingParams(max_output_len=8))


@pytest.mark.parametrize("activation", ["geglu", "reglu"])
def test_other_gated_activations_apply_to_the_first_half(activation):
    model = random_decoder(activation=activation, num_layers=1)
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(3, 64)
    gate, up = mlp.linear_fc1.weight.chunk(2)
    act = torch.nn.functional.gelu if activation == "geglu" else torch.relu
    expected = (act(x @ gate.T) * (x @ up.T)) @ mlp.linear_fc2.weight.T
    assert torch.allclose(mlp(x), expected, atol=1e-5)


def test_beam_search_equals_the_uncached_reference_with_penalties_ends_and_stop_strings():
    model = random_decoder(seed=4)
    tokenizer = LetterTokenizer()
    prompts = [[5, 17, 99, 250, 7], [8, 9, 10, 11], [42, 43]]
    free = run(model, prompts, SamplingParams(max_output_len=8, num_beams=3))
    params = [
        SamplingParams(max_output_len=8, num_beams=3, repetition_penalty=1.5),
        SamplingParams(max_output_len=8, num_beams=2, end_id=free[1][1][3]),
        SamplingParams(max_output_len=8, num_beams=3, stop=(tokenizer.decode(free[2][1][2:4]),)),
        SamplingParams(max_output_len=6, top_k=5, seed=1),
    ]
    prompts.append(PROMPTS[0])
    ours = run(model, prompts, params, tokenizer=tokenizer)
    for prompt, request, beams in zip(prompts[:3], params, ours):
        assert beams == reference_beam_search(model, prompt, request, tokenizer=tokenizer)
    assert ours[2] != free[2]  # the stop string changed the beams
    assert ours == [run(model, [p], [request], tokenizer=tokenizer)[0] for p, request in zip(prompts, params)]


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory) -> SentencePieceTokenizer:
    path = train_sentencepiece(tmp_path_factory.mktemp("sp") / "tokenizer.model")
    return SentencePieceTokenizer(path.read_bytes())


def test_stop_strings_found_in_the_new_text_as_in_the_whole_answer(sentencepiece_tokenizer):
    """A stop string is found in a short tail of tokens exactly when the whole decoded answer first holds it
    (a real SentencePiece model: pieces of several characters, spaces that a piece at the start loses)."""
    tokenizer = sentencepiece_tokenizer
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randint(5, 30))]
        text = tokenizer.decode(ids, skip_special=False)
        start = rng.randrange(len(text))
        stop = text[start : start + rng.randint(1, 6)]
        if not stop.strip():
            continue
        expected = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n], skip_special=False))
        stops, tail = StopStrings([stop, "never seen"], tokenizer), ()
        for n, token in enumerate(ids, 1):
            tail, hit = stops.extend(tail, token)
            if hit:
                break
        assert n == expected, (ids, stop)
        assert len(tail) < 12
        checked += 1
    assert checked > 200


def test_stop_strings_that_end_continued_beams_give_the_reference_beams():
    """Stop strings drawn from the beams themselves end beams the device had continued (the host rebuilds the
    search's rows); the answers equal the uncached reference's."""
    model = random_decoder(seed=4)
    tokenizer = LetterTokenizer()
    for seed in range(4):
        prompt = torch.randint(2, VOCAB, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        free = run(model, [prompt], SamplingParams(max_output_len=8, num_beams=3))[0]
        for beam, start in ((1, 1), (1, 3), (2, 1), (2, 3)):
            stop = tokenizer.decode(free[beam][start : start + 2])
            params = SamplingParams(max_output_len=8, num_beams=3, stop=(stop,))
            ours = run(model, [prompt], params, tokenizer=tokenizer)[0]
            assert ours == reference_beam_search(model, prompt, params, tokenizer=tokenizer), (seed, beam, start)
