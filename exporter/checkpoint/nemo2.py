"""NeMo 2.0: map `context/model.yaml` to a NeMo-1 model config."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

#: NeMo 2.0 config field -> NeMo-1 field.
NEMO2_RENAMED_FIELDS = {"add_bias_linear": "bias", "rotary_percent": "rotary_percentage",
                        "seq_length": "max_position_embeddings"}
#: NeMo 2.0 activation function -> (NeMo-1 activation when gated, when not).
NEMO2_ACTIVATIONS = {
    "silu": ("fast-swiglu", "silu"), "gelu": ("geglu", "gelu"), "relu": ("fast-reglu", "relu"),
    "squared_relu": ("squared-relu",) * 2,
}
#: List-valued config fields kept (the others are dropped, as NeMo's exporter keeps only scalars).
NEMO2_LIST_FIELDS = ("window_size", "moe_layer_freq")
#: NeMo 2.0 model classes that scale the input embeddings by sqrt(hidden) (their `configure_model` does).
NEMO2_EMBEDDING_SCALING_MODELS = ("GemmaModel",)
NEMO2_NORMALIZATIONS = {"RMSNorm": "rmsnorm", "LayerNorm": "layernorm"}
NEMO2_PRECISIONS = {"bfloat16": "bf16", "float16": 16, "float32": 32}


def nemo2_to_nemo1_config(model_yaml: dict) -> DictConfig:
    """Map a NeMo 2.0 `context/model.yaml` to a NeMo-1 model config (scalars, NeMo-1 names, tokenizer)."""
    source = model_yaml.get("config") or {}
    scalar = (bool, int, float, str, type(None))
    cfg = {k: v for k, v in source.items()
           if k != "_target_" and (isinstance(v, scalar) or (k in NEMO2_LIST_FIELDS and isinstance(v, list)))}
    for new, old in NEMO2_RENAMED_FIELDS.items():
        if new in cfg:
            cfg[old] = cfg.pop(new)
    cfg = {"max_position_embeddings": 4096, "rotary_percentage": 1.0, "bias": False, **cfg, "mcore_gpt": True}
    if cfg.get("normalization") in NEMO2_NORMALIZATIONS:
        cfg["normalization"] = NEMO2_NORMALIZATIONS[cfg["normalization"]]
    func = _target_tail(source.get("activation_func"), "gelu")
    if func == "openai_gelu":  # NeMo-1's spelling: the GELU activation with openai_gelu set
        func, cfg["openai_gelu"] = "gelu", True
    if _target_tail(model_yaml.get("_target_"), "") in NEMO2_EMBEDDING_SCALING_MODELS:
        cfg["apply_embedding_scaling"] = True
    gated = bool(source.get("gated_linear_unit", False))
    cfg["activation"] = NEMO2_ACTIVATIONS[func][0 if gated else 1] if func in NEMO2_ACTIVATIONS else func
    if (dtype := _target_tail(source.get("params_dtype"), "")) in NEMO2_PRECISIONS:
        cfg["precision"] = NEMO2_PRECISIONS[dtype]
    tokenizer = model_yaml.get("tokenizer") or {}
    target = str(tokenizer.get("_target_", ""))
    if target.endswith("SentencePieceTokenizer"):
        cfg["tokenizer"] = {"library": "sentencepiece", "model": f"context/{tokenizer.get('model_path')}"}
    elif target.endswith("AutoTokenizer"):
        cfg["tokenizer"] = {"library": "huggingface", "type": tokenizer.get("pretrained_model_name")}
    return OmegaConf.create(cfg)


def _target_tail(value, default: str) -> str:
    """`torch.nn.functional.silu` -> `silu`, from a `{_target_: ...}` node or a plain string."""
    value = value.get("_target_", default) if isinstance(value, dict) else str(value or default)
    return value.rsplit(".", 1)[-1]
