"""qwen3_5_moe, qwen3_vl_moe, kimi_k25: the text models of transformers' tiny random vision-language models load
(the vision tower's tensors skipped by name) and match in fp32 on text-only prompts.

A prompt of 70 tokens crosses the 64-token engine step and the delta-rule chunk, and is also prefilled in
uneven chunks; the greedy reference is transformers' full forward per token. The released files' tensor layouts,
where they differ from what transformers writes, load too. Multimodal RoPE with three equal position axes is
checked against plain RoPE at the released section layouts.
"""
from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero import LLM
from tests.engine.test_incremental import run_chunks
from tests.hf.harness import check_parity, make_hf_checkpoint, prompt_batch

TEXT = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, initializer_range=0.08, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64)
KIMI_VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=2)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
LENGTHS = (5, 70, 12, 40)
CHUNKS = (9, 30, 31)  # the 70-token prompt prefilled in three engine steps

FAMILIES = {
    "qwen3_5_moe": dict(vision_config=QWEN_VISION, text_config=dict(
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        moe_intermediate_size=24, shared_expert_intermediate_size=40, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True})),
    "qwen3_vl_moe": dict(vision_config={**QWEN_VISION, "deepstack_visual_indexes": [0]}, text_config=dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=24, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                         "mrope_interleaved": True})),
    # an untied head (transformers' default for this family ties it), so the nested LM head name is loaded too
    "kimi_k25": dict(tie_word_embeddings=False, vision_config=KIMI_VISION, text_config=dict(
        model_type="deepseek_v3", num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96,
        moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5, rope_parameters=YARN)),
}


def slow_decay(model):
    """Per-token Gated DeltaNet decays of about e^-0.01 (as in test_linear_families), so each token's state matters."""
    for layer in model.model.language_model.layers:
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None:
            gdn.A_log.copy_(torch.empty_like(gdn.A_log).uniform_(0.01, 1.0).log())
            gdn.dt_bias.fill_(math.log(math.expm1(0.02)))


def _config(model_type: str) -> dict:
    cfg = FAMILIES[model_type]
    return {**cfg, "text_config": {**TEXT, **cfg["text_config"]}}


def _checkpoint(path, model_type):
    return make_hf_checkpoint(path, model_type, init=slow_decay if model_type == "qwen3_5_moe" else None,
                              auto_class="AutoModelForImageTextToText", **_config(model_type))


def _rel(llm, hf, ids, chunks) -> float:
    """Relative error of our logits, the prompt fed in ``chunks``, against transformers' forward."""
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = run_chunks(llm.engine, ids, list(chunks))
    return ((ours - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_parity_with_transformers(tmp_path, model_type):
    from dayzero.tools.checkpoint_check import check_checkpoint
    from dayzero.tools.model_info import load

    hf = _checkpoint(tmp_path, model_type)
    report = check_checkpoint(load(tmp_path))  # what ``dayzero inspect`` reports
    assert report["ok"], report["mismatches"]
    assert sum(c.get("ignored", 0) for c in report["by_format"].values()) > 0  # the vision tower, skipped by name
    prompts = prompt_batch(TEXT["vocab_size"], lengths=LENGTHS)
    llm = check_parity(tmp_path, hf, prompts, hf_cache=False)
    rel = _rel(llm, hf, prompts[1], CHUNKS)
    assert rel <= 1e-4, f"chunked prefill {CHUNKS}: logits relative error {rel:.2e}"


def _transpose_experts(name, t):
    stacked = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    return name, t.transpose(1, 2).contiguous() if stacked else t


def _layers_not_blocks(name, t):
    return name.replace("language_model.model.blocks.", "language_model.model.layers."), t


# the released files differ from what transformers 5 writes: stacked experts [E, in, out]; decoder layers as ``layers``
RELEASED_FILES = {"qwen3_vl_moe": _transpose_experts, "kimi_k25": _layers_not_blocks}


@pytest.mark.parametrize("model_type", sorted(RELEASED_FILES))
def test_released_layout(tmp_path, model_type):
    hf = _checkpoint(tmp_path / "hf", model_type)
    (tmp_path / "released").mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "released")
    written = load_file(tmp_path / "hf" / "model.safetensors")
    tensors = dict(RELEASED_FILES[model_type](n, t) for n, t in written.items())
    assert tensors.keys() != written.keys() or any(t.shape != written[n].shape for n, t in tensors.items())
    save_file(tensors, tmp_path / "released" / "model.safetensors")
    llm = LLM(str(tmp_path / "released"), device="cpu", dtype="float32", block_size=4, num_cache_blocks=128)
    ids = prompt_batch(TEXT["vocab_size"], lengths=(23,))[0]
    assert _rel(llm, hf, ids, (len(ids),)) <= 1e-4


# released rotary layouts: (text config, an attention layer's index)
RELEASED_ROPE = {
    "qwen3_vl_moe": (dict(head_dim=128, num_attention_heads=32, rope_parameters={
        "rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True}), 0),
    "qwen3_5_moe": (dict(head_dim=256, num_attention_heads=16, rope_parameters={
        "rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
        "mrope_interleaved": True}), 3),
}


@pytest.mark.parametrize("model_type", sorted(RELEASED_ROPE))
def test_mrope_of_text_is_plain_rope(model_type):
    """transformers' multimodal rotary, given three equal position axes, equals our plain NeoX rotary over the
    adapter's rotated dims; with unequal axes it does not, so the layout is exercised."""
    from transformers import AutoConfig

    from dayzero.layers.rotary import RotaryEmbedding
    from dayzero.models.registry import adapter_for

    modeling = pytest.importorskip(f"transformers.models.{model_type}.modeling_{model_type}")
    reference = {"qwen3_vl_moe": "Qwen3VLMoeTextRotaryEmbedding", "qwen3_5_moe": "Qwen3_5MoeTextRotaryEmbedding"}
    text, layer = RELEASED_ROPE[model_type]
    cfg = AutoConfig.for_model(model_type, text_config={**text, "num_hidden_layers": 4})
    raw = cfg.to_dict()
    rope = adapter_for(raw).to_spec(raw).layers[layer].attn.rope
    hf_rope = getattr(modeling, reference[model_type])(cfg.text_config)
    assert not rope.interleaved and rope.dim == 2 * sum(text["rope_parameters"]["mrope_section"])

    positions = torch.cat([torch.arange(40), torch.arange(1000, 300000, 7919)])
    x = torch.zeros(1, positions.numel(), 8)
    cos, sin = hf_rope(x, positions.view(1, 1, -1).expand(3, 1, -1))  # [1, T, dim]: NeoX halves repeated
    ours_cos, ours_sin = RotaryEmbedding(rope).cos_sin(positions)  # [T, dim/2]
    # the same fp32 frequencies and products, so equal to the bit
    assert torch.equal(cos[0], ours_cos.repeat(1, 2)) and torch.equal(sin[0], ours_sin.repeat(1, 2))

    axes = torch.stack([positions, positions // 2, positions // 3]).unsqueeze(1)  # an image-like grid
    assert not torch.allclose(hf_rope(x, axes)[0][0], cos[0])
