"""The fused Triton kernels (norms, short conv) against the references: on the CPU through Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), on the GPU compiled."""
from __future__ import annotations

import pytest
import torch

from dayzero.ops.kda import reference as kda_ref
from dayzero.ops.norm import reference as norm_ref
from dayzero.ops.triton_support import triton_refusal
from tests.ops.paged_batch import make_batch, on_device

pytest.importorskip("triton")
from dayzero.ops.kda.conv_kernels import causal_conv1d_pooled_triton, conv_refusal  # noqa: E402
from dayzero.ops.norm import kernels as norm_k  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def close(a, b, tol):
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


def test_the_kernels_can_run_here():
    assert triton_refusal(torch.zeros(1, device=DEV)) is None


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 64), (7, 48), (3, 4, 32), (5, 300)], ids=str)
@pytest.mark.parametrize("mode", ["plain", "residual", "no_weight"])
def test_rms_norm_matches_the_reference(dtype, tol, shape, mode):
    x, w = rand(*shape, dtype=dtype, seed=1), rand(shape[-1], dtype=dtype, seed=2)
    res = rand(*shape, dtype=dtype, seed=3) if mode == "residual" else None
    w = None if mode == "no_weight" else w
    y, r = norm_k.rms_norm(x, w, 1e-6, res)
    y_ref, r_ref = norm_ref.rms_norm(x, w, 1e-6, res)
    close(y, y_ref, tol)
    close(r, r_ref, 0 if dtype == torch.float32 else tol)


