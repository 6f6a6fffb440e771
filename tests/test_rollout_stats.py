"""The rollout diagnostics in ``rollout_stats``, each against a value worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lightning.rollout_stats import (
    distinct_fraction,
    distinct_n,
    importance_ratio_stats,
    select_sample_indices,
    entropy_from_logprobs,
    token_entropy,
    zero_advantage_fraction,
)

# ---- distinct_fraction ----------------------------------------------------------------------


def test_distinct_fraction_all_different_is_one():
    assert distinct_fraction(["a", "b", "c", "d"]) == 1.0


def test_distinct_fraction_collapsed_is_one_over_g():
    assert distinct_fraction(["same"] * 8) == 1 / 8


def test_distinct_fraction_partial():
    # {"a", "b", "c"} among 5 strings; "a " differs from "a" (no normalisation).
    assert distinct_fraction(["a", "b", "a", "c", "b"]) == 3 / 5
    assert distinct_fraction(["a", "a "]) == 1.0


def test_distinct_fraction_empty_raises():
    with pytest.raises(ValueError, match="at least one"):
        distinct_fraction([])


# ---- distinct_n ---------------------------------------------------------------------------


def test_distinct_n_by_hand_2x4():
    ids = torch.tensor([[1, 2, 3, 1], [1, 2, 2, 2]])
    # unigrams: 8 tokens, distinct {1, 2, 3} -> 3/8
    assert distinct_n(ids, 1) == 3 / 8
    # bigrams: row 0 (1,2) (2,3) (3,1); row 1 (1,2) (2,2) (2,2) -> 6 total, distinct {12, 23, 31, 22} -> 4/6
    assert distinct_n(ids, 2) == 4 / 6
    # trigrams: row 0 (1,2,3) (2,3,1); row 1 (1,2,2) (2,2,2) -> 4 total, all distinct
    assert distinct_n(ids, 3) == 1.0
    # 4-grams: one per row, different -> 2/2
    assert distinct_n(ids, 4) == 1.0


def test_distinct_n_does_not_join_rows():
    # Row 0 ends with 5 and row 1 starts with 6: (5, 6) is not a bigram of either row.
    ids = torch.tensor([[5, 5], [6, 6]])
    assert distinct_n(ids, 2) == 1.0  # bigrams (5,5) and (6,6)
    ids = torch.tensor([[7, 7, 7], [7, 7, 7]])
    assert distinct_n(ids, 2) == 1 / 4  # four (7,7)


def test_distinct_n_identical_rows_collapse():
    row = torch.tensor([4, 8, 15, 16, 23, 42])
    ids = row.repeat(3, 1)
    assert distinct_n(ids, 2) == pytest.approx(5 / 15, abs=0)


def test_distinct_n_invalid_inputs():
    with pytest.raises(ValueError, match="T >= n"):
        distinct_n(torch.tensor([[1, 2]]), 3)
    with pytest.raises(ValueError, match="n >= 1"):
        distinct_n(torch.tensor([[1, 2]]), 0)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        distinct_n(torch.tensor([1, 2, 3]), 1)
    with pytest.raises(ValueError, match="integer"):
        distinct_n(torch.tensor([[1.0, 2.0]]), 1)
    with pytest.raises(ValueError, match="at least one"):
        distinct_n(torch.zeros(0, 4, dtype=torch.long), 1)


# ---- zero_advantage_fraction --------------------------------------------------------------


def test_zero_advantage_fraction_one_of_three_groups():
    rewards = torch.tensor([1.0, 2.0, 3.0, 3.0, 0.0, 0.5])  # groups (1,2) (3,3) (0,0.5)
    assert zero_advantage_fraction(rewards, 2) == pytest.approx(1 / 3, abs=1e-7)


def test_zero_advantage_fraction_extremes_and_exactness():
    assert zero_advantage_fraction(torch.zeros(6), 3) == 1.0
    assert zero_advantage_fraction(torch.tensor([0.0, 1.0, 2.0, 3.0]), 2) == 0.0
    # Exact equality: a difference of one ulp still carries signal.
    one = torch.tensor(1.0)
    assert zero_advantage_fraction(torch.stack([one, torch.nextafter(one, torch.tensor(2.0))]), 2) == 0.0
    # Integer rewards work too; a group of one is always degenerate.
    assert zero_advantage_fraction(torch.tensor([1, 1, 2, 3]), 2) == 0.5
    assert zero_advantage_fraction(torch.tensor([1.0, 2.0]), 1) == 1.0


def test_zero_advantage_fraction_nan_group_is_not_equal():
    nan = float("nan")
    assert zero_advantage_fraction(torch.tensor([nan, nan, 1.0, 1.0]), 2) == 0.5


def test_zero_advantage_fraction_validates():
    with pytest.raises(ValueError, match="B % group_size must be 0"):
        zero_advantage_fraction(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        zero_advantage_fraction(torch.zeros(4), 0)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        zero_advantage_fraction(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="at least one"):
        zero_advantage_fraction(torch.zeros(0), 2)


# ---- token_entropy ------------------------------------------------------------------------


def test_entropy_uniform_is_log_v():
    for v in (1, 2, 7, 50_000):
        logits = torch.full((3, v), 4.2)
        torch.testing.assert_close(token_entropy(logits), torch.full((3,), math.log(v)), rtol=1e-6, atol=1e-6)


def test_entropy_one_hot_with_neg_inf_is_zero_not_nan():
    logits = torch.tensor([[0.0, -math.inf, -math.inf], [-math.inf, 3.0, -math.inf]])
    out = token_entropy(logits)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, torch.zeros(2), rtol=0, atol=0)


def test_entropy_half_quarter_quarter():
    logits = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.25)])
    torch.testing.assert_close(token_entropy(logits), torch.tensor(1.5 * math.log(2)), rtol=1e-6, atol=1e-7)
    # Softmax is shift invariant, and a -inf entry (probability 0) adds nothing.
    shifted = torch.tensor([math.log(0.5) + 100, math.log(0.25) + 100, math.log(0.25) + 100, -math.inf])
    torch.testing.assert_close(token_entropy(shifted), torch.tensor(1.5 * math.log(2)), rtol=1e-6, atol=1e-6)


def test_entropy_extreme_logits_stable():
    # Huge gaps: the distribution is one-hot to float precision, entropy ~0, and never NaN or negative.
    logits = torch.tensor([[1e4, -1e4, 0.0], [-3e38, 3e38, 0.0]])
    out = token_entropy(logits)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.zeros(2), rtol=0, atol=1e-6)


def test_entropy_shape_and_low_precision_upcast():
    logits = torch.zeros(2, 3, 5, dtype=torch.bfloat16)
    out = token_entropy(logits)
    assert out.shape == (2, 3)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.full((2, 3), math.log(5)), rtol=1e-6, atol=1e-6)
    assert token_entropy(torch.zeros(4, dtype=torch.float64)).dtype == torch.float64


def test_entropy_from_logprobs_by_hand():
    logprobs = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.25), -math.inf]])
    expected = torch.tensor([1.5 * math.log(2)])
    torch.testing.assert_close(entropy_from_logprobs(logprobs), expected, rtol=1e-6, atol=1e-7)


def test_entropy_gradient_finite_with_neg_inf():
    logits = torch.tensor([0.3, -math.inf, 1.2], requires_grad=True)
    token_entropy(logits).backward()
    assert torch.isfinite(logits.grad[[0, 2]]).all()


# ---- importance_ratio_stats ---------------------------------------------------------------


def test_importance_ratio_stats_by_hand():
    old = torch.tensor([[-1.0, -2.0], [-3.0, -0.5]])
    new = old + torch.tensor([[0.0, math.log(2.0)], [math.log(0.5), math.log(4.0)]])
    mean, top = importance_ratio_stats(new, old)
    # ratios 1, 2, 0.5, 4 -> mean 7.5 / 4, max 4
    torch.testing.assert_close(mean, torch.tensor(7.5 / 4), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(top, torch.tensor(4.0), rtol=1e-6, atol=1e-6)


def test_importance_ratio_stats_detached_and_on_policy():
    lp = torch.randn(3, 4, requires_grad=True)
    mean, top = importance_ratio_stats(lp, lp.detach().clone())
    assert not mean.requires_grad and not top.requires_grad
    assert mean.item() == 1.0 and top.item() == 1.0
    assert mean.dim() == 0 and top.dim() == 0


def test_importance_ratio_stats_validates():
    with pytest.raises(ValueError, match="shape"):
        importance_ratio_stats(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="at least one"):
        importance_ratio_stats(torch.zeros(0), torch.zeros(0))


# ---- select_sample_indices ----------------------------------------------------------------


def test_select_edge_counts():
    rewards = torch.tensor([0.5, 3.0, -1.0, 2.0])
    assert select_sample_indices(rewards, 0) == []
    assert select_sample_indices(rewards, -2) == []
    assert select_sample_indices(rewards, 1) == [1]  # just the best
    assert select_sample_indices(rewards, 2) == [1, 2]  # best, worst
    # best 1, worst 2, then index 0 -> shown by descending reward: 3.0, 0.5, -1.0
    assert select_sample_indices(rewards, 3) == [1, 0, 2]
    assert select_sample_indices(rewards, 4) == [1, 3, 0, 2]  # n == B: all, by descending reward
    assert select_sample_indices(rewards, 99) == [1, 3, 0, 2]
    assert select_sample_indices(torch.zeros(0), 3) == []


def test_select_ties_take_first_occurrence():
    rewards = torch.tensor([1.0, 5.0, 0.0, 5.0, 0.0, 2.0])
    assert select_sample_indices(rewards, 1) == [1]  # first of the two 5.0
    assert select_sample_indices(rewards, 2) == [1, 2]  # first of the two 0.0
    # then indices 0, 3 (1 and 2 already taken): rewards 5 (1), 5 (3), 1 (0), 0 (2); ties by index
    assert select_sample_indices(rewards, 4) == [1, 3, 0, 2]
    assert select_sample_indices(rewards, 6) == [1, 3, 5, 0, 2, 4]


def test_select_best_or_worst_at_start_skips_duplicates():
    rewards = torch.tensor([9.0, 1.0, 4.0, 0.0, 7.0])
    # best 0, worst 3, fill with 1 (0 is taken) -> by reward: 9 (0), 1 (1), 0 (3)
    assert select_sample_indices(rewards, 3) == [0, 1, 3]


def test_select_all_equal():
    rewards = torch.full((4,), 2.0)
    assert select_sample_indices(rewards, 1) == [0]
    assert select_sample_indices(rewards, 2) == [0, 1]  # best == worst == 0, then index 1
    assert select_sample_indices(rewards, 3) == [0, 1, 2]


def test_select_nan_ranks_lowest():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 2.0])
    assert select_sample_indices(rewards, 2) == [2, 1]
    assert select_sample_indices(rewards, 4) == [2, 3, 0, 1]


def test_select_validates_shape():
    with pytest.raises(ValueError, match=r"\(B,\)"):
        select_sample_indices(torch.zeros(2, 2), 1)
