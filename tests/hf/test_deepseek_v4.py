"""deepseek_v4: transformers' tiny random model loads and matches in fp32.

The tiny config keeps every DeepSeek-V4 feature live: all three attention kinds (sliding window of 8, so
the 40-token prompts reach past it; HCA with ratio 8 and CSA with ratio 4, whose indexer (16 heads) keeps
3 of up to 14 entries per query); YaRN on the compressed layers only; partial interleaved RoPE on the last
channels; hash-routed then sqrt-softplus-routed MoE layers with a SwiGLU clamp (0.5) the routed and shared
experts cross; and mHC with 3 streams whose mixing scales are moved off their untrained values.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero import LLM, SamplingParams
from dayzero.cache.spec import parts
from dayzero.loader.safetensors_loader import CheckpointError
from dayzero.models.registry import build_model, load_config
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


def _llm(path, **kw):
    args = dict(device="cpu", dtype="float32", block_size=4, num_cache_blocks=256, max_num_batched_tokens=64)
    return LLM(str(path), **{**args, **kw})


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_matches_transformers(ckpt, block_size):
    """Prefill in chunks that end inside compression windows and inside the sliding window: later chunks pool
    entries from rows kept by earlier ones (the rings) and read entries written by them. Block size 16 puts
    four CSA entries and two HCA entries in each block."""
    path, hf = ckpt
    ids = prompt_batch(CONFIG["vocab_size"], lengths=(70,), seed=3)[0]
    ref = hf(torch.tensor([ids])).logits[0]
    engine = _llm(path, block_size=block_size).engine
    for chunks in ([70], [9, 14, 1, 3, 43], [1] * 10 + [60]):
        assert _rel(run_chunks(engine, ids, chunks), ref) < 1e-4, chunks


def test_preemption_and_batch_invariance(ckpt):
    """A cache too small for the batch preempts and recomputes; outputs equal those of a roomy cache, and every
    block and state slot comes back."""
    path, _ = ckpt
    prompts = [{"prompt_token_ids": p} for p in prompt_batch(CONFIG["vocab_size"], lengths=(5, 23, 12, 40, 31, 17))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    roomy = [o.outputs[0].token_ids for o in _llm(path).generate(prompts, params)]
    tight = _llm(path, num_cache_blocks=20, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == roomy
    assert tight.engine.scheduler.num_preemptions > 0
    usage = tight.engine.cache.usage()
    assert usage["blocks_free"] == usage["blocks_total"] and usage["slots_free"] == usage["slots_total"]


def _write_config(path, raw):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return load_config(path)


def test_released_config_spelling(ckpt, tmp_path):
    """DeepSeek's own config keys (compress_ratios, rope_scaling without attention_factor, compress_rope_theta,
    qk_rope_head_dim, num_hash_layers) give the spec of transformers' spelling."""
    path, _ = ckpt
    raw = json.loads((path / "config.json").read_text())
    ours = load_config(path)
    released = {k: v for k, v in raw.items() if k not in (
        "layer_types", "compress_rates", "mlp_layer_types", "rope_parameters", "partial_rotary_factor")}
    released.update(compress_ratios=[0, 4, 8, 4, 8], num_hash_layers=2, qk_rope_head_dim=8, rope_theta=10000.0,
                    compress_rope_theta=160000.0, rope_scaling=dict(YARN))
    assert _write_config(tmp_path / "released", released) == ours
    a = ours.layers[1].attn
    assert a.layer_kind == "csa" and a.rope.last and a.rope.interleaved and a.rope.scaling.attention_factor == 1.0
    assert ours.layers[0].attn.rope.scaling is None and ours.layers[0].attn.rope.theta == 10000.0


@pytest.mark.parametrize("change, message", [
    ({"layer_types": [SWA, CSA]}, "layer_types must list 5"),
    ({"layer_types": [SWA, "full_attention", HCA, CSA, HCA]}, "layer_types must list 5"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"compress_ratios": [0, 4, 8, 16, 8], "layer_types": None}, "several heavy ratios"),
])
def test_bad_configs_are_named(ckpt, tmp_path, change, message):
    path, _ = ckpt
    raw = {**json.loads((path / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=message):
        _write_config(tmp_path / "bad", raw)


def test_config_that_disagrees_with_the_weights(ckpt, tmp_path):
    """An HCA ratio the weights were not trained for stops the load, naming the tensor and its file."""
    path, _ = ckpt
    bad = tmp_path / "ratio"
    shutil.copytree(path, bad)
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "compress_rates": {CSA: 4, HCA: 16}}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*layers\.2\.attn\.compressor\.ape.*\(8, 32\)"):
        _llm(bad)


@torch.no_grad()
def test_in_memory_names_and_fused_experts(ckpt, tmp_path):
    """transformers' in-memory names (self_attn.compressor.indexer.*, attn_hc.fn, mlp.gate.tid2eid, fused
    gate_up_proj experts) load to the same model as the released names save_pretrained writes."""
    path, hf = ckpt
    save_file({n: t.contiguous() for n, t in hf.state_dict().items() if "rotary_emb" not in n}, str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    assert any(n.endswith("self_attn.compressor.indexer.scorer.weights_proj.weight") for n in load_file(str(tmp_path / "model.safetensors")))
    ids = prompt_batch(CONFIG["vocab_size"])[3]
    assert torch.equal(run_chunks(_llm(path).engine, ids, [len(ids)]), run_chunks(_llm(tmp_path).engine, ids, [len(ids)]))


def test_spec_and_cache(ckpt):
    path, _ = ckpt
    spec = load_config(path)
    assert [l.attn_kind for l in spec.layers] == ["swa", "csa", "hca", "csa", "hca"]
    assert [l.mlp.hash_routing for l in spec.layers] == [True, True, False, False, False]
    assert spec.hyper.sinkhorn_iters == 6 and not spec.hyper.post_eps
    model = build_model(spec, torch.float32, "meta")
    specs = [parts(m.cache_spec(torch.float32)) for _, m in model.cached_layers()]
    # the sliding-window layer keeps only its window ring; compressed layers add strided entry rows
    assert [type(s).__name__ for s in specs[0]] == ["StateSpec"] and specs[0][0].tensors["kv"][0] == (8, 32)
    assert specs[1][0].strides == {"ckv": 4, "index_k": 4} and specs[2][0].strides == {"ckv": 8}


@torch.no_grad()
def test_quantised_kv_cache_holds_the_entries(ckpt):
    """kv_cache_dtype applies to the paged entry rows (quantised per token), not to the per-sequence rings; a
    float32 cache of a float32 model changes nothing, fp8 moves the logits by the rounding of the entries."""
    from dayzero.cache.quant import QuantPagedPool

    path, _ = ckpt
    ids = prompt_batch(CONFIG["vocab_size"], lengths=(70,), seed=3)[0]
    base = run_chunks(_llm(path).engine, ids, [9, 14, 47])
    assert torch.equal(run_chunks(_llm(path, kv_cache_dtype="float32").engine, ids, [9, 14, 47]), base)
    engine = _llm(path, kv_cache_dtype="fp8").engine
    caches = {name: t for _, layer in engine.runner.layers for name, t in layer.cache.items()}
    assert isinstance(caches["ckv"], QuantPagedPool) and isinstance(caches["index_k"], QuantPagedPool)
    assert caches["kv"].dtype == torch.float32 and caches["ckv_raw"].dtype == torch.float32  # rings stay
    rel = _rel(run_chunks(engine, ids, [9, 14, 47]), base)
    assert 1e-4 < rel < 0.15, rel  # the random tiny model amplifies rounding: bf16 compute alone gives 2.6e-2
