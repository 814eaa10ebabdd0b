"""The layouts across the families that matter most here, on the CPU with Gloo, each against one process on the
same weights (prompt and decode logits within 1e-4 relative in fp32, the same greedy tokens, the same expert
loads): the native dayzero_hybrid (KDA + gated DSA + GQA + LatentMoE), deepseek_v32 (DSA), qwen3_next (Gated
DeltaNet), gpt-oss with MXFP4 experts, and deepseek_v4 (hyper-connections, compressed attention, hash routing) at
ep=2 and tp=2 with ep=2; deepseek_v4 also at tp=2, dayzero_hybrid at pp=2. The other layouts of
these families are in test_tensor_parallel, test_tp_mixers, test_expert_parallel and test_pipeline_parallel."""
from __future__ import annotations

import shutil

import pytest

from dayzero.tools.quantize import quantize_checkpoint
from tests.distributed.test_pipeline_parallel import GPT_OSS, dsa, linear, v4
from tests.distributed.test_tensor_parallel import compare_paths
from tests.hf.harness import make_hf_checkpoint


@pytest.fixture
def models(tmp_path, tiny_ckpt):
    """name -> checkpoint path."""
    out = {"dayzero_hybrid": tmp_path / "dayzero_hybrid"}
    shutil.copytree(tiny_ckpt, out["dayzero_hybrid"])
    for name, cfg, seed, init in [
            ("deepseek_v32", {**dsa.COMMON, **dsa.FAMILIES["deepseek_v32"]}, dsa.SEEDS["deepseek_v32"], None),
            ("qwen3_next", {**linear.COMMON, **linear.FAMILIES["qwen3_next"]}, 0, linear.slow_decay),
            ("deepseek_v4", v4.CONFIG, v4.SEED, v4._init)]:
        make_hf_checkpoint(tmp_path / name, name, seed=seed, init=init, **cfg)
        out[name] = tmp_path / name
    make_hf_checkpoint(tmp_path / "bf16", "gpt_oss", seed=3, **{**GPT_OSS, "intermediate_size": 64})
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "gpt_oss", progress=False)
    out["gpt_oss"] = tmp_path / "gpt_oss"
    return out


def test_ep2_across_the_families(tmp_path, models):
    compare_paths(tmp_path, list(models.values()), tp=1, ep=2)


def test_tp2_with_ep2_across_the_families(tmp_path, models):
    compare_paths(tmp_path, list(models.values()), tp=2, ep=2)


def test_deepseek_v4_at_tp2(tmp_path, models):
    """Compressed attention's heads and output groups, the CSA indexer's heads, hyper-connection streams whole."""
    compare_paths(tmp_path, [models["deepseek_v4"]], tp=2)


def test_native_hybrid_at_pp2(tmp_path, models):
    compare_paths(tmp_path, [models["dayzero_hybrid"]], tp=1, pp=2)
