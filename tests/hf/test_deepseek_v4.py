"""deepseek_v4: transformers' tiny random model loads and matches in fp32.

The tiny config keeps every DeepSeek-V4 feature live: all three attention kinds (sliding window of 8, so
the 40-token prompts reach past it; HCA with ratio 8 and CSA with ratio 4, whose indexer (16 heads) keeps
3 of up to 14 entries per query); YaRN on the compressed layers only; partial interleaved RoPE on the last
channels; hash-routed then sqrt-softplus-routed MoE layers with a SwiGLU clamp (0.5) the routed and shared
experts cross; and mHC with 3 streams whose mixing scales are moved off their untrained values.
"""
from __future__ import annotations

import pytest
import torch

from tests.engine.test_incremental import run_chunks
from tests.hf.harness import check_parity, make_hf_checkpoint, prompt_batch

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}
SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
CONFIG = dict(
    vocab_size=300, hidden_size=64, num_attention_heads=4, num_hidden_layers=5, head_dim=32, q_lora_rank=32,
    partial_rotary_factor=0.25, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
    compress_rates={CSA: 4, HCA: 8}, sliding_window=8, o_groups=2, o_lora_rank=12, index_n_heads=16,
    index_head_dim=16, index_topk=3, hc_mult=3, hc_sinkhorn_iters=6, swiglu_limit=0.5, routed_scaling_factor=1.5,
    layer_types=[SWA, CSA, HCA, CSA, HCA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
    max_position_embeddings=128, rope_parameters=YARN, initializer_range=0.08,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
SEED = 0


@torch.no_grad()
def _init(model):
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if name.endswith(("hc.scale", "hc_scale")):  # attn_hc / ffn_hc scales, hc_head.hc_scale
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):  # distinct experts per token, as a trained table has
            b.copy_(torch.stack([torch.randperm(CONFIG["n_routed_experts"], generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v4")
    return path, make_hf_checkpoint(path, "deepseek_v4", seed=SEED, init=_init, **CONFIG)


def test_parity_with_transformers(ckpt):
    path, hf = ckpt
    check_parity(path, hf, prompt_batch(CONFIG["vocab_size"]))
