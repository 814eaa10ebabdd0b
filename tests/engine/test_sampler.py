import math

import pytest
import torch

from dayzero.engine.sampler import Sampler, SamplerOutput, apply_penalties, make_generator
from dayzero.engine.sampling_params import SamplingParams as SP

sampler = Sampler()

# a distribution with distinct, well separated probabilities, scattered over the vocab so that a
# mix-up between sorted positions and token ids shows up
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
PERM = torch.tensor([3, 0, 5, 1, 4, 2])  # PROBS[r] is the probability of token PERM[r]


def scattered_logits() -> torch.Tensor:
    logits = torch.empty(6)
    logits[PERM] = PROBS.log()
    return logits  # [V]


def draw(logits: torch.Tensor, params: SP, n: int, seed: int = 0) -> torch.Tensor:
    """n unseeded draws from one row of logits, as n identical rows of one batch."""
    torch.manual_seed(seed)
    out = sampler(logits.expand(n, -1), [params] * n, [None] * n)
    return out.token_ids


def frequencies(ids: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=V).double() / len(ids)


def chi_square(ids: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(ids, minlength=len(expected)).double()
    exp = expected.double() * len(ids)
    keep = exp > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


# ---- greedy -----------------------------------------------------------------------------------

def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 33, generator=g)
    params = [SP(temperature=0.0), SP(temperature=0.8, top_k=1), SP(temperature=0.0, seed=3)] * 2
    params.append(SP(temperature=0.0, top_p=0.1, min_p=0.5))
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    out = sampler(logits, params, gens)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids.dtype == torch.long and out.token_ids.shape == (7,)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_tie_takes_lowest_id():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [7.0, 0.0, 7.0, 7.0]])
    out = sampler(logits, [SP(temperature=0.0)] * 2, [None, None])
    assert out.token_ids.tolist() == [1, 0]


def test_tiny_temperature_acts_like_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1)) * 30
    out = sampler(logits, [SP(temperature=1e-8)] * 5, [None] * 5)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert torch.isfinite(out.logprobs).all()


# ---- filters ----------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 4, 6, 100], ids=lambda k: f"k{k}")
def test_top_k_never_outside_top_k(k):
    logits = scattered_logits()
    ids = draw(logits, SP(temperature=1.5, top_k=k), 2000)
    allowed = set(PERM[: min(k, 6)].tolist())
    assert set(ids.tolist()) == allowed  # nothing outside, and every allowed token drawn


def test_top_k_cut_through_a_tie_keeps_lowest_ids():
    logits = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0])
    ids = draw(logits, SP(top_k=2), 1000)
    assert set(ids.tolist()) == {1, 2}


@pytest.mark.parametrize("top_p,n_keep", [(0.3, 1), (0.55, 2), (0.7, 3), (0.85, 4), (0.99, 6)],
                         ids=lambda v: f"{v}")
def test_top_p_keeps_exactly_the_nucleus(top_p, n_keep):
    # cumulative mass 0.40, 0.65, 0.80, 0.90, 0.96, 1.0; no case sits on a boundary
    ids = draw(scattered_logits(), SP(top_p=top_p), 4000)
    assert set(ids.tolist()) == set(PERM[:n_keep].tolist())
    # and within the nucleus the renormalised probabilities are kept
    expected = torch.zeros(6)
    expected[PERM[:n_keep]] = PROBS[:n_keep] / PROBS[:n_keep].sum()
    assert (frequencies(ids, 6) - expected.double()).abs().max() < 0.03


@pytest.mark.parametrize("min_p,n_keep", [(0.05, 6), (0.12, 5), (0.3, 3), (0.5, 2), (1.0, 1)],
                         ids=lambda v: f"{v}")
def test_min_p_drops_tokens_below_fraction_of_max(min_p, n_keep):
    # p / p_max = 1, .625, .375, .25, .15, .1
    ids = draw(scattered_logits(), SP(min_p=min_p), 2000)
    assert set(ids.tolist()) == set(PERM[:n_keep].tolist())


def test_top_p_applies_after_top_k():
    # top-3 renormalised: .5, .3125, .1875 -> mass before the 3rd is .8125 >= .68: keep 2.
    # top-p alone on the full distribution would keep 3 (mass before the 3rd is .65).
    ids = draw(scattered_logits(), SP(top_k=3, top_p=0.68), 2000)
    assert set(ids.tolist()) == set(PERM[:2].tolist())
    ids = draw(scattered_logits(), SP(top_p=0.68), 2000)
    assert set(ids.tolist()) == set(PERM[:3].tolist())


