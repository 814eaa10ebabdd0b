"""DeepSeek block-FP8 checkpoints: weights stay FP8 in memory (128×128 tile scales) and the model equals
transformers running the same checkpoint's dequantised weights."""
from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from dayzero import LLM
from dayzero.layers.fp8_linear import BlockFp8Linear
from dayzero.quant.fp8 import FP8, dequantize_fp8_blocks
from dayzero.tools.quantize import quantize_checkpoint
from dayzero.layers.parallel import Linear
from tests.hf.harness import block_kernels, check_parity, make_hf_checkpoint, prompt_batch, run_chunks

CONFIG = dict(
    vocab_size=300, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
    qk_rope_head_dim=32, v_head_dim=32, max_position_embeddings=256, initializer_range=0.06,
)


def test_block_fp8_deepseek_matches_dequantized_weights(tmp_path):
    make_hf_checkpoint(tmp_path / "bf16", "deepseek_v3", seed=5, **CONFIG)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp8", fmt="fp8", progress=False)
    q = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    assert q["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == FP8
    assert q["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].shape == (1, 1)
    assert q["model.layers.1.mlp.gate.weight"].dtype == torch.float32 and q["lm_head.weight"].dtype == torch.float32

    # the reference: transformers on the dequantised weights of the very same FP8 checkpoint
    ref = tmp_path / "dequantized"
    shutil.copytree(tmp_path / "bf16", ref)
    dense = {n: (dequantize_fp8_blocks(t, q[n + "_scale_inv"], torch.float32) if n + "_scale_inv" in q else t)
             for n, t in q.items() if not n.endswith("_scale_inv")}
    save_file(dense, str(ref / "model.safetensors"))
    block_kernels()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    engine = LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", num_cache_blocks=32).engine
    model = engine.model
    assert isinstance(model.model.layers[0].self_attn.q_a_proj, BlockFp8Linear)
    assert model.model.layers[0].self_attn.q_a_proj.weight.dtype == FP8
    assert model.model.layers[1].mlp.w1.dtype == FP8 and model.model.layers[1].mlp.w1_scale_inv.shape == (4, 2, 1)
    assert type(model.model.layers[1].mlp.gate) is torch.nn.Linear and model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert type(model.lm_head) is Linear  # kept in high precision
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    check_parity(tmp_path / "fp8", hf, prompt_batch(300))


def test_fp8_activations_reach_the_routed_experts(tmp_path, caplog):
    """``fp8_activations``: the block-FP8 routed experts take their inputs through e4m3 (the kernels' FP8 x FP8
    products are checked against the reference in tests/ops); the logits move by the activations' rounding,
    a few per cent at most, and nothing else changes. On a model without block-FP8 experts it says so."""
    make_hf_checkpoint(tmp_path / "bf16", "deepseek_v3", seed=5, **CONFIG)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp8", fmt="fp8", progress=False)
    kw = dict(device="cpu", dtype="float32", num_cache_blocks=32)
    exact, a8 = LLM(str(tmp_path / "fp8"), **kw), LLM(str(tmp_path / "fp8"), fp8_activations=True, **kw)
    assert a8.engine.model.model.layers[1].mlp.fp8_activations
    assert not exact.engine.model.model.layers[1].mlp.fp8_activations
    ids = prompt_batch(300)[0]
    lo, la = (run_chunks(llm.engine, ids, [len(ids)]) for llm in (exact, a8))
    rel = ((la - lo).norm() / lo.norm()).item()
    assert 1e-6 < rel < 5e-2, rel
    with caplog.at_level("WARNING", logger="dayzero"):
        LLM(str(tmp_path / "bf16"), fp8_activations=True, **kw)
    assert "no block-FP8 routed experts" in caplog.text