def test_rms_norm_reads_strided_rows_and_refuses_what_it_cannot_view():
    x = rand(6, 80, seed=4)
    y, _ = norm_k.rms_norm(x[:, :64], rand(64, seed=5), 1e-6)  # rows 80 apart: a view, no copy
    close(y, norm_ref.rms_norm(x[:, :64], rand(64, seed=5), 1e-6)[0], 1e-5)
    assert "contiguous" in norm_k._verify_rms(x.t(), None, 1e-6)
    assert "wider" in norm_k._verify_rms(torch.zeros(1, norm_k.MAX_WIDTH + 1, device=DEV), None, 1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gated_rms_norm_matches_the_reference(dtype, tol):
    x, g, w = rand(5, 3, 32, dtype=dtype, seed=6), rand(5, 3, 32, dtype=dtype, seed=7), rand(32, seed=8)
    close(norm_k.rms_norm_gated(x, w, g, 1e-6), norm_ref.rms_norm_gated(x, w, g, 1e-6), tol)


def test_empty_rows():
    x = torch.zeros(0, 16, device=DEV)
    y, r = norm_k.rms_norm(x, None, 1e-6, x)
    assert y.shape == (0, 16) and r.shape == (0, 16)


# prefill chunks of fresh and continuing sequences (lengths across the 16-token tile and below W-1), decode steps
CONV_STEPS = {"decode": ([3, 0, 9], [1, 1, 1]), "decode_padded": ([5, 2], [1, 1]),
              "prefill": ([0, 0, 4, 7], [21, 2, 1, 16]), "mixed": ([2, 0, 6], [1, 33, 3])}


@pytest.mark.parametrize("step", list(CONV_STEPS), ids=list(CONV_STEPS))
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("W", [4, 2])
def test_conv_matches_the_reference_and_updates_the_pool(step, activation, W):
    starts, news = CONV_STEPS[step]
    batch = make_batch(starts, news, 4, seed=9, pad_rows=2 if step == "decode_padded" else 0)
    C = 40  # not a multiple of the channel block
    pool = rand(17, C, W - 1, seed=10)
    x, w = rand(batch.num_tokens, C, seed=11), rand(C, 1, W, seed=12)
    batch = on_device(batch, DEV)
    ours = pool.clone()
    y = causal_conv1d_pooled_triton(x, w, ours, batch, activation)
    y_ref = kda_ref.causal_conv1d_pooled(x, w, pool, batch, activation)
    real = slice(0, batch.num_tokens - (2 if step == "decode_padded" else 0))
    close(y[real], y_ref[real], 1e-5)
    keep = torch.ones(17, dtype=torch.bool)
    keep[0] = False  # the null slot of padding rows holds whatever they wrote
    close(ours[keep], pool[keep], 1e-6)


@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_conv_in_groups_from_strided_rows(step):
    """Three equal channel groups (KDA's q, k, v) read from a column slice of wider rows (the fused projection's
    output) and written group by group: the ungrouped output's columns, and the same pool updates."""
    starts, news = CONV_STEPS[step]
    batch = on_device(make_batch(starts, news, 4, seed=13), DEV)
    C, W = 3 * 24, 4
    pool = rand(17, C, W - 1, seed=14)
    wide = rand(batch.num_tokens, C + 10, seed=15)
    x, w = wide[:, 2:2 + C], rand(C, 1, W, seed=16)  # rows strided by C + 10
    ours, theirs = pool.clone(), pool.clone()
    y = causal_conv1d_pooled_triton(x, w, ours, batch, "silu", groups=3)
    assert y.shape == (3, batch.num_tokens, C // 3) and y.is_contiguous()
    want = kda_ref.causal_conv1d_pooled(x.contiguous(), w, theirs, batch, "silu")
    close(y, want.view(-1, 3, C // 3).transpose(0, 1), 1e-5)
    close(ours, theirs, 1e-6)
    close(kda_ref.causal_conv1d_pooled(x, w, pool.clone(), batch, "silu", groups=3), y, 1e-5)
    assert "groups" in conv_refusal(x, w, pool, groups=5)


@pytest.mark.parametrize("step", ["decode", "decode_padded", "mixed"])
def test_conv_zeroes_the_fresh_sequences_states_in_the_same_launch(step):
    """With the layer's state pool to reset, the programs of each fresh sequence zero its slot there (a share
    each; a slot larger than the programs' tiles); other slots keep their states; the conv itself is unchanged."""
    starts, news = CONV_STEPS[step]
    batch = on_device(make_batch(starts, news, 4, seed=17, pad_rows=2 if step == "decode_padded" else 0), DEV)
    C, W = 40, 4
    pool, states = rand(17, C, W - 1, seed=18), rand(17, 3, 20, 30, seed=19)  # 1,800 floats a slot: two tiles
    x, w = rand(batch.num_tokens, C, seed=20), rand(C, 1, W, seed=21)
    ours, theirs = states.clone(), states.clone()
    y = causal_conv1d_pooled_triton(x, w, pool.clone(), batch, "silu", reset=ours)
    close(y, causal_conv1d_pooled_triton(x, w, pool.clone(), batch, "silu"), 0.0)
    kda_ref.causal_conv1d_pooled(x, w, pool.clone(), batch, "silu", reset=theirs)
    fresh = {int(s) for s, f in zip(batch.state_slots.tolist(), batch.fresh.tolist()) if f}
    assert torch.equal(ours[1:], theirs[1:])  # (the reference also zeroes the null slot 0)
    if step == "decode_padded":  # its sequences continue; its padding rows start fresh in the null slot
        assert fresh == {0} and (ours[0] == 0).all()
    else:
        assert fresh - {0}
    for slot in range(1, 17):
        assert (ours[slot] == 0).all() if slot in fresh else torch.equal(ours[slot], states[slot]), slot
    assert "contiguous slots" in conv_refusal(x, w, pool, reset=states.transpose(2, 3))


def test_conv_refuses_with_a_reason():
    x = torch.zeros(3, 8, device=DEV)
    assert conv_refusal(x, torch.zeros(8, 4), torch.zeros(4, 8, 3, device=DEV)) is None
    assert "taps" in conv_refusal(x, torch.zeros(8, 20), torch.zeros(4, 8, 19, device=DEV))
    assert "contiguous" in conv_refusal(x.t(), torch.zeros(3, 4), torch.zeros(4, 3, 3, device=DEV))


from dayzero.ops.activation import kernels as act_k  # noqa: E402
from dayzero.ops.activation import reference as act_ref  # noqa: E402
from dayzero.ops.kda import gate_kernels as gate_k  # noqa: E402
from dayzero.ops.moe import reference as moe_ref  # noqa: E402
from dayzero.ops.moe import route_kernels as route_k  # noqa: E402
from dayzero.ops.rotary import kernels as rope_k  # noqa: E402
from dayzero.ops.rotary import reference as rope_ref  # noqa: E402


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rotary_matches_the_reference(interleaved, dtype, tol):
    x = rand(5, 3, 24, dtype=dtype, seed=13)  # half = 12: not a power of two
    ang = rand(5, 12, seed=14)
    cos, sin = ang.cos(), ang.sin()
    close(rope_k.apply_rotary(x, cos, sin, interleaved), rope_ref.apply_rotary(x, cos, sin, interleaved), tol)
    part = rand(5, 3, 40, dtype=dtype, seed=15)[..., 16:]  # the rotated tail of wider heads: a strided view
    close(rope_k.apply_rotary(part, cos, sin, interleaved), rope_ref.apply_rotary(part, cos, sin, interleaved), tol)
    wide = rand(5, 3, 40, dtype=dtype, seed=16)
    for start in (0, 5, 16):  # the first 24 channels, a middle run, the last 24: the others pass through unchanged
        got = rope_k.apply_rotary(wide, cos, sin, interleaved, start=start)
        close(got, rope_ref.apply_rotary(wide, cos, sin, interleaved, start=start), tol)
        keep = torch.ones(40, dtype=torch.bool)
        keep[start:start + 24] = False
        assert torch.equal(got[..., keep], wide[..., keep])
    assert "inside it" in rope_k.refusal(wide, cos, sin, interleaved, start=17)


@pytest.mark.parametrize("name,limit", [("silu", None), ("silu", 0.5), ("relu2", None), ("swiglu_oai", None)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_activations_match_the_reference(name, limit, dtype, tol):
    x = rand(7, 3, 2 * 40, dtype=dtype, seed=16)
    if name == "silu":
        close(act_k.silu_and_mul(x, limit), act_ref.silu_and_mul(x, limit), tol)
    elif name == "relu2":
        close(act_k.relu2(x), act_ref.relu2(x), tol)
    else:
        close(act_k.swiglu_oai(x), act_ref.swiglu_oai(x), tol)


@pytest.mark.parametrize("kind", ["per channel", "per head", "interleaved with q"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_sigmoid_gate_matches_the_reference(kind, dtype, tol):
    x = rand(6, 3, 40, dtype=dtype, seed=20)
    if kind == "per channel":  # a column slice of a fused projection's rows
        gate = rand(6, 3 * 40 + 8, dtype=dtype, seed=21)[:, 8:].view(6, 3, 40)
    elif kind == "per head":
        gate = rand(6, 3, dtype=dtype, seed=22)[:, :, None]
    else:  # GQA's q_proj rows [q | gate] per head
        gate = rand(6, 3, 80, dtype=dtype, seed=23).chunk(2, dim=-1)[1]
    assert act_k._gate_refusal(x, gate) is None
    close(act_k.sigmoid_gate(x, gate), act_ref.sigmoid_gate(x, gate), tol)
    assert "[T, H, 1]" in act_k._gate_refusal(x, gate[:, :2])


@pytest.mark.parametrize("name", ["silu", "relu2"])
def test_device_mlp_matches_the_reference_in_bf16(name):
    D, I = 64, 48
    x = rand(9, D, dtype=torch.bfloat16, seed=17)
    w1 = (rand(I * (2 if name == "silu" else 1), D, seed=18) * D**-0.5).bfloat16()
    w2 = (rand(D, I, seed=19) * I**-0.5).bfloat16()
    assert act_k._verify_mlp(x, w1, w2, name) is None
    close(act_k.dense_mlp(x, w1, w2, name), moe_ref.dense_mlp(x, w1, w2, name), 3e-2)
    assert "fp32" in act_k._verify_mlp(x.float(), w1.float(), w2.float(), name)


@pytest.mark.parametrize("lower", [None, -5.0])
def test_kda_gate_matches_the_reference(lower):
    f = rand(6, 3, 16, dtype=torch.bfloat16, seed=20) * 4
    A, bias = rand(3, seed=21), rand(48, seed=22)
    close(gate_k.kda_gate(f, A, bias, lower), kda_ref.kda_gate(f, A, bias, lower), 1e-5)
    a = rand(6, 3, seed=23).reshape(6, 3, 1)  # Gated DeltaNet: one gate per head
    close(gate_k.kda_gate(a, A, rand(3, seed=24)), kda_ref.kda_gate(a, A, rand(3, seed=24)), 1e-5)


ROUTES = {"v3": dict(E=64, k=8, G=8, TG=4, bias=True), "flat": dict(E=40, k=4, G=1, TG=1, bias=False),
          "v4": dict(E=48, k=8, G=1, TG=1, bias=True, kind="sqrtsoftplus"),
          "one": dict(E=16, k=1, G=4, TG=2, bias=True),
          "wide": dict(E=256, k=8, G=8, TG=4, bias=True),  # past RANK_MAX: arg-max passes
          "ranked": dict(E=128, k=8, G=1, TG=1, bias=True)}  # the widest one comparison takes


@pytest.mark.parametrize("case", list(ROUTES), ids=list(ROUTES))
@pytest.mark.parametrize("norm", [True, False])
def test_routing_picks_the_references_experts(case, norm):
    c = ROUTES[case]
    logits = rand(33, c["E"], seed=25) * 3
    bias = rand(c["E"], seed=26) * 0.1 if c["bias"] else None
    args = (logits, c["k"], c.get("kind", "sigmoid"), bias, c["G"], c["TG"], norm, 2.5)
    assert route_k.route_refusal(*args) is None
    w, ids = route_k.route(*args)
    w_ref, ids_ref = moe_ref.route(*args)
    assert torch.equal(ids.sort(-1).values, ids_ref.sort(-1).values)
    close(w.gather(1, ids.argsort(-1)), w_ref.gather(1, ids_ref.argsort(-1)), 1e-5)


@pytest.mark.parametrize("E", [16, 256])  # one comparison, arg-max passes
def test_routing_ties_go_to_the_lower_expert_id(E):
    logits = torch.zeros(3, E, device=DEV)
    logits[1, E // 2:] = 1.0  # the upper half ahead, tied among themselves
    w, ids = route_k.route(logits, 4, "sigmoid", None, 2, 1, True, 1.0)
    assert ids.tolist() == [[0, 1, 2, 3], [E // 2, E // 2 + 1, E // 2 + 2, E // 2 + 3], [0, 1, 2, 3]]
    close(w, torch.full_like(w, 0.25), 1e-6)


@pytest.mark.parametrize("E,G,TG", [(16, 1, 1), (16, 4, 2), (256, 8, 4)])  # one comparison, with groups, arg-max
def test_nan_scores_rank_last_and_every_rank_goes_to_one_expert(E, G, TG):
    logits = rand(3, E, seed=34) * 3
    logits[0, [1, 5, E - 1]] = float("nan")
    logits[1] = float("nan")  # a token whose every score is NaN
    w, ids = route_k.route(logits, 8, "sigmoid", None, G, TG, True, 1.0)
    assert ((ids >= 0) & (ids < E)).all()
    assert all(len(set(row)) == 8 for row in ids.tolist())  # K distinct experts for every token
    if G == 1:  # the numbers come first (in groups, a kept group's NaN expert may still be needed)
        assert not {1, 5, E - 1} & set(ids[0].tolist())
    for t in (0, 2):  # the tokens with numbers route as the reference with NaN taken as last
        fixed = logits[t:t + 1].nan_to_num(-1e30)
        w_ref, ids_ref = moe_ref.route(fixed, 8, "sigmoid", None, G, TG, True, 1.0)
        assert torch.equal(ids[t:t + 1].sort(-1).values, ids_ref.sort(-1).values)


def test_routing_refuses_what_the_kernel_does_not_take():
    logits = rand(4, 16, seed=27)
    assert "softmax" in route_k.route_refusal(logits, 2, "softmax")
    assert "fixed" in route_k.route_refusal(logits, 2, "sigmoid", fixed_ids=torch.zeros(4, 2, dtype=torch.long))
    assert "power of two" in route_k.route_refusal(logits, 3, "sigmoid")


from dayzero.ops.moe import unpermute_kernels as unperm_k  # noqa: E402


@pytest.mark.parametrize("mode", ["both", "none", "bias_only"])
def test_layer_norm_matches_the_reference(mode):
    x = rand(7, 3, 40, dtype=torch.bfloat16, seed=28) * 3 + 1
    w = rand(40, seed=29) if mode == "both" else None
    b = rand(40, seed=30) if mode != "none" else None
    close(norm_k.layer_norm(x, w, b, 1e-5), norm_ref.layer_norm(x, w, b, 1e-5), 2e-2)
    xf = x.float()
    close(norm_k.layer_norm(xf, w, b, 1e-5), norm_ref.layer_norm(xf, w, b, 1e-5), 1e-5)


@pytest.mark.parametrize("T,k,E", [(9, 4, 6), (1, 8, 16), (0, 2, 4)])
def test_unpermute_matches_the_reference(T, k, E):
    ids = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(31)).to(DEV)
    weights = rand(T, k, seed=32).abs()
    order, _ = moe_ref.permute(ids, E)
    ys = rand(T * k, 40, seed=33)
    assert unperm_k.refusal(ys, order, weights, T) is None
    close(unperm_k.unpermute(ys, order, weights, T), moe_ref.unpermute(ys, order, weights, T), 1e-5)
    yb = ys.bfloat16()
    close(unperm_k.unpermute(yb, order, weights, T), moe_ref.unpermute(yb, order, weights, T), 2e-2)


from dayzero.quant import convert_kernels as conv_k  # noqa: E402
from dayzero.quant import workspace as ws_mod  # noqa: E402


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", [5, 50], ids=["one-program", "several-programs"])
def test_mxfp4_conversion_kernel_equals_the_pytorch_conversion(fp8, rows):
    g = torch.Generator().manual_seed(34)
    blocks = torch.randint(0, 256, (3, rows, 4, 16), generator=g, dtype=torch.uint8).to(DEV)
    scales = torch.randint(100, 140, (3, rows, 4), generator=g, dtype=torch.uint8)
    scales[0, 0, 0], scales[2, 4, 1] = 0xFF, 127  # NaN, and 1.0
    scales = scales.to(DEV)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    ours = torch.empty(3, rows, 128, dtype=dtype, device=DEV)
    want = torch.empty(3, rows, 128, dtype=dtype, device=DEV)
    s_ours = torch.empty(3, rows, 4, device=DEV) if fp8 else None
    s_want = torch.empty(3, rows, 4, device=DEV) if fp8 else None
    assert conv_k.convert_refusal(blocks, scales, ours, s_ours) is None
    conv_k.convert_mxfp4(blocks, scales, ours, s_ours)
    ws_mod._convert_torch(blocks, scales, want, s_want)
    assert torch.equal(ours.float().nan_to_num(7.0), want.float().nan_to_num(7.0))
    if fp8:
        assert torch.equal(s_ours.nan_to_num(7.0), s_want.nan_to_num(7.0))
