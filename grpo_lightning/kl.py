"""The KL divergence to the reference policy: exact, per-token estimators, and the ways a run uses them.

A sampled token only gives us ``log r = log pi(a) - log pi_ref(a)`` (r = pi / pi_ref), so the KL is
*estimated* from that one number. Two different questions decide which estimator fits where:

* **Measuring**: is the estimator's expected *value* under ``a ~ pi`` equal to ``KL(pi || pi_ref)``?
* **Optimising**: the sampled token is data, so a loss built from an estimator is differentiated
  through ``log pi(a)`` only. Which divergence's gradient does that *expected gradient* equal?

* k1 = log r: unbiased value (but noisy, often < 0); expected gradient zero, pure noise as a loss.
* k2 = (log r)^2 / 2: biased value (an f-divergence close to the KL); expected gradient is
  grad KL(pi || pi_ref), the reverse KL a GRPO loss wants.
* k3 = 1/r - 1 + log r: unbiased value, >= 0, low variance; expected gradient is
  grad KL(pi_ref || pi), the forward KL.

Hence a loss uses k2 (``kl_loss_penalty(..., "k2")``), or puts k1 in the *reward* (``kl_in_reward``),
whose REINFORCE gradient is the same as k2's; k3 is for logging a small drift. Every ratio is formed
from log-probabilities (a difference, then ``exp`` where needed): nothing is divided, so very unlikely
tokens stay finite.
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k2", "k3", "k1_reward")
"""Ways a run can penalise drift from the reference: k2 or k3 as a loss term, or k1 inside the reward."""


def exact_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Exact ``KL(pi || pi_ref)`` over the last (vocabulary) axis of full log-probability tensors.

    (..., V) in, (...) out. The weights ``pi`` are ``exp(logprobs)``: a token with ``pi`` underflowing
    to 0 contributes 0 even where ``pi_ref`` is tiny, so extreme logits stay finite.
    """
    return (logprobs.exp() * (logprobs - ref_logprobs)).sum(-1)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k1 = log r, with r = pi(a) / pi_ref(a) on the sampled token.

    (a) Value: unbiased for KL(pi || pi_ref) (it *is* the integrand), but high-variance and negative
        on many samples although the KL is >= 0.
    (b) Gradient: its expected gradient is zero, ``E_pi[grad log pi] = grad sum(pi) = 0``, so as a
        loss term it adds noise and no pull towards the reference. (In the *reward* it works, see
        ``kl_in_reward``.)
    """
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k2 = (log r)^2 / 2.

    (a) Value: biased, not equal to KL(pi || pi_ref) in general. Its expectation is an f-divergence
        that agrees with the KL to second order, so the bias is small while pi is near pi_ref; >= 0.
    (b) Gradient: its expected gradient, ``E_pi[log r * grad log pi]``, is exactly the gradient of the
        reverse KL(pi || pi_ref). That is the penalty GRPO's loss wants, so the loss uses k2.
    """
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 = 1/r - 1 + log r, with 1/r computed as ``exp(-log r)``.

    (a) Value: unbiased for KL(pi || pi_ref), because ``1/r - 1`` has mean zero under pi; >= 0 on every
        sample and low-variance near the reference: the best of the three for *measuring* a small KL
        (heavy-tailed once pi has made sampled tokens much less likely than pi_ref does).
    (b) Gradient: its expected gradient, ``E_pi[(1 - 1/r) grad log pi] = -sum pi_ref grad log pi``, is the
        gradient of the forward KL(pi_ref || pi), the mode-covering direction, not the one we penalise.
    """
    log_ratio = logprobs - ref_logprobs
    return torch.exp(-log_ratio) - 1 + log_ratio


_LOSS_ESTIMATORS = {"k2": kl_k2, "k3": kl_k3}


def check_kl_estimator(estimator: str) -> None:
    """Raises ValueError naming the accepted values when ``estimator`` is not one of ``KL_ESTIMATORS``."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(map(repr, KL_ESTIMATORS))}")


def kl_loss_terms(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k2") -> Tensor:
    """The per-token KL estimates (b, T) of the loss term, before they are summed (k2 or k3)."""
    check_kl_estimator(estimator)
    if estimator not in _LOSS_ESTIMATORS:
        raise ValueError(f"{estimator!r} puts the KL in the rewards: it has no loss terms")
    return _LOSS_ESTIMATORS[estimator](logprobs, ref_logprobs)


def kl_loss_penalty(logprobs: Tensor, ref_logprobs: Tensor, kl_coef: float, estimator: str = "k2") -> Tensor:
    """The KL term of the loss: ``kl_coef * mean`` over all (b, T) sampled tokens of k2 or k3.

    logprobs: (b, T) under the current policy (with grad); ref_logprobs: (b, T) under the reference.
    For ``"k1_reward"`` the KL already sits in the rewards (``kl_in_reward``), so the loss term is a
    zero scalar on ``logprobs``' device: the caller's ``surrogate - penalty`` stays uniform.
    """
    check_kl_estimator(estimator)
    if logprobs.shape != ref_logprobs.shape:
        shapes = f"{tuple(logprobs.shape)} and {tuple(ref_logprobs.shape)}"
        raise ValueError(f"logprobs and ref_logprobs must have the same shape, got {shapes}")
    if estimator == "k1_reward":
        return torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return kl_coef * _LOSS_ESTIMATORS[estimator](logprobs, ref_logprobs).mean()


def kl_in_reward(rewards: Tensor, logprobs: Tensor, ref_logprobs: Tensor, kl_coef: float) -> Tensor:
    """Rewards with the KL folded in, ``rewards - kl_coef * sum_t k1``: (B,), (B, T), (B, T) -> (B,).

    The original RLHF recipe, applied to the rollout *before* advantages are computed: the policy
    gradient then carries ``-kl_coef * log r * grad log pi``, whose expectation is the reverse-KL
    gradient, the same as k2's as a loss term. The inputs are rollout tensors and are detached here,
    so no gradient can flow through this reward.
    """
    if logprobs.shape != ref_logprobs.shape or logprobs.dim() != 2 or rewards.shape != logprobs.shape[:1]:
        raise ValueError(
            f"expected rewards (B,), logprobs and ref_logprobs (B, T); got {tuple(rewards.shape)}, "
            f"{tuple(logprobs.shape)}, {tuple(ref_logprobs.shape)}"
        )
    k1_per_sequence = kl_k1(logprobs.detach(), ref_logprobs.detach()).sum(-1)  # (B,)
    return rewards.detach() - kl_coef * k1_per_sequence


# The chapter's names, kept for code written against it (re-exported by grpo_lightning.objectives).


def calc_kl_penalty_naive(logprobs: Tensor, ref_logprobs: Tensor, kl_coef: float) -> Tensor:
    """Exact ``kl_coef * mean_{b,t} KL(pi || pi_ref)`` from full-vocabulary log-probabilities (b, T, V).

    Written with log-probabilities only (no division of probabilities), so extreme logits stay finite.
    """
    return kl_coef * exact_kl(logprobs, ref_logprobs).mean()


def calc_kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kl_coef: float) -> Tensor:
    """``kl_coef * mean(k2)`` over all (b, T) generated tokens: the KL term of the GRPO loss."""
    assert logprobs.shape == ref_logprobs.shape, "logprobs and ref_logprobs must have the same shape"
    return kl_coef * kl_k2(logprobs, ref_logprobs).mean()
