"""One tokenizer interface over NeMo's SentencePiece models and local Hugging Face tokenizer folders.

Nothing here downloads or runs a folder's code: Hugging Face tokenizers load with `local_files_only=True` and
`trust_remote_code=False`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import sentencepiece

SENTENCEPIECE_FILE = "tokenizer.model"
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token")


class TokenizerError(ValueError):
    """The tokenizer cannot be found or built; the message says what to pass instead."""


class Tokenizer(ABC):
    """Text <-> token ids. `vocab_size` counts the tokenizer's own ids (the model may pad its vocab)."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    vocab_size: int

    @abstractmethod
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text map to their ids."""

    @abstractmethod
    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`; with `skip_special`, control/special tokens are left out. Ids outside the vocab are
        always dropped (they can only come from the model's padded vocab rows)."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """Id of one token (piece) or None if it is not in the vocabulary."""

    @abstractmethod
    def save(self, directory: str | Path) -> dict[str, Any]:
        """Write the tokenizer files into `directory`; returns what `load_saved_tokenizer` needs."""


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model plus NeMo's `sentencepiece_legacy` special tokens.

    Each special token that is not a piece of the model gets the next id after the model's pieces (in the
    given order); one that is a piece keeps its id. Special tokens are matched as whole tokens when encoding
    (the longest one wins at a position). `named_special_tokens` (`bos_token`/`eos_token`/`pad_token` -> text)
    override the model's own BOS/EOS/PAD ids, as NeMo's legacy mode does.
    """

    def __init__(
        self,
        model_proto: bytes,
        special_tokens: Sequence[str] = (),
        named_special_tokens: Mapping[str, str] | None = None,
    ):
        """`special_tokens` in NeMo's order (it decides appended ids); unlisted named tokens come last."""
        self._model_proto = model_proto
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self._named = dict(named_special_tokens or {})
        unknown_names = sorted(set(self._named) - set(_NAMED_SPECIAL_TOKENS))
        if unknown_names:
            raise TokenizerError(
                f"unsupported named special tokens {unknown_names}; "
                f"supported: {', '.join(_NAMED_SPECIAL_TOKENS)}"
            )
        self._special_tokens = list(dict.fromkeys([*special_tokens, *self._named.values()]))
        self._special_to_id: dict[str, int] = {}
        self._appended: dict[int, str] = {}
        for token in self._special_tokens:
            piece_id = self._sp.piece_to_id(token)
            if piece_id == self._sp.unk_id() and token != self._sp.id_to_piece(piece_id):
                piece_id = self._sp.get_piece_size() + len(self._appended)
                self._appended[piece_id] = token
            self._special_to_id[token] = piece_id
        self.vocab_size = self._sp.get_piece_size() + len(self._appended)
        by_length = sorted(self._special_tokens, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        self._skipped_ids = set(self._special_to_id.values()) | {
            i for i in range(self._sp.get_piece_size()) if self._sp.is_control(i)
        }
        self.bos_id = self._named_or_model_id("bos_token", self._sp.bos_id())
        self.eos_id = self._named_or_model_id("eos_token", self._sp.eos_id())
        self.pad_id = self._named_or_model_id("pad_token", self._sp.pad_id())

    def _named_or_model_id(self, name: str, model_id: int) -> int | None:
        if name in self._named:
            return self._special_to_id[self._named[name]]
        return model_id if model_id >= 0 else None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        start = 0
        for match in self._special_pattern.finditer(text) if self._special_pattern else ():
            ids += self._sp.encode(text[start : match.start()])
            ids.append(self._special_to_id[match.group()])
            start = match.end()
        return ids + self._sp.encode(text[start:])

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        pieces = []
        for i in map(int, ids):
            if not 0 <= i < self.vocab_size or (skip_special and i in self._skipped_ids):
                continue
            pieces.append(self._appended[i] if i in self._appended else self._sp.id_to_piece(i))
        return self._sp.decode_pieces(pieces)

    def token_to_id(self, token: str) -> int | None:
        if token in self._special_to_id:
            return self._special_to_id[token]
        piece_id = self._sp.piece_to_id(token)
        return piece_id if self._sp.id_to_piece(piece_id) == token else None

    def save(self, directory: str | Path) -> dict[str, Any]:
        Path(directory, SENTENCEPIECE_FILE).write_bytes(self._model_proto)
        return {
            "library": "sentencepiece",
            "model": SENTENCEPIECE_FILE,
            "special_tokens": list(self._special_tokens),
            "named_special_tokens": dict(self._named),
        }


class HuggingFaceTokenizer(Tokenizer):
    """A `transformers` tokenizer loaded from a local folder (or the local HF cache), never downloaded."""

    def __init__(self, name_or_path: str | Path):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(  # a folder's own Python code never runs
                str(name_or_path), local_files_only=True, trust_remote_code=False
            )
        except (OSError, ValueError) as err:
            raise TokenizerError(
                f"cannot load the Hugging Face tokenizer {str(name_or_path)!r} from local files ({err}). "
                "Hugging Face tokenizers are not stored inside .nemo archives and nothing is downloaded: "
                "pass tokenizer_path=<local folder with the tokenizer files>"
            ) from err
        self.vocab_size = len(self._tok)
        self.bos_id, self.eos_id, self.pad_id = (
            self._tok.bos_token_id,
            self._tok.eos_token_id,
            self._tok.pad_token_id,
        )
        self._vocab: dict[str, int] | None = None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False)
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else list(ids)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        kept = [i for i in map(int, ids) if 0 <= i < self.vocab_size]
        return self._tok.decode(kept, skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        if self._vocab is None:
            self._vocab = self._tok.get_vocab()
        return self._vocab.get(token)

    def save(self, directory: str | Path) -> dict[str, Any]:
        self._tok.save_pretrained(str(directory))
        return {"library": "huggingface"}


def load_tokenizer(
    tokenizer_cfg: Mapping[str, Any] | None,
    read_artifact: Callable[[str], bytes],
    tokenizer_path: str | Path | None = None,
) -> Tokenizer:
    """The tokenizer a NeMo model config describes.

    tokenizer_cfg: the config's `tokenizer` section (`library`, `model`, `type`, `sentencepiece_legacy`,
        `special_tokens`, `additional_special_tokens`).
    read_artifact: returns the bytes of a checkpoint file given the config's reference (`nemo:<name>` or a
        file name).
    tokenizer_path: overrides the config's files: a folder holding a Hugging Face tokenizer, or a
        SentencePiece `.model` file (the config's legacy special tokens still apply to it).
    """
    cfg = tokenizer_cfg or {}
    library = str(cfg.get("library", "sentencepiece" if tokenizer_path else "")).lower()
    if tokenizer_path is not None:
        path = Path(tokenizer_path)
        if path.is_dir():
            return HuggingFaceTokenizer(path)
        if path.is_file():
            return _sentencepiece_from_config(path.read_bytes(), cfg if library == "sentencepiece" else {})
        raise TokenizerError(
            f"tokenizer_path {str(path)!r} does not exist; pass a Hugging Face tokenizer folder "
            "or a SentencePiece .model file"
        )
    if not cfg:
        raise TokenizerError("the model config has no tokenizer section; pass tokenizer_path")
    if library == "sentencepiece":
        reference = cfg.get("model")
        if reference in (None, "None", ""):
            raise TokenizerError("tokenizer.model is not set in the model config; pass tokenizer_path")
        return _sentencepiece_from_config(read_artifact(str(reference)), cfg)
    if library == "huggingface":
        name = cfg.get("type")
        if not name:
            raise TokenizerError(
                "tokenizer.library is huggingface but tokenizer.type is empty; pass tokenizer_path"
            )
        return HuggingFaceTokenizer(name)
    raise TokenizerError(
        f"tokenizer.library {library!r} is not supported; supported values: sentencepiece, "
        "huggingface (or pass tokenizer_path)"
    )


def _sentencepiece_from_config(model_proto: bytes, cfg: Mapping[str, Any]) -> SentencePieceTokenizer:
    """NeMo's rule: legacy mode (default on for SentencePiece) enables config special tokens."""
    configured = cfg.get("special_tokens") or ()
    by_name = {str(k): str(v) for k, v in configured.items()} if isinstance(configured, Mapping) else {}
    listed = list(by_name.values()) if by_name else [str(t) for t in configured]
    listed += [str(t) for t in cfg.get("additional_special_tokens") or ()]
    named = {k: v for k, v in by_name.items() if k in _NAMED_SPECIAL_TOKENS}
    if listed and not cfg.get("sentencepiece_legacy", True):
        raise TokenizerError(
            "the tokenizer config lists special tokens but sentencepiece_legacy is False; NeMo "
            "only adds special tokens to SentencePiece in legacy mode: set "
            "tokenizer.sentencepiece_legacy: True or remove the special tokens"
        )
    return SentencePieceTokenizer(model_proto, listed, named)


def load_saved_tokenizer(directory: str | Path, description: Mapping[str, Any]) -> Tokenizer:
    """Reload a tokenizer written by `Tokenizer.save(directory)`."""
    library = description.get("library")
    if library == "sentencepiece":
        proto = Path(directory, description["model"]).read_bytes()
        return SentencePieceTokenizer(
            proto, description.get("special_tokens", ()), description.get("named_special_tokens")
        )
    if library == "huggingface":
        return HuggingFaceTokenizer(directory)
    raise TokenizerError(f"unknown saved tokenizer library {library!r} in {directory}")
