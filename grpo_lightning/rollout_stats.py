"""Small pure statistics of a rollout, for diagnostics (reward hacking, mode collapse).

Every function takes plain lists or tensors and returns a number, a tensor or a list of indices; none
touches Lightning, a model or a logger, so each can be tested on hand-made inputs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def distinct_fraction(completions: list[str]) -> float:
    """Distinct strings / strings: 1.0 when all completions differ, ``1/G`` when all are one string.

    Raises ``ValueError`` on an empty list.
    """
    if len(completions) == 0:
        raise ValueError("distinct_fraction needs at least one completion")
    return len(set(completions)) / len(completions)


def distinct_n(completion_ids: Tensor, n: int, mask: Tensor | None = None) -> float:
    """Distinct-n (Li et al., 2016): distinct n-grams across all completions / total n-grams.

    ``completion_ids`` is a ``(B, T)`` integer tensor of the generated tokens only (no prompt). The
    n-grams are the ``T - n + 1`` windows inside each row; none spans two rows. Distinct is counted
    over the whole batch, total is ``B * (T - n + 1)``. With a ``mask`` (B, T) (False on padding after
    an answer ended), only windows of unmasked tokens count; with none at all the result is 0.0.

    Raises ``ValueError`` when ``n < 1``, when the tensor is not 2-D, not integer or has no rows, or
    when ``T < n`` (no n-gram at all: the ratio is undefined, and 0.0 would read as total collapse).
    """
    if n < 1:
        raise ValueError(f"distinct_n needs n >= 1, got n={n}")
    if completion_ids.dim() != 2:
        raise ValueError(f"completion_ids must be (B, T), got shape {tuple(completion_ids.shape)}")
    if completion_ids.dtype.is_floating_point or completion_ids.dtype.is_complex:
        raise ValueError(f"completion_ids must hold integer token ids, got {completion_ids.dtype}")
    batch, length = completion_ids.shape
    if batch == 0:
        raise ValueError("distinct_n needs at least one completion")
    if length < n:
        raise ValueError(f"distinct_n: completions of {length} tokens have no {n}-grams (need T >= n)")
    grams = completion_ids.detach().unfold(1, n, 1).reshape(-1, n)  # (B * (T - n + 1), n)
    if mask is not None:
        grams = grams[mask.unfold(1, n, 1).reshape(-1, n).all(dim=1)]
        if grams.shape[0] == 0:
            return 0.0
    return torch.unique(grams, dim=0).shape[0] / grams.shape[0]


def zero_advantage_fraction(rewards: Tensor, group_size: int) -> float:
    """Fraction of groups whose rewards are all exactly equal, hence carry no learning signal.

    ``rewards`` is ``(B,)``, laid out as consecutive groups of ``group_size`` (samples ``0..G-1`` are
    group 0, and so on). Equality is exact (``==``); a group holding a NaN never counts as equal.
    A group of size 1 always counts as equal.

    Raises ``ValueError`` when ``rewards`` is not 1-D or empty, ``group_size < 1``, or
    ``B % group_size != 0``.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (B,), got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError("zero_advantage_fraction needs at least one reward")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size} (B % group_size must be 0)"
        )
    groups = rewards.detach().reshape(-1, group_size)
    equal = (groups == groups[:, :1]).all(dim=1)
    return equal.float().mean().item()


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy in nats of ``softmax(logits)`` over the last dimension: ``(..., V) -> (...)``.

    Computed from ``log_softmax`` in at least float32 (half and bfloat16 are upcast, float64 stays), so
    it is stable for extreme logits. Entries at ``-inf`` (probability exactly 0) contribute 0, not NaN:
    a one-hot distribution has entropy 0. Logits must not hold NaN or ``+inf``; a row that is all
    ``-inf`` (no distribution) gives NaN. The result is not detached: call it under ``torch.no_grad()``
    when it is only logged.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return entropy_from_logprobs(torch.log_softmax(logits.to(dtype), dim=-1))


def entropy_from_logprobs(logprobs: Tensor) -> Tensor:
    """Entropy in nats of full log-probabilities ``(..., V) -> (...)``. The readable reference: sampling
    computes the same quantity in fewer passes (``grpo_lightning.sampling.softmax_parts``), checked against it."""
    probs = logprobs.exp()
    # 0 * -inf is NaN: zero the log of impossible tokens, their probability is exactly 0 anyway.
    return -(probs * logprobs.masked_fill(torch.isneginf(logprobs), 0.0)).sum(dim=-1)


def importance_ratio_stats(logprobs: Tensor, old_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and max over all elements of ``exp(logprobs - old_logprobs)``, detached, as 0-dim tensors.

    Both inputs are per-token log-probabilities of the same shape (e.g. ``(B, T)``), computed in float32
    at least. Raises ``ValueError`` on a shape mismatch or empty input.
    """
    if logprobs.shape != old_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and old_logprobs {tuple(old_logprobs.shape)} differ in shape"
        )
    if logprobs.numel() == 0:
        raise ValueError("importance_ratio_stats needs at least one log-probability")
    dtype = torch.promote_types(torch.promote_types(logprobs.dtype, old_logprobs.dtype), torch.float32)
    ratio = torch.exp(logprobs.detach().to(dtype) - old_logprobs.detach().to(dtype))
    return ratio.mean(), ratio.max()


def select_sample_indices(rewards: Tensor, n: int) -> list[int]:
    """Indices of ``n`` samples to show in a table, ordered by descending reward.

    The choice: the best reward and the worst reward (first index on ties) always, then indices
    0, 1, 2, ... in order, skipping those already taken, until there are ``n``. The result is then
    sorted by descending reward, ties by ascending index. ``n <= 0`` gives ``[]``, ``n == 1`` gives only
    the best, ``n >= B`` gives every index. A NaN reward ranks like ``-inf``: it may be picked as the
    worst, and is the best only when no reward is larger.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (B,), got shape {tuple(rewards.shape)}")
    values = [-math.inf if math.isnan(v) else v for v in rewards.detach().double().tolist()]
    count = len(values)
    if n <= 0 or count == 0:
        return []
    order = sorted(range(count), key=lambda i: (-values[i], i))  # descending reward, ties by index
    if n >= count:
        return order
    best = order[0]
    worst = min(range(count), key=lambda i: (values[i], i))  # first index holding the lowest reward
    chosen = [best]
    for i in [worst, *range(count)]:
        if len(chosen) == n:
            break
        if i not in chosen:
            chosen.append(i)
    rank = {i: r for r, i in enumerate(order)}
    return sorted(chosen, key=rank.__getitem__)
