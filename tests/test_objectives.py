"""Hand-computed checks of the GRPO objective functions (grpo_lightning.objectives)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from grpo_lightning import objectives
from grpo_lightning.objectives import (
    calc_clipped_surrogate_objective,
    calc_kl_penalty,
    calc_kl_penalty_naive,
    clip_fraction,
    compute_grpo_advantages,
    get_logits,
    get_logprobs,
    get_logprobs_batched,
    kl_k1,
    kl_k2,
    kl_k3,
)

TOL = dict(atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# compute_grpo_advantages
# ---------------------------------------------------------------------------------------------


def test_advantages_simple_group():
    # rewards [1, 2, 3]: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1
    # -> advantages [-1, 0, 1] / (1 + 1e-6)
    adv = compute_grpo_advantages(torch.tensor([1.0, 2.0, 3.0]))
    expected = torch.tensor([-1.0, 0.0, 1.0]) / (1 + 1e-6)
    assert adv.shape == (3,)
    assert adv.dtype == torch.float32
    assert_close(adv, expected, **TOL)


def test_advantages_uses_unbiased_std():
    # rewards [0, 0, 0, 4]: mean 1, deviations [-1, -1, -1, 3]
    # unbiased var = (1 + 1 + 1 + 9) / 3 = 4 -> std 2   (the biased std would be sqrt(3))
    # -> advantages [-1, -1, -1, 3] / (2 + 1e-6)
    adv = compute_grpo_advantages(torch.tensor([0.0, 0.0, 0.0, 4.0]))
    expected = torch.tensor([-1.0, -1.0, -1.0, 3.0]) / (2 + 1e-6)
    assert_close(adv, expected, **TOL)


def test_advantages_default_eps_is_1e_minus_6():
    # rewards [0, 2]: mean 1, unbiased std sqrt((1 + 1) / 1) = sqrt(2)
    # -> [-1, 1] / (sqrt(2) + 1e-6); eps 1e-6 vs eps 0 differ by ~5e-7 relative, so compare
    # against the explicit eps=1e-6 call bit for bit, and against the formula tightly.
    r = torch.tensor([0.0, 2.0])
    assert torch.equal(compute_grpo_advantages(r), compute_grpo_advantages(r, eps=1e-6))
    expected = torch.tensor([-1.0, 1.0], dtype=torch.float64) / (math.sqrt(2) + 1e-6)
    assert_close(compute_grpo_advantages(r).double(), expected, atol=1e-7, rtol=1e-7)


def test_advantages_custom_eps():
    # rewards [1, 2, 3], eps 1: std 1 -> [-1, 0, 1] / (1 + 1) = [-0.5, 0, 0.5]
    adv = compute_grpo_advantages(torch.tensor([1.0, 2.0, 3.0]), eps=1.0)
    assert_close(adv, torch.tensor([-0.5, 0.0, 0.5]), **TOL)


def test_advantages_integer_rewards_become_float():
    # int rewards [1, 2, 3] behave exactly as the float ones
    adv = compute_grpo_advantages(torch.tensor([1, 2, 3]))
    assert adv.dtype == torch.float32
    assert_close(adv, torch.tensor([-1.0, 0.0, 1.0]) / (1 + 1e-6), **TOL)


@pytest.mark.parametrize("value", [0.0, 5.0, -2.0, 1.0])
@pytest.mark.parametrize("n", [2, 4, 128])
def test_advantages_all_equal_exactly_representable_gives_exact_zeros(value, n):
    # all rewards equal: mean == each reward, std 0 -> 0 / (0 + eps) = 0 exactly, never NaN (0/0)
    adv = compute_grpo_advantages(torch.full((n,), value))
    assert not torch.isnan(adv).any()
    assert torch.equal(adv, torch.zeros(n))


@pytest.mark.parametrize("value, n", [(0.1, 7), (0.7, 128), (0.3, 128)])
def test_advantages_all_equal_rewards_give_exact_zeros(value, n):
    # Every sample got the same reward: there is no signal, the advantages must be zero
    # (reference: "If every sample gets the same reward, they all get advantage zero").
    adv = compute_grpo_advantages(torch.full((n,), value))
    assert not torch.isnan(adv).any()
    assert torch.equal(adv, torch.zeros(n)), (
        f"LIBRARY BUG: {n} equal rewards of {value} give advantages {adv[:3].tolist()}... instead of zeros: "
        "the float32 mean differs from the rewards by one ulp, the (n-1) std of those identical "
        "deviations is ~1e-8, far below eps=1e-6, so (r - mean) / (std + eps) ~ ulp / 1e-6 is a spurious, "
        "same-sign advantage for every sample"
    )


def test_advantages_single_reward_is_zero_not_nan():
    adv = compute_grpo_advantages(torch.tensor([3.0]))
    assert torch.equal(adv, torch.zeros(1))


# ---------------------------------------------------------------------------------------------
# get_logprobs: the shift by one
# ---------------------------------------------------------------------------------------------


def _two_token_logits(num_positions: int) -> torch.Tensor:
    """(2, S, 2) logits where position s is [0, log(s + 1)]:
    p(token 1 | pos s) = (s + 1) / (s + 2), p(token 0 | pos s) = 1 / (s + 2)."""
    rows = [[0.0, math.log(s + 1)] for s in range(num_positions)]
    return torch.tensor([rows, rows])


def test_get_logprobs_shift_with_logits_over_the_whole_sequence():
    # S = 5 tokens, gen_len = 2: generated tokens are at positions 3 and 4, so they are predicted
    # by the logits at positions 2 and 3.
    #   pos 2: p(1) = 3/4, p(0) = 1/4;   pos 3: p(1) = 4/5, p(0) = 1/5
    # row 0 generates [1, 0] -> [log 3/4, log 1/5]
    # row 1 generates [0, 1] -> [log 1/4, log 4/5]
    logits = _two_token_logits(5)
    tokens = torch.tensor([[0, 0, 0, 1, 0], [1, 1, 1, 0, 1]])
    lp = get_logprobs(logits, tokens, gen_len=2)
    expected = torch.tensor([[math.log(3 / 4), math.log(1 / 5)], [math.log(1 / 4), math.log(4 / 5)]])
    assert lp.shape == (2, 2)
    assert_close(lp, expected, **TOL)


def test_get_logprobs_shift_with_exactly_gen_len_plus_one_logits():
    # The model only unembedded the last gen_len + 1 = 3 positions (2, 3, 4); the last one
    # (position 4, predicting a token that does not exist yet) must be ignored.
    logits = _two_token_logits(5)[:, -3:]
    tokens = torch.tensor([[0, 0, 0, 1, 0], [1, 1, 1, 0, 1]])
    lp = get_logprobs(logits, tokens, gen_len=2)
    expected = torch.tensor([[math.log(3 / 4), math.log(1 / 5)], [math.log(1 / 4), math.log(4 / 5)]])
    assert_close(lp, expected, **TOL)


def test_get_logprobs_ignores_logits_of_the_last_position():
    # Last position's logits are huge for token 0; changing them must not change anything.
    logits = _two_token_logits(5)
    tokens = torch.tensor([[0, 0, 0, 1, 0], [1, 1, 1, 0, 1]])
    altered = logits.clone()
    altered[:, -1] = torch.tensor([100.0, -100.0])
    assert torch.equal(get_logprobs(logits, tokens, 2), get_logprobs(altered, tokens, 2))


def test_get_logprobs_uniform_gives_minus_log_v():
    # all logits equal over V = 7 -> log p = -log 7 for any token
    V, S, gen_len = 7, 6, 4
    logits = torch.full((3, S, V), 2.5)
    tokens = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 6, 6, 6, 6, 6], [3, 0, 5, 1, 6, 2]])
    lp = get_logprobs(logits, tokens, gen_len)
    assert_close(lp, torch.full((3, gen_len), -math.log(V)), **TOL)


def test_get_logprobs_log_three_quarters():
    # logits [0, log 3] -> softmax [1/4, 3/4]; gen_len = 1 with two logit positions
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, -5.0]]])
    assert_close(get_logprobs(logits, torch.tensor([[0, 1]]), 1), torch.tensor([[math.log(3 / 4)]]), **TOL)
    assert_close(get_logprobs(logits, torch.tensor([[1, 0]]), 1), torch.tensor([[math.log(1 / 4)]]), **TOL)


def test_get_logprobs_half_precision_logits_give_float32():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]], dtype=torch.bfloat16)
    lp = get_logprobs(logits, torch.tensor([[0, 1]]), 1)
    assert lp.dtype == torch.float32
    # bf16 log 3 = 1.09375 (bf16 rounding), so p(1) = 3'/(1 + 3') with 3' = e^1.09375
    three = math.exp(float(torch.tensor(math.log(3.0), dtype=torch.bfloat16)))
    assert_close(lp, torch.tensor([[math.log(three / (1 + three))]]), **TOL)


# ---------------------------------------------------------------------------------------------
# get_logits / get_logprobs_batched with fake models
# ---------------------------------------------------------------------------------------------


class RecordingModel:
    """Returns fixed float64 logits of shape (b, logits_to_keep, V) and records its kwargs."""

    def __init__(self, V: int = 3):
        self.V = V
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        ids = kwargs["input_ids"]
        keep = kwargs["logits_to_keep"]
        logits = torch.arange(ids.shape[0] * keep * self.V, dtype=torch.float64).reshape(ids.shape[0], keep, self.V)
        return SimpleNamespace(logits=logits)


def test_get_logits_passes_logits_to_keep_and_keeps_the_models_dtype():
    model = RecordingModel(V=3)
    ids = torch.tensor([[1, 2, 0, 1, 2, 0]])
    logits = get_logits(model, ids, gen_len=3)
    assert len(model.calls) == 1
    assert set(model.calls[0]) == {"input_ids", "logits_to_keep"}
    assert model.calls[0]["logits_to_keep"] == 4  # gen_len + 1
    assert model.calls[0]["input_ids"] is ids
    assert logits.dtype == torch.float64  # as the model returned them; get_logprobs works in float32
    assert logits.shape == (1, 4, 3)
    assert torch.equal(logits, torch.arange(12, dtype=torch.float64).reshape(1, 4, 3))


class TinyLM(torch.nn.Module):
    """logits[b, s] = table[ids[b, s]], unembedding only the last ``logits_to_keep`` positions,
    like a Hugging Face causal LM. Records the batch size of each call."""

    def __init__(self, V: int = 5):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=g))
        self.batch_sizes = []

    def forward(self, input_ids, logits_to_keep):
        # As Hugging Face models read it: a count of last positions, or the positions themselves (a slice).
        self.batch_sizes.append(input_ids.shape[0])
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return SimpleNamespace(logits=self.table[input_ids][:, keep])


def test_get_logprobs_batched_equals_unbatched_and_has_no_grad():
    model = TinyLM(V=5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 5, (5, 7), generator=g)
    gen_len = 3

    unbatched = get_logprobs(get_logits(model, ids, gen_len), ids, gen_len)
    assert unbatched.requires_grad  # sanity: the model does carry grad outside no_grad
    # and the same as reading the full-sequence logits by hand
    full = get_logprobs(model.table[ids], ids, gen_len)
    # by hand for row 0, token t at position S - gen_len + t predicted by position S - gen_len + t - 1
    S = ids.shape[1]
    by_hand = torch.stack(
        [model.table[ids[0, S - gen_len + t - 1]].log_softmax(-1)[ids[0, S - gen_len + t]] for t in range(gen_len)]
    )

    model.batch_sizes.clear()
    batched = get_logprobs_batched(model, ids, gen_len, chunk_size=2)
    assert model.batch_sizes == [2, 2, 1]
    assert batched.shape == (5, gen_len)
    assert not batched.requires_grad
    assert batched.grad_fn is None
    assert_close(batched, unbatched.detach(), **TOL)
    assert_close(batched, full.detach(), **TOL)
    assert_close(batched[0], by_hand.detach(), **TOL)


def test_get_logprobs_batched_chunk_larger_than_batch():
    model = TinyLM(V=5)
    ids = torch.randint(0, 5, (3, 4), generator=torch.Generator().manual_seed(2))
    batched = get_logprobs_batched(model, ids, 2, chunk_size=64)
    assert model.batch_sizes == [3]
    assert_close(batched, get_logprobs(model.table[ids], ids, 2).detach(), **TOL)


# ---------------------------------------------------------------------------------------------
# KL penalties
# ---------------------------------------------------------------------------------------------


def test_kl_penalty_naive_hand_value():
    # position 0: p = [1/2, 1/2], ref = [1/4, 3/4]
    #   KL = 1/2 log(2) + 1/2 log(2/3) = 1/2 log(4/3)
    # position 1: p = [1/4, 3/4], ref = [1/2, 1/2]
    #   KL = 1/4 log(1/2) + 3/4 log(3/2)
    # penalty = kl_coef * mean = 0.3 * (KL0 + KL1) / 2
    p = torch.tensor([[[0.5, 0.5], [0.25, 0.75]]])
    ref = torch.tensor([[[0.25, 0.75], [0.5, 0.5]]])
    kl0 = 0.5 * math.log(4 / 3)
    kl1 = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    out = calc_kl_penalty_naive(p.log(), ref.log(), kl_coef=0.3)
    assert out.shape == ()
    assert_close(out, torch.tensor(0.3 * (kl0 + kl1) / 2), **TOL)


def test_kl_penalty_naive_three_token_vocab_over_batch():
    # batch of 2, T = 1, V = 3
    # row 0: p = [0.5, 0.25, 0.25], ref = [0.25, 0.25, 0.5]
    #   KL = 0.5 log 2 + 0.25 log 1 + 0.25 log(1/2) = 0.25 log 2
    # row 1: p == ref -> 0
    # penalty = 1.0 * (0.25 log 2 + 0) / 2 = 0.125 log 2
    p = torch.tensor([[[0.5, 0.25, 0.25]], [[0.2, 0.3, 0.5]]])
    ref = torch.tensor([[[0.25, 0.25, 0.5]], [[0.2, 0.3, 0.5]]])
    out = calc_kl_penalty_naive(p.log(), ref.log(), kl_coef=1.0)
    assert_close(out, torch.tensor(0.125 * math.log(2)), **TOL)


def test_kl_penalty_naive_identical_is_zero():
    lp = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    assert calc_kl_penalty_naive(lp, lp.clone(), 0.3).item() == 0.0


def test_kl_penalty_naive_extreme_logits_are_finite():
    # logits [1e4, -1e4, 0] -> logprobs [0, -2e4, -1e4]: p = [1, 0, 0] (exp underflows to 0)
    # ref logits [-1e4, 1e4, 0] -> ref logprobs [-2e4, 0, -1e4]
    # KL = 1 * (0 - (-2e4)) + 0 + 0 = 2e4; penalty = 0.3 * 2e4 = 6000
    lp = torch.tensor([[[1e4, -1e4, 0.0]]]).log_softmax(-1)
    ref = torch.tensor([[[-1e4, 1e4, 0.0]]]).log_softmax(-1)
    out = calc_kl_penalty_naive(lp, ref, 0.3)
    assert torch.isfinite(out)
    assert_close(out, torch.tensor(6000.0), atol=0.0, rtol=1e-6)


def test_kl_penalty_naive_extreme_reference_is_finite():
    # p uniform on 2 tokens: logprobs [log 1/2, log 1/2]
    # ref logits [1e4, -1e4] -> ref logprobs [0, -2e4]
    # KL = 1/2 (log 1/2 - 0) + 1/2 (log 1/2 + 2e4) = log(1/2) + 1e4
    lp = torch.tensor([[[0.0, 0.0]]]).log_softmax(-1)
    ref = torch.tensor([[[1e4, -1e4]]]).log_softmax(-1)
    out = calc_kl_penalty_naive(lp, ref, 1.0)
    assert torch.isfinite(out)
    assert_close(out, torch.tensor(1e4 + math.log(0.5)), atol=0.0, rtol=1e-6)


def test_kl_penalty_naive_extreme_gradient_is_finite():
    logits = torch.tensor([[[1e4, -1e4, 0.0]]], requires_grad=True)
    ref = torch.tensor([[[-1e4, 1e4, 0.0]]]).log_softmax(-1)
    calc_kl_penalty_naive(logits.log_softmax(-1), ref, 0.3).backward()
    assert torch.isfinite(logits.grad).all()


def test_kl_k1_k2_k3_values():
    # log ratios d = [0, log 2, -log 2, 1]
    lp = torch.tensor([[-1.0, math.log(0.5), math.log(0.25), -2.0]])
    ref = torch.tensor([[-1.0, math.log(0.25), math.log(0.5), -3.0]])
    d = [0.0, math.log(2), -math.log(2), 1.0]
    # k1 = d
    assert_close(kl_k1(lp, ref), torch.tensor([d]), **TOL)
    # k2 = d^2 / 2
    assert_close(kl_k2(lp, ref), torch.tensor([[x * x / 2 for x in d]]), **TOL)
    # k3 = e^-d - 1 + d: d=0 -> 0; d=log 2 -> 1/2 - 1 + log 2; d=-log 2 -> 2 - 1 - log 2; d=1 -> e^-1
    expected_k3 = torch.tensor([[0.0, math.log(2) - 0.5, 1 - math.log(2), math.exp(-1.0)]])
    assert_close(kl_k3(lp, ref), expected_k3, **TOL)
    assert (kl_k3(lp, ref) >= 0).all()


def test_calc_kl_penalty_hand_value():
    # log ratios [[0.5, -1], [0, 2]] -> k2 = [[0.125, 0.5], [0, 2]], mean 2.625 / 4 = 0.65625
    # penalty = 0.2 * 0.65625 = 0.13125
    lp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    ref = torch.tensor([[-1.5, -1.0], [-3.0, -6.0]])
    out = calc_kl_penalty(lp, ref, kl_coef=0.2)
    assert out.shape == ()
    assert_close(out, torch.tensor(0.13125), **TOL)


def test_calc_kl_penalty_gradient():
    # d/d lp of kl_coef * mean(0.5 d^2) = kl_coef * d / N = 0.2 * [[0.5, -1], [0, 2]] / 4
    lp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0], [-3.0, -6.0]])
    calc_kl_penalty(lp, ref, 0.2).backward()
    assert_close(lp.grad, torch.tensor([[0.025, -0.05], [0.0, 0.1]]), **TOL)


def test_calc_kl_penalty_zero_when_equal_and_zero_coef():
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    assert calc_kl_penalty(lp, lp.clone(), 0.3).item() == 0.0
    assert calc_kl_penalty(lp, lp - 3.0, 0.0).item() == 0.0


def test_calc_kl_penalty_stable_with_extreme_logprobs():
    # lp -1e4 vs ref -1e4 + 1 (exactly representable): d = -1 -> k2 0.5
    # lp -1e4 vs ref 0: d = -1e4 -> k2 5e7
    # lp 0 vs ref -1e4: d = 1e4 -> k2 5e7
    # mean (0.5 + 5e7 + 5e7) / 3, times kl_coef 1
    lp = torch.tensor([[-1e4, -1e4, 0.0]])
    ref = torch.tensor([[-1e4 + 1, 0.0, -1e4]])
    out = calc_kl_penalty(lp, ref, 1.0)
    assert torch.isfinite(out)
    assert_close(out, torch.tensor((0.5 + 5e7 + 5e7) / 3), atol=0.0, rtol=1e-6)
    # the same log-ratio far out in the tail gives the same penalty as near zero
    assert_close(
        calc_kl_penalty(torch.tensor([[-1e4]]), torch.tensor([[-1e4 + 1]]), 0.3),
        calc_kl_penalty(torch.tensor([[-1.0]]), torch.tensor([[0.0]]), 0.3),
        **TOL,
    )


def test_calc_kl_penalty_rejects_shape_mismatch():
    with pytest.raises(AssertionError):
        calc_kl_penalty(torch.zeros(2, 3), torch.zeros(2, 4), 0.3)


# ---------------------------------------------------------------------------------------------
# Clipped surrogate objective
# ---------------------------------------------------------------------------------------------


def _surrogate(ratio: float, advantage: float, eps: float = 0.2, tokens: int = 2):
    """Runs the objective on one sequence of ``tokens`` tokens that all have importance ratio
    ``ratio`` (old logprob -1, new -1 + log ratio); returns (value, grad wrt the new logprobs)."""
    old = torch.full((1, tokens), -1.0)
    lp = (old + math.log(ratio)).requires_grad_(True)
    value = calc_clipped_surrogate_objective(lp, old, torch.tensor([advantage]), eps)
    value.backward()
    return value.detach(), lp.grad


def test_surrogate_positive_advantage_ratio_above_clip_is_clipped_with_zero_grad():
    # A = 2, rho = 1.5 > 1.2: min(1.5 * 2, 1.2 * 2) = 2.4; the clamp is saturated -> grad 0
    value, grad = _surrogate(1.5, 2.0)
    assert_close(value, torch.tensor(2.4), **TOL)
    assert torch.equal(grad, torch.zeros(1, 2))


def test_surrogate_positive_advantage_ratio_below_clip_is_unclipped_with_grad():
    # A = 2, rho = 0.5 < 0.8: min(0.5 * 2, 0.8 * 2) = 1.0 (unclipped)
    # d/d lp (rho * A) = rho * A = 1.0 per token, / 2 tokens for the mean -> 0.5
    value, grad = _surrogate(0.5, 2.0)
    assert_close(value, torch.tensor(1.0), **TOL)
    assert_close(grad, torch.full((1, 2), 0.5), **TOL)


def test_surrogate_negative_advantage_ratio_below_clip_is_clipped_with_zero_grad():
    # A = -2, rho = 0.5 < 0.8: min(0.5 * -2, 0.8 * -2) = min(-1, -1.6) = -1.6 = (1 - eps) A -> grad 0
    value, grad = _surrogate(0.5, -2.0)
    assert_close(value, torch.tensor(-1.6), **TOL)
    assert torch.equal(grad, torch.zeros(1, 2))


def test_surrogate_negative_advantage_ratio_above_clip_is_unclipped_with_grad():
    # A = -2, rho = 1.5 > 1.2: min(1.5 * -2, 1.2 * -2) = min(-3, -2.4) = -3 (unclipped)
    # grad per token rho * A = -3, / 2 tokens -> -1.5
    value, grad = _surrogate(1.5, -2.0)
    assert_close(value, torch.tensor(-3.0), **TOL)
    assert_close(grad, torch.full((1, 2), -1.5), **TOL)


@pytest.mark.parametrize("advantage", [2.0, -2.0])
def test_surrogate_inside_clip_range_is_plain_ratio_times_advantage(advantage):
    # rho = 1.1 inside [0.8, 1.2]: value rho * A, grad rho * A / 2 tokens
    value, grad = _surrogate(1.1, advantage)
    assert_close(value, torch.tensor(1.1 * advantage), **TOL)
    assert_close(grad, torch.full((1, 2), 1.1 * advantage / 2), **TOL)


def test_surrogate_at_ratio_one_is_policy_gradient():
    # rho = 1 (first step of a learning phase): value A, grad A / N
    value, grad = _surrogate(1.0, 3.0)
    assert_close(value, torch.tensor(3.0), **TOL)
    assert_close(grad, torch.full((1, 2), 1.5), **TOL)


def test_surrogate_broadcasts_advantages_over_each_sequences_tokens():
    # Square (2, 2) so that broadcasting along the wrong axis would not raise.
    # row 0 (A = +1): rho [1.5, 0.5] -> [min(1.5, 1.2), min(0.5, 0.8)] = [1.2, 0.5]
    # row 1 (A = -1): rho [1.5, 0.5] -> [min(-1.5, -1.2), min(-0.5, -0.8)] = [-1.5, -0.8]
    # mean = (1.2 + 0.5 - 1.5 - 0.8) / 4 = -0.15
    # grads (rho * A / 4 where unclipped, else 0): [[0, 0.125], [-0.375, 0]]
    old = torch.zeros(2, 2)
    lp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.5), math.log(0.5)]], requires_grad=True)
    value = calc_clipped_surrogate_objective(lp, old, torch.tensor([1.0, -1.0]), 0.2)
    value.backward()
    assert_close(value.detach(), torch.tensor(-0.15), **TOL)
    assert_close(lp.grad, torch.tensor([[0.0, 0.125], [-0.375, 0.0]]), **TOL)


def test_surrogate_clip_coef_is_used():
    # A = 1, rho = 1.5, eps = 0.4 -> min(1.5, 1.4) = 1.4
    value, grad = _surrogate(1.5, 1.0, eps=0.4)
    assert_close(value, torch.tensor(1.4), **TOL)
    assert torch.equal(grad, torch.zeros(1, 2))


def test_surrogate_rejects_bad_shapes():
    with pytest.raises(AssertionError):
        calc_clipped_surrogate_objective(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), 0.2)
    with pytest.raises(AssertionError):
        calc_clipped_surrogate_objective(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2), 0.2)


# ---------------------------------------------------------------------------------------------
# clip_fraction
# ---------------------------------------------------------------------------------------------


def test_clip_fraction_counts_ratios_outside_the_range():
    # ratios [[1.5, 0.5, 1.0], [1.1, 0.9, 1.25]] with eps 0.2: outside -> 1.5, 0.5, 1.25 = 3 of 6
    old = torch.full((2, 3), -2.0)
    ratios = torch.tensor([[1.5, 0.5, 1.0], [1.1, 0.9, 1.25]])
    lp = (old + ratios.log()).requires_grad_(True)
    frac = clip_fraction(lp, old, 0.2)
    assert frac.shape == ()
    assert not frac.requires_grad
    assert_close(frac, torch.tensor(0.5), **TOL)
    # wider range: only 1.5 and 0.5 are further than 0.3 from 1 -> 2 of 6
    assert_close(clip_fraction(lp, old, 0.3), torch.tensor(2 / 6), **TOL)
    # at the start of a phase (ratio 1) nothing is clipped
    assert clip_fraction(old.clone(), old, 0.2).item() == 0.0


# ---------------------------------------------------------------------------------------------
# selective_log_softmax: the values and gradient of log_softmax + gather, a few rows at a time
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernels", "pytorch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax_matches_log_softmax_and_gather_across_chunks(monkeypatch, dtype, fused):
    monkeypatch.setattr(objectives, "LOG_SOFTMAX_CHUNK_ELEMENTS", 3 * 11)  # 3 rows of 11 per chunk: 4 chunks
    if not fused:  # the chunked PyTorch path, which float32 logits take where the kernels are off or not built
        monkeypatch.setattr(objectives, "fused_training_kernels", lambda: None)
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(10, 11, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, 11, (10,), generator=g)
    weights = torch.randn(10, generator=g)  # an arbitrary upstream gradient

    expected_logits = logits.detach().clone().requires_grad_()
    expected = expected_logits.float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    (expected * weights).sum().backward()
    got = objectives.selective_log_softmax(logits, targets)
    (got * weights).sum().backward()

    assert got.dtype == torch.float32
    assert_close(got, expected, rtol=0, atol=1e-6)
    assert logits.grad.dtype == dtype
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # bf16 grads: 8 bits
    assert_close(logits.grad, expected_logits.grad, **tol)


def test_selective_log_softmax_gradient_by_hand():
    # one row, p = softmax([0, log 3]) = (1/4, 3/4), target 1: d log p_1 / d logits = (0 - 1/4, 1 - 3/4)
    logits = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64).requires_grad_()
    objectives.selective_log_softmax(logits, torch.tensor([1])).sum().backward()
    assert_close(logits.grad, torch.tensor([[-0.25, 0.25]], dtype=torch.float64), rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_in_place_logsumexp_gives_torchs_bits_and_leaves_float32_logits_alone(dtype):
    logits = (torch.randn(5, 300, generator=torch.Generator().manual_seed(4)) * 6).to(dtype)
    logits[1, :] = float("-inf")  # an impossible row: -inf, as torch says
    logits[2, 7] = float("-inf")  # one impossible token
    logits[3, 9] = float("inf")  # an infinite logit: inf
    chunk, own = objectives._float32_rows(logits, slice(0, 5))
    assert own == (dtype != torch.float32)
    expected = logits.float().logsumexp(-1)
    assert torch.equal(objectives._logsumexp_rows(chunk, in_place=own), expected)
    if not own:  # the caller's float32 logits are not shifted in place
        assert torch.equal(chunk, logits) and chunk.data_ptr() == logits.data_ptr()
