"""``dayzero plan``'s per-device memory for a layout against what the engine allocates on each rank of that
layout (weights and cache, within 10%), for tensor, expert (also in expert groups: tp=4 with ep=2), pipeline and
attention data parallelism (each replica caching its share of the sequences) on the CPU with Gloo."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dayzero.distributed import ParallelState
from dayzero.engine.engine import EngineConfig, LLMEngine
from dayzero.tools.plan import Layout, predict_allocation
from tests.distributed.test_tensor_parallel import CONFIGS, spawn
from tests.hf.harness import make_hf_checkpoint

L, B = 256, 2  # the cache the engine plans: B sequences of L tokens


def allocate_rank(state: ParallelState, path: str, out_dir: str) -> None:
    seqs = B // state.dp_size  # attention data parallelism: each replica holds its share of the sequences
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", max_num_seqs=seqs, max_model_len=L,
                                    cache_memory_bytes=1 << 40, num_threads=1,
                                    num_prefix_snapshots=seqs), state)  # one a sequence, as the plan predicts
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    cache = sum(t.numel() * t.element_size() for _, layer in engine.runner.layers for t in layer.cache.values())
    torch.save({"weights": weights + engine.expert_workspace.nbytes, "cache": cache},
               Path(out_dir) / f"alloc{state.world_rank}.pt")


@pytest.mark.parametrize("model,layout", [("kimi_linear", dict(tp=2)), ("kimi_linear", dict(tp=2, ep=2)),
                                          ("qwen3_moe", dict(tp=4, ep=2)), ("kimi_linear", dict(tp=1, pp=2)),
                                          ("kimi_linear", dict(tp=1, dp=2, ep=2))],
                         ids=["tp2", "tp2-ep2", "tp4-ep2", "pp2", "dp2-ep2"])  # the tiny kimi_linear has 2 KDA heads
def test_plan_predicts_each_ranks_allocation(tmp_path, model, layout):
    path = tmp_path / model
    make_hf_checkpoint(path, model, **CONFIGS[model])
    tp, ep, pp, dp = (layout.get(k, 1) for k in ("tp", "ep", "pp", "dp"))
    spawn(allocate_rank, str(path), str(tmp_path), tp=tp, ep=ep, pp=pp, dp=dp)
    stage_ranks = max(tp * dp, ep)
    plan_layout = Layout(pp, tp, dp, ep)
    for rank in range(pp * stage_ranks):
        got = torch.load(tmp_path / f"alloc{rank}.pt")
        want = predict_allocation(str(path), "fp32", L, B, layout=plan_layout, stage=rank // stage_ranks,
                                  snapshots=B // dp)
        for term in ("weights", "cache"):
            assert got[term] == pytest.approx(want[term], rel=0.10), (layout, rank, term, got, want)
