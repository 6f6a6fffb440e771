"""The loss variants on a tiny ragged batch, every value computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lightning.losses import (
    LOSS_VARIANTS,
    aggregate,
    group_advantages,
    kl_objective,
    loss_variant,
    surrogate_objective,
)
from grpo_lightning.objectives import calc_clipped_surrogate_objective

# Two sequences of gen_len 3; the second answer ended after one token (two padding positions).
RATIOS = torch.tensor([[1.5, 0.5, 1.0], [1.1, 2.0, 3.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])
ADVANTAGES = torch.tensor([1.0, -2.0], dtype=torch.float64)
OLD = torch.zeros(2, 3, dtype=torch.float64)


def objective(name: str, **kwargs) -> float:
    logprobs = RATIOS.log()  # log pi - log pi_old = log ratio, with log pi_old = 0
    return surrogate_objective(LOSS_VARIANTS[name], logprobs, OLD, ADVANTAGES, MASK, **kwargs).item()


def test_grpo_is_a_mean_over_each_sequence_then_over_sequences():
    # sequence 1 (A = 1): min(1.5, 1.2) + min(0.5, 0.8) + 1.0 = 2.7 over 3 tokens = 0.9
    # sequence 2 (A = -2): min(1.1 * -2, 1.1 * -2) = -2.2 over 1 token; its padding (2.0, 3.0) never counts
    assert objective("grpo", clip_coef=0.2) == pytest.approx((0.9 - 2.2) / 2, abs=1e-12)


def test_dapo_weighs_every_token_the_same_and_clips_higher_above():
    # upper clip 0.28: min(1.5, 1.28) = 1.28; (1.28 + 0.5 + 1.0 - 2.2) / 4 tokens
    assert objective("dapo", clip_coef=0.2, clip_coef_high=0.28) == pytest.approx(0.58 / 4, abs=1e-12)


def test_dr_grpo_divides_by_a_constant_not_by_lengths():
    # (1.2 + 0.5 + 1.0 - 2.2) / (2 sequences x gen_len 3)
    assert objective("dr_grpo", clip_coef=0.2, max_len=3) == pytest.approx(0.5 / 6, abs=1e-12)
    assert objective("dr_grpo", clip_coef=0.2, max_len=10) == pytest.approx(0.5 / 20, abs=1e-12)


def test_gspo_forms_one_length_normalised_ratio_per_sequence():
    # sequence 1: exp(mean(log 1.5, log 0.5, log 1)) = 0.75 ** (1/3) = 0.90856, inside [0.8, 1.2]
    # sequence 2: exp(log 1.1) = 1.1, times -2
    expected = (0.75 ** (1 / 3) - 2.2) / 2
    assert objective("gspo", clip_coef=0.2) == pytest.approx(expected, abs=1e-12)
    # with GSPO's tiny clip range: sequence 1 (A > 0): min(0.90856, clip to 0.9997) = 0.90856; sequence 2
    # (A < 0): min(1.1 * -2, clip to 1.0004 * -2) = -2.2; the unclipped, pessimistic term wins both times
    assert objective("gspo", clip_coef=3e-4, clip_coef_high=4e-4) == pytest.approx(expected, abs=1e-12)
    # a ratio above 1 + eps with A > 0 is clipped: one token of ratio 2 -> 1.0004
    clipped = surrogate_objective(LOSS_VARIANTS["gspo"], torch.tensor([[math.log(2.0)]]), torch.zeros(1, 1),
                                  torch.tensor([1.0]), torch.ones(1, 1), 3e-4, 4e-4)  # fmt: skip
    assert clipped.item() == pytest.approx(1.0004, abs=1e-6)


@pytest.mark.parametrize("name", sorted(LOSS_VARIANTS))
def test_padding_gets_no_gradient(name):
    logprobs = RATIOS.log().clone().requires_grad_(True)
    surrogate_objective(LOSS_VARIANTS[name], logprobs, OLD, ADVANTAGES, MASK, clip_coef=0.5, max_len=3).backward()
    assert torch.equal(logprobs.grad[1, 1:], torch.zeros(2, dtype=torch.float64))
    assert (logprobs.grad[0] != 0).any()


def test_grpo_with_a_full_mask_is_the_chapters_objective():
    torch.manual_seed(0)
    logprobs, old = torch.randn(4, 5), torch.randn(4, 5)
    advantages = torch.randn(4)
    ours = surrogate_objective(LOSS_VARIANTS["grpo"], logprobs, old, advantages, torch.ones(4, 5), 0.2)
    assert torch.allclose(ours, calc_clipped_surrogate_objective(logprobs, old, advantages, 0.2), rtol=1e-6, atol=0)


def test_group_advantages_normalise_within_each_group_only():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0])
    std = math.sqrt(5 / 3)  # unbiased std of 1, 2, 3, 4
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / (std + 1e-6)
    advantages = group_advantages(rewards, group_size=4)
    assert torch.allclose(advantages[:4], expected, rtol=1e-6, atol=0)
    assert torch.equal(advantages[4:], torch.zeros(4))  # all equal: exactly zero
    assert torch.equal(group_advantages(rewards, 4, scale_by_std=False), torch.tensor([-1.5, -0.5, 0.5, 1.5, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match=r"do not split into groups of 3"):
        group_advantages(rewards, 3)


def test_aggregations_and_the_kl_term_follow_the_variant():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    assert aggregate(values, MASK, "sequence_mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(values, MASK, "token_mean").item() == pytest.approx(10.0 / 4)
    assert aggregate(values, MASK, "constant", max_len=5).item() == pytest.approx(10.0 / 10)
    assert kl_objective(LOSS_VARIANTS["dapo"], values, MASK).item() == pytest.approx(2.5)
    assert kl_objective(LOSS_VARIANTS["gspo"], values, MASK).item() == pytest.approx(3.0)


def test_an_unknown_variant_names_the_choices():
    with pytest.raises(ValueError, match=r"loss_variant \('ppo'\) must be one of 'grpo', 'dapo', 'dr_grpo', 'gspo'"):
        loss_variant("ppo")
