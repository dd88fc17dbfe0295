"""Tokenizers: SentencePiece with NeMo's legacy special tokens, local Hugging Face folders, artifacts."""

from pathlib import Path

import pytest
import sentencepiece
from tokenizers import Tokenizer as RawTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from exporter.checkpoint import NemoCheckpoint
from exporter.llm.tokenizer import (
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    load_saved_tokenizer,
    load_tokenizer,
)
from support.tokenizer_files import train_sentencepiece


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("sp") / "tokenizer.model")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A local Hugging Face tokenizer folder (word level), as `save_pretrained` writes it."""
    vocab = {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        "<pad>": 3,
        **{w: i + 4 for i, w in enumerate("hello world robot".split())},
    }
    raw = RawTokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    folder = tmp_path_factory.mktemp("hf_tok")
    tok.save_pretrained(folder)
    return folder


def sp_config(**extra) -> dict:
    return {"library": "sentencepiece", "model": "nemo:0123abcd_tokenizer.model", **extra}


def reader_for(sp_model: Path):
    def read(ref: str) -> bytes:
        assert ref == "nemo:0123abcd_tokenizer.model"
        return sp_model.read_bytes()

    return read


def test_plain_sentencepiece_matches_the_library(sp_model):
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    tok = load_tokenizer(sp_config(), reader_for(sp_model))
    text = "describe the image <extra_id_1> hello world"
    assert tok.encode(text) == reference.encode(text)
    assert tok.encode(text, add_bos=True) == [1, *reference.encode(text)]
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, None, reference.get_piece_size())
    assert tok.decode(reference.encode("hello world")) == "hello world"
    assert tok.token_to_id("<extra_id_1>") == reference.piece_to_id("<extra_id_1>")
    assert tok.token_to_id("no-such-piece") is None


def test_legacy_special_tokens_are_appended_and_matched_whole(sp_model):
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    size = reference.get_piece_size()
    cfg = sp_config(
        sentencepiece_legacy=True,
        additional_special_tokens=["<extra_id_0>", "<image>", "<extra_id_1>", "<extra_id_10>"],
    )
    tok = load_tokenizer(cfg, reader_for(sp_model))
    assert tok.token_to_id("<extra_id_0>") == reference.piece_to_id("<extra_id_0>")  # a piece keeps its id
    assert tok.token_to_id("<image>") == size  # appended in config order
    assert tok.token_to_id("<extra_id_10>") == size + 1  # longest match wins over <extra_id_1>
    assert tok.vocab_size == size + 2

    ids = tok.encode("hello <image>world<extra_id_10> robot")
    expected = [
        *reference.encode("hello "),
        size,
        *reference.encode("world"),
        size + 1,
        *reference.encode(" robot"),
    ]
    assert ids == expected
    assert tok.decode(ids) == "hello world robot"  # special tokens skipped
    # segments are encoded apart (as NeMo does), so spaces next to special tokens do not round-trip exactly
    assert tok.decode(ids, skip_special=False).replace(" ", "") == "hello<image>world<extra_id_10>robot"
    assert tok.decode([*ids, 5000]) == "hello world robot"  # ids past the vocab (padded rows) are dropped


def test_named_special_tokens_override_model_ids(sp_model):
    cfg = sp_config(
        special_tokens={"bos_token": "<extra_id_0>", "eos_token": "<eos_new>", "sep_token": "<sep>"}
    )
    tok = load_tokenizer(cfg, reader_for(sp_model))
    size = sentencepiece.SentencePieceProcessor(model_file=str(sp_model)).get_piece_size()
    assert tok.bos_id == tok.token_to_id("<extra_id_0>")
    assert (tok.eos_id, tok.token_to_id("<sep>")) == (size, size + 1)
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id


def test_special_tokens_need_legacy_mode(sp_model):
    cfg = sp_config(sentencepiece_legacy=False, additional_special_tokens=["<image>"])
    with pytest.raises(TokenizerError, match="sentencepiece_legacy"):
        load_tokenizer(cfg, reader_for(sp_model))


def test_saved_sentencepiece_reloads_identically(sp_model, tmp_path):
    tok = load_tokenizer(
        sp_config(additional_special_tokens=["<image>"], special_tokens={"eos_token": "<eot>"}),
        reader_for(sp_model),
    )
    again = load_saved_tokenizer(tmp_path, tok.save(tmp_path))
    text = "hello <image> robot<eot>"
    assert again.encode(text) == tok.encode(text)
    assert (again.eos_id, again.vocab_size) == (tok.eos_id, tok.vocab_size)


def test_huggingface_folder_from_config_and_from_tokenizer_path(hf_folder, sp_model):
    reference = AutoTokenizer.from_pretrained(str(hf_folder))
    from_config = load_tokenizer({"library": "huggingface", "type": str(hf_folder)}, read_artifact=None)
    from_path = load_tokenizer(sp_config(), reader_for(sp_model), tokenizer_path=hf_folder)
    for tok in (from_config, from_path):
        assert isinstance(tok, HuggingFaceTokenizer)
        assert tok.encode("hello robot world") == reference.encode(
            "hello robot world", add_special_tokens=False
        )
        assert tok.encode("hello", add_bos=True) == [1, 4]
        assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 3, 7)
        assert tok.decode([1, 4, 6, 2]) == "hello robot"
        assert tok.token_to_id("world") == 5 and tok.token_to_id("nope") is None


def test_saved_huggingface_reloads(hf_folder, tmp_path):
    tok = load_tokenizer({"library": "huggingface", "type": str(hf_folder)}, read_artifact=None)
    again = load_saved_tokenizer(tmp_path, tok.save(tmp_path))
    assert again.encode("world hello") == tok.encode("world hello")


def test_tokenizer_path_may_be_a_sentencepiece_file(sp_model):
    cfg = {"library": "huggingface", "type": "some-org/some-model"}
    tok = load_tokenizer(cfg, read_artifact=None, tokenizer_path=sp_model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.encode("hello world") == sentencepiece.SentencePieceProcessor(model_file=str(sp_model)).encode(
        "hello world"
    )


def test_hub_name_without_local_copy_asks_for_tokenizer_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    with pytest.raises(TokenizerError, match="tokenizer_path"):
        load_tokenizer({"library": "huggingface", "type": "meta-llama/Llama-2-7b-hf"}, read_artifact=None)


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"library": "megatron", "type": "GPT2BPETokenizer"}, "not supported"),
        ({"library": "sentencepiece", "model": None}, "tokenizer.model is not set"),
        (None, "no tokenizer section"),
    ],
)
def test_unusable_configs_say_what_to_do(cfg, message):
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(cfg, read_artifact=None)


def test_missing_tokenizer_path_is_reported(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(sp_config(), read_artifact=None, tokenizer_path=tmp_path / "missing.model")


@pytest.mark.parametrize("layout", ["legacy", "nemo2"])
def test_tokenizer_from_a_nemo_archive(sp_model, tmp_path, layout):
    import torch

    from tools.nemo_writer import write_nemo

    config = {
        "num_layers": 1,
        "hidden_size": 8,
        "ffn_hidden_size": 16,
        "num_attention_heads": 2,
        "normalization": "rmsnorm",
        "activation": "fast-swiglu",
        "bias": False,
        "position_embedding_type": "rope",
        "share_embeddings_and_output_weights": True,
        "tokenizer": {
            "library": "sentencepiece",
            "model": str(sp_model),
            "sentencepiece_legacy": True,
            "additional_special_tokens": ["<image>"],
        },
    }
    weights = {
        "embedding.word_embeddings.weight": torch.zeros(320, 8),
        "decoder.final_layernorm.weight": torch.ones(8),
    }
    path = write_nemo(
        tmp_path / "m.nemo", config, weights, layout=layout, artifacts={"tokenizer.model": sp_model}
    )
    tok = NemoCheckpoint(path).tokenizer()
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    assert tok.encode("hello world") == reference.encode("hello world")
    if layout == "legacy":  # NeMo 2.0 configs carry no legacy special tokens
        assert tok.encode("<image>") == [reference.get_piece_size()]
