"""deepseek_v32, glm_moe_dsa: transformers' tiny random DSA models load and match in fp32, with the indexer
choosing 8 of up to 40 keys per query, so the sparse path decides the result."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from dayzero import LLM, SamplingParams, ops
from dayzero.cache.rows import read_rows
from tests.engine.test_incremental import run_chunks
from tests.hf.harness import check_parity, make_hf_checkpoint, prompt_batch

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
TOPK = 8
COMMON = dict(
    vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    initializer_range=0.08, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5, rope_parameters=YARN,
    index_topk=TOPK, index_n_heads=16, index_head_dim=32,
)
FAMILIES = {
    "deepseek_v32": dict(num_hidden_layers=3),
    # layer 2 reuses layer 1's top-k (IndexCache), not layer 0's; 1e-5 is GLM-5's norm eps;
    # an MLP pattern that first_k_dense_replace cannot express
    "glm_moe_dsa": dict(num_hidden_layers=4, indexer_types=["full", "full", "shared", "full"], rms_norm_eps=1e-5,
                        mlp_layer_types=["dense", "sparse", "sparse", "dense"]),
}
SEEDS = {"deepseek_v32": 2, "glm_moe_dsa": 1}  # seeds without near-ties at the top-k cut
GAP = 1e-5  # smallest relative score gap at the top-k cut for which both engines surely choose the same keys


def topk_cut_gap(llm: LLM, sequences) -> float:
    """Smallest gap between the topk-th and (topk+1)-th index score of any query (relative to its score
    range), over every indexer layer and sequence: a near-tie would let rounding pick different keys."""
    captured = []

    def spy(project):
        def wrapped(x, c_q, batch, pool, k=None, q=None, selects=True, key_written=False):
            q, w = project(x, c_q, batch, pool, k, q, selects, key_written)
            if q is None:  # no more keys than topk: nothing selected, no query
                return q, w
            k = read_rows(pool, batch.slot_mapping)  # the step's keys, as written
            captured.append(ops.call("indexer_scores", q, w, k, batch.positions))  # [T, T] after one full prefill
            return q, w
        return wrapped

    for _, mod in llm.engine.model.cached_layers():
        if mod.indexer is not None:
            mod.indexer.project = spy(mod.indexer.project)
    for ids in sequences:
        run_chunks(llm.engine, ids, [len(ids)])
    gap = float("inf")
    for s in captured:
        s = s[TOPK:]  # queries with more than TOPK causal keys
        top = s.topk(TOPK + 1, dim=-1).values
        spread = (top[:, 0] - s.masked_fill(s.isinf(), float("inf")).amin(-1)).clamp_min(1e-30)
        gap = min(gap, ((top[:, TOPK - 1] - top[:, TOPK]) / spread).min().item())
    return gap


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_parity_with_transformers(tmp_path, model_type):
    hf = make_hf_checkpoint(tmp_path, model_type, seed=SEEDS[model_type], **COMMON, **FAMILIES[model_type])
    prompts = prompt_batch(COMMON["vocab_size"])
    assert max(map(len, prompts)) > TOPK
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, num_cache_blocks=128)
    # the queries of prompts and of their greedy continuations must have no near-tie at the top-k cut
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    gap = topk_cut_gap(llm, [p + o.outputs[0].token_ids for p, o in zip(prompts, outs) if len(p) > TOPK])
    assert gap > GAP, f"index scores near-tie at the top-k cut (gap {gap:.1e}); pick another seed"
    check_parity(tmp_path, hf, prompts)

    # The same checkpoint read densely (top-k larger than any prompt) gives other logits: the sparse path matters.
    dense_dir = tmp_path / "dense"
    shutil.copytree(tmp_path, dense_dir, ignore=shutil.ignore_patterns("dense"))
    cfg = json.loads((dense_dir / "config.json").read_text())
    (dense_dir / "config.json").write_text(json.dumps({**cfg, "index_topk": 4096}))
    dense = LLM(str(dense_dir), device="cpu", dtype="float32", block_size=4, num_cache_blocks=128)
    ids = prompts[-1]
    sparse_logits, dense_logits = run_chunks(llm.engine, ids, [len(ids)]), run_chunks(dense.engine, ids, [len(ids)])
    rel = ((sparse_logits - dense_logits).norm() / dense_logits.norm()).item()
    assert rel > 1e-2, f"top-{TOPK} and dense attention differ by only {rel:.1e}"


@pytest.mark.parametrize("schedule", [
    {}, {"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1}, {"index_topk_pattern": "FFSFSS"},
], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()) or "default")
def test_glm_indexer_schedule(schedule):
    """Released GLM configs give the IndexCache schedule as a pattern or a frequency: read as transformers does;
    shared layers keep no indexer weights and no indexer key cache."""
    from transformers import AutoConfig

    from dayzero.models.adapters.dsa import glm_moe_dsa_spec, indexer_types
    from dayzero.models.registry import build_model

    raw = {**COMMON, "model_type": "glm_moe_dsa", "num_hidden_layers": 6, "rope_parameters": YARN, **schedule}
    expected = AutoConfig.for_model("glm_moe_dsa", **{k: v for k, v in raw.items() if k != "model_type"}).indexer_types
    assert indexer_types(raw) == expected
    model = build_model(glm_moe_dsa_spec(raw), torch.float32, "meta")
    for (_, attn), kind in zip(model.cached_layers(), expected):
        assert (attn.indexer is None) == (kind == "shared")
        assert ("index_k" in attn.cache_spec(torch.float32).rows) == (kind == "full")
