"""gpt_oss: transformers' tiny random model loads and matches in fp32.

The tiny config keeps every gpt-oss feature live: attention sinks, q/k/v/o biases, sliding layers with a
window (6) shorter than the prompts, YaRN with ``truncate=False`` (its correction range is fractional
here, so truncating would change the frequencies), non-square experts (2I = 80, D = 64) with biases, a
biased router picking 2 of 6 experts, and expert biases pushed past the SwiGLU clamp (±7) so the clamp acts.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero import LLM
from dayzero.loader.safetensors_loader import load_weights
from dayzero.models.registry import adapter_for, build_model, load_config
from tests.engine.test_incremental import run_chunks
from tests.hf.harness import check_parity, make_hf_checkpoint, prompt_batch

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0}
CONFIG = dict(
    vocab_size=300, hidden_size=64, intermediate_size=40, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=6,
    num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.08,
    rope_parameters=YARN,
)
LIMIT = 7.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = make_hf_checkpoint(path, "gpt_oss", **CONFIG)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in hf.model.layers:
            b = layer.mlp.experts.gate_up_proj_bias  # [E, 2I], gate/up interleaved
            b[:, :16] += 9.0 * torch.randn(b.shape[0], 16, generator=g).sign()  # 8 gate + 8 up channels past ±7
    hf.save_pretrained(str(path))
    return path, hf


def test_parity_with_transformers(ckpt):
    path, hf = ckpt
    check_parity(path, hf, prompt_batch(CONFIG["vocab_size"]))


def _logits(path, ids):
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_cache_blocks=64, max_num_batched_tokens=64)
    return run_chunks(llm.engine, ids, [len(ids)])


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def test_window_and_clamp_are_exercised(ckpt, tmp_path):
    """Loading the same weights with the window disabled changes the logits, and the clamp is hit."""
    path, hf = ckpt
    ids = max(prompt_batch(CONFIG["vocab_size"]), key=len)
    assert len(ids) > CONFIG["sliding_window"]
    ref = hf(torch.tensor([ids])).logits[0]
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert all(l.attn.sliding_window is None for l in load_config(tmp_path).layers)
    assert _rel(_logits(tmp_path, ids), ref) > 1e-2

    h = hf.model.layers[0].post_attention_layernorm(hf.model.embed_tokens(torch.tensor(ids)))
    e = hf.model.layers[0].mlp.experts
    gate_up = torch.einsum("td,edf->etf", h, e.gate_up_proj) + e.gate_up_proj_bias[:, None]
    assert (gate_up[..., 0::2] > LIMIT).any() and (gate_up[..., 1::2] > LIMIT).any() and (gate_up[..., 1::2] < -LIMIT).any()


def _relayout(tensors: dict, layout: str) -> dict:
    """The same weights in another stored expert layout: ``out_in`` ([E, 2I, D] / [E, D, I]) or ``per_expert``."""
    out = {}
    for name, t in tensors.items():
        if ".mlp.experts." not in name:
            out[name] = t
            continue
        base, _, kind = name.rpartition(".experts.")
        if layout == "out_in":
            out[name] = t.transpose(1, 2).contiguous() if kind in ("gate_up_proj", "down_proj") else t
            continue
        for e in range(t.shape[0]):
            p = f"{base}.experts.{e}"
            if kind.startswith("gate_up_proj"):
                w = t[e].t() if kind == "gate_up_proj" else t[e]  # [2I, D] / [2I], interleaved
                suffix = "weight" if kind == "gate_up_proj" else "bias"
                out[f"{p}.gate_proj.{suffix}"], out[f"{p}.up_proj.{suffix}"] = w[0::2].contiguous(), w[1::2].contiguous()
            else:
                out[f"{p}.down_proj.weight" if kind == "down_proj" else f"{p}.down_proj.bias"] = (
                    t[e].t().contiguous() if kind == "down_proj" else t[e])
    return out


@pytest.mark.parametrize("layout", ["out_in", "per_expert"])
def test_every_expert_layout_loads_the_same(ckpt, tmp_path, layout):
    path, _ = ckpt
    raw = json.loads((path / "config.json").read_text())
    spec, adapter = load_config(path), adapter_for(raw)
    save_file(_relayout(load_file(path / "model.safetensors"), layout), tmp_path / "model.safetensors")
    models = []
    for p in (path, tmp_path):
        m = build_model(spec, torch.float32)
        load_weights(m, p, adapter.rules(spec), adapter.ignore)
        models.append(dict(m.named_parameters()))
    for name, t in models[0].items():
        assert torch.equal(t, models[1][name]), name


def test_released_config_spelling():
    """A released-style config (rope_scaling + rope_theta, torch_dtype, defaults left out) gives the same spec
    as transformers 5's spelling; unsupported SwiGLU constants are refused."""
    from dayzero.models.adapters.gpt_oss import gpt_oss_spec

    common = dict(model_type="gpt_oss", vocab_size=300, hidden_size=64, intermediate_size=40, head_dim=16,
                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, num_local_experts=6,
                  num_experts_per_tok=2, max_position_embeddings=4096, sliding_window=128)
    released = gpt_oss_spec({**common, "torch_dtype": "bfloat16", "rope_theta": 150000, "swiglu_limit": 7.0,
                             "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                              "truncate": False, "original_max_position_embeddings": 4096}})
    hf5 = gpt_oss_spec({**common, "dtype": "bfloat16",
                        "layer_types": ["sliding_attention", "full_attention"] * 2,
                        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                            "truncate": False, "original_max_position_embeddings": 4096,
                                            "rope_theta": 150000.0}})
    bare = gpt_oss_spec(common)  # transformers' defaults: alternating layers, YaRN x32, theta 150000
    assert released == hf5 == bare
    attn = released.layers[0].attn
    assert attn.sinks and attn.qkv_bias and attn.o_bias and attn.sliding_window == 128
    assert released.layers[1].attn.sliding_window is None
    assert attn.rope.scaling.truncate is False and attn.rope.theta == 150000
    with pytest.raises(ValueError, match="swiglu_limit"):
        gpt_oss_spec({**common, "swiglu_limit": 10.0})
