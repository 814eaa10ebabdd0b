"""Overlapped steps on the GPU (needs a CUDA device; skipped without one): with decode graphs replayed and the
next step queued before the host reads the samples, the outputs equal those of the engine that waits every step,
for greedy and seeded sampling with logprobs, stop strings and ``n > 1``, and every block and slot comes back."""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM
from tests.engine.test_async_scheduling import PARAMS, outputs
from tests.engine.test_engine import assert_cache_empty, prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make(ckpt, overlap: bool, dtype: str) -> LLM:
    return LLM(str(ckpt), device="cuda", dtype=dtype, block_size=4, num_cache_blocks=256, max_num_seqs=8,
               max_model_len=128, cuda_graph_sizes=[1, 2, 4, 8], async_scheduling=overlap)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["greedy", "seeded-logprobs", "stop-strings", "n3"])
def test_overlapped_steps_on_the_gpu_equal_the_waiting_engine(tiny_ckpt, name, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    ps, sp = prompts(8), PARAMS[name]
    sync, overlap = make(tiny_ckpt, False, dtype), make(tiny_ckpt, True, dtype)
    want = outputs(sync, ps, sp)
    replays = overlap.engine.runner.graphs.replays
    assert outputs(overlap, ps, sp) == want
    assert overlap.engine.runner.graphs.replays > replays  # decode ran from the graphs
    assert_cache_empty(overlap)
    assert overlap.engine._inflight is None
