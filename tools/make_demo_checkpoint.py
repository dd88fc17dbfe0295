"""Train a tiny Neva on CPU and write it as a real NeMo ``.nemo`` checkpoint (the project's demo model).

The task: each 64x64 RGB image holds ONE shape (circle, square or triangle) in ONE colour (red, green, blue or
yellow) at a random size and position on a light, slightly noisy background. The model answers two questions:
"What shape is this?" -> the shape word, and "What color is the shape?" -> the colour word.

The model is a NeVA in miniature, trained with transformers' own modules and then renamed to NeMo's keys:
CLIPVisionModel (features = ``hidden_states[-2]`` without the CLS token) -> ``mlp2x_gelu`` projector ->
LlamaForCausalLM, with a SentencePiece tokenizer trained here on the prompt texts. Each training sequence is
exactly what the runtime builds from template ``v1``: ``[bos] + sp(piece0) + 64 image features + sp(piece1)``,
where ``piece0``/``piece1`` are the rendered prompt split at ``<image>``, then ``sp(answer) + [eos]``; only
the answer and EOS are scored. Images are normalised with CLIP's mean/std (64x64 input: CLIP's resize/crop is
the identity). Training has two phases: a short vision warm-up (standing in for CLIP pretraining), then all
three parts jointly. The tower is stored in the checkpoint (``vision_encoder.freeze: False``); its
``from_pretrained`` names no real folder.

Run from the repository root (about 2 minutes on 2 CPU cores): ``python -m tools.make_demo_checkpoint``.
Deterministic for a given --seed; fails unless held-out greedy accuracy is at least 98% on both questions.
"""

from __future__ import annotations

import argparse
import io
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from PIL import Image, ImageDraw
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM

from exporter.models.templates import IMAGE_PLACEHOLDER, get_template
from tools.nemo_writer import hf_llama_to_nemo, write_nemo

IMAGE_SIZE, PATCH = 64, 8
NUM_PATCHES = (IMAGE_SIZE // PATCH) ** 2
SIZE_RANGE = (16, 40)
SHAPES = ("circle", "square", "triangle")
COLORS = {"red": (235, 25, 25), "green": (25, 200, 40), "blue": (30, 40, 235), "yellow": (240, 220, 20)}
QUESTIONS = {"What shape is this?": "shape", "What color is the shape?": "color"}
QUESTION_WEIGHTS = (2 / 3, 1 / 3)  # shape is the harder question: ask it more often while training
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
TEMPLATE = "v1"
BOS, EOS = 1, 2
VOCAB_DIVISOR = 128
LEARNING_RATE = 1e-3
VISION = dict(
    hidden_size=64,
    num_layers=3,
    num_attention_heads=4,
    ffn_hidden_size=128,
    hidden_act="quick_gelu",
    layernorm_epsilon=1e-5,
)
LLM = dict(hidden_size=96, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256)


# ----------------------------------------------------------------------------------------------------- data
def draw_shape(rng: np.random.Generator, shape: str, color: str) -> Image.Image:
    """One image: ``shape`` filled in ``color`` (jittered), fully inside, on a light noisy background."""
    if shape not in SHAPES or color not in COLORS:
        raise ValueError(f"unknown shape/colour {shape!r}/{color!r}; use one of {SHAPES} / {tuple(COLORS)}")
    base = rng.integers(215, 256)
    background = np.clip(base + rng.integers(-6, 7, size=3), 0, 255)
    pixels = np.broadcast_to(background, (IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.uint8)
    image = Image.fromarray(pixels.copy())
    size = int(rng.integers(SIZE_RANGE[0], SIZE_RANGE[1] + 1))
    x0, y0 = (int(v) for v in rng.integers(0, IMAGE_SIZE - size + 1, size=2))
    x1, y1 = x0 + size - 1, y0 + size - 1
    fill = tuple(int(np.clip(c + rng.integers(-15, 16), 0, 255)) for c in COLORS[color])
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
    noise = rng.integers(-4, 5, size=(IMAGE_SIZE, IMAGE_SIZE, 3))
    return Image.fromarray(np.clip(np.asarray(image, dtype=np.int16) + noise, 0, 255).astype(np.uint8))


def answer_for(question: str, shape: str, color: str) -> str:
    """The expected answer word for one of the two ``QUESTIONS``."""
    if question not in QUESTIONS:
        raise ValueError(f"unknown question {question!r}; ask one of {list(QUESTIONS)}")
    return shape if QUESTIONS[question] == "shape" else color


def sample_examples(rng: np.random.Generator, count: int) -> list[tuple[Image.Image, str, str]]:
    """``count`` random (image, shape, colour) triples."""
    examples = []
    for _ in range(count):
        shape, color = SHAPES[rng.integers(len(SHAPES))], list(COLORS)[rng.integers(len(COLORS))]
        examples.append((draw_shape(rng, shape, color), shape, color))
    return examples


def to_pixels(images: list[Image.Image]) -> torch.Tensor:
    """PIL images -> CLIP-normalised ``[B, 3, 64, 64]`` floats."""
    array = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0 for im in images])
    array = (array - np.array(CLIP_MEAN, dtype=np.float32)) / np.array(CLIP_STD, dtype=np.float32)
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()


