"""hy_v4: transformers' tiny random model loads and matches in fp32.

The tiny config keeps every HY-V4 feature live: 3 hyper-connection streams whose mixing scales are moved
off their untrained 0.01 so the weights depend on the input; the indexer (16 heads, RoPE on its last dims)
choosing 8 of up to 40 keys per query, with IndexCache layers that reuse the nearest earlier full layer
(layer 3 reuses layer 2, not layer 0); per-head sinks and the sigmoid output gate; YaRN; dense and MoE
layers in an order ``first_k_dense_replace`` cannot express; and a SwiGLU clamp (0.5) the experts cross.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from packaging.version import Version
from safetensors.torch import load_file, save_file

from dayzero import LLM, SamplingParams
from dayzero.config.spec import MLASpec
from dayzero.models.registry import build_model, load_config
from tests.engine.test_incremental import run_chunks
from tests.hf.harness import check_parity, make_hf_checkpoint, prompt_batch
from tests.hf.test_dsa_families import GAP, TOPK, topk_cut_gap

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
CONFIG = dict(
    vocab_size=300, hidden_size=64, num_attention_heads=4, num_hidden_layers=5, max_position_embeddings=128,
    initializer_range=0.08, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    index_topk=TOPK, index_n_heads=16, index_head_dim=32, rope_parameters=YARN, hc_mult=3, swiglu_limit=0.5,
    indexer_types=["full", "shared", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse"],
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # transformers 5.25 moved HY-V4's RoPE from NeoX halves to interleaved pairs: the checkpoint names the layout
    # the installed reference applies, and the adapter reads it
    rope_interleave=Version(transformers.__version__) >= Version("5.25"),
)
SEED = 2  # no near-tie at the top-k cut under either RoPE layout


def _spread_hc_scales(model):
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if name.endswith(("hc.scale", "hc_scale")):  # attn_hc / ffn_hc scale, hc_head.hc_scale
            p.copy_(0.5 + torch.rand(p.shape, generator=g))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("hy_v4")
    return path, make_hf_checkpoint(path, "hy_v4", seed=SEED, init=_spread_hc_scales, **CONFIG)


def _llm(path):
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, num_cache_blocks=256, max_num_batched_tokens=64)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_parity_with_transformers(ckpt):
    path, hf = ckpt
    prompts = prompt_batch(CONFIG["vocab_size"])
    assert max(map(len, prompts)) > TOPK
    llm = _llm(path)
    # the queries of prompts and of their greedy continuations must have no near-tie at the top-k cut
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    gap = topk_cut_gap(llm, [p + o.outputs[0].token_ids for p, o in zip(prompts, outs) if len(p) > TOPK])
    assert gap > GAP, f"index scores near-tie at the top-k cut (gap {gap:.1e}); pick another seed"
    check_parity(path, hf, prompts)


@torch.no_grad()
def test_chunked_prefill_matches_transformers(ckpt):
    """Prefill in chunks: later chunks' queries select among keys cached by earlier ones, in full and shared layers."""
    path, hf = ckpt
    ids = prompt_batch(CONFIG["vocab_size"])[-1]
    ref = hf(torch.tensor([ids])).logits[0]
    ours = run_chunks(_llm(path).engine, ids, [9, 14, 1, len(ids) - 24])
    assert _rel(ours, ref) < 1e-4


def test_spec_and_layers(ckpt):
    path, hf = ckpt
    spec = load_config(path)
    assert spec.hyper.streams == 3 and spec.hyper.post_magnitude == 2.0
    assert [l.mlp_kind for l in spec.layers] == ["dense", "moe", "dense", "moe", "moe"]
    assert all(l.mlp.swiglu_limit == 0.5 for l in spec.layers if l.mlp_kind == "moe")
    a = spec.layers[0].attn
    assert isinstance(a, MLASpec) and a.sinks and a.output_gate
    assert a.rope.interleaved == a.indexer.rope.interleaved == CONFIG["rope_interleave"]
    assert a.indexer.rope.last and a.indexer.norm_eps == hf.config.rms_norm_eps
    model = build_model(spec, torch.float32, "meta")
    shared = [attn.indexer is None for _, attn in model.cached_layers()]
    assert shared == [k == "shared" for k in CONFIG["indexer_types"]]
    # the default IndexCache schedule and MLP pattern are transformers' own
    raw = {**json.loads((path / "config.json").read_text()), "num_hidden_layers": 10}
    for key in ("indexer_types", "mlp_layer_types", "layer_types", "swiglu_limit"):
        raw.pop(key)
    from transformers import AutoConfig

    hf_cfg = AutoConfig.for_model("hy_v4", **{k: v for k, v in raw.items() if k != "model_type"})
    spec = load_config_from(raw, path.parent / "defaults")
    assert [l.attn.indexer.shared for l in spec.layers] == [k == "shared" for k in hf_cfg.indexer_types]
    assert [l.mlp_kind for l in spec.layers] == ["dense" if k == "dense" else "moe" for k in hf_cfg.mlp_layer_types]
    assert spec.layers[1].mlp.swiglu_limit == hf_cfg.swiglu_limit


