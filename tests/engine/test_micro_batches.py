"""Pipeline micro-batches: an eager step cut into batches of consecutive sequences (``ForwardBatch.split``) and run
part after part gives the whole step's outputs.

One process on the CPU, so the parts run one after another with nothing to overlap: what is checked is that the
cut changes nothing. Every family's mixers see a part as a whole batch (KDA and Gated DeltaNet states, DSA
selection, compressed attention, hyper-connection streams, MXFP4 experts); greedy tokens of prompts run together
are equal and the sampled rows' logits within 1e-5 relative, with steps cut into 2 and 3 parts against whole ones.
Under pipeline parallelism (tests/distributed) the stages cut the same way, by default two parts a stage.
"""
from __future__ import annotations

import pytest
import torch

from dayzero.engine.batch import ForwardBatch
from dayzero.engine.engine import EngineConfig, LLMEngine
from dayzero.engine.sampling_params import SamplingParams
from tests.distributed.test_tensor_parallel import CONFIGS
from tests.hf import test_deepseek_v4 as v4
from tests.hf import test_dsa_families as dsa
from tests.hf import test_linear_families as linear
from tests.hf.harness import make_hf_checkpoint, prompt_batch
from tests.hf.test_gpt_oss_mxfp4 import CONFIG as GPT_OSS

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_cache_blocks=256, max_num_batched_tokens=48,
              num_threads=2)
RTOL = 1e-5


def batch(query_start, seq_start, num_real=None) -> ForwardBatch:
    T, B = query_start[-1], len(query_start) - 1
    seq_lens = [s + q1 - q0 for s, q0, q1 in zip(seq_start, query_start, query_start[1:])]
    b = ForwardBatch(torch.arange(T) + 100, torch.arange(T), query_start, seq_start, seq_lens, torch.arange(T) + 7,
                     torch.arange(B * 3).view(B, 3), torch.arange(B) + 1, torch.tensor([T - 1]), 4, num_real=num_real)
    b.rope_positions = torch.arange(3 * T).view(3, T)
    return b


def test_parts_are_consecutive_sequences_with_about_equal_rows():
    whole = batch([0, 1, 2, 10, 11, 12, 13], [5, 7, 0, 3, 9, 4])
    parts = whole.split(2)
    # 13 rows: the boundary at or after 6.5 rows is after sequence 2 (row 10)
    assert [p.num_seqs for p in parts] == [3, 3] and [p.num_tokens for p in parts] == [10, 3]
    a, b = parts
    assert b.query_start == (0, 1, 2, 3) and b.seq_start == (3, 9, 4) and b.seq_lens == (4, 10, 5)
    assert torch.equal(b.input_ids, whole.input_ids[10:]) and torch.equal(b.positions, whole.positions[10:])
    assert torch.equal(b.slot_mapping, whole.slot_mapping[10:]) and torch.equal(b.block_tables, whole.block_tables[3:])
    assert torch.equal(b.state_slots, whole.state_slots[3:]) and torch.equal(b.fresh, whole.fresh[3:])
    assert torch.equal(a.fresh, torch.tensor([False, False, True])) and torch.equal(b.cu_seqlens, torch.tensor([0, 1, 2, 3]))
    assert torch.equal(b.rope_positions, whole.rope_positions[:, 10:]) and b.logits_indices.numel() == 0
    assert [p.num_seqs for p in whole.split(3)] == [3, 1, 2]  # boundaries at the first row ends past 4.3 and 8.7
    assert [p.num_seqs for p in whole.split(9)] == [2, 1, 1, 1, 1]  # never more parts than sequences


def test_bad_micro_batch_setting_names_it():
    with pytest.raises(ValueError, match="pp_micro_batches must be an int >= 0"):
        EngineConfig(pp_micro_batches=-1)


def test_steps_that_stay_whole():
    assert batch([0, 4], [0]).split(2) is None  # one sequence
    assert batch([0, 1, 2], [3, 4]).split(1) is None
    assert batch([0, 1, 2], [3, 4], num_real=1).split(2) is None  # a padded (captured-size) step
    with_images = batch([0, 1, 2], [3, 4])
    with_images.images = object()
    assert with_images.split(2) is None
    captured = ForwardBatch(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), [0, 1, 2], None, None,
                            torch.zeros(2, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long),
                            torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.long), 4,
                            fresh=torch.zeros(2, dtype=torch.bool))
    assert captured.split(2) is None  # no host lengths


def run(path, micro: int) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Greedy tokens of four prompts run together, every sampled row's logits, and the steps run in parts."""
    engine = LLMEngine(EngineConfig(model=str(path), pp_micro_batches=micro, **ENGINE))
    engine.model.micro_batch_min_rows = 1  # cut even the decode steps of these few sequences
    logits, compute = [], engine.model.compute_logits
    engine.model.compute_logits = lambda h: logits.append(compute(h)) or logits[-1]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = prompt_batch(engine.model_config.vocab_size, lengths=(5, 23, 12, 30))
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[str(i)] for i in range(len(prompts))], logits, engine.model.split_steps


FAMILIES = {
    "qwen3_moe": (CONFIGS["qwen3_moe"], None),
    "kimi_linear": (CONFIGS["kimi_linear"], None),
    "qwen3_next": ({**linear.COMMON, **linear.FAMILIES["qwen3_next"]}, linear.slow_decay),
    "deepseek_v32": ({**dsa.COMMON, **dsa.FAMILIES["deepseek_v32"]}, None),
    "deepseek_v4": (v4.CONFIG, v4._init),
    "gpt_oss": (GPT_OSS, None),
}


@pytest.fixture(scope="module", params=["dayzero_hybrid", *FAMILIES])
def model_path(request, tmp_path_factory, tiny_ckpt):
    if request.param == "dayzero_hybrid":
        return tiny_ckpt
    cfg, init = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    make_hf_checkpoint(path, request.param, init=init, **cfg)
    return path


def test_small_steps_stay_whole(tiny_ckpt):
    """By default a part needs MICRO_BATCH_MIN_ROWS rows: a decode step of four sequences is not cut."""
    engine = LLMEngine(EngineConfig(model=str(tiny_ckpt), pp_micro_batches=2, **ENGINE))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompt_batch(engine.model_config.vocab_size, lengths=(40, 41, 3, 2))):
        engine.add_request(str(i), ids, params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    # the first prefill step (48 rows: 40 + 8) is too short for two parts of 32; so is every later step
    assert engine.model.micro_batch_min_rows == 32 and engine.model.split_steps == 0 and steps > 3


def test_steps_in_parts_give_the_whole_steps_outputs(model_path):
    tokens, logits, split = run(model_path, 1)
    assert split == 0
    for micro in (2, 3):
        got_tokens, got_logits, got_split = run(model_path, micro)
        assert got_split > 0  # prefill, mixed and decode steps of several sequences ran in parts
        assert got_tokens == tokens
        assert len(got_logits) == len(logits)
        for a, b in zip(got_logits, logits):
            assert a.shape == b.shape  # a step that only brings prompts to a snapshot point samples no row
            if b.numel():
                assert ((a - b).norm() / b.norm()).item() <= RTOL
