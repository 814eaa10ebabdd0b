"""Incremental equals full: prefill in chunks of 1, 7 or all, then decode token by token, must give the
logits of one full forward pass over the same tokens (required test 4)."""
from __future__ import annotations

import pytest
import torch

from dayzero.engine.engine import EngineConfig, LLMEngine
from dayzero.engine.request import Sequence
from dayzero.engine.sampling_params import SamplingParams
from dayzero.engine.scheduler import ScheduledSeq


def run_chunks(engine: LLMEngine, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Feed one sequence through the engine's runner in the given chunk sizes; logits of every row."""
    seq = Sequence("t", 0, list(tokens), len(tokens), SamplingParams())
    rows = []
    with torch.inference_mode():
        for n in chunks:
            assert engine.cache.grow(seq.seq_id, seq.num_computed + n)
            batch = engine.runner.build_batch([ScheduledSeq(seq, n)], engine.cache)
            rows.append(engine.model.compute_logits(engine.model(batch)))
            seq.num_computed += n
    engine.cache.release(seq.seq_id)
    return torch.cat(rows)


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return LLMEngine(EngineConfig(model=str(tiny_ckpt), device="cpu", dtype="float32", block_size=4, num_cache_blocks=64, max_num_seqs=4))


@pytest.mark.parametrize("chunk", [1, 7, 40], ids=lambda c: f"chunk{c}")
def test_incremental_equals_full(engine, chunk):
    cfg = engine.model_config
    assert set(cfg.layer_types) == {"kda", "dsa", "gqa"} and "moe" in {l.mlp_kind for l in cfg.layers}
    topk = next(l.attn.indexer.topk for l in cfg.layers if l.attn_kind == "dsa")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (52,), generator=g).tolist()
    prompt_len = 40  # > index_topk (8): the DSA layers attend sparsely
    assert prompt_len > topk
    full = run_chunks(engine, tokens, [len(tokens)])
    chunks = [chunk] * (prompt_len // chunk) + ([prompt_len % chunk] if prompt_len % chunk else [])
    inc = run_chunks(engine, tokens, chunks + [1] * (len(tokens) - prompt_len))
    rel = ((inc - full).norm() / full.norm()).item()
    assert rel <= 1e-4, f"relative error {rel:.2e}, max abs {(inc - full).abs().max().item():.2e}"


def test_two_sequences_in_one_batch_equal_alone(engine):
    """Two sequences sharing a step (one prefilling, one decoding) give their solo logits."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 250, (30,), generator=g).tolist()
    b = torch.randint(0, 250, (21,), generator=g).tolist()
    solo_a, solo_b = run_chunks(engine, a, [30]), run_chunks(engine, b, [20, 1])
    sa = Sequence("a", 0, a, 30, SamplingParams())
    sb = Sequence("b", 0, b, 21, SamplingParams())
    with torch.inference_mode():
        assert engine.cache.grow(sb.seq_id, 20)
        engine.model(engine.runner.build_batch([ScheduledSeq(sb, 20)], engine.cache))
        sb.num_computed = 20
        assert engine.cache.grow(sa.seq_id, 30) and engine.cache.grow(sb.seq_id, 21)
        batch = engine.runner.build_batch([ScheduledSeq(sa, 30), ScheduledSeq(sb, 1)], engine.cache)
        logits = engine.model.compute_logits(engine.model(batch))
    engine.cache.release(sa.seq_id)
    engine.cache.release(sb.seq_id)
    torch.testing.assert_close(logits[:30], solo_a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits[30], solo_b[-1], rtol=1e-4, atol=1e-5)


def test_a_decode_steps_sampled_rows_are_taken_as_its_first_rows(engine):
    """A step whose sampled rows are 0 .. S-1 (every sequence decoding one token) marks them on the host
    (``leading_samples``) and ``execute`` takes those rows as a view; each sequence still gets its solo logits. A
    step whose sampled rows are others (a prompt's last row after its chunk) keeps the gather."""
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 250, (6,), generator=g).tolist()
    b = torch.randint(0, 250, (9,), generator=g).tolist()
    solo_a, solo_b = run_chunks(engine, a, [5, 1]), run_chunks(engine, b, [8, 1])
    sa = Sequence("a", 0, a, 6, SamplingParams())
    sb = Sequence("b", 0, b, 9, SamplingParams())
    with torch.inference_mode():
        for s, n in ((sa, 5), (sb, 8)):
            assert engine.cache.grow(s.seq_id, n)
            prompt = engine.runner.build_batch([ScheduledSeq(s, n)], engine.cache)
            assert prompt.leading_samples == 0  # the chunk ends before the sequence: no row sampled
            engine.model(prompt)
            s.num_computed = n
        assert engine.cache.grow(sa.seq_id, 6) and engine.cache.grow(sb.seq_id, 9)
        batch = engine.runner.build_batch([ScheduledSeq(sa, 1), ScheduledSeq(sb, 1)], engine.cache)
        assert batch.leading_samples == 2
        logits = engine.runner.execute(batch)
    engine.cache.release(sa.seq_id)
    engine.cache.release(sb.seq_id)
    torch.testing.assert_close(logits[0], solo_a[-1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits[1], solo_b[-1], rtol=1e-4, atol=1e-5)
    c = Sequence("c", 0, b[:3], 3, SamplingParams())
    assert engine.cache.grow(c.seq_id, 3)
    last = engine.runner.build_batch([ScheduledSeq(c, 3)], engine.cache)  # samples row 2 of 0 .. 2
    engine.cache.release(c.seq_id)
    assert last.leading_samples is None and last.logits_indices.tolist() == [2]
