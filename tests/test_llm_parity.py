"""The decoder against transformers' own models built from the same random weights (tiny, CPU, float32).

Llama (RMSNorm, SwiGLU, RoPE; MHA/GQA/MQA, rotary base, linear RoPE scaling), Nemotron (layernorm1p,
squared ReLU, partial RoPE, biases) and GPT-2 (LayerNorm, GELU, learned positions, biases, tied head); then
every checkpoint layout NeMo writes, loaded through `load_llm(path)`.
"""

import tarfile

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    NemotronConfig,
    NemotronForCausalLM,
)

from exporter.checkpoint import NemoCheckpoint
from exporter.llm import Decoder, DecoderConfig, SamplingParams, load_llm
from exporter.runtime.scheduler import generate
from support.decoding import check_logits_and_cache, hf_greedy, relative_error
from support.tiny_llama import FFN, HIDDEN, LAYERS, VOCAB, llama_nemo_config, small_noise_, tiny_llama
from support.tokenizer_files import train_sentencepiece
from tools.nemo_writer import fuse_qkv, hf_llama_to_nemo, write_nemo

torch.set_num_threads(1)


def llama_decoder(hf: LlamaForCausalLM, nemo_config: dict) -> Decoder:
    weights = hf_llama_to_nemo(
        hf.state_dict(), nemo_config["num_attention_heads"], nemo_config["num_query_groups"]
    )
    config = DecoderConfig.from_nemo(
        nemo_config, vocab_size=weights["embedding.word_embeddings.weight"].shape[0]
    )
    return Decoder.from_state_dict(config, weights)


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_llama_logits_match(heads, groups):
    hf = tiny_llama(heads, groups)
    check_logits_and_cache(llama_decoder(hf, llama_nemo_config(heads, groups)), hf)


def test_llama_rotary_base_and_linear_scaling_match():
    hf = tiny_llama(4, 2, rope_theta=500000.0, scaling=4.0)
    nemo = llama_nemo_config(4, 2, rotary_base=500000, seq_len_interpolation_factor=4)
    check_logits_and_cache(llama_decoder(hf, nemo), hf)


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_llama_greedy_generation_matches_hf_generate(heads, groups):
    hf = tiny_llama(heads, groups, seed=3)
    model = llama_decoder(hf, llama_nemo_config(heads, groups))
    prompts = [[5, 17, 99, 250, 7], [42], [8, 9, 10, 11, 12, 13, 14, 15, 16]]
    for penalty in (1.0, 1.5):
        params = [SamplingParams(max_output_len=10, repetition_penalty=penalty)] * len(prompts)
        ours = generate(model, [model.embed(torch.tensor(p)) for p in prompts], prompts, params, eos_id=2)
        expected = [hf_greedy(hf, p, 10, eos_id=2, repetition_penalty=penalty) for p in prompts]
        assert [beams[0] for beams in ours] == expected


@pytest.mark.parametrize("seed", range(6))
def test_beam_search_matches_hf_beam_search(seed):
    """Same hypotheses, order and stopping as transformers' beam search (length penalty 1.0), with EOS chosen
    as a token one of the beams produces, so hypotheses end early and at different lengths."""
    hf = tiny_llama(4, 2, seed=5)
    model = llama_decoder(hf, llama_nemo_config(4, 2))
    prompt = torch.randint(3, VOCAB, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
    params = [SamplingParams(max_output_len=8, num_beams=3)]
    without_eos = generate(model, [model.embed(torch.tensor(prompt))], [prompt], params, eos_id=None)[0]
    for eos in (None, without_eos[1][2]):
        ours = generate(model, [model.embed(torch.tensor(prompt))], [prompt], params, eos_id=eos)[0]
        reference = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            num_beams=3,
            num_return_sequences=3,
            eos_token_id=eos,
            pad_token_id=0,
        )[:, len(prompt) :].tolist()
        assert ours == [r[: r.index(eos)] if eos in r else r for r in reference]


