"""Which activations may take fla's chunk kernel (``DAYZERO_FLA_CHUNK``): its dots multiply fp32 in TF32, so fp32
models keep the exact reference chunk form unless told otherwise."""
from __future__ import annotations

import pytest
import torch

from dayzero.ops.kda import cuda as kda_dev


@pytest.mark.parametrize("mode,bf16,fp32", [(None, True, False), ("1", True, False), ("tf32", True, True),
                                            ("0", False, False)])
def test_chunk_kernel_policy(monkeypatch, mode, bf16, fp32):
    if mode is None:
        monkeypatch.delenv("DAYZERO_FLA_CHUNK", raising=False)
    else:
        monkeypatch.setenv("DAYZERO_FLA_CHUNK", mode)
    assert kda_dev.fla_chunk_enabled(torch.bfloat16) is bf16
    assert kda_dev.fla_chunk_enabled(torch.float16) is bf16
    assert kda_dev.fla_chunk_enabled(torch.float32) is fp32


def test_fp32_prefill_says_why_it_keeps_the_reference(monkeypatch):
    from tests.ops.paged_batch import make_batch
    monkeypatch.delenv("DAYZERO_FLA_CHUNK", raising=False)
    monkeypatch.setattr(kda_dev, "_uses_fla", lambda q, pool: True)  # as if fla ran on this device
    batch = make_batch([0], [5], 16, seed=0)
    q = torch.zeros(5, 2, 8)
    why = kda_dev._kda_verify(q, q, q, q, q[..., 0], 1.0, torch.zeros(3, 2, 8, 8), batch)
    assert "TF32" in why and "DAYZERO_FLA_CHUNK=tf32" in why
    assert kda_dev._kda_verify(q.bfloat16(), q, q, q, q[..., 0], 1.0, torch.zeros(3, 2, 8, 8), batch) is None
