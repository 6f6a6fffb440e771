"""The loss variants people compare, in one table: how advantages are scaled, how the importance ratio is
formed, and how per-token terms are summed into one number.

Every function here takes a completion mask (b, T), 1 for a generated token and 0 for padding after
an answer ended, so that padding never counts. With every mask entry 1 (fixed-length completions)
the "grpo" variant is exactly the chapter's objective: the mean over all (b, T) terms.

| variant   | advantages               | ratio          | per-token terms summed as                     |
|-----------|--------------------------|----------------|-----------------------------------------------|
| grpo      | (r - mean) / std, per group | per token   | mean over each sequence's tokens, then over sequences |
| dapo      | (r - mean) / std, per group | per token, upper clip `clip_coef_high` | sum over all tokens / number of tokens |
| dr_grpo   | r - mean, per group      | per token      | sum over all tokens / (sequences x max_len)   |
| gspo      | (r - mean) / std, per group | per sequence: exp(mean of the token log-ratios) | mean over sequences |

Sources: GRPO (Shao et al. 2024, DeepSeekMath); DAPO (Yu et al. 2025): token-level mean and a
decoupled, higher upper clip; Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"):
no std division and a constant length normaliser, which remove the biases towards long wrong and
short right answers; GSPO (Zheng et al. 2025): one length-normalised importance ratio per sequence,
clipped as a whole (its paper uses a far smaller clip range, ~3e-4 / 4e-4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossVariant:
    name: str
    scale_by_std: bool  # divide advantages by the group's reward std
    sequence_ratio: bool  # one importance ratio per sequence (GSPO) instead of one per token
    aggregation: str  # "sequence_mean", "token_mean" or "constant"
    summary: str


LOSS_VARIANTS: dict[str, LossVariant] = {
    variant.name: variant
    for variant in (
        LossVariant("grpo", True, False, "sequence_mean", "the chapter's GRPO: every sequence weighs the same"),
        LossVariant("dapo", True, False, "token_mean", "every token weighs the same; decoupled upper clip"),
        LossVariant("dr_grpo", False, False, "constant", "no std division, constant length normaliser"),
        LossVariant("gspo", True, True, "sequence_mean", "one length-normalised ratio per sequence, clipped"),
    )
}


def loss_variant(name: str) -> LossVariant:
    if name not in LOSS_VARIANTS:
        raise ValueError(f"loss_variant ({name!r}) must be one of {', '.join(map(repr, LOSS_VARIANTS))}")
    return LOSS_VARIANTS[name]


# ---- advantages ------------------------------------------------------------------------------------


def group_advantages(rewards: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """``r - mean`` (optionally ``/ (std + eps)``) within each group of ``group_size`` consecutive rewards.

    rewards: (B,) with B a multiple of group_size, each prompt's completions contiguous. std is the
    unbiased (n - 1) one, as in ``compute_grpo_advantages``. A group of equal rewards gets exact zeros.
    Returns (B,)."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    equal = (groups == groups[:, :1]).all(dim=1, keepdim=True)  # no signal: zeros, not rounding noise
    centred = torch.where(equal, torch.zeros_like(centred), centred)
    if scale_by_std and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.view(-1)


# ---- summing per-token terms ---------------------------------------------------------------------


def aggregate(
    values: Tensor, mask: Tensor, how: str, max_len: int | None = None, tokens: Tensor | None = None
) -> Tensor:
    """One scalar from per-token values (b, T), counting only tokens where ``mask`` is 1.

    "sequence_mean": mean over each sequence's tokens, then over sequences (a sequence without tokens
    counts as 0); "token_mean": sum / number of tokens (or / ``tokens`` when given: the share of all
    processes' tokens each is to divide by, ``grpo_lightning.distributed.token_mean_denominator``);
    "constant": sum / (b * max_len), max_len defaulting to T."""
    mask = mask.to(values.dtype)
    total = (values * mask).sum(dim=1)  # (b,)
    if how == "sequence_mean":
        return (total / mask.sum(dim=1).clamp(min=1)).mean()
    if how == "token_mean":
        return total.sum() / (mask.sum().clamp(min=1) if tokens is None else tokens)
    if how == "constant":
        return total.sum() / (values.shape[0] * (max_len or values.shape[1]))
    raise ValueError(f"unknown aggregation {how!r}")


# ---- the clipped surrogate -----------------------------------------------------------------------


def clipped_terms(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """``min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``, elementwise (ratio and A broadcast)."""
    return torch.minimum(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO's per-sequence log importance ratio: the mean over the sequence's tokens of log pi - log pi_old."""
    mask = mask.to(logprobs.dtype)
    return ((logprobs - old_logprobs) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def surrogate_objective(
    variant: LossVariant,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_coef: float,
    clip_coef_high: float | None = None,
    max_len: int | None = None,
    tokens: Tensor | None = None,
) -> Tensor:
    """The clipped surrogate of ``variant``, to be maximised. logprobs, old_logprobs, mask: (b, T);
    advantages: (b,). ``clip_coef_high`` (default ``clip_coef``) bounds the ratio from above; ``tokens``
    replaces a token mean's own token count (see ``aggregate``)."""
    clip_high = clip_coef if clip_coef_high is None else clip_coef_high
    if variant.sequence_ratio:
        ratio = sequence_log_ratio(logprobs, old_logprobs, mask).exp()  # (b,)
        return clipped_terms(ratio, advantages, clip_coef, clip_high).mean()
    ratio = (logprobs - old_logprobs).exp()
    terms = clipped_terms(ratio, advantages[:, None], clip_coef, clip_high)
    return aggregate(terms, mask, variant.aggregation, max_len, tokens)


def kl_objective(
    variant: LossVariant, per_token_kl: Tensor, mask: Tensor, max_len: int | None = None, tokens: Tensor | None = None
) -> Tensor:
    """The KL penalty's per-token estimates (b, T) summed the way the variant sums its surrogate (GSPO's
    sequence-level ratio has no per-token sum: its KL is a mean over each sequence, then over sequences)."""
    return aggregate(per_token_kl, mask, variant.aggregation, max_len, tokens)
