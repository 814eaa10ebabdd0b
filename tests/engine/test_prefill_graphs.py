"""Prefill and mixed steps replayed from graphs, checked on any machine: the shapes captured, how a step finds its
capture, and the padded layout replayed (one padding sequence, then sequences with no rows) giving the plain
engine's tokens and logits, with decode steps replayed the same way. On a CPU a "replay" runs the captured batch eagerly: the same ops over the same step
buffers, shapes and plan (no host lengths) as a CUDA graph replays, with the device implementations chosen as on
a GPU (Triton kernels through the interpreter)."""
from __future__ import annotations

import json

import pytest
import torch

from dayzero import LLM, SamplingParams
from dayzero.engine.batch import HostLengthsUnavailable
from dayzero.engine.cuda_graphs import DecodeGraphs, PrefillGraphs, prefill_seats, prefill_token_buckets
from dayzero.engine.engine import EngineConfig
from tests.engine.families import hf_config, prompts


class EagerReplayMixin:
    """A graph set whose capture keeps each padded batch (after the warm pass every capture makes) and whose
    replay runs it again over whatever the step buffers hold."""

    def capture(self, pool=None) -> None:
        for key in self.keys():
            batch = self.padding_batch(key)
            self.runner.model(batch)  # the warm pass: an op that needs host lengths fails here, as before a capture
            self.graphs[key] = (batch, None)

    def replay(self, key):
        batch = self.graphs[key][0]  # what the pass computes once for its layers is recomputed, as in a graph
        self.replays += 1
        return self.output(key, self.runner.model(batch))


class EagerReplay(EagerReplayMixin, PrefillGraphs):
    pass


class EagerDecodeReplay(EagerReplayMixin, DecodeGraphs):
    pass


def with_replayed_prefill(llm: LLM, tokens: list[int], widths: list[int]) -> EagerReplay:
    runner = llm.engine.runner
    buf = runner.buffers
    runner.reserve_buffers(max(buf.max_tokens, tokens[-1]), buf.max_seqs + 1, buf.max_blocks)
    graphs = EagerReplay(runner, tokens, prefill_seats(llm.engine.scheduler.max_num_seqs), widths,
                         llm.engine.cache.block_size)
    graphs.capture()
    runner.prefill_graphs = graphs
    return graphs


def test_row_buckets_double_up_to_the_limit():
    assert prefill_token_buckets(2048) == [32, 64, 128, 256, 512, 1024, 2048]
    assert prefill_token_buckets(1000) == [32, 64, 128, 256, 512, 1000]
    assert prefill_token_buckets(16) == [16] and prefill_token_buckets(0) == []
    assert prefill_seats(64) == [2, 65] and prefill_seats(1) == [2]


