"""What the Neva end-to-end tests add to ``support.vlm``: a vision tower published in a local Hugging Face hub
cache under a hub name, as a full CLIPModel with its own image processor (NeMo's ``from_pretrained`` case)."""

from __future__ import annotations

from pathlib import Path

from transformers import CLIPConfig, CLIPModel, CLIPVisionModel

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"  # the commit hash the cache's refs/main points at
TINY_TEXT_TOWER = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "vocab_size": 64, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}


def cache_full_clip(cache_dir: Path, repo_id: str, vision: CLIPVisionModel, processor) -> Path:
    """Store a full CLIPModel whose vision half is ``vision``, and ``processor``, as hub repo ``repo_id`` in
    the hub cache ``cache_dir`` (the ``models--org--name/{refs,snapshots}`` layout); return the snapshot."""
    model = CLIPModel(CLIPConfig(vision_config=vision.config.to_dict(), text_config=TINY_TEXT_TOWER,
                                 projection_dim=8))
    missing, unexpected = model.vision_model.load_state_dict(vision.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / SNAPSHOT
    model.save_pretrained(snapshot)
    processor.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return snapshot
