"""The Qwen3-VL vision tower against transformers' own (qwen3_vl_moe with deep stack, qwen3_5_moe without),
built from a tiny random config, its state_dict loaded into ours by name; fp32 on the CPU."""
from __future__ import annotations

import importlib

import pytest
import torch

from dayzero.multimodal import Qwen3VLImageProcessor
from dayzero.multimodal.qwen3_vl import Qwen3VLVision, Qwen3VLVisionConfig
from tests.multimodal.helpers import assert_close, packed_pixels, perturb_constant

# model_type -> (module, vision config class, vision model class)
FAMILIES = {
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeVisionConfig", "Qwen3VLMoeVisionModel"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeVisionConfig", "Qwen3_5MoeVisionModel"),
}
TINY = dict(depth=3, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=48, num_heads=4, patch_size=4,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=24, num_position_embeddings=36)
ROW = (3 * 2 * 4 * 4,)  # C*T*P*P
GRIDS = {
    "one": [[1, 4, 6]],
    "two-sizes": [[1, 4, 6], [1, 10, 2]],
    "table-size": [[1, 6, 6], [1, 2, 2]],  # the position table itself, and the smallest image
    "video": [[2, 4, 4], [1, 2, 8]],  # two frames: attention stays within each frame
}


@torch.no_grad()
def reference(model_type: str, seed: int = 0, **overrides):
    mod_name, cfg_cls, model_cls = FAMILIES[model_type]
    try:
        cfg_mod = importlib.import_module(f"transformers.models.{mod_name}.configuration_{mod_name}")
        model_mod = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}")
    except ImportError:
        import transformers
        pytest.skip(f"transformers {transformers.__version__} has no {model_type} implementation")
    cfg = getattr(cfg_mod, cfg_cls)(**(TINY | overrides))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(model_mod, model_cls)(cfg).float().eval()
    perturb_constant(model, seed + 1)
    return model, cfg


def ours_from(model_type, hf_model, hf_cfg) -> Qwen3VLVision:
    ours = Qwen3VLVision(Qwen3VLVisionConfig.from_hf({"model_type": model_type, "vision_config": hf_cfg.to_dict()}))
    result = ours.load_state_dict(hf_model.state_dict(), strict=True)  # every name matches, none left over
    assert not result.missing_keys and not result.unexpected_keys
    return ours.eval()


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_matches_transformers(model_type, grid):
    extra = {"deepstack_visual_indexes": [0, 2]} if model_type == "qwen3_vl_moe" else {}
    hf, cfg = reference(model_type, **extra)
    ours = ours_from(model_type, hf, cfg)
    px, g = packed_pixels(GRIDS[grid], ROW)
    with torch.no_grad():
        theirs = hf(px, grid_thw=g)
        got = ours(px, g)
    assert got.features.shape == (int(g.prod(-1).sum()) // 4, 24)
    assert_close(got.features, theirs.pooler_output)
    ref_deep = getattr(theirs, "deepstack_features", None) or []
    assert len(got.deepstack) == len(ref_deep) == (2 if model_type == "qwen3_vl_moe" else 0)
    for a, b in zip(got.deepstack, ref_deep):
        assert_close(a, b)


def test_images_packed_together_equal_images_alone():
    hf, cfg = reference("qwen3_vl_moe", deepstack_visual_indexes=[1])
    ours = ours_from("qwen3_vl_moe", hf, cfg)
    px, g = packed_pixels(GRIDS["two-sizes"], ROW)
    with torch.no_grad():
        both = ours(px, g)
        first, second = ours(px[:24], g[:1]), ours(px[24:], g[1:])
    assert_close(both.features, torch.cat([first.features, second.features]))
    assert_close(both.deepstack[0], torch.cat([first.deepstack[0], second.deepstack[0]]))


def test_processor_rows_feed_the_tower():
    hf, cfg = reference("qwen3_vl_moe")
    ours = ours_from("qwen3_vl_moe", hf, cfg)
    from PIL import Image
    proc = Qwen3VLImageProcessor(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=64, max_pixels=4096)
    inputs = proc([Image.new("RGB", (37, 23), (200, 30, 90)), Image.new("RGBA", (16, 40), (0, 0, 0, 0))])
    with torch.no_grad():
        got = ours(inputs.pixel_values, inputs.grid_thw)
        theirs = hf(inputs.pixel_values, grid_thw=inputs.grid_thw)
    assert got.features.shape[0] == sum(inputs.num_tokens)
    assert_close(got.features, theirs.pooler_output)


def test_config_from_checkpoint():
    base = {"vision_config": TINY | {"deepstack_visual_indexes": [1, 2], "rope_parameters": {"rope_theta": 500.0}}}
    vl = Qwen3VLVisionConfig.from_hf(base | {"model_type": "qwen3_vl_moe"})
    assert vl.deepstack_visual_indexes == (1, 2) and vl.rope_theta == 500.0 and vl.patch_size == 4
    assert Qwen3VLVisionConfig.from_hf(base | {"model_type": "qwen3_5_moe"}).deepstack_visual_indexes == ()
    assert Qwen3VLVisionConfig.from_hf({"model_type": "qwen3_vl_moe", "vision_config": {}}).deepstack_visual_indexes \
        == (8, 16, 24)


def test_bad_grids_refused():
    ours = Qwen3VLVision(Qwen3VLVisionConfig(**TINY, deepstack_visual_indexes=()))
    px, g = packed_pixels([[1, 4, 6]], ROW)
    with pytest.raises(ValueError, match="rows but grid_thw"):
        ours(px[:-1], g)
    with pytest.raises(ValueError, match="whole 2x2 windows"):
        ours(px[:20], torch.tensor([[1, 4, 5]]))
    with pytest.raises(ValueError, match=r"\[images, 3\]"):
        ours(px, g[0])
