"""The same engine on a CUDA device with the reference ops: fp32 greedy outputs equal the CPU's."""
from __future__ import annotations

import json

import pytest
import torch

from dayzero import LLM, SamplingParams
from tests.engine.test_engine import prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_gpu_fp32_greedy_equals_cpu(tiny_ckpt):
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ps = prompts()
    kw = dict(dtype="float32", block_size=4, num_cache_blocks=256)
    cpu = [o.outputs[0].token_ids for o in LLM(str(tiny_ckpt), device="cpu", **kw).generate(ps, sp)]
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = [o.outputs[0].token_ids for o in LLM(str(tiny_ckpt), device="cuda", **kw).generate(ps, sp)]
    assert gpu == cpu


def test_gpu_bf16_runs_and_is_batch_invariant(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cuda", dtype="bfloat16", block_size=4, num_cache_blocks=256)
    assert llm.engine.dtype == torch.bfloat16
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ps = prompts()
    outs = [o.outputs[0].token_ids for o in llm.generate(ps, sp)]
    assert all(len(o) == 8 for o in outs)
    assert llm.generate([ps[3]], sp)[0].outputs[0].token_ids == outs[3]


def test_deepseek_v4_gpu_fp32_equals_cpu_and_bf16_runs(tmp_path):
    """Compressed attention (rings, strided entry pools, indexer), hash routing and mHC on the GPU: the same
    weights give the CPU's fp32 greedy tokens; bf16 runs and is batch invariant."""
    from tests.hf.test_deepseek_v4 import CONFIG

    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "model_type": "deepseek_v4"}))
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ps = prompts()
    kw = dict(dtype="float32", block_size=16, num_cache_blocks=64, load_format="dummy")
    cpu_llm = LLM(str(tmp_path), device="cpu", **kw)
    cpu = [o.outputs[0].token_ids for o in cpu_llm.generate(ps, sp)]
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu_llm = LLM(str(tmp_path), device="cuda", **kw)
    gpu_llm.engine.model.load_state_dict(cpu_llm.engine.model.state_dict())
    assert [o.outputs[0].token_ids for o in gpu_llm.generate(ps, sp)] == cpu
    bf16 = LLM(str(tmp_path), device="cuda", **{**kw, "dtype": "bfloat16"})
    outs = [o.outputs[0].token_ids for o in bf16.generate(ps, sp)]
    assert all(len(o) == 16 for o in outs) and bf16.generate([ps[3]], sp)[0].outputs[0].token_ids == outs[3]