def test_keys_cover_every_step_and_lookup_takes_the_smallest():
    g = PrefillGraphs(runner=None, tokens=[32, 64, 128], seats=[2, 9], widths=[4, 8, 16], block_size=16)
    keys = g.keys()
    assert keys == sorted(keys, reverse=True)  # largest first
    # a width is captured for a row bucket when a sequence longer than the bucket below fits in it
    assert (128, 2, 4) not in keys and (128, 9, 4) not in keys and (128, 2, 8) in keys and (64, 9, 4) in keys
    assert g.lookup(1, 1, 1) == (32, 2, 4)
    assert g.lookup(100, 1, 3) == (128, 2, 8)  # no (128, 2, 4): the next width
    assert g.lookup(32, 2, 2) == (32, 9, 4)  # two sequences and the padding one
    assert g.lookup(100, 8, 16) == (128, 9, 16)
    assert g.lookup(129, 1, 1) is None and g.lookup(8, 9, 1) is None and g.lookup(8, 1, 17) is None
    # every step a key admits fits the key, and a step of one sequence fits its own bucket
    for t in range(1, 129):
        key = g.lookup(t, 1, -(-t // 16))
        assert key is not None and key[0] >= t and key[2] * 16 >= t


def test_bad_setting_names_the_field():
    with pytest.raises(ValueError, match="cuda_graph_prefill_tokens"):
        EngineConfig(cuda_graph_prefill_tokens=-1)
    assert EngineConfig(cuda_graph_prefill_tokens=0).cuda_graph_prefill_tokens == 0


def test_prefill_mode_on_a_cpu(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float32", num_cache_blocks=32)
    assert llm.engine.runner.prefill_graphs is None and "need a CUDA device" in llm.engine.prefill_mode


def _engine(path: str, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", load_format="dummy", block_size=4, num_cache_blocks=256,
               max_num_seqs=8, max_model_len=128, **kw)


def test_padded_layout(tiny_ckpt, cuda_ops_on_cpu):
    cuda_ops_on_cpu()
    llm = _engine(str(tiny_ckpt), max_num_batched_tokens=32)
    with_replayed_prefill(llm, [32], [8])
    eng = llm.engine
    for i, p in enumerate(prompts(2, eng.model_config.vocab_size, 0)):  # 3 and 17 tokens
        eng.add_request(f"r{i}", p["prompt_token_ids"], SamplingParams(max_tokens=2))
    scheduled = eng.scheduler.schedule()
    a, b = (s.num_tokens for s in scheduled)  # the second may stop at a snapshot point
    assert 16 < a + b <= 32
    batch = eng.runner.build_batch(scheduled, eng.cache)
    assert batch.graph == (32, 9, 8) and batch.graph_set is eng.runner.prefill_graphs
    assert batch.cu_seqlens.tolist() == [0, a, a + b] + [32] * 7  # the padding sequence, then empty ones
    pad = 32 - a - b
    assert batch.positions[a + b:].tolist() == [0] * pad and batch.slot_mapping[a + b:].tolist() == [0] * pad
    assert batch.state_slots[2:].tolist() == [0] * 7 and batch.fresh.tolist() == [True] * 9
    assert batch.block_tables.shape == (9, 8) and not batch.block_tables[2:].any()
    assert batch.logits_indices.tolist() == [a - 1, a + b - 1][: len(batch.logits_indices)]
    while eng.has_unfinished():
        eng.step()


def _family_dir(name: str, tmp_path, tiny_ckpt) -> str:
    if name == "dayzero_hybrid":
        return str(tiny_ckpt)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(name)))
    return str(tmp_path)


# KDA + DSA + MoE in mixed steps; MLA with the indexer, and KDA with NoPE MLA, in steps of up to 64 rows; Gated
# DeltaNet and gated attention in mixed steps; mixed steps overlapped with the next (decode rows' inputs written
# into the step buffers on the device from the previous step's samples, after the batch is built)
@pytest.mark.parametrize("family,chunk,overlap", [("dayzero_hybrid", 7, False), ("deepseek_v32", 64, False),
                                                  ("kimi_linear", 64, False), ("qwen3_next", 7, False),
                                                  ("kimi_linear", 7, True)])
def test_replayed_prefill_gives_the_plain_engines_tokens(family, chunk, overlap, tmp_path, tiny_ckpt, cuda_ops_on_cpu):
    """Greedy tokens of prompts of 1..29 tokens, prefilled in steps of up to 64 rows or in chunks of 7 (mixed
    steps), and a second round served from the prefix cache: equal to the engine that runs every step eagerly,
    with the prefill steps replayed."""
    cuda_ops_on_cpu()
    path = _family_dir(family, tmp_path, tiny_ckpt)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plain = _engine(path, max_num_batched_tokens=chunk)
    ps = prompts(5, plain.engine.model_config.vocab_size, 5)
    want = [[o.outputs[0].token_ids for o in plain.generate(ps, sp)] for _ in range(2)]
    replayed = _engine(path, max_num_batched_tokens=chunk, async_scheduling=overlap)
    graphs = with_replayed_prefill(replayed, [16, 64], [8, 32])
    got = [[o.outputs[0].token_ids for o in replayed.generate(ps, sp)] for _ in range(2)]
    assert graphs.replays >= 2
    assert replayed.engine.stats()["model_steps"]["prefill", "graph"] == graphs.replays
    assert got == want


def test_a_family_whose_prefill_reads_host_lengths_is_not_captured(tmp_path, tiny_ckpt, cuda_ops_on_cpu):
    """DeepSeek-V4's compressed attention runs prefill rows per sequence from the host lengths: the warm pass of
    a capture fails by name (the engine then runs its prefill steps eagerly and says why)."""
    cuda_ops_on_cpu()
    llm = _engine(_family_dir("deepseek_v4", tmp_path, tiny_ckpt), max_num_batched_tokens=16)
    with pytest.raises(HostLengthsUnavailable, match="captured"):
        with_replayed_prefill(llm, [16], [8])


def test_replayed_prefill_logits_match(tiny_ckpt, cuda_ops_on_cpu):
    """The prompt logits of one replayed prefill step equal the eager step's within fp32 rounding."""
    cuda_ops_on_cpu()
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    ps = prompts(3, 64, 9)
    plain = _engine(str(tiny_ckpt))
    replayed = _engine(str(tiny_ckpt))
    graphs = with_replayed_prefill(replayed, [32], [8])
    want = plain.generate(ps, sp)
    got = replayed.generate(ps, sp)
    assert graphs.replays >= 1
    for a, b in zip(want, got):
        wa, wb = a.outputs[0].top_logprobs[0], b.outputs[0].top_logprobs[0]
        assert [t for t, _ in wa] == [t for t, _ in wb]
        assert torch.allclose(torch.tensor([v for _, v in wa]), torch.tensor([v for _, v in wb]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["dayzero_hybrid", "deepseek_v32"])
def test_replayed_decode_and_prefill_give_the_plain_engines_tokens(family, tmp_path, tiny_ckpt, cuda_ops_on_cpu):
    """Decode steps replayed too (padded to batch sizes 2 and 8, block-table widths 8 and 32): with every step
    replayed that fits a capture, greedy tokens equal the plain engine's."""
    cuda_ops_on_cpu()
    path = _family_dir(family, tmp_path, tiny_ckpt)
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    plain = _engine(path, max_num_batched_tokens=64)
    ps = prompts(5, plain.engine.model_config.vocab_size, 21)
    want = [o.outputs[0].token_ids for o in plain.generate(ps, sp)]
    replayed = _engine(path, max_num_batched_tokens=64)
    prefill = with_replayed_prefill(replayed, [64], [8, 32])
    runner = replayed.engine.runner
    decode = EagerDecodeReplay(runner, [2, 8], [8, 32], replayed.engine.cache.block_size)
    decode.capture()
    runner.graphs = decode
    got = [o.outputs[0].token_ids for o in replayed.generate(ps, sp)]
    assert prefill.replays >= 1 and decode.replays >= 4
    assert got == want


@pytest.mark.parametrize("family", ["deepseek_v32", "dayzero_hybrid"])
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantised_cache_prefill_is_replayed(family, kv, tmp_path, tiny_ckpt, cuda_ops_on_cpu):
    """FP8 / INT8 KV caches (the latent rows and the indexer keys): the MLA and indexer kernels read the codes
    and their per-token scales on the device, so a prefill step captures (it used to read host lengths in the
    reference and run eagerly) and gives the eager engine's greedy tokens, with the same cache."""
    cuda_ops_on_cpu()
    path = _family_dir(family, tmp_path, tiny_ckpt)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plain = _engine(path, max_num_batched_tokens=64, kv_cache_dtype=kv)
    ps = prompts(4, plain.engine.model_config.vocab_size, 7)
    want = [o.outputs[0].token_ids for o in plain.generate(ps, sp)]
    replayed = _engine(path, max_num_batched_tokens=64, kv_cache_dtype=kv)
    graphs = with_replayed_prefill(replayed, [64], [32])
    got = [o.outputs[0].token_ids for o in replayed.generate(ps, sp)]
    assert graphs.replays >= 1
    assert got == want
