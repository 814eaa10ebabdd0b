"""Tensor parallelism on the CPU with Gloo: two spawned ranks against one process on the same weights.

- the parallel linears and embedding, loaded from one checkpoint through the loader's narrowing (a fused
  [gate; up] of two tensors, an odd vocabulary that pads the last rank), equal their unsharded versions;
- whole models made by transformers (qwen3_moe: GQA, dense and MoE layers; glm4_moe: shared experts, partial
  RoPE; deepseek_v3: MLA, shared experts; kimi_linear: KDA with its state slots, NoPE MLA) give prompt and decode
  logits within 1e-4 relative of tp=1 and the same greedy tokens;
- impossible layouts stop with a message naming the setting, and tp=1 builds plain modules.
"""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch import nn

from dayzero.config.spec import MLPSpec
from dayzero.distributed import ParallelState, destroy_parallel, init_parallel
from dayzero.engine.engine import EngineConfig, LLMEngine
from dayzero.engine.sampling_params import SamplingParams
from dayzero.layers.mlp import MLP
from dayzero.layers.moe import MoE
from dayzero.layers.parallel import (ColumnParallelLinear, Linear, RowParallelLinear, VocabParallelEmbedding,
                                     column_linear, gather_logits, lm_head, row_linear, vocab_embedding)
from dayzero.loader.rules import Rule, identity_rules, rows
from dayzero.loader.safetensors_loader import load_weights
from dayzero.models.registry import build_model, load_config
from dayzero.layers.fp8_linear import BlockFp8Linear
from tests.engine.test_incremental import run_chunks
from tests.hf.harness import make_hf_checkpoint, prompt_batch
from tests.hf import test_linear_families as linear
from tests.hf.test_moe_families import COMMON, FAMILIES

# the transformers configs of the whole-model cases
CONFIGS = {**{name: {**COMMON, **fam} for name, fam in FAMILIES.items()},
           "kimi_linear": {**linear.COMMON, **linear.FAMILIES["kimi_linear"]}}

TP = 2
RTOL = 1e-4
NEW_TOKENS = 6
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_cache_blocks=128, max_num_batched_tokens=64,
              num_threads=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, *args, tp: int = TP, ep: int = 1, pp: int = 1, dp: int = 1) -> None:
    """Run ``fn(state, *args)`` in ``pp · max(tp · dp, ep)`` fresh processes joined by Gloo on a free loopback port."""
    world = pp * max(tp * dp, ep)
    mp.spawn(_rank_main, args=(tp, ep, pp, dp, world, free_port(), fn, args), nprocs=world, join=True)


def _rank_main(rank: int, tp: int, ep: int, pp: int, dp: int, world: int, port: int, fn, args) -> None:
    torch.set_num_threads(1 if world > 2 else 2)
    state = init_parallel(tp=tp, ep=ep, pp=pp, dp=dp, backend="gloo", rank=rank, world_size=world, port=port)
    try:
        fn(state, *args)
        # Every rank past its last collective before any leaves: a rank tearing Gloo down while a peer's last
        # exchange is still draining has aborted the peer's process at exit ("terminate called without an
        # active exception").
        torch.distributed.barrier()
    finally:
        destroy_parallel()


# --- building blocks ------------------------------------------------------------------------------------
V, D, I, OUT = 301, 16, 12, 10  # V odd: the last rank's embedding and head rows are padding


class Blocks(nn.Module):
    def __init__(self, p: ParallelState):
        super().__init__()
        self.col = column_linear(D, OUT, True, p)
        self.gate_up = column_linear(D, 2 * I, False, p, parts=2)  # [gate; up], each cut by rank
        self.packed = column_linear(D, 2 * I, False, p, parts=2)  # the same, stored as one [2I, D] tensor
        self.row = row_linear(OUT, D, True, p)
        self.embed = vocab_embedding(V, D, p)
        self.head = lm_head(D, V, p)


def full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"col.weight": (OUT, D), "col.bias": (OUT,), "gate": (I, D), "up": (I, D), "row.weight": (D, OUT),
              "row.bias": (D,), "embed.weight": (V, D), "head.weight": (V, D)}
    w = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    return w | {"packed.weight": torch.cat([w["gate"], w["up"]])}


BLOCK_RULES = [Rule(r"gate", "gate_up.weight", rows(0, 2)), Rule(r"up", "gate_up.weight", rows(1, 2))] + identity_rules()


