"""gpt-oss with MXFP4 experts made by ``dayzero quantize`` in gpt-oss layout: dayzero (experts packed,
converted per layer in the workspace) matches transformers' own dequantizing path for the same checkpoint."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dayzero import LLM
from dayzero.tools.quantize import quantize_checkpoint
from tests.hf.harness import block_kernels, check_parity, make_hf_checkpoint, prompt_batch

CONFIG = dict(vocab_size=300, hidden_size=96, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=256, initializer_range=0.08)


def _transformers_version() -> tuple[int, ...]:
    import transformers

    return tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())


# transformers 5.17 dequantizes MXFP4 experts through bf16 on this path (measured: 3.3e-3 relative logits
# difference, against 3e-7 with 5.24), which is its rounding, not the checkpoint's
@pytest.mark.skipif(_transformers_version() < (5, 24), reason="needs transformers >= 5.24 (fp32-exact MXFP4 dequantization)")
@pytest.mark.parametrize("compute", ["bf16", "fp8"])
def test_mxfp4_gpt_oss_matches_transformers_dequantized(tmp_path, compute):
    make_hf_checkpoint(tmp_path / "bf16", "gpt_oss", seed=3, **CONFIG)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "mxfp4", progress=False)
    names = load_file(str(tmp_path / "mxfp4" / "model.safetensors"))
    assert names["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (4, 64, 3, 16)  # [E, 2I, D/32, 16]
    assert names["model.layers.0.mlp.experts.down_proj_scales"].shape == (4, 96, 1)  # [E, D, I/32]
    assert json.loads((tmp_path / "mxfp4" / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"

    block_kernels()
    from transformers import AutoModelForCausalLM, Mxfp4Config

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "mxfp4"), quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    llm_kwargs = dict(expert_compute=compute)
    engine = LLM(str(tmp_path / "mxfp4"), device="cpu", dtype="float32", num_cache_blocks=64, **llm_kwargs).engine
    assert len(engine.packed_moe_layers) == 2 and engine.expert_workspace.compute == compute
    check_parity(tmp_path / "mxfp4", hf, prompt_batch(300), rtol=1e-3, llm_kwargs=llm_kwargs)
