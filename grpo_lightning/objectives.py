"""The GRPO objective as small pure tensor functions.

Nothing here knows about Lightning: tensors in, tensor out. Shapes follow the legend of the
design notes: ``B`` sequences in the group, ``b`` in a minibatch, ``T`` generated tokens
(``gen_len``), ``V`` vocabulary size.

Signs: every function returns a quantity in the direction the reference chapter writes it.
The objective to *maximise* is ``clipped_surrogate - kl_penalty``.
"""

from __future__ import annotations

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def compute_grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages ``(r - mean(r)) / (std(r) + eps)``.

    rewards: (B,), one group (all rollouts share one prompt). std is the unbiased (n-1) one,
    as in the reference. A group of equal rewards gives zeros, not NaN, thanks to ``eps``.
    Returns (B,).
    """
    rewards = rewards.float()
    # One sample, or all equal: no signal. Tested explicitly because in float32 the mean of equal
    # values can be one rounding step off them, and (r - mean) / (std + eps) would then be a
    # same-signed ~0.05 for every sample instead of 0.
    if rewards.numel() < 2 or bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + eps)


# ---------------------------------------------------------------------------------------------
# Log-probabilities of the generated tokens
# ---------------------------------------------------------------------------------------------


def get_logprobs(logits: Tensor, tokens: Tensor, gen_len: int) -> Tensor:
    """Log-probabilities of the last ``gen_len`` tokens of ``tokens``.

    logits: (b, S', V) with S' >= gen_len + 1 (only the last gen_len + 1 positions are read).
    tokens: (b, S), the last gen_len of which were generated.
    Returns (b, T). The logits at position s predict the token at s + 1, hence the shift.
    """
    logprobs = logits[:, -gen_len - 1 : -1].float().log_softmax(dim=-1)  # (b, T, V), fp32 always
    targets = tokens[:, -gen_len:]  # (b, T)
    return logprobs.gather(dim=-1, index=targets.unsqueeze(-1)).squeeze(-1)


def get_logits(model: torch.nn.Module, sample_ids: Tensor, gen_len: int) -> Tensor:
    """Runs ``model`` on (b, S) ids; returns float32 logits for the last ``gen_len + 1`` positions.

    ``logits_to_keep`` makes the model unembed only those positions, which is where most of the
    memory of a forward pass goes (a (b, S, V) tensor otherwise).
    """
    return model(input_ids=sample_ids, logits_to_keep=gen_len + 1).logits.float()


@torch.no_grad()
def get_logprobs_batched(model: torch.nn.Module, sample_ids: Tensor, gen_len: int, chunk_size: int) -> Tensor:
    """Log-probabilities (B, T) of the generated tokens under ``model``, ``chunk_size`` sequences at a time."""
    chunks = [get_logprobs(get_logits(model, chunk, gen_len), chunk, gen_len) for chunk in sample_ids.split(chunk_size)]
    return torch.cat(chunks)


# ---------------------------------------------------------------------------------------------
# KL to the reference policy
# ---------------------------------------------------------------------------------------------


# The estimators and the chapter's penalty functions live in grpo_lightning.kl; re-exported here under
# the names code written against this module imports.
from .kl import calc_kl_penalty, calc_kl_penalty_naive, kl_k1, kl_k2, kl_k3  # noqa: E402

__all__ = [
    "compute_grpo_advantages", "get_logprobs", "get_logits", "get_logprobs_batched",
    "calc_kl_penalty", "calc_kl_penalty_naive", "kl_k1", "kl_k2", "kl_k3",
    "calc_clipped_surrogate_objective", "clip_fraction",
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Clipped surrogate
# ---------------------------------------------------------------------------------------------


def calc_clipped_surrogate_objective(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_coef: float
) -> Tensor:
    """Mean over (b, T) of ``min(rho * A, clip(rho, 1 - eps, 1 + eps) * A)``, to be maximised.

    logprobs: (b, T) under the current policy (with grad); old_logprobs: (b, T) at rollout time;
    advantages: (b,), broadcast over each sequence's tokens. rho is formed from the log-ratio so
    that nothing is divided.
    """
    assert logprobs.shape == old_logprobs.shape and advantages.shape == logprobs.shape[:1]
    ratio = (logprobs - old_logprobs).exp()
    advantages = advantages[:, None]  # (b, 1)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_coef, 1 + clip_coef) * advantages
    return torch.minimum(unclipped, clipped).mean()


def clip_fraction(logprobs: Tensor, old_logprobs: Tensor, clip_coef: float) -> Tensor:
    """Fraction of tokens whose importance ratio lies outside [1 - eps, 1 + eps] (a statistic, no grad)."""
    ratio = (logprobs.detach() - old_logprobs).exp()
    return ((ratio - 1).abs() > clip_coef).float().mean()
