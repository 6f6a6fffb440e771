"""The reward contract: a list of samples (prompt + completion strings) in, a float tensor (B,) out."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor


class Reward(ABC):
    """Subclass and implement ``score``; instances are callables usable wherever a reward is taken.

    Any plain function with the reference's ``reward_fn(samples) -> Tensor`` signature works too.
    """

    @property
    def name(self) -> str:
        return type(self).__name__

    @abstractmethod
    def score(self, samples: list[str]) -> Tensor:
        """Returns one float reward per sample, shape (len(samples),)."""

    def __call__(self, samples: list[str]) -> Tensor:
        return self.score(samples)


def reward_name(reward) -> str:
    """A readable name for any reward callable, for messages and logs."""
    if isinstance(reward, Reward):
        return reward.name
    return getattr(reward, "__qualname__", None) or getattr(reward, "__name__", None) or type(reward).__name__


def as_reward_tensor(values: list[float]) -> Tensor:
    return torch.tensor(values, dtype=torch.float32)
