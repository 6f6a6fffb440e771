"""Rewards: callables mapping samples (prompt + completion strings) to a float tensor (B,)."""

from .base import Reward, reward_name
from .char_count import CharCount, reward_fn_char_count

__all__ = ["Reward", "CharCount", "reward_fn_char_count", "reward_name"]