# ------------------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(path: Path, vocab_size: int = 300) -> spm.SentencePieceProcessor:
    """Train a BPE SentencePiece model on the prompt texts and answer words; write it to ``path``."""
    template = get_template(TEMPLATE)
    corpus = [template.render(q) for q in QUESTIONS] + list(SHAPES) + list(COLORS)
    corpus += [
        f"The {color} {shape} is {size} on a light background."
        for shape in SHAPES
        for color in COLORS
        for size in ("small", "large", "centered", "near the edge")
    ]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus * 4),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        unk_id=0,
        bos_id=BOS,
        eos_id=EOS,
        pad_id=-1,
        hard_vocab_limit=False,
        user_defined_symbols=[f"<extra_id_{i}>" for i in range(10)],
        num_threads=1,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def prompt_pieces(sp: spm.SentencePieceProcessor, question: str) -> tuple[list[int], list[int]]:
    """Token ids before and after the image features, as the runtime builds them from template ``v1``."""
    piece0, piece1 = get_template(TEMPLATE).render(question).split(IMAGE_PLACEHOLDER)
    return [BOS] + sp.encode(piece0), sp.encode(piece1)


# ------------------------------------------------------------------------------------------------ model
class TinyNeva(nn.Module):
    """CLIP tower -> mlp2x_gelu projector -> Llama, splicing 64 image features between the prompt pieces."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.tower = CLIPVisionModel(
            CLIPVisionConfig(
                hidden_size=VISION["hidden_size"],
                intermediate_size=VISION["ffn_hidden_size"],
                num_hidden_layers=VISION["num_layers"],
                num_attention_heads=VISION["num_attention_heads"],
                image_size=IMAGE_SIZE,
                patch_size=PATCH,
                hidden_act=VISION["hidden_act"],
                layer_norm_eps=VISION["layernorm_epsilon"],
            )
        )
        self.projector = nn.Sequential(
            nn.Linear(VISION["hidden_size"], LLM["hidden_size"]),
            nn.GELU(),
            nn.Linear(LLM["hidden_size"], LLM["hidden_size"]),
        )
        self.llm = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab_size,
                hidden_size=LLM["hidden_size"],
                intermediate_size=LLM["ffn_hidden_size"],
                num_hidden_layers=LLM["num_layers"],
                num_attention_heads=LLM["num_attention_heads"],
                num_key_value_heads=LLM["num_query_groups"],
                rms_norm_eps=1e-5,
                rope_theta=10000.0,
                max_position_embeddings=512,
                tie_word_embeddings=False,
                bos_token_id=BOS,
                eos_token_id=EOS,
            )
        )

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden = self.tower(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        return self.projector(hidden[:, 1:])  # vision_select_feature "patch": drop the CLS token

    def logits(self, pixels: torch.Tensor, before: list[int], after: torch.Tensor) -> torch.Tensor:
        """Logits for ``before`` + image features + ``after`` (``after``: ``[B, T]`` ids)."""
        embed = self.llm.get_input_embeddings()
        prefix = embed(torch.tensor(before)).expand(len(pixels), -1, -1)
        inputs = torch.cat([prefix, self.image_features(pixels), embed(after)], dim=1)
        return self.llm(inputs_embeds=inputs, use_cache=False).logits


def training_batch(sp, examples, questions) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """``(before, after, targets)``: after = question + answer + eos, right-padded; targets -100 elsewhere."""
    before = prompt_pieces(sp, questions[0])[0]
    rows = []
    for (_, shape, color), question in zip(examples, questions, strict=True):
        tail = prompt_pieces(sp, question)[1]
        answer = sp.encode(answer_for(question, shape, color)) + [EOS]
        rows.append((tail + answer, [-100] * len(tail) + answer))
    width = max(len(ids) for ids, _ in rows)
    after = torch.tensor([ids + [EOS] * (width - len(ids)) for ids, _ in rows])
    targets = torch.tensor([t + [-100] * (width - len(t)) for _, t in rows])
    return before, after, targets


def pretrain_tower(model: TinyNeva, steps: int, batch_size: int, rng: np.random.Generator, lr: float) -> None:
    """Vision warm-up (a real NeVA starts from a pretrained CLIP): shape and colour from max-pooled patches.

    The shape covers a few of the 64 patches; learning it only through the LLM's (at first uniform) attention
    takes the tower far longer. The temporary head is thrown away; only the tower keeps what it learned.
    """
    head = nn.Linear(VISION["hidden_size"], len(SHAPES) + len(COLORS))
    optimizer = torch.optim.AdamW([*model.tower.parameters(), *head.parameters()], lr=lr)
    for step in range(steps):
        examples = sample_examples(rng, batch_size)
        hidden = model.tower(pixel_values=to_pixels([im for im, _, _ in examples]), output_hidden_states=True)
        logits = head(hidden.hidden_states[-2][:, 1:].max(dim=1).values)
        shapes = torch.tensor([SHAPES.index(shape) for _, shape, _ in examples])
        colors = torch.tensor([list(COLORS).index(color) for _, _, color in examples])
        loss = nn.functional.cross_entropy(logits[:, : len(SHAPES)], shapes) + nn.functional.cross_entropy(
            logits[:, len(SHAPES) :], colors
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"tower step {step:4d}  loss {loss.item():.4f}", flush=True)


def train(model: TinyNeva, sp, steps: int, batch_size: int, rng: np.random.Generator, lr: float) -> None:
    """Joint training of tower, projector and LLM on the answer tokens and EOS."""
    questions = list(QUESTIONS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * s / steps))
    )
    model.train()
    for step in range(steps):
        examples = sample_examples(rng, batch_size)
        asked = [questions[i] for i in rng.choice(len(questions), size=batch_size, p=QUESTION_WEIGHTS)]
        before, after, targets = training_batch(sp, examples, asked)
        logits = model.logits(to_pixels([im for im, _, _ in examples]), before, after)
        logits = logits[:, len(before) + NUM_PATCHES - 1 : -1]  # the positions that predict ``after``
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)


@torch.no_grad()
def greedy_answers(
    model: TinyNeva, sp, images: list[Image.Image], question: str, max_new: int = 6
) -> list[str]:
    """Greedy-decode the answer to ``question`` for every image (no KV cache; the sequences are short)."""
    model.eval()
    before, tail = prompt_pieces(sp, question)
    pixels = to_pixels(images)
    after = torch.tensor([tail] * len(images))
    generated = torch.empty(len(images), 0, dtype=torch.long)
    for _ in range(max_new):
        next_ids = model.logits(pixels, before, torch.cat([after, generated], 1))[:, -1].argmax(
            -1, keepdim=True
        )
        generated = torch.cat([generated, next_ids], 1)
    answers = []
    for row in generated.tolist():
        answers.append(sp.decode(row[: row.index(EOS)] if EOS in row else row))
    return answers


def accuracy(model: TinyNeva, sp, seed: int, count: int = 200) -> dict[str, float]:
    """Held-out accuracy per question on ``count`` fresh images."""
    examples = sample_examples(np.random.default_rng(seed), count)
    result = {}
    for question in QUESTIONS:
        answers = greedy_answers(model, sp, [im for im, _, _ in examples], question)
        hits = sum(a == answer_for(question, s, c) for a, (_, s, c) in zip(answers, examples, strict=True))
        result[question] = hits / count
    return result


# ------------------------------------------------------------------------------------------------ NeMo export
def nemo_config() -> dict:
    """``model_config.yaml`` in NeMo-1 field names."""
    return {
        "mcore_gpt": True,
        "precision": 32,
        "num_layers": LLM["num_layers"],
        "hidden_size": LLM["hidden_size"],
        "ffn_hidden_size": LLM["ffn_hidden_size"],
        "num_attention_heads": LLM["num_attention_heads"],
        "num_query_groups": LLM["num_query_groups"],
        "kv_channels": None,
        "normalization": "rmsnorm",
        "layernorm_epsilon": 1e-5,
        "activation": "fast-swiglu",
        "bias": False,
        "position_embedding_type": "rope",
        "rotary_percentage": 1.0,
        "rotary_base": 10000,
        "share_embeddings_and_output_weights": False,
        "make_vocab_size_divisible_by": VOCAB_DIVISOR,
        "encoder_seq_length": 512,
        "max_position_embeddings": 512,
        "tokenizer": {"library": "sentencepiece", "type": None, "model": None, "sentencepiece_legacy": True},
        "mm_cfg": {
            "llm": {"from_pretrained": None, "freeze": False, "model_type": TEMPLATE},
            "vision_encoder": {
                "from_pretrained": "demo/tiny-clip-vit-64",
                "from_hf": True,
                "model_type": "clip",
                "patch_dim": PATCH,
                "crop_size": [IMAGE_SIZE, IMAGE_SIZE],
                "image_size": IMAGE_SIZE,
                **VISION,
                "vision_select_layer": -2,
                "vision_select_feature": "patch",
                "class_token_length": 1,
                "freeze": False,
            },
            "mm_mlp_adapter_type": "mlp2x_gelu",
            "use_im_start_end": False,
        },
        "data": {
            "media_type": "image",
            "image_aspect_ratio": "square",
            "conv_template": TEMPLATE,
            "image_token_len": NUM_PATCHES,
        },
    }


def canonical_state_dict(model: TinyNeva) -> dict[str, torch.Tensor]:
    """The model under NeMo's canonical names (see docs/architecture.md)."""
    state = hf_llama_to_nemo(
        model.llm.state_dict(),
        num_attention_heads=LLM["num_attention_heads"],
        num_query_groups=LLM["num_query_groups"],
    )
    projector = "embedding.word_embeddings.adapter_layer.mm_projector_adapter.mm_projector."
    state |= {projector + name: t for name, t in model.projector.state_dict().items()}
    # NeMo stored the transformers-4 names, which have a ``vision_model.`` level that transformers 5 dropped.
    tower = "embedding.word_embeddings.vision_encoder.vision_model."
    state |= {tower + name.removeprefix("vision_model."): t for name, t in model.tower.state_dict().items()}
    return {name: t.detach().clone().contiguous() for name, t in state.items()}


