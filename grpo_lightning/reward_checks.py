"""Calling a reward and refusing what it returns when it cannot be trained on."""

from __future__ import annotations

import torch
from torch import Tensor

from rewards.base import call_reward, reward_name

from .config import GRPOError


class RewardError(GRPOError):
    """A reward raised, or returned something other than B finite floats."""


def _indices(mask: Tensor, limit: int = 10) -> str:
    idx = mask.nonzero().flatten().tolist()
    shown = ", ".join(map(str, idx[:limit]))
    return f"[{shown}{', ...' if len(idx) > limit else ''}] ({len(idx)} of {mask.numel()})"


def score_samples(reward, samples: list[str], completions: list[str] | None = None, rows: list[dict] | None = None) -> Tensor:
    """Calls the reward (with each sample's completion and row, where it reads them: ``call_reward``) and
    returns float32 rewards (B,) on the CPU, or raises RewardError naming the reward and what is wrong
    (the sample indices, where the fault is per sample)."""
    name = reward_name(reward)
    try:
        values = call_reward(reward, samples, completions, rows)
    except Exception as error:  # any failure inside user code becomes one readable line
        raise RewardError(f"reward {name} raised {type(error).__name__}: {error}") from error
    if isinstance(values, Tensor):
        rewards = values.detach()
    else:
        try:
            rewards = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError) as error:
            raise RewardError(
                f"reward {name} returned {type(values).__name__}; it must return a float tensor of shape ({len(samples)},)"
            ) from error
    if not (rewards.is_floating_point() or rewards.dtype in (torch.int32, torch.int64, torch.bool)):
        raise RewardError(f"reward {name} returned dtype {rewards.dtype}; it must return floats")
    if rewards.shape != (len(samples),):
        raise RewardError(
            f"reward {name} returned shape {tuple(rewards.shape)} for {len(samples)} samples; "
            f"it must return one value per sample, shape ({len(samples)},)"
        )
    rewards = rewards.float().cpu()
    not_finite = ~torch.isfinite(rewards)
    if not_finite.any():
        raise RewardError(f"reward {name} returned NaN or inf for samples {_indices(not_finite)}")
    return rewards
