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


def describe_reward(reward) -> dict | str:
    """A plain-data description of a reward for hyperparameters and checkpoints (which must hold no
    pickled objects to stay loadable with ``weights_only``): ``class_path``/``init_args`` for a
    ``Reward`` whose attributes are plain values, the import path for a function, else its repr."""
    plain = (str, int, float, bool, type(None))
    cls = type(reward)
    if isinstance(reward, Reward) and all(isinstance(v, plain) for v in vars(reward).values()):
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": dict(vars(reward))}
    if callable(reward) and hasattr(reward, "__module__") and hasattr(reward, "__qualname__"):
        return f"{reward.__module__}.{reward.__qualname__}"
    return repr(reward)