def test_mixed_batch_rows_keep_their_own_filters():
    logits = scattered_logits()
    params = [SP(top_k=2), SP(), SP(top_p=0.3), SP(min_p=0.5), SP(temperature=0.0)] * 400
    torch.manual_seed(0)
    ids = sampler(logits.expand(len(params), -1), params, [None] * len(params)).token_ids
    ids = ids.view(-1, 5)
    allowed = [PERM[:2], PERM, PERM[:1], PERM[:2], PERM[:1]]
    for col, ok in enumerate(allowed):
        assert set(ids[:, col].tolist()) == set(ok.tolist()), col


# ---- distribution -----------------------------------------------------------------------------

# chi-square quantile for 7 degrees of freedom at p = 0.001
CHI2_7_999 = 24.32


@pytest.mark.parametrize("seeded", [False, True], ids=["global-rng", "own-generators"])
def test_frequencies_match_softmax_over_temperature(seeded):
    V, T, n = 8, 0.7, 20000
    logits = torch.randn(V, generator=torch.Generator().manual_seed(5))
    expected = torch.softmax(logits / T, dim=-1)
    gens = [make_generator(1000 + i) for i in range(n)] if seeded else [None] * n
    torch.manual_seed(0)
    ids = sampler(logits.expand(n, -1), [SP(temperature=T)] * n, gens).token_ids
    assert chi_square(ids, expected) < CHI2_7_999
    assert (frequencies(ids, V) - expected.double()).abs().max() < 0.015
    # the test has power: the same draws are far from the untempered distribution
    assert chi_square(ids, torch.softmax(logits, dim=-1)) > 10 * CHI2_7_999


# ---- seeds ------------------------------------------------------------------------------------

STEPS, V_SEED = 25, 64
STEP_LOGITS = torch.randn(STEPS, V_SEED, generator=torch.Generator().manual_seed(11)) * 2


def run_steps(rows: list[SP], target: int) -> list[int]:
    """Sample STEPS steps of a batch; one generator per seeded row, made once like the engine."""
    gens = [make_generator(p.seed) if p.seed is not None else None for p in rows]
    out = []
    for step in range(STEPS):
        # every row sees different logits, the target row always STEP_LOGITS[step]
        logits = torch.randn(len(rows), V_SEED)
        logits[target] = STEP_LOGITS[step]
        out.append(sampler(logits, rows, gens).token_ids[target].item())
    return out


@pytest.mark.parametrize("target", [
    SP(seed=1234),
    SP(seed=1234, temperature=0.9, top_k=40, top_p=0.95),
    SP(seed=99, min_p=0.05, temperature=1.3),
], ids=["plain", "top_k-top_p", "min_p"])
def test_same_seed_same_tokens_alone_or_in_batch(target):
    alone = run_steps([target], 0)
    others = [SP(), SP(seed=7, top_k=5), SP(temperature=0.0), SP(top_p=0.5)]
    for pos in (0, 2, 4):
        rows = others[:pos] + [target] + others[pos:]
        assert run_steps(rows, pos) == alone, f"target at position {pos}"


def test_different_seeds_differ():
    flat = torch.zeros(1, 100)  # 30 draws: two seeds agree everywhere with probability 1e-60

    def tokens(seed):
        g = make_generator(seed)
        return [sampler(flat, [SP(seed=seed)], [g]).token_ids.item() for _ in range(30)]

    a, b = tokens(1), tokens(2)
    assert a == tokens(1)
    assert a != b
    assert len(set(a)) > 10  # really sampling, not a constant


def test_seeded_row_ignores_global_rng():
    logits = torch.zeros(1, 1000)
    torch.manual_seed(0)
    a = sampler(logits, [SP(seed=5)], [make_generator(5)]).token_ids
    torch.manual_seed(1)
    b = sampler(logits, [SP(seed=5)], [make_generator(5)]).token_ids
    torch.manual_seed(1)
    c = sampler(logits, [SP()], [None]).token_ids
    torch.manual_seed(2)
    d = sampler(logits, [SP()], [None]).token_ids
    assert torch.equal(a, b) and not torch.equal(c, d)


def test_make_generator_accepts_any_int_seed():
    for seed in (0, -1, 2 ** 64 + 3, 2 ** 70):
        make_generator(seed)  # must not raise
    assert torch.equal(torch.rand(4, generator=make_generator(3)),
                       torch.rand(4, generator=make_generator(2 ** 64 + 3)))


