"""What each KL estimator's value and gradient really estimate, checked exactly on small categoricals.

Every expectation here is an exact sum over the support weighted by pi (no sampling), in float64,
so the identities hold to ~1e-15 and the tolerance can be 1e-10. The gradient of an estimator
"as used in a loss" is the gradient of the surrogate

    sum_a  stop_grad(pi(a)) * k(log pi(a) - log pi_ref(a))

i.e. the estimator's value at each outcome differentiated through log pi of that outcome only,
weighted by the (fixed) probability of drawing it: sampled tokens are data, not functions of theta.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from grpo_lightning.kl import KL_ESTIMATORS, kl_in_reward, kl_k1, kl_k2, kl_k3, kl_loss_penalty

EXACT = dict(atol=1e-10, rtol=1e-10)
N_OUTCOMES = 5


def categorical(seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy logits theta (a float64 leaf with grad) and fixed reference log-probabilities."""
    gen = torch.Generator().manual_seed(seed)
    theta = (scale * torch.randn(N_OUTCOMES, generator=gen, dtype=torch.float64)).requires_grad_()
    ref_logprobs = (scale * torch.randn(N_OUTCOMES, generator=gen, dtype=torch.float64)).log_softmax(-1)
    return theta, ref_logprobs


def reverse_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(pi || pi_ref) written out directly, differentiable through pi in both places."""
    return (logprobs.exp() * (logprobs - ref_logprobs)).sum()


def forward_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(pi_ref || pi) written out directly."""
    return (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum()


def expected_value(estimator, theta: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """E_{a ~ pi}[k(a)] as an exact sum over the support."""
    logprobs = theta.log_softmax(-1)
    return (logprobs.exp() * estimator(logprobs, ref_logprobs)).sum()


def expected_loss_gradient(estimator, theta: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """E_{a ~ pi}[grad_theta k(a)] with a held fixed: the gradient a loss built from k follows on average."""
    logprobs = theta.log_softmax(-1)
    surrogate = (logprobs.exp().detach() * estimator(logprobs, ref_logprobs)).sum()
    (grad,) = torch.autograd.grad(surrogate, theta)
    return grad


def divergence_gradient(divergence, theta: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(divergence(theta.log_softmax(-1), ref_logprobs), theta)
    return grad


# (seed, scale): several random pairs near-ish the reference, plus pairs far from it (logits x6).
CASES = [(seed, 1.0) for seed in range(6)] + [(100, 6.0), (101, 6.0)]


# ---------------------------------------------------------------------------------------------
# Values: k1 and k3 are unbiased for KL(pi || pi_ref), k2 is not
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed, scale", CASES)
def test_k1_and_k3_values_are_unbiased(seed, scale):
    theta, ref = categorical(seed, scale)
    true = reverse_kl(theta.log_softmax(-1), ref)
    assert true.item() > 1e-3  # a real divergence, not a trivially zero one
    assert_close(expected_value(kl_k1, theta, ref), true, **EXACT)
    assert_close(expected_value(kl_k3, theta, ref), true, **EXACT)


@pytest.mark.parametrize("seed, scale", CASES)
def test_k2_value_is_biased(seed, scale):
    theta, ref = categorical(seed, scale)
    true = reverse_kl(theta.log_softmax(-1), ref).item()
    gap = expected_value(kl_k2, theta, ref).item() - true
    assert abs(gap) > 1e-4 * true  # far above float64 rounding: a genuine bias


def test_k2_bias_by_hand_on_two_outcomes():
    # pi = [1/2, 1/2], pi_ref = [1/4, 3/4]: log r = [log 2, log(2/3)]
    # KL = 1/2 log 2 + 1/2 log(2/3) = 1/2 log(4/3) ~ 0.1438
    # E[k2] = 1/2 * 1/2 (log 2)^2 + 1/2 * 1/2 (log 2/3)^2 ~ 0.1612
    theta = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.25, 0.75], dtype=torch.float64).log()
    assert_close(expected_value(kl_k1, theta, ref).item(), 0.5 * math.log(4 / 3), **EXACT)
    assert_close(expected_value(kl_k3, theta, ref).item(), 0.5 * math.log(4 / 3), **EXACT)
    k2 = 0.25 * math.log(2) ** 2 + 0.25 * math.log(2 / 3) ** 2
    assert_close(expected_value(kl_k2, theta, ref).item(), k2, **EXACT)
    assert k2 - 0.5 * math.log(4 / 3) > 0.015


# ---------------------------------------------------------------------------------------------
# Gradients as a loss: k1 -> 0, k2 -> reverse KL, k3 -> forward KL
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed, scale", CASES)
def test_k1_loss_gradient_is_zero(seed, scale):
    theta, ref = categorical(seed, scale)
    grad = expected_loss_gradient(kl_k1, theta, ref)
    assert_close(grad, torch.zeros_like(grad), **EXACT)
    assert divergence_gradient(reverse_kl, theta, ref).abs().max() > 1e-3  # ... although the KL's is not


@pytest.mark.parametrize("seed, scale", CASES)
def test_k2_loss_gradient_is_the_reverse_kl_gradient(seed, scale):
    theta, ref = categorical(seed, scale)
    assert_close(expected_loss_gradient(kl_k2, theta, ref), divergence_gradient(reverse_kl, theta, ref), **EXACT)


@pytest.mark.parametrize("seed, scale", CASES)
def test_k3_loss_gradient_is_the_forward_kl_gradient(seed, scale):
    theta, ref = categorical(seed, scale)
    grad = expected_loss_gradient(kl_k3, theta, ref)
    assert_close(grad, divergence_gradient(forward_kl, theta, ref), **EXACT)
    # ... and that is a different direction from the reverse KL's: not a rounding coincidence
    assert (grad - divergence_gradient(reverse_kl, theta, ref)).abs().max() > 1e-3


@pytest.mark.parametrize("seed, scale", CASES)
def test_k1_in_the_reward_has_the_reverse_kl_gradient(seed, scale):
    # REINFORCE with per-token reward -k1: E[-k1 * grad log pi], k1 detached (it is a reward);
    # its negation is the gradient of the penalty, and equals grad KL(pi || pi_ref), like k2 as a loss.
    theta, ref = categorical(seed, scale)
    logprobs = theta.log_softmax(-1)
    reward = -kl_k1(logprobs, ref).detach()
    (policy_gradient,) = torch.autograd.grad((logprobs.exp().detach() * reward * logprobs).sum(), theta)
    assert_close(-policy_gradient, divergence_gradient(reverse_kl, theta, ref), **EXACT)


def test_far_from_reference_the_estimators_still_satisfy_the_identities():
    # pi puts ~all its mass on outcome 0, which pi_ref makes ~e^-20 likely: KL ~ 20 nats
    theta = torch.tensor([20.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.0, 20.0, 20.0, 20.0, 20.0], dtype=torch.float64).log_softmax(-1)
    true = reverse_kl(theta.log_softmax(-1), ref)
    assert true.item() > 19
    assert_close(expected_value(kl_k3, theta, ref), true, **EXACT)
    assert_close(expected_loss_gradient(kl_k2, theta, ref), divergence_gradient(reverse_kl, theta, ref), **EXACT)
    assert_close(expected_loss_gradient(kl_k3, theta, ref), divergence_gradient(forward_kl, theta, ref), **EXACT)


# ---------------------------------------------------------------------------------------------
# kl_loss_penalty and kl_in_reward by hand
# ---------------------------------------------------------------------------------------------

# log ratios d = [[0.5, -1], [0, 2]]
LP = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], dtype=torch.float64)
REF = torch.tensor([[-1.5, -1.0], [-3.0, -6.0]], dtype=torch.float64)


