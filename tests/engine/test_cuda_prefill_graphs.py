"""Prefill and mixed steps replayed from CUDA graphs (needs a CUDA device; skipped without one): a replay gives
what its captured padded step gives run eagerly, token for token (the padded layout against the plain step is
checked on any machine, ``test_prefill_graphs.py``); a family whose prefill ops cannot be captured says why."""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM, SamplingParams
from tests.engine.families import prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_replay_equals_the_captured_step_run_eagerly(model_dir):
    """bf16: a prefill graph's replay gives, token for token, what running its captured padded step eagerly over
    the same buffers gives (same shapes, same kernels): nothing a replay reads was freed or left stale after
    the capture."""
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = []
    for eager_replay in (False, True):
        llm = LLM(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", block_size=4, num_cache_blocks=256,
                  max_num_seqs=8, max_model_len=128, max_num_batched_tokens=64, cuda_graph_sizes=[1, 2, 4, 8])
        runner = llm.engine.runner
        graphs = runner.prefill_graphs
        if graphs is None:
            pytest.skip(llm.engine.prefill_mode)
        if eager_replay:
            batches = {key: graphs.padding_batch(key) for key in graphs.graphs}
            graphs.replay = lambda key: graphs.output(key, runner.model(batches[key]))
        ps = prompts(6, llm.engine.model_config.vocab_size, 13)
        outs.append([[o.outputs[0].token_ids for o in llm.generate(ps, sp)] for _ in range(2)])
    assert outs[0] == outs[1]