# ---- logprobs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logprobs_are_raw_log_softmax_at_chosen_id(dtype):
    logits = (torch.randn(6, 40, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    params = [SP(temperature=0.0), SP(temperature=0.5, top_k=3), SP(top_p=0.5),
              SP(repetition_penalty=1.8, presence_penalty=1.0), SP(min_p=0.3, temperature=2.0),
              SP(temperature=0.0, frequency_penalty=2.0)]
    out_ids = [[1, 2], [], [5], list(range(20)), [], logits[5].float().topk(3).indices.tolist()]
    out = sampler(logits, params, [None] * 6, out_ids)
    ref = torch.log_softmax(logits.float(), dim=-1)[torch.arange(6), out.token_ids]
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, ref, rtol=0, atol=1e-5)
    # the penalised greedy row did not take the raw argmax, and its logprob is still raw
    assert out.token_ids[5] != logits[5].float().argmax()


# ---- penalties --------------------------------------------------------------------------------

def test_repetition_penalty_divides_positive_multiplies_negative():
    x = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    apply_penalties(x, [SP(repetition_penalty=2.0)], [[0, 1, 1]])
    assert x.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_presence_and_frequency_penalties_subtract():
    x = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    apply_penalties(x, [SP(presence_penalty=0.5, frequency_penalty=0.25)], [[0, 1, 1]])
    assert x.tolist() == [[2.0 - 0.5 - 0.25, -2.0 - 0.5 - 0.5, 1.0, 0.5]]
    x = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    apply_penalties(x, [SP(presence_penalty=-1.0, frequency_penalty=-0.5)], [[2]])
    assert x.tolist() == [[2.0, -2.0, 2.5, 0.5]]  # negative values reward repeats


def test_penalties_are_per_row_and_ignore_bad_ids():
    x = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    params = [SP(presence_penalty=1.0), SP(), SP(repetition_penalty=4.0)]
    apply_penalties(x, params, [[0, 7, -1], [0, 1, 2], [2, 2]])
    assert x.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.25]]


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sampler(logits, [SP(temperature=0.0)], [None], [[0]]).token_ids.item() == 0
    out = sampler(logits, [SP(temperature=0.0, presence_penalty=0.5)], [None], [[0]])
    assert out.token_ids.item() == 1
    out = sampler(logits, [SP(temperature=0.0, repetition_penalty=1.1)], [None], [[0]])
    assert out.token_ids.item() == 1


def test_extreme_repetition_penalty_stays_finite():
    logits = torch.tensor([[1e30, 1.0, -1e30]])
    out = sampler(logits, [SP(repetition_penalty=1e-10)], [None], [[0, 2]])
    assert out.token_ids.item() in (0, 1, 2) and torch.isfinite(out.logprobs).all()


# ---- faults and edges -------------------------------------------------------------------------

@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")],
                         ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("bad_params", [SP(), SP(temperature=0.0), SP(seed=3, top_k=4)],
                         ids=["sampled", "greedy", "seeded-top_k"])
def test_non_finite_row_gives_minus_one_others_unaffected(poison, bad_params):
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4))
    good = [SP(seed=1), SP(temperature=0.0), SP(seed=2, top_p=0.8)]
    good_gens = lambda: [make_generator(1), None, make_generator(2)]  # noqa: E731
    clean = sampler(logits[[0, 2, 3]], good, good_gens())

    poisoned = logits.clone()
    poisoned[1, 7] = poison
    gens = good_gens()
    gens.insert(1, make_generator(3) if bad_params.seed is not None else None)
    out = sampler(poisoned, good[:1] + [bad_params] + good[1:], gens)
    assert out.token_ids[1].item() == -1 and math.isnan(out.logprobs[1].item())
    assert torch.equal(out.token_ids[[0, 2, 3]], clean.token_ids)
    torch.testing.assert_close(out.logprobs[[0, 2, 3]], clean.logprobs)


def test_all_rows_bad():
    logits = torch.full((2, 5), float("nan"))
    out = sampler(logits, [SP(), SP(temperature=0.0)], [None, None])
    assert out.token_ids.tolist() == [-1, -1] and torch.isnan(out.logprobs).all()


def test_input_logits_not_modified():
    logits = torch.randn(3, 20)
    before = logits.clone()
    sampler(logits, [SP(repetition_penalty=2.0, top_k=3), SP(temperature=0.0, presence_penalty=2.0),
                     SP(top_p=0.5, min_p=0.2)], [None] * 3, [[1, 2], [3], [4]])
    assert torch.equal(logits, before)


def test_empty_batch():
    out = sampler(torch.empty(0, 10), [], [])
    assert out.token_ids.shape == (0,) and out.logprobs.shape == (0,)


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="2 logit rows"):
        sampler(torch.zeros(2, 4), [SP()], [None, None])


def test_top_logprobs_are_the_k_most_likely_under_the_raw_distribution():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    params = [SP(temperature=0.0, logprobs=3), SP(temperature=0.0, logprobs=1)]
    out = Sampler()(logits, params, [None, None])
    raw = torch.log_softmax(logits, dim=-1)
    assert out.top_ids.shape == (2, 3)  # the largest request sets K; the engine trims per request
    assert out.top_ids[0].tolist() == [1, 3, 2]
    torch.testing.assert_close(out.top_logprobs[0], raw[0, [1, 3, 2]])
    assert Sampler()(logits, [SP(temperature=0.0)] * 2, [None, None]).top_ids is None
