"""The Kimi-K2.5 vision tower and projector against transformers' own, built from a tiny random config, their
state_dicts loaded into ours by name (under ``vision_tower.`` / ``mm_projector.``, q/k/v fused as ``attn.qkv``);
fp32 on the CPU. The checkpoints' names and fused ``wqkv`` load through the engine (``test_engine_images.py``)."""
from __future__ import annotations

import pytest
import torch

from dayzero.multimodal import KimiK25ImageProcessor
from dayzero.multimodal.kimi_k25 import KimiK25Vision, KimiK25VisionConfig, checkpoint_rules
from tests.multimodal.helpers import assert_close, packed_pixels, perturb_constant

VISION = dict(patch_size=4, pos_emb_height=6, pos_emb_width=6, pos_emb_time=4, num_attention_heads=4,
              num_hidden_layers=2, hidden_size=32, intermediate_size=48)
ROW = (3, 4, 4)
GRIDS = {
    "one": [[1, 4, 6]],
    "two-sizes": [[1, 4, 6], [1, 10, 2]],
    "table-size": [[1, 6, 6], [1, 2, 2]],  # the position table itself (no resampling), the smallest image
    "larger-than-table": [[1, 8, 12]],  # the table upsampled
    "clip": [[2, 4, 4], [1, 2, 8]],  # two frames: time embedding, one attention segment, frames averaged
}


@torch.no_grad()
def reference(seed: int = 0):
    try:
        from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config
        from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection, Kimi_K25VisionModel
    except ImportError:
        import transformers
        pytest.skip(f"transformers {transformers.__version__} has no kimi_k25 implementation")
    cfg = Kimi_K25Config(vision_config=VISION, text_config={"hidden_size": 24}, projection_hidden_size=32)
    cfg.vision_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    tower, projector = Kimi_K25VisionModel(cfg.vision_config).eval(), Kimi_K25MultimodalProjection(cfg).eval()
    perturb_constant(tower, seed + 1)
    perturb_constant(projector, seed + 2)
    return tower, projector, cfg


def fused(state: dict) -> dict:
    """transformers' separate ``attn.q_proj/k_proj/v_proj`` (rotate-half layout) as our ``attn.qkv``."""
    out = {}
    for name, t in state.items():
        if ".attn.q_proj." in name:
            parts = [state[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv")] = torch.cat(parts)
        elif ".attn.k_proj." not in name and ".attn.v_proj." not in name:
            out[name] = t
    return out


def ours_from(tower, projector, cfg) -> KimiK25Vision:
    ours = KimiK25Vision(KimiK25VisionConfig.from_hf(cfg.to_dict()))
    state = fused({f"vision_tower.{k}": v for k, v in tower.state_dict().items()})
    state |= {f"mm_projector.{k}": v for k, v in projector.state_dict().items()}
    result = ours.load_state_dict(state, strict=True)  # every name matches, none left over
    assert not result.missing_keys and not result.unexpected_keys
    return ours.eval()


@torch.no_grad()
def reference_features(tower, projector, px, g):
    return projector(tower(px, grid_thw=g).pooler_output).squeeze(1)


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_matches_transformers(grid):
    tower, projector, cfg = reference()
    ours = ours_from(tower, projector, cfg)
    px, g = packed_pixels(GRIDS[grid], ROW)
    with torch.no_grad():
        got = ours(px, g)
        merged = ours.vision_tower(px, g)
    theirs = tower(px, grid_thw=g).pooler_output
    assert_close(merged, theirs)  # the merged windows before the projector
    assert got.features.shape == (int(g[:, 1:].prod(-1).sum()) // 4, 24) and got.deepstack == []
    assert_close(got.features, reference_features(tower, projector, px, g))


def test_images_packed_together_equal_images_alone():
    ours = ours_from(*reference())
    px, g = packed_pixels(GRIDS["two-sizes"], ROW)
    with torch.no_grad():
        both = ours(px, g).features
        alone = torch.cat([ours(px[:24], g[:1]).features, ours(px[24:], g[1:]).features])
    assert_close(both, alone)


def test_processor_rows_feed_the_tower():
    tower, projector, cfg = reference()
    ours = ours_from(tower, projector, cfg)
    from PIL import Image
    proc = KimiK25ImageProcessor(patch_size=4, merge_size=2, max_patches=64, max_patches_per_side=16)
    inputs = proc([Image.new("RGB", (37, 23), (200, 30, 90)), Image.new("RGB", (90, 9), (5, 250, 9))])
    with torch.no_grad():
        got = ours(inputs.pixel_values, inputs.grid_thw).features
    assert got.shape[0] == sum(inputs.num_tokens)
    assert_close(got, reference_features(tower, projector, inputs.pixel_values, inputs.grid_thw))


def test_config_from_checkpoint():
    cfg = KimiK25VisionConfig.from_hf({"vision_config": VISION | {"merge_kernel_size": [2, 2]},
                                       "text_config": {"hidden_size": 24}, "projection_layer_norm_eps": 1e-6})
    assert (cfg.hidden_size, cfg.text_hidden_size, cfg.merge_kernel_size, cfg.projection_layer_norm_eps) == \
        (32, 24, (2, 2), 1e-6)
    with pytest.raises(ValueError, match="projection_hidden_size"):
        KimiK25VisionConfig.from_hf({"vision_config": VISION, "projection_hidden_size": 64})
    released = {"vt_hidden_size": 32, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 4,
                "vt_intermediate_size": 48, "init_pos_emb_height": 6, "init_pos_emb_width": 6,
                "init_pos_emb_time": 4, "patch_size": 4, "merge_kernel_size": [2, 2], "mm_hidden_size": 32,
                "projector_ln_eps": 1e-6, "text_hidden_size": 24}  # the release's keys
    assert KimiK25VisionConfig.from_hf({"vision_config": released}) == KimiK25VisionConfig(
        **VISION, text_hidden_size=24, projection_layer_norm_eps=1e-6)


def test_bad_inputs_refused():
    ours = KimiK25Vision(KimiK25VisionConfig(**VISION, text_hidden_size=24))
    px, g = packed_pixels([[1, 4, 6]], ROW)
    with pytest.raises(ValueError, match="rows but grid_thw"):
        ours(px[:-1], g)
    with pytest.raises(ValueError, match="whole 2x2 windows"):
        ours(px[:20], torch.tensor([[1, 4, 5]]))
    px, g = packed_pixels([[5, 2, 2]], ROW)
    with pytest.raises(ValueError, match="pos_emb_time"):
        ours(px, g)


def test_wqkv_rule_reorders_pairs_to_halves():
    """The checkpoint's fused wqkv (and bias) -> ``attn.qkv``: q and k rows of each head from complex pairs
    (2i, 2i+1) to halves (i, Dh/2 + i), v untouched; 4 heads of 8 here."""
    rule = checkpoint_rules(KimiK25VisionConfig(**VISION, text_hidden_size=24), "visual.")[0]
    m = rule.match("vision_tower.encoder.blocks.1.wqkv.bias")
    assert rule.param_name(m) == "visual.vision_tower.layers.1.attn.qkv.bias"
    head = [0, 2, 4, 6, 1, 3, 5, 7]
    qk = [part * 32 + h * 8 + i for part in range(2) for h in range(4) for i in head]
    want = torch.tensor(qk + list(range(64, 96)))
    assert torch.equal(rule.transform(torch.arange(96)), want)
    weight = torch.arange(96 * 2).view(96, 2)
    assert torch.equal(rule.transform(weight), weight[want])
