"""The direct (unsorted) routed-expert kernels of few-pair steps against the reference ``moe_experts``.

On the CPU they run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at tiny shapes: every
activation, biases, the clamp, every weight format, odd widths, experts hit by several pairs (of one token too, as
hash routing can), and the load counters. Scratch and output buffers start as NaN. On a CUDA device the same
checks run, and the CUDA ``moe_experts`` op is checked on both of its paths and inside a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

from dayzero.ops.moe import cuda as moe_cuda
from dayzero.ops.moe import direct_kernels as D
from dayzero.ops.moe import triton_moe
from dayzero.ops.moe import reference
from dayzero.ops import triton_support
from tests.ops.test_moe_triton import TOL, scaled_randn, to_format

pytestmark = [pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton"),
              pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(triton_moe, "new_buffer", lambda r, c, like: torch.full((r, c), float("nan"), dtype=like.dtype, device=like.device))


def case(T, k, E, L, I, activation="silu", fmt="plain", dtype=torch.float32, bias=False, seed=0, repeats=False):
    g = torch.Generator(DEV).manual_seed(seed)
    r = 1 if activation == "relu2" else 2
    x = torch.randn(T, L, generator=g, device=DEV).to(dtype)
    if repeats:  # any ids, a token's k included (hash routing may pick one expert twice)
        ids = torch.randint(0, E, (T, k), generator=g, device=DEV)
    else:
        ids = torch.rand(T, E, generator=g, device=DEV).topk(k, dim=-1).indices
    weights = torch.rand(T, k, generator=g, device=DEV)
    w1 = to_format(scaled_randn(E, r * I, L, g=g), fmt, dtype)
    w2 = to_format(scaled_randn(E, L, I, g=g), fmt, dtype)
    b1, b2 = (torch.randn(E, r * I, generator=g, device=DEV), torch.randn(E, L, generator=g, device=DEV)) if bias else (None, None)
    return x, ids, weights, w1, w2, b1, b2


def check(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape and torch.isfinite(out).all()
    o, r = out.float(), ref.float()
    scale = r.abs().max().clamp(min=1e-6)
    assert (o - r).abs().max() / scale < TOL[dtype], f"max-abs error {(o - r).abs().max() / scale:.2e}"
    assert (o - r).norm() / r.norm().clamp(min=1e-6) < TOL[dtype]


def run(T, k, E, L, I, activation="silu", fmt="plain", dtype=torch.float32, bias=False, limit=None, seed=0,
        repeats=False, block=None):
    x, ids, weights, w1, w2, b1, b2 = case(T, k, E, L, I, activation, fmt, dtype, bias, seed, repeats)
    assert D.refusal(x, ids, weights, w1, w2, activation, b1, b2, limit, max_pairs=64) is None
    load, want_load = torch.full((E,), 5, dtype=torch.int64, device=DEV), torch.full((E,), 5, dtype=torch.int64, device=DEV)
    out = D.moe_experts_direct(x, ids, weights, w1, w2, activation, b1, b2, limit, load, block=block)
    ref = reference.grouped_experts(x, ids, weights, w1, w2, activation, b1, b2, limit, load=want_load)
    check(out, ref, dtype)
    assert torch.equal(load, want_load)  # the sorted path's running row ends, raised from where they were


ACTS = [("silu", False, None), ("silu", True, 0.7), ("relu2", True, None), ("swiglu_oai", True, None)]


@pytest.mark.parametrize("activation,bias,limit", ACTS, ids=str)
@pytest.mark.parametrize("T,k,E,L,I", [(1, 2, 6, 48, 40), (3, 3, 9, 37, 24)], ids=str)
def test_plain_fp32_matches_reference(T, k, E, L, I, activation, bias, limit):
    run(T, k, E, L, I, activation, bias=bias, limit=limit)


@pytest.mark.parametrize("activation", ["silu", "relu2", "swiglu_oai"])
def test_plain_bf16_matches_reference(activation):
    run(2, 4, 8, 64, 32, activation, dtype=torch.bfloat16, bias=True)


@pytest.mark.parametrize("fmt,L,I", [("fp8_tile", 160, 96), ("fp8_block", 64, 32), ("mxfp4", 96, 64),
                                     ("fp8_tile_a8", 160, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantised_weights_match_reference(fmt, L, I, dtype):
    """fp8_tile at L=160, I=96 crosses 128-tiles along n (gate/up rows) and k; K steps of 32 make MXFP4 and the
    32-block FP8 take several scale blocks; FP8 activations take K steps of one 128-wide group (the last one
    partial)."""
    block = ((16, 128), (8, 128)) if fmt == "fp8_tile_a8" else ((16, 32), (8, 32))
    run(2, 2, 5, L, I, "silu", fmt, dtype, bias=True, block=block)
    run(1, 3, 5, L, I, "swiglu_oai", fmt, dtype)


def test_fp8_activations_refuse_k_steps_other_than_one_group():
    x, ids, weights, w1, w2, _, _ = case(1, 2, 4, 256, 64, fmt="fp8_tile_a8")
    with pytest.raises(ValueError, match="K steps of 128"):
        D.moe_experts_direct(x, ids, weights, w1, w2, block=((8, 64), (8, 128)))


def test_repeated_experts_and_one_token_choosing_one_twice():
    run(5, 3, 4, 32, 32, "silu", bias=True, repeats=True, seed=3)


@pytest.mark.parametrize("block", [((4, 32), (1, 32)), ((64, 512), (32, 128)), ((8, 64), (16, 64))], ids=str)
def test_block_sizes(block):
    run(2, 3, 7, 72, 40, "silu", bias=True, block=block)


def test_blocks_fill_the_device_and_fit_the_formats():
    for rows, width, depth, fmt in ((8, 512, 512, "bfloat16"), (1, 512, 512, "bfloat16"), (64, 2048, 7168, "bfloat16"),
                                    (1, 7168, 2048, "fp8_tile"), (3, 40, 24, "mxfp4")):
        bn, bk = D.blocks(rows, width, depth, 264, fmt)
        assert rows * -(-width // bn) >= 264 or bn == 4 or bn >= width  # enough programs, or as narrow as allowed
        assert bn * bk <= D.TILE_ELEMS and bk >= 32 and bk & (bk - 1) == 0
        assert fmt in D.PLAIN or 128 % bk == 0  # quantised: a K step within one 128-tile, at most 4 blocks
    assert D.blocks(64, 2048, 7168, 264, "bfloat16")[0] == 64  # many programs already: the widest blocks
    for tokens, k, width, depth, fmt in ((1, 8, 512, 512, "bfloat16"), (4, 8, 7168, 2048, "fp8_tile"), (2, 22, 64, 96, "mxfp4")):
        bn, bk = D.down_blocks(tokens, k, width, depth, 264, fmt)
        kp = 1 << (k - 1).bit_length()
        assert tokens * -(-width // bn) >= 264 or bn == 1 or bn * kp == 256
        assert kp * bn <= 256 and kp * bn * bk <= 2 * D.TILE_ELEMS and bk >= 32
        assert fmt in D.PLAIN or 128 % bk == 0


def test_token_rows_read_from_a_wider_projection():
    """The latent rows of LatentMoE are a column slice of the fused input projection's output (row stride wider
    than the row): read in place, the same as from a contiguous copy."""
    x, ids, weights, w1, w2, b1, b2 = case(3, 2, 5, 40, 32, bias=True, seed=4)
    wide = torch.cat((x, torch.full_like(x[:, :24], float("nan"))), dim=1)[:, :40]  # NaN past each row
    assert wide.stride(0) == 64 and D.refusal(wide, ids, weights, w1, w2, "silu", b1, b2) is None
    out = D.moe_experts_direct(wide, ids, weights, w1, w2, "silu", b1, b2)
    assert torch.equal(out, D.moe_experts_direct(x, ids, weights, w1, w2, "silu", b1, b2))


def test_no_tokens():
    x, ids, weights, w1, w2, _, _ = case(1, 2, 4, 32, 32)
    out = D.moe_experts_direct(x[:0], ids[:0], weights[:0], w1, w2)
    assert out.shape == (0, 32)


def test_refusals_name_the_reason():
    x, ids, weights, w1, w2, b1, b2 = case(3, 2, 4, 32, 32)
    assert D.refusal(x, ids, weights, w1, w2) is None
    assert D.direct_max_pairs(4) == 8 and D.direct_max_pairs(64) == 32
    assert "past 8" in D.refusal(x.repeat(2, 1), ids.repeat(2, 1), weights.repeat(2, 1), w1, w2)  # 12 pairs
    assert D.refusal(x.repeat(2, 1), ids.repeat(2, 1), weights.repeat(2, 1), w1, w2, max_pairs=12) is None
    assert "contiguous columns" in D.refusal(x.t().contiguous().t(), ids, weights, w1, w2)
    assert "integer" in D.refusal(x, ids.float(), weights, w1, w2)
    assert "activation" in D.refusal(x, ids, weights, w1, w2, "gelu")
    assert "reference" in D.refusal(x, ids[:2], weights, w1, w2)
    packed = to_format(w1.float(), "mxfp4", torch.float32), to_format(w2.float(), "mxfp4", torch.float32)
    assert D.refusal(x, ids, weights, *packed) is None


@pytest.mark.parametrize("fmt", ["fp8_tile", "mxfp4"])
def test_quantised_k_steps_stay_within_a_tile(fmt):
    """A K step past one 128-column tile would apply one tile's scale to the next (FP8 tiles) and gave wrong MXFP4
    rows on the H200: a block override asking for one is refused, the default never does."""
    x, ids, weights, w1, w2, _, _ = case(1, 2, 4, 256, 64, fmt=fmt)
    with pytest.raises(ValueError, match="at most 128"):
        D.moe_experts_direct(x, ids, weights, w1, w2, block=((8, 256), (8, 128)))
    check(D.moe_experts_direct(x, ids, weights, w1, w2), reference.grouped_experts(x, ids, weights, w1, w2), torch.float32)


def test_cuda_op_takes_the_direct_path_for_few_pairs_and_the_sort_for_many(monkeypatch):
    x, ids, weights, w1, w2, b1, b2 = case(9, 2, 8, 32, 32, bias=True, seed=5)
    taken = []
    real = D.moe_experts_direct
    monkeypatch.setattr(D, "moe_experts_direct", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    for T in (4, 9):  # 8 pairs (direct), 18 (past direct_max_pairs(8) = 8: sorted)
        load, want = torch.zeros(8, dtype=torch.int64, device=DEV), torch.zeros(8, dtype=torch.int64, device=DEV)
        out = moe_cuda.grouped_experts(x[:T], ids[:T], weights[:T], w1, w2, "silu", b1, b2, load=load)
        check(out, reference.grouped_experts(x[:T], ids[:T], weights[:T], w1, w2, "silu", b1, b2, load=want), torch.float32)
        assert torch.equal(load, want)
    assert taken == [1]


ROUTINGS = {  # E, (top_k, kind, correction bias, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    "v3": (64, (8, "sigmoid", True, 8, 4, True, 2.5)), "flat": (12, (2, "sigmoid", False, 1, 1, False, 1.0)),
    "v4": (48, (4, "sqrtsoftplus", True, 1, 1, True, 1.5)), "odd": (12, (2, "sigmoid", True, 3, 2, True, 1.0)),
    "wide": (256, (8, "sigmoid", True, 8, 4, True, 2.5)),  # past route_kernels.RANK_MAX: arg-max passes
}


def routing_case(name, T, seed=0):
    E, (k, kind, corr, G, TG, norm, scale) = ROUTINGS[name]
    g = torch.Generator(DEV).manual_seed(100 + seed)
    logits = 3 * torch.randn(T, E, generator=g, device=DEV)
    bias = 0.1 * torch.randn(E, generator=g, device=DEV) if corr else None
    return logits, (k, kind, bias, G, TG, norm, scale)


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("T", [1, 3])
def test_routing_inside_the_first_kernel_matches_the_route_then_the_experts(name, T):
    logits, routing = routing_case(name, T, seed=T)
    E, k = logits.shape[1], routing[0]
    x, _, _, w1, w2, b1, b2 = case(T, k, E, 24, 20, bias=True, seed=T)
    assert D.routed_refusal(x, routing, w1, w2, "silu", b1, b2, max_pairs=64) is None
    load, want_load = (torch.full((E,), 3, dtype=torch.int64, device=DEV) for _ in range(2))
    out, weights, ids = D.moe_experts_routed(x, logits, routing, w1, w2, "silu", b1, b2, None, load)
    w_ref, ids_ref = reference.route(logits, *routing)
    assert torch.equal(ids, ids_ref)  # best first, as the reference's sorted top-k gives them
    torch.testing.assert_close(weights, w_ref, rtol=1e-5, atol=1e-7)
    check(out, reference.grouped_experts(x, ids_ref, w_ref, w1, w2, "silu", b1, b2, load=want_load), torch.float32)
    assert torch.equal(load, want_load)


@pytest.mark.parametrize("name", ["v3", "odd", "wide"])
@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("blocks", [None, ((8, 32), (4, 32))])  # the default's one K step, or several
def test_routing_before_the_wait_matches_routing_after_it(name, activation, blocks, monkeypatch):
    """``early``: logits written two kernels back are routed before the wait, and the expert's first weight step
    of a model weight read too (PRELOAD); the second kernel ranks its slots' experts before its own wait and
    reads their first step too. The same ids, weights, rows and load counters as routing after it."""
    from dayzero.ops.static import mark_static

    T = 2
    logits, routing = routing_case(name, T, seed=3)
    E, k = logits.shape[1], routing[0]
    x, _, _, w1, w2, b1, b2 = case(T, k, E, 40, 72, activation, bias=True, seed=8)
    mark_static(w1), mark_static(w2)
    monkeypatch.setattr(D, "DOWN_EARLY_ROWS", 1)
    up, down = [], []
    monkeypatch.setattr(D, "_direct_up_kernel", _Spy(D._direct_up_kernel, up))
    monkeypatch.setattr(D, "_direct_down_kernel", _Spy(D._direct_down_kernel, down))
    outs = []
    for early in (False, True):
        load = torch.zeros(E, dtype=torch.int64, device=DEV)
        outs.append((*D.moe_experts_routed(x, logits, routing, w1, w2, activation, b1, b2, None, load, blocks,
                                           early=early), load))
    assert up == down == [(False, False), (True, True)]  # (EARLY, PRELOAD) of each launch
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    w_ref, ids_ref = reference.route(logits, *routing)
    assert torch.equal(outs[1][2], ids_ref)
    check(outs[1][0], reference.grouped_experts(x, ids_ref, w_ref, w1, w2, activation, b1, b2), torch.float32)


def test_the_second_kernel_ranks_early_from_its_token_count(monkeypatch):
    """Below ``DOWN_EARLY_ROWS`` tokens only the first kernel routes early; from it the second ranks early too."""
    from dayzero.ops.static import mark_static

    logits, routing = routing_case("v3", D.DOWN_EARLY_ROWS, seed=4)
    E, k = logits.shape[1], routing[0]
    x, _, _, w1, w2, _, _ = case(D.DOWN_EARLY_ROWS, k, E, 24, 20, seed=9)
    mark_static(w1), mark_static(w2)
    down = []
    monkeypatch.setattr(D, "_direct_down_kernel", _Spy(D._direct_down_kernel, down))
    for T in (D.DOWN_EARLY_ROWS - 1, D.DOWN_EARLY_ROWS):
        D.moe_experts_routed(x[:T], logits[:T], routing, w1, w2, early=True)
    assert down == [(False, False), (True, True)]


def test_the_early_first_kernel_takes_wider_column_blocks(monkeypatch):
    """Routed early, the first kernel's column blocks are at least ``EARLY_MIN_COLS`` wide where the rule of about
    two programs an SM would make them narrower; routed late they keep that rule. The rows are the same."""
    from dayzero.ops.static import mark_static

    assert D.blocks(8, 512, 512, 264, "bfloat16") == (8, 512)  # dayzero-small at one token
    assert D.blocks(8, 512, 512, 264, "bfloat16", least=D.EARLY_MIN_COLS) == (16, 256)
    monkeypatch.setattr(D, "_programs_wanted", lambda device: 130)
    logits, routing = routing_case("v3", 1, seed=6)
    E, k = logits.shape[1], routing[0]
    x, _, _, w1, w2, _, _ = case(1, k, E, 24, 64, seed=9)
    mark_static(w1), mark_static(w2)
    widths, outs = [], []
    real = D._direct_up_kernel

    class Widths(_Spy):
        def __getitem__(self, grid):
            widths.append(grid[1])
            return real[grid]

    monkeypatch.setattr(D, "_direct_up_kernel", Widths(real, []))
    for early in (False, True):
        outs.append(D.moe_experts_routed(x, logits, routing, w1, w2, early=early))
    assert widths == [64 // 4, 64 // D.EARLY_MIN_COLS]  # column blocks a pair: 4 wide late, 16 early
    check(outs[1][0], outs[0][0], torch.float32)
    assert torch.equal(outs[1][2], outs[0][2])


def test_early_routing_of_nan_logits_reads_the_experts_the_first_kernel_wrote(monkeypatch):
    """NaN logits routed early: the second kernel's own ranking gives the ids the first kernel wrote (in range),
    so its weights and ids are those of routing after the wait, and its rows those rows."""
    from dayzero.ops.static import mark_static

    logits, routing = routing_case("v3", 2, seed=5)
    logits[0, 3] = logits[0, 9] = float("nan")
    E, k = logits.shape[1], routing[0]
    x, _, _, w1, w2, _, _ = case(2, k, E, 24, 20, seed=9)
    mark_static(w1), mark_static(w2)
    monkeypatch.setattr(D, "DOWN_EARLY_ROWS", 1)
    late, early = (D.moe_experts_routed(x, logits, routing, w1, w2, early=e) for e in (False, True))
    assert ((early[2] >= 0) & (early[2] < E)).all()
    for a, b in zip(late[1:], early[1:]):  # the same weights and ids
        assert torch.equal(a, b)
    check(early[0], late[0], torch.float32)  # the same rows (on a GPU the two launches may sum in another order)


class _Spy:
    """A kernel launcher that records each launch's (EARLY, PRELOAD) and then launches."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append((kwargs.get("EARLY", False), kwargs.get("PRELOAD", False)))
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_cuda_routed_op_with_logits_computed_ahead(monkeypatch):
    """Logits given (a layer that routes first): the op routes them early on the direct path and through
    ``moe_route`` on the sorted one, the same as routing its router input itself."""
    from dayzero.ops.moe.cuda import routed_experts

    E, D_ = 8, 40
    x, _, _, w1, w2, b1, b2 = case(9, 2, E, 32, 32, bias=True, seed=6)
    g = torch.Generator(DEV).manual_seed(7)
    router_in = torch.randn(9, D_, generator=g, device=DEV)
    rw, rb = torch.randn(E, D_, generator=g, device=DEV) / D_ ** 0.5, 0.1 * torch.randn(E, generator=g, device=DEV)
    routing = dict(top_k=2, kind="sigmoid", correction_bias=None, n_group=1, topk_group=1, norm_topk_prob=True,
                   routed_scaling_factor=2.0)
    early = []
    real = D.moe_experts_routed
    monkeypatch.setattr(D, "moe_experts_routed", lambda *a, **kw: early.append(kw["early"]) or real(*a, **kw))
    for T in (4, 9):  # 8 pairs (direct), 18 (sorted)
        logits = torch.nn.functional.linear(router_in[:T], rw, rb)
        load, want = torch.zeros(E, dtype=torch.int64, device=DEV), torch.zeros(E, dtype=torch.int64, device=DEV)
        out = routed_experts(router_in[:T], x[:T], rw, rb, w1, w2, "silu", b1, b2, load=load, logits=logits,
                             **routing)
        ref = routed_experts(router_in[:T], x[:T], rw, rb, w1, w2, "silu", b1, b2, load=want, **routing)
        check(out, ref, torch.float32)
        assert torch.equal(load, want)
    assert early == [True, False]


