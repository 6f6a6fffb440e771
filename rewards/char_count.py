"""The reference's toy reward, how often a character occurs in the sample, and a length-normalised
variant. (``CharTokenCount``, in ``char_tokens.py``, is the token-counting variant.)"""

from __future__ import annotations

from torch import Tensor

from .base import Reward, as_reward_tensor, reward_config_error


def reward_fn_char_count(generated_sample: list[str], char: str = ".") -> Tensor:
    """Count of ``char`` in each sample, as a float tensor (B,). Counts characters, not tokens, so a
    token made of many periods scores many times: the reward the chapter shows being hacked."""
    return as_reward_tensor([sample.count(char) for sample in generated_sample])


def _check_char(reward: str, char) -> None:
    if not isinstance(char, str) or len(char) != 1:
        raise reward_config_error(f"{reward}: char must be a single character, got {char!r}")


class CharCount(Reward):
    """``reward_fn_char_count`` as a configurable reward (``char`` defaults to the period)."""

    def __init__(self, char: str = "."):
        """
        Args:
            char: the character counted (one character).
        """
        _check_char("CharCount", char)
        self.char = char

    def score(self, samples: list[str]) -> Tensor:
        return reward_fn_char_count(samples, self.char)


class CharFrequency(Reward):
    """The share of a sample's characters that are ``char``, in [0, 1].

    count / length in characters (0 for an empty sample).

    Resists the hack of packing more characters into the fixed budget of ``gen_len`` tokens: a
    token made of 64 periods no longer scores 64, it only moves the rate, and long ordinary words
    around the periods now cost reward. It does not stop a collapse into nothing but ``char`` (rate
    1); keep a KL penalty for that. The prompt counts in the length, the same for the whole group.
    """

    def __init__(self, char: str = "."):
        """
        Args:
            char: the character whose frequency is the reward (one character).
        """
        _check_char("CharFrequency", char)
        self.char = char

    def score(self, samples: list[str]) -> Tensor:
        return as_reward_tensor([sample.count(self.char) / max(1, len(sample)) for sample in samples])
