"""Tensor parallelism of the DSA indexer, Gated DeltaNet and Mamba-2 on the CPU with Gloo: two spawned ranks
against one process on the same weights, through LLMEngine.

deepseek_v32 (MLA + DSA: 8 of up to 29 keys per query), qwen3_next (Gated DeltaNet, two value heads per key
head), nemotron_h (Mamba-2 with two groups, LatentMoE) and the native dayzero_hybrid (KDA + gated DSA + GQA +
LatentMoE) give prompt logits, logits of a prefill cut into chunks and continued by decode steps, and greedy
tokens of a batch the scheduler splits into prefill chunks beside decode rows, within 1e-4 relative of one
process in fp32 and equal. Each rank holds its heads (checked on the built layers); tp=1 keeps plain modules.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from dayzero import ops
from dayzero.config.model_config import HybridConfig
from dayzero.config.spec import GDNSpec, Mamba2Spec, MLASpec, ModelSpec
from dayzero.distributed import ParallelState
from dayzero.engine.engine import EngineConfig, LLMEngine
from dayzero.layers.attention.dsa import MLAAttention
from dayzero.layers.attention.gdn import GatedDeltaNet
from dayzero.layers.attention.mamba2 import Mamba2Mixer
from dayzero.layers.parallel import PLAIN_LINEARS, ColumnParallelLinear, Linear, RowParallelLinear
from tests.conftest import tiny_config
from tests.distributed.test_tensor_parallel import ENGINE, NEW_TOKENS, RTOL, TP, greedy_tokens, spawn
from tests.engine.test_incremental import run_chunks
from tests.hf import test_dsa_families as dsa
from tests.hf import test_linear_families as linear
from tests.hf import test_nemotron_h as nemotron
from tests.hf.harness import make_hf_checkpoint, prompt_batch

# model type -> (transformers config, seed, init); a DSA seed without near-ties at the top-k cut
HF = {
    "deepseek_v32": ({**dsa.COMMON, **dsa.FAMILIES["deepseek_v32"]}, dsa.SEEDS["deepseek_v32"], None),
    "qwen3_next": ({**linear.COMMON, **linear.FAMILIES["qwen3_next"]}, 0, linear.slow_decay),
    "nemotron_h": (nemotron.CONFIG, 0, None),
}
# 16 tokens a step: the three prompts (5, 23, 12) prefill in chunks, beside the decode rows of the earlier ones
STEP_TOKENS = 16
CHUNKS = [9, 7, 4, 1, 1, 1]  # the 23-token prompt: three prefill chunks, then three decode steps


def check_rank_holds_its_heads(model, spec: ModelSpec, tp: int) -> None:
    for (i, mixer), layer in zip(model.cached_layers(), spec.layers):
        s = layer.attn
        assert isinstance(getattr(mixer, "o_proj", None) or mixer.out_proj, RowParallelLinear), i
        if isinstance(s, MLASpec) and mixer.indexer is not None:
            ix = mixer.indexer
            assert ix.H * tp == s.indexer.n_heads and isinstance(ix.wq_b, ColumnParallelLinear)
            assert ix.weights_proj.weight.shape == (ix.H, spec.hidden_size)
            assert ix.weights_proj.weight.dtype == torch.float32 and type(ix.wk) is Linear  # the key: whole
        elif isinstance(s, GDNSpec):
            assert (mixer.Hk * tp, mixer.Hv * tp) == (s.num_k_heads, s.num_v_heads)
            assert mixer.in_proj_qkvz.weight.shape[0] == (2 * s.num_k_heads * s.head_k_dim
                                                          + 2 * s.num_v_heads * s.head_v_dim) // tp
            assert "fused_in" in mixer._modules  # the rank's qkvz and ba rows still one GEMM
            assert mixer.cache["state"].shape[1:] == (s.num_v_heads // tp, s.head_k_dim, s.head_v_dim)
            assert mixer.cache["conv"].shape[1] == s.conv_dim // tp
        elif isinstance(s, Mamba2Spec):
            assert (mixer.H * tp, mixer.G * tp) == (s.num_heads, s.n_groups)
            P, N = s.head_dim, s.state_size
            assert mixer.in_proj.weight.shape[0] == (2 * s.num_heads * P + 2 * s.n_groups * N + s.num_heads) // tp
            assert mixer.conv1d.weight.shape[0] == mixer.conv1d.groups == (s.num_heads * P + 2 * s.n_groups * N) // tp
            assert mixer.cache["ssm"].shape[1:] == (s.num_heads // tp, P, N)


def run_model(path: Path, state: ParallelState | None = None) -> dict:
    """Prompt logits, chunked-prefill-then-decode logits and greedy tokens of the model at ``path``."""
    engine = LLMEngine(EngineConfig(model=str(path), **{**ENGINE, "max_num_batched_tokens": STEP_TOKENS}),
                       *([state] if state else []))
    if state is not None:
        check_rank_holds_its_heads(engine.model, engine.model_config, state.tp_size)
    prompts = prompt_batch(engine.model_config.vocab_size, lengths=(5, 23, 12))
    out = {"prompt": [run_chunks(engine, ids, [len(ids)]) for ids in prompts],
           "chunked": run_chunks(engine, prompts[1], CHUNKS)}
    out["tokens"] = greedy_tokens(engine, prompts, NEW_TOKENS)
    return out


def model_rank(state: ParallelState, path: str, out_dir: str) -> None:
    torch.save(run_model(Path(path), state), Path(out_dir) / f"rank{state.tp_rank}.pt")


def compare_with_one_process(tmp_path: Path, path: Path) -> None:
    spawn(model_rank, str(path), str(tmp_path), tp=TP)
    want = run_model(path)
    worst = 0.0
    for r in range(TP):
        got = torch.load(tmp_path / f"rank{r}.pt")
        pairs = [("prompt", a, b) for a, b in zip(got["prompt"], want["prompt"])]
        for name, a, b in pairs + [("chunked", got["chunked"], want["chunked"])]:
            rel = ((a - b).norm() / b.norm()).item()
            assert rel <= RTOL, f"{path.name} tp={TP} rank {r}: {name} logits relative error {rel:.2e}"
            worst = max(worst, rel)
        assert got["tokens"] == want["tokens"], f"{path.name} tp={TP} rank {r}: greedy tokens differ from tp=1"
    print(f"tp={TP} {path.name}: greedy tokens equal, logits relative error at most {worst:.1e}")


@pytest.mark.parametrize("model_type", sorted(HF))
def test_hf_model_at_tp2_matches_one_process(tmp_path, model_type):
    config, seed, init = HF[model_type]
    path = tmp_path / model_type
    make_hf_checkpoint(path, model_type, seed=seed, init=init, **config)
    compare_with_one_process(tmp_path, path)


def test_native_hybrid_at_tp2_matches_one_process(tmp_path, tiny_ckpt):
    compare_with_one_process(tmp_path, tiny_ckpt)


# --- one rank, and layouts that cannot run -------------------------------------------------------------
def test_tp1_keeps_plain_modules_and_the_fused_topk(tiny_ckpt):
    """At tp=1 the mixers hold plain modules and the indexer runs its one fused op (no partial scores)."""
    gdn = GatedDeltaNet(64, GDNSpec(2, 4, 8, 12))
    mamba = Mamba2Mixer(64, Mamba2Spec(8, 12, 16, 2))
    for m in (gdn.in_proj_qkvz, gdn.in_proj_ba, gdn.out_proj, mamba.in_proj, mamba.out_proj):
        assert type(m) is Linear
    assert not hasattr(gdn, "shards") and not hasattr(mamba, "shards")
    engine = LLMEngine(EngineConfig(model=str(tiny_ckpt), **ENGINE))
    indexers = [m.indexer for _, m in engine.model.cached_layers() if getattr(m, "indexer", None) is not None]
    assert indexers and all(type(ix.wq_b) is Linear and type(ix.weights_proj) in PLAIN_LINEARS for ix in indexers)
    called = []
    prev = ops.registry.set_hook(lambda op, chosen, reason, fn, args, kwargs: called.append(op) or fn(*args, **kwargs))
    try:
        run_chunks(engine, prompt_batch(engine.model_config.vocab_size, lengths=(21,))[0], [20, 1])
    finally:
        ops.registry.set_hook(prev)
    assert "paged_indexer_topk" in called and "paged_indexer_scores" not in called


def test_heads_or_groups_not_divisible_name_the_setting():
    with pytest.raises(ValueError, match="tp=4 does not divide n_groups=2 of the Mamba-2 layers"):
        Mamba2Mixer(64, Mamba2Spec(8, 12, 16, 2), parallel=ParallelState(0, 4))
    with pytest.raises(ValueError, match="tp=4 does not divide the Gated DeltaNet layers' num_k_heads=2"):
        GatedDeltaNet(64, GDNSpec(2, 4, 8, 12), parallel=ParallelState(0, 4))
    spec = next(l.attn for l in HybridConfig.from_dict(tiny_config()).to_spec().layers
                if isinstance(l.attn, MLASpec) and l.attn.indexer is not None)
    with pytest.raises(ValueError, match="tp=3 does not divide index_n_heads=16"):
        MLAAttention(64, replace(spec, num_heads=6), parallel=ParallelState(0, 3))