@pytest.mark.parametrize("name", ["v3", "flat"])
def test_nan_router_logits_of_one_token_leave_the_others_and_memory_alone(name):
    """A token whose router logits hold NaN (a broken checkpoint, an overflow upstream) gets ids in range, whatever
    its routing; the step's other tokens route and compute as without it."""
    logits, routing = routing_case(name, 3)
    E, k = logits.shape[1], routing[0]
    logits[1, 3] = float("nan")
    logits[1, 7] = float("nan")
    x, _, _, w1, w2, _, _ = case(3, k, E, 24, 20, seed=4)
    out, weights, ids = D.moe_experts_routed(x, logits, routing, w1, w2)
    assert ((ids >= 0) & (ids < E)).all()
    for t in (0, 2):
        w_ref, ids_ref = reference.route(logits[t:t + 1], *routing)
        assert torch.equal(ids[t:t + 1], ids_ref)
        check(out[t:t + 1], reference.grouped_experts(x[t:t + 1], ids_ref, w_ref, w1, w2), torch.float32)


def test_ids_out_of_range_read_no_other_experts_memory():
    """Ids the routing should never give (the device path does not check them on the host, as the reference does)
    are taken as the nearest expert, never as memory past the experts' weights."""
    x, ids, weights, w1, w2, _, _ = case(2, 2, 6, 24, 20, seed=5)
    bad = torch.tensor([[-3, 1], [2, 1000]], device=DEV)
    out = D.moe_experts_direct(x, bad, weights, w1, w2)
    want = reference.grouped_experts(x, bad.clamp(0, 5), weights, w1, w2)
    check(out, want, torch.float32)


