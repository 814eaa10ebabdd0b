"""One cos/sin per forward pass for every rotary of the same frequencies (the MLA and indexer rotaries of all
layers), computed again for the next pass: the memo never carries a step's angles into another step."""
from __future__ import annotations

import torch

from dayzero import LLM, SamplingParams
from dayzero.layers.rotary import RotaryEmbedding


def test_cos_sin_is_computed_once_per_forward_and_never_reused_across_steps(tiny_ckpt, monkeypatch):
    calls = []
    real = RotaryEmbedding.cos_sin

    def counted(self, positions):
        calls.append((self.key, positions.tolist()))
        return real(self, positions)

    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 20))}
    # eager: a replayed CUDA graph runs no Python, so the counting below would not see its steps
    want = LLM(str(tiny_ckpt), dtype="float32", enforce_eager=True).generate([prompt], sp)[0].outputs[0].token_ids
    llm = LLM(str(tiny_ckpt), dtype="float32", enforce_eager=True)
    rotaries = [m for m in llm.engine.model.modules() if isinstance(m, RotaryEmbedding)]
    keys = {m.key for m in rotaries}
    assert len(rotaries) > len(keys)  # the tiny model has rotaries that share their frequencies
    monkeypatch.setattr(RotaryEmbedding, "cos_sin", counted)
    got = llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert got == want
    # per frequency set, each forward pass's positions once: together every position fed, 0..16 of the prompt
    # (however the prefill is chunked) and 17..19 of the decode steps
    for key in keys:
        fed = [p for k, pos in calls if k == key for p in pos]
        assert fed == list(range(20))
    assert len(calls) % len(keys) == 0


def _rotary(dim=64, theta=50000.0, scaling=None):
    from dayzero.config.spec import RopeSpec

    return RotaryEmbedding(RopeSpec(dim=dim, theta=theta, scaling=scaling))


def test_a_reserved_table_gives_the_rows_a_step_computes_and_is_shared_by_equal_frequencies():
    from dayzero.config.spec import RopeScaling

    yarn = RopeScaling(factor=8.0, original_max_position_embeddings=4096)
    for scaling in (None, yarn):
        a, b, other = _rotary(scaling=scaling), _rotary(scaling=scaling), _rotary(dim=32, scaling=scaling)
        positions = torch.tensor([0, 5, 4095, 17, 5])
        want = a.cos_sin(positions)  # no table: computed
        shared = {}
        assert a.reserve(4096, shared) and b.reserve(4096, shared) and other.reserve(4096, shared)
        assert a.table is b.table and a.table.shape == (4096, 2, 32)
        assert other.table is not a.table and len(shared) == 2
        got = a.cos_sin(positions)
        for w, g in zip(want, got):  # the same ops over every position (CUDA: equal bits; the CPU's vector and
            torch.testing.assert_close(g, w, rtol=2e-7, atol=2e-7)  # scalar paths may differ in the last bit)
            assert g.stride(-1) == 1 and got[0].stride() == got[1].stride()  # what the rotary kernel takes


def test_no_table_past_its_budget_nor_for_multimodal_positions_nor_on_the_cpu_engine(monkeypatch):
    from dayzero.config.spec import RopeSpec
    from dayzero.layers import rotary as R

    monkeypatch.setattr(R, "TABLE_MAX_BYTES", 4096 * 64 * 4 - 1)
    assert not _rotary().reserve(4096) and _rotary().reserve(4095)
    assert not RotaryEmbedding(RopeSpec(dim=64, theta=1e4, mrope_section=(12, 10, 10))).reserve(8)
    model = torch.nn.Sequential(_rotary(), _rotary())
    assert R.reserve_tables(model, 16, torch.device("cpu")) == 0 and model[0].table is None


def test_on_a_gpu_the_table_holds_the_same_bits_a_step_computes():
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rot = _rotary().cuda()
    positions = torch.randint(0, 131072, (257,), device="cuda")
    want = rot.cos_sin(positions)
    assert rot.reserve(131072)
    assert all(torch.equal(g, w) for g, w in zip(rot.cos_sin(positions), want))