def test_kl_loss_penalty_k2_by_hand():
    # k2 = d^2 / 2 = [[0.125, 0.5], [0, 2]], mean 0.65625; times 0.2 -> 0.13125
    assert_close(kl_loss_penalty(LP, REF, 0.2), torch.tensor(0.13125, dtype=torch.float64), **EXACT)
    assert_close(kl_loss_penalty(LP, REF, 0.2, estimator="k2"), torch.tensor(0.13125, dtype=torch.float64), **EXACT)


def test_kl_loss_penalty_k3_by_hand():
    # k3 = e^-d - 1 + d per token, mean over the 4 tokens, times 0.5
    d = [0.5, -1.0, 0.0, 2.0]
    expected = 0.5 * sum(math.exp(-x) - 1 + x for x in d) / 4
    assert_close(kl_loss_penalty(LP, REF, 0.5, estimator="k3").item(), expected, **EXACT)


def test_kl_loss_penalty_k1_reward_is_a_zero_scalar():
    out = kl_loss_penalty(LP, REF, 0.5, estimator="k1_reward")
    assert out.shape == () and out.item() == 0.0 and out.device == LP.device


def test_kl_loss_penalty_gradient_flows_for_k2():
    lp = LP.clone().requires_grad_()
    kl_loss_penalty(lp, REF, 0.2).backward()
    # d/d lp of 0.2 * mean(d^2 / 2) = 0.2 * d / 4
    assert_close(lp.grad, 0.2 * (LP - REF) / 4, **EXACT)


def test_kl_loss_penalty_unknown_estimator():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'.*'k2', 'k3', 'k1_reward'"):
        kl_loss_penalty(LP, REF, 0.1, estimator="k4")
    assert KL_ESTIMATORS == ("k2", "k3", "k1_reward")


def test_kl_loss_penalty_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        kl_loss_penalty(LP, REF[:, :1], 0.1)


def test_kl_in_reward_by_hand():
    # sum_t k1 per sequence: [0.5 - 1, 0 + 2] = [-0.5, 2]; rewards [1, 3] - 0.1 * [-0.5, 2] = [1.05, 2.8]
    rewards = torch.tensor([1.0, 3.0], dtype=torch.float64)
    out = kl_in_reward(rewards, LP, REF, kl_coef=0.1)
    assert_close(out, torch.tensor([1.05, 2.8], dtype=torch.float64), **EXACT)


def test_kl_in_reward_carries_no_gradient():
    lp = LP.clone().requires_grad_()
    out = kl_in_reward(torch.zeros(2, dtype=torch.float64), lp, REF, kl_coef=0.1)
    assert not out.requires_grad


def test_kl_in_reward_checks_shapes():
    with pytest.raises(ValueError, match=r"rewards \(B,\)"):
        kl_in_reward(torch.zeros(3), LP, REF, kl_coef=0.1)
