"""SentencePiece tokenizers trained in the test run (no tokenizer file is downloaded or checked in)."""

from __future__ import annotations

import io
import random
from pathlib import Path

import sentencepiece

SPECIAL = tuple(f"<extra_id_{i}>" for i in range(10))  # NeMo's chat templates' special tokens


def train_sentencepiece(path: Path, vocab_size: int = 300,
                        user_defined_symbols=("<extra_id_0>", "<extra_id_1>")) -> Path:
    """Train a small BPE SentencePiece model (unk 0, bos 1, eos 2, no pad) on generated text into `path`."""
    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
        for _ in range(400)
    ]
    words += "describe the image what is in this picture robot video hello world".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) for _ in range(3000)]
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=proto,
        vocab_size=vocab_size,
        model_type="bpe",
        user_defined_symbols=list(user_defined_symbols),
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    path.write_bytes(proto.getvalue())
    return path


def tokenizer_file(folder: Path) -> Path:
    """`folder/tokenizer.model`, trained with NeMo's `<extra_id_0..9>` special tokens."""
    return train_sentencepiece(folder / "tokenizer.model", user_defined_symbols=SPECIAL)