def test_routing_inside_refuses_what_the_routing_kernel_does_not_take():
    logits, routing = routing_case("v3", 1)
    x, _, _, w1, w2, _, _ = case(1, 8, 64, 16, 16)
    assert "softmax" in D.routed_refusal(x, (8, "softmax", None, 1, 1, True, 1.0), w1, w2)
    assert "power of two" in D.routed_refusal(x, (3,) + routing[1:], w1, w2)
    assert "pairs" in D.routed_refusal(x.repeat(5, 1), routing, w1, w2)  # 40 pairs past direct_max_pairs(64)
    with pytest.raises(ValueError, match="logits must be fp32"):
        D.moe_experts_routed(x, logits[:, :32].contiguous(), routing, w1, w2)


def test_cuda_routed_op_routes_inside_for_few_pairs_and_apart_for_many(monkeypatch):
    from dayzero.ops.moe.cuda import routed_experts
    from dayzero.ops.moe.reference import routed_experts as reference_routed

    E, D_ = 8, 40
    x, _, _, w1, w2, b1, b2 = case(9, 2, E, 32, 32, bias=True, seed=6)
    g = torch.Generator(DEV).manual_seed(7)
    router_in = torch.randn(9, D_, generator=g, device=DEV)
    rw, rb = torch.randn(E, D_, generator=g, device=DEV) / D_ ** 0.5, 0.1 * torch.randn(E, generator=g, device=DEV)
    routing = dict(top_k=2, kind="sigmoid", correction_bias=0.1 * torch.randn(E, generator=g, device=DEV), n_group=2,
                   topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.0)
    taken = []
    real = D.moe_experts_routed
    monkeypatch.setattr(D, "moe_experts_routed", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    for T in (4, 9):  # 8 pairs (routed inside), 18 (past direct_max_pairs(8) = 8: the router, then the sort)
        load, want = torch.zeros(E, dtype=torch.int64, device=DEV), torch.zeros(E, dtype=torch.int64, device=DEV)
        out = routed_experts(router_in[:T], x[:T], rw, rb, w1, w2, "silu", b1, b2, load=load, **routing)
        ref = reference_routed(router_in[:T], x[:T], rw, rb, w1, w2, "silu", b1, b2, load=want, **routing)
        check(out, ref, torch.float32)
        assert torch.equal(load, want)
    assert taken == [1]


@cuda
@pytest.mark.parametrize("fmt", ["plain", "fp8_tile", "mxfp4", "fp8_tile_a8"])
@pytest.mark.parametrize("T,L,I", [(1, 512, 512), (4, 512, 512), (2, 2048, 768), (1, 7168, 2048)], ids=str)
def test_realistic_shapes_bf16_on_the_gpu(T, L, I, fmt):
    """At the default block sizes: against the sorted path (same roundings, so close), and against the fp32
    reference on weights without the scaled rows (whose cancellations the bf16 roundings of h would amplify).
    16 experts: with 64, the 7168 : 2048 case's fp32 reference asked for 14 GB more with 108 GB held on the H200."""
    E = 16
    x, ids, weights, w1, w2, _, _ = case(T, 8, E, L, I, "silu", fmt, torch.bfloat16, seed=T)
    assert D.refusal(x, ids, weights, w1, w2, max_pairs=32) is None
    out = D.moe_experts_direct(x, ids, weights, w1, w2)
    want = moe_cuda.sorted_experts(x, ids, weights, w1, w2)  # the same roundings: h and each row in bf16
    assert (out.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
    del w1, w2, want
    g = torch.Generator(DEV).manual_seed(T)
    w1 = to_format(0.05 * torch.randn(E, 2 * I, L, generator=g, device=DEV), fmt, torch.bfloat16)
    w2 = to_format(0.05 * torch.randn(E, L, I, generator=g, device=DEV), fmt, torch.bfloat16)
    check(D.moe_experts_direct(x, ids, weights, w1, w2), reference.grouped_experts(x, ids, weights, w1, w2), torch.bfloat16)


@cuda
def test_moe_layer_with_and_without_the_direct_path_on_the_gpu(monkeypatch):
    """A LatentMoE block in bf16: inference (one ``moe_experts_routed`` call: the router GEMV, then the direct
    kernels routing in place for these few pairs) against the separate ops the layer runs with gradients; the
    load counters raised the same."""
    from dayzero.config.model_config import HybridConfig
    from dayzero.layers.moe import MoE
    from dayzero.models.init import init_random_weights
    from tests.conftest import tiny_config

    m = HybridConfig.from_dict(tiny_config(moe_intermediate_size=64, moe_latent_size=64, n_routed_experts=16,
                                           num_experts_per_tok=4, n_group=2, topk_group=1)).to_spec()
    moe = init_random_weights(MoE(m.hidden_size, m.layers[-1].mlp).float(), seed=1, std=0.2).to(DEV, torch.bfloat16)
    x = torch.randn(2, m.hidden_size, device=DEV, dtype=torch.bfloat16)
    assert D.direct_max_pairs(16) >= 2 * 4
    taken = []
    real = D.moe_experts_routed
    monkeypatch.setattr(D, "moe_experts_routed", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    with torch.no_grad():
        direct = moe(x)
    assert taken == [1]
    loads = moe.load_ends.clone()
    moe.load_ends.zero_()
    sorted_ = moe(x).detach()
    assert torch.equal(loads, moe.load_ends)
    assert (direct.float() - sorted_.float()).abs().max() <= 2e-2 * sorted_.float().abs().max()


@cuda
def test_replayed_in_a_cuda_graph_with_other_ids():
    x, ids, weights, w1, w2, _, _ = case(4, 8, 64, 512, 256, dtype=torch.bfloat16)
    load = torch.zeros(64, dtype=torch.int64, device=DEV)
    D.moe_experts_direct(x, ids, weights, w1, w2, load=load)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = D.moe_experts_direct(x, ids, weights, w1, w2, load=load)
    new_x, new_ids, new_w, _, _, _, _ = case(4, 8, 64, 512, 256, dtype=torch.bfloat16, seed=9)
    x.copy_(new_x), ids.copy_(new_ids), weights.copy_(new_w)
    load.zero_()
    graph.replay()
    want = torch.zeros_like(load)
    check(out, reference.grouped_experts(x, ids, weights, w1, w2, load=want), torch.bfloat16)
    assert torch.equal(load, want)


@cuda
def test_routed_inside_replayed_in_a_cuda_graph_with_other_logits():
    logits, routing = routing_case("v3", 2)
    x, _, _, w1, w2, _, _ = case(2, 8, 64, 512, 256, dtype=torch.bfloat16)
    load = torch.zeros(64, dtype=torch.int64, device=DEV)
    D.moe_experts_routed(x, logits, routing, w1, w2, load=load)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, weights, ids = D.moe_experts_routed(x, logits, routing, w1, w2, load=load)
    logits.copy_(routing_case("v3", 2, seed=9)[0])
    load.zero_()
    graph.replay()
    w_ref, ids_ref = reference.route(logits, *routing)
    assert torch.equal(ids, ids_ref)
    want = torch.zeros_like(load)
    check(out, reference.grouped_experts(x, ids_ref, w_ref, w1, w2, load=want), torch.bfloat16)
    assert torch.equal(load, want)


@cuda
@pytest.mark.parametrize("T", [2, D.DOWN_EARLY_ROWS])
def test_routed_early_behind_two_dependent_kernels_in_a_cuda_graph(T):
    """As a layer that routes first runs it: the router's skinny GEMV writes the logits, the experts' input
    projection (another skinny launch, waiting on the router) writes h, and the first expert kernel routes the
    logits and reads its expert's weights before waiting on that projection (programmatic dependent launch on a
    Hopper GPU), the second too from ``DOWN_EARLY_ROWS`` tokens. Replayed with new router inputs: the same ids,
    rows and counters as the reference."""
    from dayzero.ops.linear import kernels as LK
    from dayzero.ops.static import mark_static

    E, Dm, L = 64, 256, 512
    _, routing = routing_case("v3", T)
    g = torch.Generator(DEV).manual_seed(11)
    xr = torch.randn(T, Dm, generator=g, device=DEV).to(torch.bfloat16)
    rw = mark_static(torch.randn(E, Dm, generator=g, device=DEV) / Dm ** 0.5 * 3)
    proj = mark_static((torch.randn(L, Dm, generator=g, device=DEV) / Dm ** 0.5).to(torch.bfloat16))
    _, _, _, w1, w2, _, _ = case(T, 8, E, L, 256, dtype=torch.bfloat16)
    mark_static(w1), mark_static(w2)
    load = torch.zeros(E, dtype=torch.int64, device=DEV)

    def step():
        logits = LK.skinny_linear(xr, rw, out_dtype=torch.float32, block=(4, 256, 4))
        h = LK.skinny_linear(xr, proj, block=(8, 256, 4))
        return (logits, h, *D.moe_experts_routed(h, logits, routing, w1, w2, load=load, early=True))

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, h, out, weights, ids = step()
    for seed in (12, 13):
        xr.copy_(torch.randn(T, Dm, generator=torch.Generator(DEV).manual_seed(seed), device=DEV))
        load.zero_()
        graph.replay()
        torch.cuda.synchronize()
        w_ref, ids_ref = reference.route(logits, *routing)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(weights, w_ref, rtol=1e-5, atol=1e-7)
        want = torch.zeros_like(load)
        check(out, reference.grouped_experts(h, ids_ref, w_ref, w1, w2, load=want), torch.bfloat16)
        assert torch.equal(load, want)
