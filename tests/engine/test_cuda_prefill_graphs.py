"""Prefill and mixed steps replayed from CUDA graphs (needs a CUDA device; skipped without one): greedy tokens
equal to the engine whose prefill steps run eagerly, for prompts prefilled whole and in chunks (mixed steps), and
again from the prefix cache; a family whose prefill ops cannot be captured says why and runs them eagerly."""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM, SamplingParams
from tests.engine.families import prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def engine(path: str, **kw) -> LLM:
    return LLM(path, device="cuda", dtype="float32", load_format="dummy", block_size=4, num_cache_blocks=256,
               max_num_seqs=8, max_model_len=128, cuda_graph_sizes=[1, 2, 4, 8], **kw)


@pytest.mark.parametrize("chunk", [64, 7], ids=["whole", "chunked"])
def test_prefill_replay_equals_eager(model_dir, chunk, monkeypatch):
    # fp32 without TF32 GEMMs; fla's chunk kernel for fp32 in both engines (its graph mode and its eager mode
    # run the same kernels), so the two differ only in how the steps are launched
    monkeypatch.setenv("DAYZERO_FLA_CHUNK", "tf32")
    torch.backends.cuda.matmul.allow_tf32 = False
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager = engine(model_dir, max_num_batched_tokens=chunk, cuda_graph_prefill_tokens=0)
    assert eager.engine.runner.prefill_graphs is None and "cuda_graph_prefill_tokens=0" in eager.engine.prefill_mode
    graphed = engine(model_dir, max_num_batched_tokens=chunk)
    graphs = graphed.engine.runner.prefill_graphs
    if graphs is None:
        assert graphed.engine.prefill_mode.startswith("eager (prefill graph capture failed")
        pytest.skip(graphed.engine.prefill_mode)
    ps = prompts(6, eager.engine.model_config.vocab_size, 11)
    want = [[o.outputs[0].token_ids for o in eager.generate(ps, sp)] for _ in range(2)]
    got = [[o.outputs[0].token_ids for o in graphed.generate(ps, sp)] for _ in range(2)]  # the second from the cache
    assert graphs.replays > 0
    assert got == want


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