def write_samples(folder: Path, seed: int) -> list[tuple[Image.Image, str, str]]:
    """Save a few sample images as ``<colour>_<shape>.png``; return them as (image, shape, colour)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    samples = []
    for color, shape in (("red", "circle"), ("blue", "triangle"), ("green", "square"), ("yellow", "circle")):
        image = draw_shape(rng, shape, color)
        image.save(folder / f"{color}_{shape}.png")
        samples.append((image, shape, color))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("demo/neva_demo.nemo"))
    parser.add_argument("--images-out", type=Path, default=Path("demo/images"))
    parser.add_argument("--tower-steps", type=int, default=250, help="vision warm-up steps")
    parser.add_argument("--steps", type=int, default=450, help="joint training steps")
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    start = time.time()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_path = Path(tmp) / "tokenizer.model"
        sp = train_tokenizer(tokenizer_path)
        vocab_size = math.ceil(sp.vocab_size() / VOCAB_DIVISOR) * VOCAB_DIVISOR
        model = TinyNeva(vocab_size)
        rng = np.random.default_rng(args.seed)
        pretrain_tower(model, args.tower_steps, args.batch_size, rng, LEARNING_RATE)
        train(model, sp, args.steps, args.batch_size, rng, LEARNING_RATE)
        scores = accuracy(model, sp, seed=args.seed + 1_000_003)
        for question, score in scores.items():
            print(f"held-out accuracy {question!r}: {score:.1%}")
        samples = write_samples(args.images_out, args.seed)
        for question in QUESTIONS:
            print(
                f"samples, {question!r}:", greedy_answers(model, sp, [im for im, _, _ in samples], question)
            )
        write_nemo(
            args.output,
            nemo_config(),
            canonical_state_dict(model),
            layout="torch_dist",
            artifacts={"tokenizer.model": str(tokenizer_path)},
        )
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.2f} MB) in {time.time() - start:.0f} s")
    if min(scores.values()) < 0.98:
        raise SystemExit(f"accuracy below 98%: {scores}; train longer (--steps) or change --seed")


if __name__ == "__main__":
    main()
