"""DeepSeek-V3.2 and GLM-MoE-DSA (GLM-5): the DeepSeek-V3 blocks of ``deepseek.py`` whose MLA adds the
lightning indexer and attends over its causal top-k keys only (ARCHITECTURE.md 2.2).

Read from transformers ``models/deepseek_v32`` and ``models/glm_moe_dsa``, whose numbers these follow:
- the indexer scores in high precision: ``sum_h w_h ReLU(q_h . k)`` with ``w = weights_proj(x) Hi^-1/2``
  and ``q . k`` scaled by ``Di^-1/2``, without the released code's Hadamard rotation (orthogonal, so dot
  products are unchanged) or its FP8 quantisation; ``wq_b`` reads the normalised q latent, ``k_norm`` is a
  LayerNorm with bias (eps 1e-6);
- the indexer RoPE rotates the first ``qk_rope_head_dim`` dims of q and k with MLA's frequencies (YaRN
  included): NeoX halves in V3.2 (the fixed layout), interleaved pairs in GLM-MoE-DSA; MLA's own RoPE is
  interleaved in both;
- GLM-MoE-DSA layers marked ``"shared"`` in ``indexer_types`` (IndexCache) keep no indexer and reuse the
  top-k of the nearest earlier ``"full"`` layer;
- the MLP of each layer follows ``mlp_layer_types`` when the config has it (transformers 5 writes it), else
  ``first_k_dense_replace``.

Known difference: transformers fixes the eps of MLA's ``q_a_layernorm``/``kv_a_layernorm`` at 1e-6, while
vLLM and SGLang (and this engine) use ``rms_norm_eps``. GLM-5 sets 1e-5; in the fp32 parity test that
moves the logits by about 1.5e-5 relative (4.5e-7 with 1e-6), inside the 1e-4 tolerance.
"""
from __future__ import annotations

from dayzero.config.spec import LayerSpec, ModelSpec
from dayzero.models.adapters.common import dense_mlp_spec
from dayzero.models.adapters.deepseek import deepseek_rules, indexer_spec, is_moe_layer, mla_spec, model_spec, moe_spec
from dayzero.models.registry import Adapter, register


def _is_moe(raw: dict, i: int) -> bool:
    kinds = raw.get("mlp_layer_types")
    return kinds[i] == "sparse" if kinds else is_moe_layer(raw, i)


def indexer_types(raw: dict) -> list[str]:
    """Per layer "full" (runs its indexer) or "shared" (reuses the previous full layer's top-k), as
    ``indexer_types``, else ``index_topk_pattern`` ("FSS..."), else every ``index_topk_freq``-th layer
    counted from ``index_skip_topk_offset - 1`` (layers before that run their own)."""
    n = raw["num_hidden_layers"]
    kinds = raw.get("indexer_types")
    if kinds is None and raw.get("index_topk_pattern") is not None:
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in raw["index_topk_pattern"]]
    if kinds is None:
        freq, offset = max(raw.get("index_topk_freq", 1), 1), raw.get("index_skip_topk_offset", 2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(kinds) != n or set(kinds) - {"full", "shared"} or kinds[0] != "full":
        raise ValueError(f"indexer_types {kinds!r}: need {n} entries of 'full'/'shared', the first 'full'")
    return list(kinds)


def _dsa_spec(raw: dict, interleaved: bool, kinds: list[str]) -> ModelSpec:
    raw = {**raw, "rope_interleave": True}  # both families' MLA RoPE is interleaved whatever the config says
    attn = {k: mla_spec(raw, indexer_spec(raw, interleaved, shared=k == "shared")) for k in set(kinds)}
    return model_spec(raw, (
        LayerSpec(i, attn[kinds[i]], moe_spec(raw) if _is_moe(raw, i) else dense_mlp_spec(raw))
        for i in range(raw["num_hidden_layers"])
    ))


def deepseek_v32_spec(raw: dict) -> ModelSpec:
    return _dsa_spec(raw, interleaved=False, kinds=["full"] * raw["num_hidden_layers"])


def glm_moe_dsa_spec(raw: dict) -> ModelSpec:
    return _dsa_spec(raw, interleaved=True, kinds=indexer_types(raw))


# The released checkpoints carry one multi-token-prediction layer past the last decoder layer (61 and 78),
# for speculative decoding; like transformers, the loader leaves it alone.
register(Adapter(
    "deepseek_v32", deepseek_v32_spec, deepseek_rules, ignore=(r"model\.layers\.61\..*",),
    notes="MLA + lightning indexer top-k (DSA) + sigmoid group-limited MoE + shared experts",
))
register(Adapter(
    "glm_moe_dsa", glm_moe_dsa_spec, deepseek_rules, ignore=(r"model\.layers\.78\..*",),
    notes="DSA as DeepSeek-V3.2 with interleaved indexer RoPE and IndexCache (shared top-k) layers",
))