def load_config_from(raw: dict, path):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return load_config(path)


@torch.no_grad()
def test_features_matter(ckpt, tmp_path):
    """Each of these, read differently, moves the logits far past the parity tolerance: top-k vs dense, the
    clamp, and the hyper-connections' input-dependent weights."""
    path, hf = ckpt
    ids = prompt_batch(CONFIG["vocab_size"])[-1]
    base = run_chunks(_llm(path).engine, ids, [len(ids)])
    for change in ({"index_topk": 4096}, {"swiglu_limit": 0}):
        other = tmp_path / next(iter(change))
        shutil.copytree(path, other)
        cfg = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**cfg, **change}))
        assert _rel(run_chunks(_llm(other).engine, ids, [len(ids)]), base) > 1e-2, change
    llm = _llm(path)
    for layer in llm.engine.model.model.layers:
        layer.attn_hc.scale.data.zero_()  # weights from the bias alone, the same for every token
    assert _rel(run_chunks(llm.engine, ids, [len(ids)]), base) > 1e-2


@torch.no_grad()
def test_in_memory_names_and_per_expert_layout(ckpt, tmp_path):
    """The names transformers holds in memory (gate_proj, sinks, attn_hc.fn, hc_head.hc_fn) and experts stored
    one tensor each load to the same model as the release names transformers saves."""
    path, _ = ckpt
    renames = [(".linear_gate.", ".gate_proj."), (".learnable_sink_param", ".sinks"),
               (".hc_pre.hc_attn_layer.hc_", ".attn_hc."), (".hc_pre.hc_mlp_layer.hc_", ".ffn_hc."),
               (".hc_pre.hc_head.hc_head_", ".hc_head.hc_")]
    out = {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        for a, b in renames:
            name = name.replace(a, b)
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, D], gate rows then up rows
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate.contiguous()
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.contiguous()
        elif name.endswith("experts.down_proj"):
            for e, w in enumerate(t):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = w.contiguous()
        else:
            out[name] = t
    assert any(".attn_hc.fn" in n for n in out) and any("model.hc_head.hc_fn" == n for n in out)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    save_file(out, str(tmp_path / "model.safetensors"))
    ids = prompt_batch(CONFIG["vocab_size"])[1]
    a, b = run_chunks(_llm(path).engine, ids, [len(ids)]), run_chunks(_llm(tmp_path).engine, ids, [len(ids)])
    assert torch.equal(a, b)


@torch.no_grad()
def test_layer_outputs_are_streams(ckpt):
    """model.layers[i] returns (streams [T, n, D], None): what `dayzero align` hooks record for this family."""
    path, hf = ckpt
    llm = _llm(path)
    seen = []
    hooks = [l.register_forward_hook(lambda m, a, out: seen.append(out)) for l in llm.engine.model.model.layers]
    ids = prompt_batch(CONFIG["vocab_size"])[0]
    run_chunks(llm.engine, ids, [len(ids)])
    for h in hooks:
        h.remove()
    ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # per layer [1, T, n, D]
    for i, (h, res) in enumerate(seen):
        assert res is None and h.shape == (len(ids), 3, CONFIG["hidden_size"])
        if i < len(seen) - 1:  # transformers' last entry is after the final norm
            assert _rel(h, ref[i + 1][0]) < 1e-4


@torch.no_grad()
def test_headwise_gate_equals_repeated_elementwise():
    """A head-wise gate (one sigmoid per head) is the element-wise gate with each head's row repeated."""
    from dataclasses import replace

    from dayzero.config.spec import IndexerSpec, RopeSpec
    from dayzero.engine.batch import ForwardBatch
    from dayzero.layers.attention.dsa import MLAAttention

    rope = RopeSpec(8)
    spec = MLASpec(4, 32, 32, 16, 8, 12, rope, 24**-0.5, output_gate=True, output_gate_kind="headwise", sinks=True,
                   indexer=IndexerSpec(16, 32, 4, replace(rope, last=True)))
    torch.manual_seed(0)
    head, elem = MLAAttention(64, spec), MLAAttention(64, replace(spec, output_gate_kind="elementwise"))
    for m in (head, elem):
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.2)
    elem.load_state_dict({**head.state_dict(), "g_proj.weight": head.g_proj.weight.repeat_interleave(12, dim=0)})
    assert head.g_proj.weight.shape == (4, 64)
    T = 10
    outs = []
    for m in (head, elem):
        m.bind_cache({"latent": torch.zeros(3, 4, 40), "index_k": torch.zeros(3, 4, 32)})
        batch = ForwardBatch(torch.zeros(T, dtype=torch.int64), torch.arange(T), [0, T], [0], [T], torch.arange(T),
                             torch.arange(3)[None], torch.zeros(1, dtype=torch.int64), torch.tensor([T - 1]), 4)
        outs.append(m(torch.randn(T, 64, generator=torch.Generator().manual_seed(1)), batch))
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
