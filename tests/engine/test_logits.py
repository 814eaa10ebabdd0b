"""``compute_logits`` with a bf16 LM head: fp32 logits of the bf16 product, accumulated in fp32. On a GPU cuBLAS
writes them in fp32 (no bf16 rounding in between); on the CPU the bf16 GEMM's output is cast."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dayzero.models.registry import build_model, load_config

DEFAULT = Path(__file__).resolve().parents[2] / "dayzero" / "assets" / "default"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_lm_head_gives_fp32_logits_of_the_bf16_product(device):
    spec = load_config(DEFAULT)
    model = build_model(spec, torch.bfloat16, device)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=g) * 0.05)
    hidden = torch.randn(3, spec.hidden_size, generator=g).to(torch.bfloat16).to(device)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    want = hidden.double() @ model.lm_head.weight.double().t()  # the bf16 operands' exact product
    assert logits.dtype == torch.float32 and logits.shape == (3, spec.vocab_size)
    # fp32 logits carry the fp32 sum's error alone; the CPU's bf16 GEMM output is rounded to bf16 before its cast
    tol = 1e-5 if device == "cuda" else 8e-3
    torch.testing.assert_close(logits.double(), want, rtol=tol, atol=tol)
