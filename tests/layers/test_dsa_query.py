"""MLA's query path (``MLAAttention._query``): the query latent's norm, then the heads' queries and the indexer's,
fused into one GEMM (``fused_q``) and run with the norm as one ``rms_norm_linear``, equal the norm and the two
projections apart, on the reference ops and on the device ops (the skinny kernel through Triton's interpreter)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dayzero.layers.fused import FusedLinear
from dayzero.models.registry import build_model, load_config
from dayzero.ops import registry, triton_support
from dayzero.ops.static import is_static
from tests.engine.test_device_ops_on_cpu import choose_first_blocks

DEFAULT = Path(__file__).resolve().parents[2] / "dayzero" / "assets" / "default"


def _layer():
    spec = load_config(DEFAULT)  # the bundled model: DSA layers with a query latent and an indexer
    model = build_model(spec, torch.float32, "cpu")
    attn = next(m for _, m in model.cached_layers() if getattr(m, "indexer", None) is not None)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return attn


def _apart(attn, q_a):
    c_q = attn.q_a_layernorm(q_a)
    return c_q, attn.q_b_proj(c_q), attn.indexer.wq_b(c_q)


def _recorded_with(attn, q_a, **kw):
    calls = []
    hook = lambda op, c, reason, fn, args, kwargs: calls.append((op, c, args)) or fn(*args, **kwargs)  # noqa: E731
    prev = registry.set_hook(hook)
    try:
        got = attn._query(q_a, **kw)
    finally:
        registry.set_hook(prev)
    return got, calls


@pytest.mark.parametrize("device_ops", [False, True], ids=["reference", "device"])
def test_query_projections_fused_with_the_norm_equal_them_apart(device_ops, monkeypatch):
    if device_ops and not triton_support.HAS_TRITON:
        pytest.skip("needs triton")
    attn = _layer()
    q_a = torch.randn(3, attn.q_a_layernorm.weight.shape[0], generator=torch.Generator().manual_seed(1))
    want = _apart(attn, q_a)
    if device_ops and torch.cuda.is_available():  # the kernel itself, compiled for the GPU
        attn, q_a = attn.cuda(), q_a.cuda()
    attn.process_weights_after_loading()  # (after the move: the members' weights are views of the fused one)
    assert isinstance(attn.fused_q, FusedLinear) and attn.fused_q.members == ["q_b_proj", "indexer.wq_b"]
    if device_ops:
        choose_first_blocks(monkeypatch)
        if not torch.cuda.is_available():  # through Triton's interpreter on the CPU's tensors
            monkeypatch.setattr(registry, "platform_of", lambda device: "cuda")
    got, calls = _recorded_with(attn, q_a)
    norm_calls = [(c, args) for op, c, args in calls if op == "rms_norm_linear"]
    assert len(norm_calls) == 1 and norm_calls[0][1][4] is attn.fused_q.weight  # one op: the norm and both GEMMs
    assert norm_calls[0][0] == ("cuda" if device_ops else "reference")
    assert [t.shape for t in got] == [t.shape for t in want]
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_.cpu(), w, rtol=1e-5, atol=1e-5)


def test_the_indexers_query_comes_from_the_fused_gemm(monkeypatch):
    """With ``fused_q`` the indexer's ``wq_b`` module is not called: ``_query`` gives its output, a slice of the
    fused GEMM's, which the layer passes to ``Indexer.project``."""
    attn = _layer()
    attn.process_weights_after_loading()
    monkeypatch.setattr(attn.indexer.wq_b, "forward", lambda x: pytest.fail("wq_b ran apart"))
    q_a = torch.randn(2, attn.q_a_layernorm.weight.shape[0])
    c_q, q, iq = attn._query(q_a)
    assert iq is not None and iq.shape == (2, attn.indexer.wq_b.out_features)


def test_a_step_that_selects_nothing_reads_only_the_heads_query_rows():
    """Where the step's keys are no more than topk (every key selected), ``_query`` runs the norm with
    ``q_b_proj``'s rows of the fused weight alone (a static view of it, so still read before the kernel's wait),
    and gives no indexer query."""
    attn = _layer()
    q_a = torch.randn(3, attn.q_a_layernorm.weight.shape[0], generator=torch.Generator().manual_seed(2))
    want = _apart(attn, q_a)
    attn.process_weights_after_loading()
    (c_q, q, iq), calls = _recorded_with(attn, q_a, selects=False)
    (args,) = [args for op, _, args in calls if op == "rms_norm_linear"]
    weight = args[4]
    assert weight is attn.q_b_proj.weight and is_static(weight)
    assert weight.data_ptr() == attn.fused_q.weight.data_ptr() and weight.shape[0] < attn.fused_q.weight.shape[0]
    assert iq is None
    torch.testing.assert_close(c_q, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, want[1], rtol=1e-5, atol=1e-5)