def check_blocks(state: ParallelState, ckpt: str) -> None:
    w = full_weights()
    local = Blocks(state)
    assert isinstance(local.col, ColumnParallelLinear) and isinstance(local.row, RowParallelLinear)
    assert isinstance(local.embed, VocabParallelEmbedding) and local.embed.weight.shape == (151, D)
    load_weights(local, ckpt, BLOCK_RULES)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, D, generator=g)
    ids = torch.tensor([0, 150, 151, 300, 7, 299])  # both sides of the rank boundary and the last id
    with torch.no_grad():
        col = local.col(x)  # the rank's output features
        r = state.tp_rank
        ref_col = x @ w["col.weight"].T + w["col.bias"]
        torch.testing.assert_close(col, ref_col[:, r * OUT // TP:(r + 1) * OUT // TP])
        gate, up = local.gate_up(x).chunk(2, dim=-1)
        half = slice(r * I // TP, (r + 1) * I // TP)
        torch.testing.assert_close(gate, (x @ w["gate"].T)[:, half])
        torch.testing.assert_close(up, (x @ w["up"].T)[:, half])
        torch.testing.assert_close(local.packed(x), torch.cat([gate, up], dim=-1))
        h = torch.randn(5, OUT, generator=g)
        torch.testing.assert_close(local.row(h[:, r * OUT // TP:(r + 1) * OUT // TP]), h @ w["row.weight"].T + w["row.bias"])
        torch.testing.assert_close(local.embed(ids), w["embed.weight"][ids])
        logits = gather_logits(local.head(x), V, state)
        torch.testing.assert_close(logits, x @ w["head.weight"].T)


def test_parallel_blocks_equal_unsharded(tmp_path):
    save_file(full_weights(), str(tmp_path / "model.safetensors"))
    spawn(check_blocks, str(tmp_path))


def test_tp1_builds_plain_modules():
    b = Blocks(ParallelState())
    assert [type(m) for m in (b.col, b.gate_up, b.packed, b.row, b.head)] == [Linear] * 5 and type(b.embed) is nn.Embedding
    assert not hasattr(b.col, "shards")


# --- whole models ---------------------------------------------------------------------------------------
# GQA + MoE, GQA + shared experts, MLA + shared experts, KDA + MLA (NoPE) + shared experts
MODELS = ("qwen3_moe", "glm4_moe", "deepseek_v3", "kimi_linear")


def run_model(path: Path, state: ParallelState | None = None) -> dict:
    """Prompt logits, decode-step logits and greedy tokens of the model at ``path`` (tp=1 without ``state``)."""
    engine = LLMEngine(EngineConfig(model=str(path), **ENGINE), *([state] if state else []))
    engine.model.micro_batch_min_rows = 1  # these steps are small: cut them anyway (under pp, two parts a stage)
    if state is not None and state.tp_size > 1:  # the rank holds its slices, and still runs q/k/v as one GEMM
        tp, spec = state.tp_size, engine.model_config
        for i, attn in engine.model.cached_layers():  # (test_tp_mixers checks Gated DeltaNet's and Mamba-2's heads)
            if hasattr(attn, "H") and hasattr(spec.layers[i].attn, "num_heads"):
                assert attn.H * tp == spec.layers[i].attn.num_heads  # the rank's heads
            if hasattr(attn, "Hkv"):  # GQA (MLA's latent row serves every head, whole on every rank)
                assert attn.Hkv == max(1, spec.layers[i].attn.num_kv_heads // tp)
            out = next(getattr(attn, n) for n in ("o_proj", "out_proj", "o_b_proj") if hasattr(attn, n))
            assert isinstance(out, RowParallelLinear) or getattr(out, "kind", None) == "row"  # or its block-FP8 form
            members = [attn.get_submodule(m) for m in getattr(attn, "in_proj_members", [])]
            assert "fused_in" in attn._modules or any(isinstance(m, BlockFp8Linear) for m in members) or not members
        if state.last_stage:
            assert engine.model.lm_head.weight.shape[0] == -(-spec.vocab_size // tp)
        moe = [m for m in engine.model.modules() if isinstance(m, MoE)]
        assert all(isinstance(m.shared_experts.down_proj, RowParallelLinear) or m.shared_experts.down_proj.kind == "row"
                   for m in moe if m.shared_experts)
        # every expert's width split without ep (over tp), or with 1 < ep < G (over G / ep); whole at ep = G
        assert all(m.expert_tp == (state.etp_size > 1) for m in moe)
        assert state.etp_size == (tp if state.ep_size == 1 else (state.world_size // state.pp_size) // state.ep_size)
    prompts = prompt_batch(engine.model_config.vocab_size, lengths=(5, 23, 12))
    out = {"prompt": [run_chunks(engine, ids, [len(ids)]) for ids in prompts],
           "decode": run_chunks(engine, prompts[1], [20, 1, 1, 1])}
    out["tokens"] = greedy_tokens(engine, prompts)
    out["split_steps"] = engine.model.split_steps  # steps of several sequences run as pipeline micro-batches
    out["load"] = dict(zip(engine.moe_layer_index, engine.expert_load()))
    assert all(int(load.sum()) > 0 for load in out["load"].values())
    return out


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Each prompt's ``new_tokens`` greedy tokens, the prompts run together by the engine's scheduler."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


def model_rank(state: ParallelState, paths: list[str], out_dir: str) -> None:
    results = [run_model(Path(p), state) for p in paths]
    torch.save(results, Path(out_dir) / f"rank{state.world_rank}.pt")


def compare_with_one_process(tmp_path: Path, model_types: tuple[str, ...], tp: int, ep: int = 1, pp: int = 1,
                             configs: dict = CONFIGS) -> None:
    paths = []
    for model_type in model_types:
        path = tmp_path / model_type
        make_hf_checkpoint(path, model_type, **configs[model_type])
        paths.append(path)
    compare_paths(tmp_path, paths, tp, ep, pp)


def compare_paths(tmp_path: Path, paths: list[Path], tp: int, ep: int = 1, pp: int = 1) -> None:
    """The models at ``paths`` run by ``pp · max(tp, ep)`` ranks give one process's logits, tokens and expert
    loads (under pp, a stage's MoE layers' loads)."""
    spawn(model_rank, [str(p) for p in paths], str(tmp_path), tp=tp, ep=ep, pp=pp)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(pp * max(tp, ep))]
    for i, path in enumerate(paths):
        model_type = path.name
        want = run_model(path)
        worst = 0.0
        for r, got in enumerate(rank[i] for rank in ranks):
            for name, a, b in [("prompt", x, y) for x, y in zip(got["prompt"], want["prompt"])] + \
                              [("decode", got["decode"], want["decode"])]:
                rel = ((a - b).norm() / b.norm()).item()
                assert rel <= RTOL, f"{model_type} tp={tp} ep={ep} rank {r}: {name} logits relative error {rel:.2e}"
                worst = max(worst, rel)
            assert got["tokens"] == want["tokens"], f"{model_type} tp={tp} ep={ep} rank {r}: greedy tokens differ"
            assert (got["split_steps"] > 0) == (pp > 1), got["split_steps"]  # by default two micro-batches a stage
            for layer, a in got["load"].items():
                b = want["load"][layer]
                assert torch.equal(a, b), f"{model_type} tp={tp} ep={ep} rank {r}: layer {layer} expert load {a} != {b}"
        print(f"tp={tp} ep={ep} pp={pp} {model_type}: greedy tokens equal, logits relative error at most {worst:.1e}")


def test_models_at_tp2_match_one_process(tmp_path):
    compare_with_one_process(tmp_path, MODELS, TP)


def test_kv_heads_replicated_at_tp4_match_one_process(tmp_path):
    """tp=4 over 2 k/v heads: each pair of ranks keeps one copy of its k/v head."""
    compare_with_one_process(tmp_path, ("qwen3_moe",), 4)


# --- layouts that cannot run ----------------------------------------------------------------------------
def test_heads_not_divisible_names_the_setting(tmp_path):
    path = tmp_path / "qwen3_moe"
    make_hf_checkpoint(path, "qwen3_moe", **COMMON, **FAMILIES["qwen3_moe"])
    spec = load_config(path)
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        build_model(spec, torch.float32, "meta", ParallelState(0, 3))
    with pytest.raises(ValueError, match="tp=8 does not divide num_attention_heads=4"):
        build_model(spec, torch.float32, "meta", ParallelState(0, 8))
    model = build_model(spec, torch.float32, "meta", ParallelState(1, 4))  # 2 k/v heads: one per pair of ranks
    attn = model.model.layers[0].self_attn
    assert (attn.H, attn.Hkv) == (1, 1) and attn.k_proj.shards["weight"].rank == 0
    with pytest.raises(ValueError, match="tp=3 does not divide intermediate_size=40"):
        MLP(64, MLPSpec(40), ParallelState(0, 3))


def test_compressed_attention_splits_heads_and_output_groups():
    """deepseek_v4 at tp=8 on the meta device: a rank holds 8 of the 64 heads, one of the 8 output groups and 8 of
    the 64 indexer heads; the K=V head and the compressors are whole; tp=16 does not divide o_groups=8."""
    spec = load_config(Path(__file__).resolve().parents[2] / "configs" / "deepseek-v4-small.json")
    model = build_model(spec, torch.float32, "meta", ParallelState(3, 8))
    attn = next(m for _, m in model.cached_layers() if getattr(m, "indexer", None) is not None)
    assert (attn.H, attn.groups, attn.indexer.H) == (8, 1, 8) and attn.sinks.shape == (8,)
    assert isinstance(attn.o_b_proj, RowParallelLinear) and type(attn.kv_proj) is Linear
    assert attn.q_b_proj.weight.shape[0] == 8 * spec.layers[0].attn.head_dim
    with pytest.raises(ValueError, match="tp=16 does not divide o_groups=8"):
        build_model(spec, torch.float32, "meta", ParallelState(0, 16))


def test_impossible_process_layouts():
    with pytest.raises(ValueError, match="tp=3 does not divide world_size=4"):
        init_parallel(tp=3, world_size=4, rank=0)
    with pytest.raises(ValueError, match=r"ep=4 does not divide world_size=6: a stage's ranks form expert groups"):
        init_parallel(tp=2, ep=4, world_size=6, rank=0)
    with pytest.raises(ValueError, match="tp must be a positive int, got 0"):
        init_parallel(tp=0)
    with pytest.raises(ValueError, match="ep must be a positive int, got -1"):
        init_parallel(tp=1, ep=-1)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="world_size=64 needs one CUDA device per rank"):
            init_parallel(tp=64, backend="nccl", rank=63, world_size=64)
    with pytest.raises(ValueError, match="backend"):
        init_parallel(tp=2, backend="mpi")
