"""nemotron_h with LatentMoE: transformers' tiny random model loads and matches in fp32, with all four layer
kinds (Mamba-2, NoPE attention, ReLU² MLP, latent MoE), prompts longer than the SSM chunk, both stored
expert layouts, and config spellings of released checkpoints."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero import LLM
from dayzero.config.spec import GQASpec, MoESpec
from dayzero.layers.attention.mamba2 import Mamba2Spec
from dayzero.models.registry import load_config
from tests.engine.test_incremental import run_chunks
from tests.hf.harness import check_parity, make_hf_checkpoint, prompt_batch

CHUNK = 16  # SSM chunk; the prompt batch has lengths 23 and 40 (several chunks) and 5, 12 (one partial chunk)
CONFIG = dict(
    vocab_size=300, hidden_size=64, max_position_embeddings=256, initializer_range=0.08,
    layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp", "moe"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
    mamba_num_heads=8, mamba_head_dim=12, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=CHUNK,
    # transformers clamps dt at time_step_min in prefill but not in decode (vLLM and mamba_ssm never do):
    # a floor far below every dt of this model keeps that quirk out of the comparison
    time_step_min=1e-6,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, moe_shared_expert_intermediate_size=40,
    moe_latent_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5,
)


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_h")
    hf = make_hf_checkpoint(path, "nemotron_h", **CONFIG)
    # time steps from 0.01 to 1 (the init range ends at 0.1): per-token decays down to e^-8 exercise the scan
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in hf.model.layers:
            if layer.block_type == "linear_attention":
                dt = torch.exp(torch.empty(CONFIG["mamba_num_heads"]).uniform_(math.log(0.01), 0.0, generator=g))
                layer.mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
    hf.save_pretrained(str(path))
    return path, hf


def test_spec_covers_every_layer_kind(hf_ckpt):
    path, _ = hf_ckpt
    spec = load_config(path)
    kinds = [(type(l.attn).__name__ if l.attn else None, type(l.mlp).__name__ if l.mlp else None) for l in spec.layers]
    assert kinds == [("Mamba2Spec", None), (None, "MoESpec"), ("GQASpec", None), ("Mamba2Spec", None),
                     (None, "MLPSpec"), (None, "MoESpec")]
    mamba, attn, moe = spec.layers[0].attn, spec.layers[2].attn, spec.layers[1].mlp
    assert isinstance(mamba, Mamba2Spec) and mamba.n_groups == 2 and mamba.chunk_size == CHUNK
    assert mamba.dt_limit == (0.0, float("inf"))
    assert isinstance(attn, GQASpec) and attn.rope is None
    assert isinstance(moe, MoESpec) and moe.latent_size == 32 and moe.latent_size not in (moe.intermediate_size, 64)
    assert moe.activation == "relu2" and moe.n_shared == 1 and moe.shared_intermediate_size == 40


def test_parity_with_transformers(hf_ckpt):
    path, hf = hf_ckpt
    prompts = prompt_batch(CONFIG["vocab_size"])
    assert max(map(len, prompts)) > 2 * CHUNK
    check_parity(path, hf, prompts)


def test_reused_state_slot_starts_clean(hf_ckpt):
    """One state slot serves every sequence in turn: a sequence must not see its predecessor's SSM state
    or conv window."""
    path, _ = hf_ckpt
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_cache_blocks=64, max_num_seqs=1)
    assert llm.engine.cache_plan.num_slots == 1
    a, b = prompt_batch(CONFIG["vocab_size"], lengths=(20, 9), seed=3)
    first = run_chunks(llm.engine, a, [20])
    run_chunks(llm.engine, b, [9])
    torch.testing.assert_close(run_chunks(llm.engine, a, [13, 6, 1]), first, rtol=1e-5, atol=1e-5)


def test_stacked_experts_and_released_config_spellings(hf_ckpt, tmp_path):
    """The same weights with stacked experts under ``model.``, and a config written the released way
    (``hybrid_override_pattern``, ``mamba_*`` keys, ``torch_dtype``), give the same logits."""
    path, hf = hf_ckpt
    tensors = load_file(str(path / "model.safetensors"))
    out, experts = {}, {}
    for name, t in tensors.items():
        parts = name.replace("backbone.", "model.", 1).split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            experts.setdefault((".".join(parts[:i + 1]), parts[i + 2]), {})[int(parts[i + 1])] = t
        else:
            out[".".join(parts)] = t
    for (prefix, proj), per_expert in experts.items():
        out[f"{prefix}.{proj}"] = torch.stack([per_expert[e] for e in sorted(per_expert)])  # [E, out, in]
    save_file(out, str(tmp_path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    pattern = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    raw["hybrid_override_pattern"] = "".join(pattern[k] for k in raw.pop("layers_block_type"))
    for new, old in (("n_groups", "mamba_n_groups"), ("conv_kernel", "mamba_d_conv"), ("chunk_size", "mamba_chunk_size")):
        raw[old] = raw.pop(new)
    raw["torch_dtype"] = raw.pop("dtype")
    raw["time_step_limit"] = [0.0, float("inf")]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_config(tmp_path) == load_config(path)
    check_parity(tmp_path, hf, prompt_batch(CONFIG["vocab_size"], lengths=(37,)), new_tokens=4)
