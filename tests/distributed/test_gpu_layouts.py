"""Parallel layouts on two GPUs (NCCL): tp=2, ep=2, pp=2 and attention data parallelism (dp=2 with ep=2) give one
GPU's greedy tokens and logprobs, in fp32 and eagerly (the multi-rank paths do not capture CUDA graphs under ep
or pp), on the bundled model (MXFP4 experts) and a tiny kimi_linear (MLA, KDA, MoE). Skipped without two GPUs;
the same layouts run on the CPU with Gloo in the other tests of this directory."""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM, SamplingParams
from dayzero.engine.engine import DEFAULT_MODEL
from tests.distributed.test_tensor_parallel import CONFIGS
from tests.hf.harness import make_hf_checkpoint, prompt_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")

ENGINE = dict(device="cuda", dtype="float32", block_size=16, num_cache_blocks=64, max_num_batched_tokens=128,
              enforce_eager=True)
RTOL = 1e-3  # fp32 on GPUs: reductions split across ranks add in another order


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("gpu_layouts") / "kimi_linear"
    make_hf_checkpoint(path, "kimi_linear", **CONFIGS["kimi_linear"])
    return {"default": DEFAULT_MODEL, "kimi_linear": path}


@pytest.mark.parametrize("layout", [dict(tp=2), dict(ep=2), dict(pp=2), dict(dp=2, ep=2)],
                         ids=["tp2", "ep2", "pp2", "dp2-ep2"])
@pytest.mark.parametrize("model", ["default", "kimi_linear"])
def test_two_gpus_give_one_gpus_outputs(models, model, layout):
    path = str(models[model])
    import json

    vocab = json.loads((models[model] / "config.json").read_text())["vocab_size"]
    prompts = [{"prompt_token_ids": p} for p in prompt_batch(vocab, lengths=(5, 23, 12, 40))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    with LLM(path, **ENGINE) as one:
        want = one.generate(prompts, params)
    with LLM(path, **layout, **ENGINE) as llm:
        got = llm.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        lp, ref = torch.tensor(g.outputs[0].logprobs), torch.tensor(w.outputs[0].logprobs)
        assert ((lp - ref).norm() / ref.norm()).item() <= RTOL
