"""Conversation templates as NeMo training rendered them (``data.conv_template`` / ``mm_cfg.llm.model_type``).

A template turns one user message into the prompt text the LLM saw during training, up to the point where the
assistant's answer starts. Media stay in the text as the placeholder ``<image>`` (or ``<video>``); the model type
decides what each placeholder becomes (feature embeddings, possibly framed by special tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"

CHAT_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
LLAVA_V1_SYSTEM = (
    "A chat between a curious human and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the human's questions."
)
VISION_ASSISTANT_SYSTEM = (
    "You are a helpful language and vision assistant. You are able to understand the visual content that the "
    "user provides, and assist the user with a variety of tasks using natural language."
)
STEERLM_LABELS = (
    "quality:4,toxicity:0,humor:0,creativity:0,helpfulness:4,correctness:4,coherence:4,complexity:4,verbosity:4"
)


@dataclass(frozen=True)
class ChatTemplate:
    """One training conversation format.

    ``prompt`` has the fields ``{system}`` and ``{message}``; ``add_bos`` says whether training put the tokenizer's
    BOS in front; ``stop_tokens`` end the answer besides the tokenizer's EOS.
    """

    name: str
    prompt: str
    system: str = ""
    add_bos: bool = False
    stop_tokens: tuple[str, ...] = field(default_factory=tuple)

    def render(self, message: str, placeholder: str = IMAGE_PLACEHOLDER, system: str | None = None) -> str:
        """Return the prompt text for one user ``message``; a missing placeholder goes first, as training put it."""
        if placeholder and placeholder not in message:
            message = f"{placeholder}\n{message}"
        return self.prompt.format(system=self.system if system is None else system, message=message)

    def to_dict(self) -> dict:
        return {"name": self.name, "prompt": self.prompt, "system": self.system, "add_bos": self.add_bos,
                "stop_tokens": list(self.stop_tokens)}

    @classmethod
    def from_dict(cls, data: dict) -> ChatTemplate:
        return cls(name=data["name"], prompt=data["prompt"], system=data.get("system", ""),
                   add_bos=bool(data.get("add_bos", False)), stop_tokens=tuple(data.get("stop_tokens", ())))


_NVGPT = "<extra_id_0>System\n{system}<extra_id_1>User\n{message}\n<extra_id_1>Assistant\n"
_VICUNA = "{system} USER: {message} ASSISTANT:"

TEMPLATES: dict[str, ChatTemplate] = {
    t.name: t
    for t in (
        ChatTemplate("nvgpt", _NVGPT + f"<extra_id_2>{STEERLM_LABELS}\n", CHAT_SYSTEM + "\n\n",
                     stop_tokens=("<extra_id_1>",)),
        ChatTemplate("nv_steerlm", _NVGPT + f"<extra_id_2>{STEERLM_LABELS}\n", CHAT_SYSTEM + "\n\n",
                     stop_tokens=("<extra_id_1>",)),
        ChatTemplate("nv_dpo", _NVGPT, "\n", stop_tokens=("<extra_id_1>",)),
        ChatTemplate("v1", _VICUNA, CHAT_SYSTEM, add_bos=True),
        ChatTemplate("vicuna_v1", _VICUNA, CHAT_SYSTEM, add_bos=True),
        ChatTemplate("llava_v1", _VICUNA, LLAVA_V1_SYSTEM, add_bos=True),
        ChatTemplate("llama_2", "[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{message} [/INST]", VISION_ASSISTANT_SYSTEM,
                     add_bos=True),
        ChatTemplate("mistral", "[INST] {message} [/INST]", add_bos=True),
        ChatTemplate(
            "llama_3",
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\n{message}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            VISION_ASSISTANT_SYSTEM,
            stop_tokens=("<|eot_id|>",),
        ),
        ChatTemplate("plain", "{message}"),
    )
}
# NeMo's mm_cfg.llm.model_type names that select one of the formats above.
TEMPLATE_ALIASES = {"llava_llama_2": "llama_2", "vita": "llama_3", "nemotron": "nvgpt"}


def resolve_template(model_config) -> ChatTemplate:
    """Pick the template the checkpoint was trained with: ``data.conv_template``, else ``mm_cfg.llm.model_type``."""
    data = model_config.get("data") or {}
    mm_llm = (model_config.get("mm_cfg") or {}).get("llm") or {}
    name = data.get("conv_template") or mm_llm.get("model_type") or "nvgpt"
    return get_template(str(name))


def get_template(name: str) -> ChatTemplate:
    """Return the template called ``name`` (or one of its aliases)."""
    key = TEMPLATE_ALIASES.get(name, name)
    if key not in TEMPLATES:
        known = ", ".join(sorted(TEMPLATES) + sorted(TEMPLATE_ALIASES))
        raise ValueError(f"unknown conversation template {name!r}; supported: {known}. Set data.conv_template.")
    return TEMPLATES[key]
