"""The step buffers: every field a step stages holds its values on the "device" after ``end()``, through the packed
copy (one copy and one ``index_copy_`` into the arena) and through the field-by-field copy of large steps; fields
not staged keep what they held. Run staged on the CPU (an arena of its own), as a CUDA device runs them."""
from __future__ import annotations

import pytest
import torch

from dayzero.engine import step_buffers as SB


def _step(buf: SB.StepBuffers, rows: int, width: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ints = lambda n: torch.randint(0, 1 << 40, (n,), generator=g).tolist()  # noqa: E731 - past 32 bits
    fresh = (torch.rand(rows, generator=g) < 0.5).tolist()
    tables = [ints(int(torch.randint(0, width + 1, (1,), generator=g))) for _ in range(rows)]
    ids = ints(rows)
    buf.begin()
    out = {"input_ids": (buf.put("input_ids", ids), ids), "fresh": (buf.put("fresh", fresh), fresh),
           "cu_seqlens": (buf.put("cu_seqlens", list(range(rows + 1))), list(range(rows + 1))),
           "block_tables": (buf.put_table(tables, rows, width), [t + [0] * (width - len(t)) for t in tables])}
    buf.end()
    return out


@pytest.mark.parametrize("rows,width", [(1, 3), (9, 40), (13, 1)], ids=str)
def test_a_packed_step_lands_in_every_field(rows, width):
    buf = SB.StepBuffers(torch.device("cpu"), 64, 16, 64, staged=True)
    for seed in range(3):  # steps after steps: each holds its own values, shorter ones over longer ones
        for name, (view, want) in _step(buf, max(1, rows - seed % 2), width, seed).items():
            assert view.tolist() == want, name
            assert view.data_ptr() == buf.dev[name].data_ptr()  # the fixed address a graph reads


def test_a_large_step_copies_field_by_field_and_fields_not_staged_keep_their_values(monkeypatch):
    buf = SB.StepBuffers(torch.device("cpu"), 64, 16, 64, staged=True)
    buf.begin()
    buf.put("positions", [7, 8, 9])
    buf.end()
    monkeypatch.setattr(SB, "PACKED_MAX", 10)  # a table of 12 x 5 is past it
    copies = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, **k: copies.append(1) or real(t, src, **k))
    for name, (view, want) in _step(buf, 12, 5, 0).items():
        assert view.tolist() == want, name
    assert len(copies) == 4  # one per field
    assert buf.dev["positions"][:3].tolist() == [7, 8, 9]


def test_unstaged_buffers_are_the_host_buffers():
    buf = SB.StepBuffers(torch.device("cpu"), 8, 4, 4)
    assert not buf.staged and buf.host is buf.dev
    buf.begin()
    view = buf.put("fresh", [True, False, True])
    buf.end()
    assert view.dtype == torch.bool and view.tolist() == [True, False, True]


def test_an_engine_on_staged_buffers_generates_what_it_does_on_plain_ones(tiny_ckpt, monkeypatch):
    """The packed copy under a whole engine (as a CUDA device runs it), overlapped steps included: their rows
    that take the previous step's samples go over with the step's other inputs."""
    from dayzero import LLM, SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 9)]
    run = lambda llm: [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]  # noqa: E731
    want = run(LLM(str(tiny_ckpt), dtype="float32", async_scheduling=True))
    real = SB.StepBuffers.__init__
    monkeypatch.setattr(SB.StepBuffers, "__init__", lambda self, *a, **k: real(self, *a, **{**k, "staged": True}))
    packed = []
    real_end = SB.StepBuffers.end
    monkeypatch.setattr(SB.StepBuffers, "end",
                        lambda self, patch=None: packed.append(sorted(self._puts)) or real_end(self, patch))
    llm = LLM(str(tiny_ckpt), dtype="float32", async_scheduling=True)
    assert llm.engine.runner.buffers.staged
    assert run(llm) == want
    assert any("patch_rows" in names for names in packed)  # overlapped steps patched their inputs


def test_a_step_past_the_positions_the_engine_was_built_for_is_refused_on_the_host(tiny_ckpt):
    """The RoPE tables hold the engine's longest sequence: a step reaching past it (which admission never lets
    happen) stops with an error on the host, not with a device gather past the table."""
    from dayzero import LLM, SamplingParams

    llm = LLM(str(tiny_ckpt), dtype="float32", max_model_len=64)
    assert llm.engine.runner.max_positions == 64
    llm.engine.runner.max_positions = 8  # as if built for 8 positions
    with pytest.raises(RuntimeError, match="reaches position 9, past the 8 positions"):
        llm.generate([{"prompt_token_ids": list(range(3, 13))}], SamplingParams(max_tokens=2))
