"""The reference's toy reward: how often a character occurs in the sample."""

from __future__ import annotations

from torch import Tensor

from .base import Reward, as_reward_tensor


def reward_fn_char_count(generated_sample: list[str], char: str = ".") -> Tensor:
    """Count of ``char`` in each sample, as a float tensor (B,). Counts characters, not tokens, so a
    token made of many periods scores many times: the reward the chapter shows being hacked."""
    return as_reward_tensor([sample.count(char) for sample in generated_sample])


class CharCount(Reward):
    """``reward_fn_char_count`` as a configurable reward (``char`` defaults to the period)."""

    def __init__(self, char: str = "."):
        if not isinstance(char, str) or len(char) != 1:
            raise ValueError(f"CharCount: char must be a single character, got {char!r}")
        self.char = char

    def score(self, samples: list[str]) -> Tensor:
        return reward_fn_char_count(samples, self.char)
