"""A weighted sum of rewards, e.g. sentiment plus a small term for something else."""

from __future__ import annotations

import re

import torch
from torch import Tensor

from .base import Reward, RewardModule, prepare_reward, reward_config_error


class WeightedSum(RewardModule):
    """The weighted sum of several rewards: sum_i weights[i] * rewards[i](samples).

    Each component is checked like a reward on its own (one finite float per sample; an error names
    the component and the samples), and its unweighted scores are kept in ``last_components``
    (name -> (B,) tensor) for logging. Components are named by their class (a function by its
    name), with ``_<index>`` appended where two share a name. Components that hold networks
    (``SentimentClassifier``) are child modules, so they move to the training device with the policy.
    """

    def __init__(self, rewards: list[Reward], weights: list[float] | None = None):
        """
        Args:
            rewards: the component rewards (``class_path``/``init_args`` blocks in YAML).
            weights: one weight per reward; unset (null) weighs each 1.0.
        """
        super().__init__()
        rewards = list(rewards)
        weights = [1.0] * len(rewards) if weights is None else [float(w) for w in weights]
        if not rewards:
            raise reward_config_error("WeightedSum: rewards must hold at least one reward")
        if len(weights) != len(rewards):
            raise reward_config_error(
                f"WeightedSum: got {len(weights)} weights for {len(rewards)} rewards; pass one weight per reward"
            )
        not_callable = [i for i, r in enumerate(rewards) if not callable(r)]
        if not_callable:
            raise reward_config_error(f"WeightedSum: rewards at indices {not_callable} are not callable")
        self.rewards = rewards
        self.weights = weights
        # Registered as children (plain lists hide modules from Lightning's device placement).
        self._networks = torch.nn.ModuleList([r for r in rewards if isinstance(r, torch.nn.Module)])
        names = [_tag_name(r) for r in rewards]
        self._names = [f"{n}_{i}" if names.count(n) > 1 else n for i, (n, r) in enumerate(zip(names, rewards))]

    @property
    def component_names(self) -> list[str]:
        """The names ``last_components`` uses, in the order of ``rewards``."""
        return list(self._names)

    def setup(self) -> None:
        for reward in self.rewards:
            prepare_reward(reward)

    def score(self, samples: list[str]) -> Tensor:
        return self._weighted(samples, None, None)

    def score_rows(self, completions: list[str], rows: list[dict]) -> Tensor:
        # Each component gets the rows too: a row-reading component (an exact answer) can sit beside others.
        samples = [row["prompt"] + completion for completion, row in zip(completions, rows)]
        return self._weighted(samples, completions, rows)

    def _weighted(self, samples: list[str], completions, rows) -> Tensor:
        from grpo_lightning.reward_checks import score_samples

        components = {
            name: score_samples(reward, samples, completions, rows) for name, reward in zip(self._names, self.rewards)
        }
        self.last_components = components
        total = torch.zeros(len(samples), dtype=torch.float32)
        for weight, values in zip(self.weights, components.values()):
            total += weight * values
        return total


def _tag_name(reward) -> str:
    """A short name usable in a metric tag: the class of a ``Reward``, the name of a function."""
    name = reward.name if isinstance(reward, Reward) else getattr(reward, "__name__", None) or type(reward).__name__
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
