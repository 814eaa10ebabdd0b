"""The whole decode step on the GPU (needs a CUDA device; skipped without one): no host synchronisation in a
decode step, and decode graphs replayed at several batch sizes (padded ones too) give the eager engine's
tokens, token for token over 64 steps, for every architecture family that decodes through the batch-wide ops."""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM, SamplingParams
from dayzero.engine import cuda_graphs
from tests.engine.families import prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 64


def engine(path: str, dtype: str, **kw) -> LLM:
    return LLM(path, device="cuda", dtype=dtype, load_format="dummy", block_size=4, num_cache_blocks=256,
               max_num_seqs=8, max_model_len=128, **kw)


def test_decode_step_has_no_host_sync(model_dir):
    # the step is driven by hand below (schedule, build, run, sample): the engine must not hold a queued step, whose
    # sequences end in tokens still on the device
    llm = engine(model_dir, "bfloat16", enforce_eager=True, async_scheduling=False)
    eng = llm.engine
    for i, p in enumerate(prompts(5, eng.model_config.vocab_size, 0)):
        eng.add_request(f"r{i}", p["prompt_token_ids"], SamplingParams(max_tokens=8, temperature=0.7, seed=i))
    eng.step()  # prefill every prompt
    eng.step()  # a first decode step (warms up lazily initialised kernels)
    scheduled = eng.scheduler.schedule()
    assert scheduled and all(s.num_tokens == 1 for s in scheduled)
    with cuda_graphs.sync_debug("error"):  # any host round trip raises
        batch = eng.runner.build_batch(scheduled, eng.cache)
        logits = eng.runner.execute(batch)
        out = eng.sampler(logits, [s.seq.params for s in scheduled], [s.seq.generator for s in scheduled],
                          [s.seq.output_ids for s in scheduled])
    assert out.token_ids.shape == (len(scheduled),)


@pytest.mark.parametrize("batch", [1, 3, 8, 5], ids=lambda b: f"B{b}")
def test_graph_replay_equals_eager(model_dir, batch, monkeypatch):
    """fp32 (no TF32): replaying captured graphs, padded to the next captured size and block-table width, gives
    the eager engine's greedy tokens for 64 steps; the widths grow past the DSA top-k and windows on the way."""
    torch.backends.cuda.matmul.allow_tf32 = False
    widths = cuda_graphs.default_widths
    monkeypatch.setattr(cuda_graphs, "default_widths", lambda *a, **k: widths(*a, min_tokens=8))
    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    eager = engine(model_dir, "float32", enforce_eager=True)
    graphed = engine(model_dir, "float32", cuda_graph_sizes=[1, 2, 4, 8])
    graphs = graphed.engine.runner.graphs
    assert graphs is not None, graphed.engine.decode_mode
    assert graphed.engine.cache_plan.graph_bytes > 0
    ps = prompts(batch, eager.engine.model_config.vocab_size, batch)
    want = [o.outputs[0].token_ids for o in eager.generate(ps, sp)]
    replays = graphs.replays
    got = [o.outputs[0].token_ids for o in graphed.generate(ps, sp)]
    assert graphs.replays - replays >= STEPS - 2  # decode ran from the graphs
    assert got == want


def test_enforce_eager_captures_nothing(tiny_ckpt):
    llm = engine(str(tiny_ckpt), "bfloat16", enforce_eager=True)
    assert llm.engine.runner.graphs is None and llm.engine.decode_mode == "eager"


def test_padding_rows_touch_only_the_null_block_and_slot(tiny_ckpt):
    """A step of 3 sequences replayed in the graph of 4: the KV and state rows of the live sequences after it are
    those the eager engine leaves (the padding row wrote only block 0 and slot 0)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = []
    for kw in ({"enforce_eager": True}, {"cuda_graph_sizes": [4]}):
        llm = engine(str(tiny_ckpt), "float32", **kw)
        ps = prompts(3, llm.engine.model_config.vocab_size, 7)
        outs.append([o.outputs[0].token_ids for o in llm.generate(ps, sp)])
        if "cuda_graph_sizes" in kw:
            assert llm.engine.runner.graphs.replays > 0
    assert outs[0] == outs[1]


def test_graphs_cover_only_captured_shapes(tiny_ckpt):
    llm = engine(str(tiny_ckpt), "bfloat16", cuda_graph_sizes=[2, 4])
    graphs = llm.engine.runner.graphs
    assert graphs.lookup(1, 1) == (2, graphs.widths[0]) and graphs.lookup(3, graphs.widths[0]) == (4, graphs.widths[0])
    assert graphs.lookup(5, 1) is None and graphs.lookup(1, graphs.widths[-1] + 1) is None
    # a step larger than every capture runs eagerly and still decodes
    out = llm.generate(prompts(6, llm.engine.model_config.vocab_size, 3), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    usage = llm.engine.cache_usage()
    assert usage["blocks_free"] == usage["blocks_total"] and usage["slots_free"] == usage["slots_total"]