def nemotron_to_nemo(hf: NemotronForCausalLM, heads: int, groups: int) -> dict:
    sd, head_dim = hf.state_dict(), HIDDEN // heads
    out = {
        "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "output_layer.weight": sd["lm_head.weight"],
    }
    for kind in ("weight", "bias"):
        out[f"decoder.final_layernorm.{kind}"] = sd[f"model.norm.{kind}"]
        for i in range(LAYERS):
            src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
            out[f"{dst}input_layernorm.{kind}"] = sd[f"{src}input_layernorm.{kind}"]
            out[f"{dst}pre_mlp_layernorm.{kind}"] = sd[f"{src}post_attention_layernorm.{kind}"]
            q, k, v = (sd[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, groups, head_dim)
            out[f"{dst}self_attention.linear_proj.{kind}"] = sd[f"{src}self_attn.o_proj.{kind}"]
            out[f"{dst}mlp.linear_fc1.{kind}"] = sd[f"{src}mlp.up_proj.{kind}"]
            out[f"{dst}mlp.linear_fc2.{kind}"] = sd[f"{src}mlp.down_proj.{kind}"]
    return out


def test_nemotron_layernorm1p_squared_relu_partial_rope_match():
    heads, groups = 4, 2
    config = NemotronConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        max_position_embeddings=128,
        norm_eps=1e-5,
        attention_bias=True,
        mlp_bias=True,
        hidden_act="relu2",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    hf = small_noise_(NemotronForCausalLM(config), seed=2)
    nemo = {
        "num_layers": LAYERS,
        "hidden_size": HIDDEN,
        "ffn_hidden_size": FFN,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "normalization": "layernorm1p",
        "activation": "squared-relu",
        "bias": True,
        "position_embedding_type": "rope",
        "rotary_percentage": 0.5,
        "share_embeddings_and_output_weights": False,
        "layernorm_epsilon": 1e-5,
        "max_position_embeddings": 128,
    }
    decoder = Decoder.from_state_dict(
        DecoderConfig.from_nemo(nemo, VOCAB), nemotron_to_nemo(hf, heads, groups)
    )
    assert decoder.config.zero_centered_gamma and decoder.config.rotary_dim == 8
    check_logits_and_cache(decoder, hf)


def gpt2_to_nemo(hf: GPT2LMHeadModel, heads: int) -> dict:
    """GPT-2's Conv1D weights are [in, out]; its c_attn columns are [Q | K | V], each head-contiguous."""
    sd, head_dim = dict(hf.named_parameters()), HIDDEN // heads
    out = {
        "embedding.word_embeddings.weight": sd["transformer.wte.weight"],
        "embedding.position_embeddings.weight": sd["transformer.wpe.weight"],
        "decoder.final_layernorm.weight": sd["transformer.ln_f.weight"],
        "decoder.final_layernorm.bias": sd["transformer.ln_f.bias"],
    }
    for i in range(LAYERS):
        src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
        qkv_w = sd[f"{src}attn.c_attn.weight"].T.reshape(3, heads, head_dim, HIDDEN).transpose(0, 1)
        qkv_b = sd[f"{src}attn.c_attn.bias"].reshape(3, heads, head_dim).transpose(0, 1)
        out.update(
            {
                f"{dst}input_layernorm.weight": sd[f"{src}ln_1.weight"],
                f"{dst}input_layernorm.bias": sd[f"{src}ln_1.bias"],
                f"{dst}self_attention.linear_qkv.weight": qkv_w.reshape(3 * HIDDEN, HIDDEN),
                f"{dst}self_attention.linear_qkv.bias": qkv_b.reshape(3 * HIDDEN),
                f"{dst}self_attention.linear_proj.weight": sd[f"{src}attn.c_proj.weight"].T,
                f"{dst}self_attention.linear_proj.bias": sd[f"{src}attn.c_proj.bias"],
                f"{dst}pre_mlp_layernorm.weight": sd[f"{src}ln_2.weight"],
                f"{dst}pre_mlp_layernorm.bias": sd[f"{src}ln_2.bias"],
                f"{dst}mlp.linear_fc1.weight": sd[f"{src}mlp.c_fc.weight"].T,
                f"{dst}mlp.linear_fc1.bias": sd[f"{src}mlp.c_fc.bias"],
                f"{dst}mlp.linear_fc2.weight": sd[f"{src}mlp.c_proj.weight"].T,
                f"{dst}mlp.linear_fc2.bias": sd[f"{src}mlp.c_proj.bias"],
            }
        )
    return out


@pytest.mark.parametrize(
    "hf_activation, nemo_activation, fusion",
    [("gelu_new", "openai-gelu", True), ("gelu_new", "gelu", True), ("gelu", "gelu", False)],
    ids=["openai-gelu", "fused-bias-gelu-is-tanh", "unfused-gelu-is-erf"],
)
def test_gpt2_learned_positions_gelu_bias_tied_head_match(hf_activation, nemo_activation, fusion):
    heads = 4
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=heads,
        n_inner=FFN,
        activation_function=hf_activation,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = small_noise_(GPT2LMHeadModel(config), seed=4)
    nemo = {
        "num_layers": LAYERS,
        "hidden_size": HIDDEN,
        "ffn_hidden_size": FFN,
        "num_attention_heads": heads,
        "normalization": "layernorm",
        "activation": nemo_activation,
        "bias_activation_fusion": fusion,
        "bias": True,
        "position_embedding_type": "learned_absolute",
        "max_position_embeddings": 64,
        "share_embeddings_and_output_weights": True,
        "layernorm_epsilon": 1e-5,
    }
    check_logits_and_cache(
        Decoder.from_state_dict(DecoderConfig.from_nemo(nemo, VOCAB), gpt2_to_nemo(hf, heads)), hf
    )


def test_half_precisions_stay_close_to_float32():
    hf = tiny_llama(4, 2)
    weights = hf_llama_to_nemo(hf.state_dict(), 4, 2)
    config = DecoderConfig.from_nemo(llama_nemo_config(4, 2), VOCAB)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    reference = hf(ids).logits.detach()
    for dtype in (torch.bfloat16, torch.float16):
        model = Decoder.from_state_dict(config, weights, dtype=dtype)
        assert model.dtype == dtype
        with torch.no_grad():
            assert relative_error(model(model.embed(ids)), reference) < 3e-2


# -- checkpoints in every layout, through exporter.checkpoint / tools.nemo_writer -------------------------

LAYOUT_HEADS, LAYOUT_GROUPS, PADDED_VOCAB = 8, 4, 384  # TP=4 needs the groups and the padded vocab to split


@pytest.fixture(scope="module")
def layout_model(tmp_path_factory):
    """A Llama with a padded vocab and a SentencePiece tokenizer file: NeMo config + canonical weights."""
    folder = tmp_path_factory.mktemp("layouts")
    sp_model = train_sentencepiece(folder / "tokenizer.model")
    hf = tiny_llama(LAYOUT_HEADS, LAYOUT_GROUPS, vocab=PADDED_VOCAB, seed=7)
    config = llama_nemo_config(LAYOUT_HEADS, LAYOUT_GROUPS, vocab=PADDED_VOCAB)
    config["tokenizer"] = {"library": "sentencepiece", "model": str(sp_model), "sentencepiece_legacy": True}
    weights = hf_llama_to_nemo(hf.state_dict(), LAYOUT_HEADS, LAYOUT_GROUPS)
    return hf, config, weights, sp_model


LAYOUTS = {
    "legacy": dict(layout="legacy"),
    "legacy-tp2": dict(layout="legacy", tp_size=2),
    "legacy-tp4": dict(layout="legacy", tp_size=4),
    "legacy-tp2-pp2": dict(layout="legacy", tp_size=2, pp_size=2),
    "legacy-local-spec": dict(layout="legacy", transformer_engine=False),
    "legacy-non-mcore-swiglu": dict(layout="legacy", mcore=False, activation="swiglu"),
    "torch_dist": dict(layout="torch_dist"),
    "torch_dist-tp2": dict(layout="torch_dist", tp_size=2),
    "nemo2": dict(layout="nemo2"),
    "gzip": dict(layout="legacy", compress=True),
    "no-dot-prefix": dict(layout="torch_dist", dot_prefix=False),
    "folder": dict(layout="legacy", extract=True),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_checkpoint_layouts_give_hf_logits(layout_model, tmp_path, name):
    hf, config, weights, sp_model = layout_model
    options = dict(LAYOUTS[name])
    extract = options.pop("extract", False)
    config = {**config, "activation": options.pop("activation", config["activation"])}
    path = write_nemo(
        tmp_path / "model.nemo", config, weights, artifacts={"tokenizer.model": sp_model}, **options
    )
    if extract:
        with tarfile.open(path) as archive:
            archive.extractall(tmp_path / "folder", filter="data")
        path = tmp_path / "folder"
    llm = load_llm(path, dtype="float32")
    assert llm.config.vocab_size == PADDED_VOCAB
    ids = torch.randint(0, PADDED_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    assert relative_error(llm.logits(ids), hf(ids).logits.detach()) < 1e-5


def test_load_llm_generates_hf_greedy_text(layout_model, tmp_path):
    hf, config, weights, sp_model = layout_model
    path = write_nemo(tmp_path / "model.nemo", config, weights, artifacts={"tokenizer.model": sp_model})
    llm = load_llm(NemoCheckpoint(path), dtype="float32")
    prompt = "describe the image"
    ids = llm.tokenizer.encode(prompt, add_bos=True)
    expected = hf_greedy(hf, ids, 8, eos_id=llm.tokenizer.eos_id)
    assert llm.generate([prompt], max_output_len=8) == [llm.tokenizer.decode(expected)]


def test_load_llm_defaults_to_bfloat16(layout_model, tmp_path):
    hf, config, weights, sp_model = layout_model
    llm = load_llm(write_nemo(tmp_path / "m.nemo", config, weights, artifacts={"tokenizer.model": sp_model}))
    assert llm.model.dtype == torch.bfloat16
    ids = torch.randint(0, PADDED_VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    assert relative_error(llm.logits(ids), hf(ids).logits.detach()) < 3e-2


def test_wrong_tied_setting_is_reported_with_a_hint(layout_model):
    _, config, weights, _ = layout_model
    tied = DecoderConfig.from_nemo({**config, "share_embeddings_and_output_weights": True}, PADDED_VOCAB)
    with pytest.raises(
        ValueError, match="unexpected keys.*output_layer.weight(.|\n)*share_embeddings_and_output"
    ):
        Decoder.from_state_dict(tied, weights)
    without_layer = {k: v for k, v in weights.items() if k != "decoder.layers.1.mlp.linear_fc2.weight"}
    untied = DecoderConfig.from_nemo(config, PADDED_VOCAB)
    with pytest.raises(ValueError, match=r"missing keys \(1\): \['decoder.layers.1.mlp.linear_fc2.weight'\]"):
        Decoder.from_state_dict(untied, without_layer)


# -- DecoderConfig from NeMo configs ------------------------------------------------------------------------


def test_nemo_config_defaults_and_nulls():
    cfg = {
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 96,
        "num_attention_heads": 4,
        "num_query_groups": None,
        "kv_channels": None,
        "encoder_seq_length": 512,
    }
    config = DecoderConfig.from_nemo(cfg, vocab_size=384)
    assert (config.num_query_groups, config.head_dim, config.max_position_embeddings) == (4, 16, 512)
    # NeMo's defaults: LayerNorm, GELU, biases, learned positions, tied output layer
    assert (config.normalization, config.activation, config.bias) == ("layernorm", "gelu", True)
    assert config.position_embedding_type == "learned_absolute" and config.share_embeddings_and_output_weights
    zero_centered = DecoderConfig.from_nemo(
        {**cfg, "normalization": "rmsnorm", "layernorm_zero_centered_gamma": True}, 8
    )
    assert zero_centered.normalization == "rmsnorm" and zero_centered.zero_centered_gamma
    assert DecoderConfig.from_nemo({**cfg, "normalization": "LayerNorm1p"}, 8).zero_centered_gamma


def test_config_round_trips_through_a_dict():
    config = DecoderConfig.from_nemo(llama_nemo_config(4, 2, seq_len_interpolation_factor=2), VOCAB)
    assert DecoderConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown decoder config fields \\['colour'\\]"):
        DecoderConfig.from_dict({**config.to_dict(), "colour": 1})


@pytest.mark.parametrize(
    "override, message",
    [
        ({"activation": "swish"}, "activation='swish' is not supported; supported values: fast-swiglu"),
        (
            {"normalization": "batchnorm"},
            "normalization='batchnorm' is not supported; supported values: layernorm",
        ),
        ({"position_embedding_type": "alibi"}, "position_embedding_type='alibi' is not supported"),
        ({"transformer_block_type": "post_ln"}, "transformer_block_type='post_ln' is not supported"),
        ({"num_moe_experts": 8, "moe_shared_expert_intermediate_size": 64}, "moe_shared_expert_intermediate_size"),
        ({"num_query_groups": 3}, r"num_attention_heads \(4\) must be a multiple of num_query_groups \(3\)"),
        ({"rotary_percentage": 1.5}, r"rotary_percentage must be in \(0, 1\]"),
        ({"ffn_hidden_size": None}, "model config has no ffn_hidden_size"),
    ],
)
def test_unsupported_nemo_configs_name_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig.from_nemo({**llama_nemo_config(4, 2), **override}, VOCAB)
