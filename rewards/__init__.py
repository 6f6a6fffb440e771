"""Rewards: callables mapping samples (prompt + completion strings) to a float tensor (B,).

Subclass ``Reward`` (or ``RewardModule`` for a reward holding a network) and implement ``score``;
any plain function ``reward_fn(samples) -> Tensor`` works too. Built in:

* ``CharCount`` (the reference's period count), ``CharTokenCount`` (tokens containing the
  character) and ``CharFrequency`` (count per character of the sample), the last two resisting
  the multi-period-token hack;
* ``SentimentClassifier`` (any Hugging Face sequence classifier) and ``VaderSentiment`` (offline);
* ``ExactAnswer``: 1 where the completion's last number is the row's answer (a verifiable task,
  with ``grpo_lightning.tasks.ArithmeticProblems``);
* ``WeightedSum`` of rewards;
* ``LearnedReward``: a reward model trained on preferences (``grpo-lightning reward-model fit``).
"""

from .base import Reward, RewardModule, describe_reward, prepare_reward, reward_name
from .char_count import CharCount, CharFrequency, reward_fn_char_count
from .char_tokens import CharTokenCount
from .exact_answer import ExactAnswer
from .learned import LearnedReward
from .sentiment import SentimentClassifier
from .vader import VaderSentiment
from .weighted_sum import WeightedSum

__all__ = [
    "Reward", "RewardModule", "CharCount", "CharTokenCount", "CharFrequency", "ExactAnswer", "SentimentClassifier",
    "VaderSentiment", "WeightedSum", "LearnedReward", "reward_fn_char_count", "reward_name", "describe_reward",
    "prepare_reward",
]  # fmt: skip
