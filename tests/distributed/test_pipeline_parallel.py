"""Pipeline parallelism on the CPU with Gloo: stages of contiguous layers against one process on the same weights.

Each stage builds only its layers (the embedding on the first, the LM head on the last), receives the residual
stream from the stage before and sends it on; the last stage's logits reach every stage. Whole models made by
transformers give prompt and decode logits within 1e-4 relative of one process and the same greedy tokens:

- pp=2: qwen3_moe (GQA, MoE), deepseek_v32 (DSA with its indexer), kimi_linear (KDA), qwen3_next (Gated
  DeltaNet), deepseek_v4 (hyper-connection streams between the stages, compressed attention, hash routing), and
  gpt-oss with MXFP4 experts;
- pp=2 with tp=2 and pp=2 with ep=2 on four ranks: qwen3_moe.
"""
from __future__ import annotations

import pytest
import torch

from dayzero.distributed import ParallelState, pipeline_stages
from dayzero.models.decoder import Elsewhere
from dayzero.models.registry import build_model, load_config
from dayzero.loader.safetensors_loader import check_headers
from dayzero.models.registry import adapter_for, read_config
from dayzero.tools.quantize import quantize_checkpoint
from tests.distributed.test_tensor_parallel import CONFIGS, compare_paths, compare_with_one_process
from tests.hf import test_deepseek_v4 as v4
from tests.hf import test_dsa_families as dsa
from tests.hf import test_linear_families as linear
from tests.hf.harness import make_hf_checkpoint
from tests.hf.test_gpt_oss_mxfp4 import CONFIG as GPT_OSS


def test_stages_cut_the_layers_evenly():
    assert pipeline_stages(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert pipeline_stages(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="pp=4 exceeds num_hidden_layers=3"):
        pipeline_stages(3, 4)


def test_models_at_pp2_match_one_process(tmp_path):
    paths = []
    for name, cfg, init in [("qwen3_moe", CONFIGS["qwen3_moe"], None),
                            ("deepseek_v32", {**dsa.COMMON, **dsa.FAMILIES["deepseek_v32"]}, None),
                            ("kimi_linear", CONFIGS["kimi_linear"], None),
                            ("qwen3_next", {**linear.COMMON, **linear.FAMILIES["qwen3_next"]}, linear.slow_decay),
                            ("deepseek_v4", v4.CONFIG, v4._init)]:
        make_hf_checkpoint(tmp_path / name, name, init=init, **cfg)
        paths.append(tmp_path / name)
    make_hf_checkpoint(tmp_path / "bf16", "gpt_oss", seed=3, **GPT_OSS)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "gpt_oss", progress=False)
    compare_paths(tmp_path, paths + [tmp_path / "gpt_oss"], tp=1, pp=2)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=1, ep=2)], ids=["tp2", "ep2"])
def test_pp2_with_tp_or_ep_on_four_ranks(tmp_path, layout):
    compare_with_one_process(tmp_path, ("qwen3_moe",), pp=2, **layout)


def test_a_stage_holds_only_its_layers(tmp_path):
    path = tmp_path / "qwen3_moe"
    make_hf_checkpoint(path, "qwen3_moe", **CONFIGS["qwen3_moe"])
    spec = load_config(path)
    raw, cfg_file = read_config(path)
    adapter = adapter_for(raw, cfg_file)
    first = build_model(spec, torch.float32, "meta", ParallelState(pp_rank=0, pp_size=2, world_size=2))
    last = build_model(spec, torch.float32, "meta", ParallelState(pp_rank=1, pp_size=2, world_size=1 * 2))
    assert [type(l) is Elsewhere for l in first.model.layers] == [False, False, True]
    assert [type(l) is Elsewhere for l in last.model.layers] == [True, True, False]
    assert isinstance(first.lm_head, Elsewhere) and isinstance(last.model.embed_tokens, Elsewhere)
    assert not any(n.startswith(("model.layers.2.", "lm_head.")) for n, _ in first.named_parameters())
    for model in (first, last):  # the other stage's tensors are neither missing nor unexpected
        assert check_headers(model, path, adapter.rules(spec), adapter.ignore) == []


def test_a_stage_that_would_miss_a_shared_selection_is_refused(tmp_path):
    path = tmp_path / "glm_moe_dsa"
    make_hf_checkpoint(path, "glm_moe_dsa", **{**dsa.COMMON, **dsa.FAMILIES["glm_moe_dsa"]})
    spec = load_config(path)  # layer 2 reuses layer 1's selection: stages [0, 1] and [2, 3] split them
    with pytest.raises(ValueError, match="pp=2: layer 2 reuses the DSA selection of a layer on an earlier stage"):
        build_model(spec, torch.float32, "meta", ParallelState(pp_rank=1, pp_size=2, world_size=2))
