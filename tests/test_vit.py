"""The serving path's own CLIP / SigLIP tower equals transformers' vision models, and loads without them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from exporter.perception.vision_tower import strip_hf_prefix
from exporter.perception.vit import VisionTransformer
from support.vision_towers import pixels_for, tiny_tower


@pytest.mark.parametrize("tower_type, image_size, act", [("clip", 32, None), ("siglip", 40, None),
                                                         ("clip", 32, "gelu")])
def test_equals_transformers_vision_model_in_float32(tower_type, image_size, act):
    reference = tiny_tower(tower_type, image_size)
    if act is not None:
        reference.config.hidden_act = act
        reference = type(reference)(reference.config).eval()
        reference.load_state_dict(tiny_tower(tower_type, image_size).state_dict())
    config = reference.config.to_dict()
    weights = strip_hf_prefix(reference.state_dict())
    ours = VisionTransformer.from_weights(tower_type, config, weights, torch.float32)
    pixels = pixels_for(image_size)
    with torch.no_grad():
        # the last encoder layer's output (transformers' last_hidden_state is after the post-norm)
        expected = reference(pixel_values=pixels, output_hidden_states=True).hidden_states[-1]
        got = ours(pixels)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, torch.zeros_like(got))


def test_missing_extra_or_misshapen_weights_are_named():
    reference = tiny_tower("clip")
    weights = strip_hf_prefix(reference.state_dict())
    config = reference.config.to_dict()
    missing = {k: v for k, v in weights.items() if k != "pre_layrnorm.weight"}
    with pytest.raises(ValueError, match="missing.*pre_layrnorm.weight"):
        VisionTransformer.from_weights("clip", config, missing, torch.float32)
    with pytest.raises(ValueError, match="unexpected.*extra.weight"):
        VisionTransformer.from_weights("clip", config, {**weights, "extra.weight": torch.zeros(1)}, torch.float32)
    bad = {**weights, "pre_layrnorm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="do not match the clip config"):
        VisionTransformer.from_weights("clip", config, bad, torch.float32)


def test_the_tower_module_does_not_import_transformers():
    code = ("import sys, exporter.perception.vit, exporter.perception.vision_encoder; "
            "print('transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
