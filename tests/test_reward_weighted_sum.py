"""WeightedSum: arithmetic, the components it keeps for logging, its errors, and how it is
described, configured and placed (its networks are child modules)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from grpo_lightning.config import GRPOConfigError
from grpo_lightning.reward_checks import RewardError, score_samples
from rewards import CharCount, CharFrequency, Reward, RewardModule, VaderSentiment, WeightedSum, describe_reward

SAMPLES = ["A. B. C.", "no", "x.y"]  # periods 3, 0, 1; lengths 8, 2, 3


def test_weighted_sum_arithmetic_and_components():
    reward = WeightedSum([CharCount("."), CharFrequency("."), CharCount(" ")], [2.0, -4.0, 0.5])
    out = reward(SAMPLES)
    expected = [2 * 3 - 4 * 3 / 8 + 0.5 * 2, 0.0, 2 * 1 - 4 * 1 / 3 + 0.0]  # 5.5, 0, 2/3
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor(expected), atol=1e-6, rtol=0)
    assert reward.component_names == ["CharCount_0", "CharFrequency", "CharCount_2"]
    assert list(reward.last_components) == reward.component_names
    assert_close(reward.last_components["CharCount_0"], torch.tensor([3.0, 0.0, 1.0]), atol=0, rtol=0)  # unweighted
    assert_close(reward.last_components["CharFrequency"], torch.tensor([3 / 8, 0.0, 1 / 3]), atol=1e-7, rtol=0)
    assert_close(reward.last_components["CharCount_2"], torch.tensor([2.0, 0.0, 0.0]), atol=0, rtol=0)
    reward(["...."])
    assert_close(reward.last_components["CharCount_0"], torch.tensor([4.0]), atol=0, rtol=0)  # the last call's


def test_weighted_sum_default_weights_and_plain_functions():
    def length(samples):
        return torch.tensor([float(len(s)) for s in samples])

    reward = WeightedSum([CharCount("."), length])
    assert reward.weights == [1.0, 1.0]
    assert_close(reward(SAMPLES), torch.tensor([11.0, 2.0, 4.0]), atol=0, rtol=0)
    assert reward.component_names == ["CharCount", "length"]


def test_single_part_rewards_have_no_components():
    reward = CharCount()
    reward(SAMPLES)
    assert reward.last_components == {}


@pytest.mark.parametrize(
    "rewards, weights, message",
    [
        ([], None, "WeightedSum: rewards must hold at least one reward"),
        ([CharCount()], [1.0, 2.0], "WeightedSum: got 2 weights for 1 rewards"),
        ([CharCount(), "CharCount"], None, r"WeightedSum: rewards at indices \[1\] are not callable"),
    ],
)
def test_weighted_sum_bad_settings(rewards, weights, message):
    with pytest.raises(GRPOConfigError, match=message):
        WeightedSum(rewards, weights)


class NaNForSecondSample(Reward):
    def score(self, samples):
        values = torch.ones(len(samples))
        values[1] = float("nan")
        return values


class Exploding(Reward):
    def score(self, samples):
        raise RuntimeError("out of coffee")


class TooShort(Reward):
    def score(self, samples):
        return torch.zeros(len(samples) - 1)


@pytest.mark.parametrize(
    "component, message",
    [
        (NaNForSecondSample(), r"reward NaNForSecondSample returned NaN or inf for samples \[1\] \(1 of 3\)"),
        (Exploding(), r"reward Exploding raised RuntimeError: out of coffee"),
        (TooShort(), r"reward TooShort returned shape \(2,\) for 3 samples"),
    ],
)
def test_weighted_sum_errors_name_the_component_and_the_samples(component, message):
    reward = WeightedSum([CharCount(), component], [1.0, 0.0])  # even at weight 0, a bad component stops
    with pytest.raises(RewardError, match=rf"^reward WeightedSum raised RewardError: {message}"):
        score_samples(reward, SAMPLES)


def test_weighted_sum_is_described_recursively():
    reward = WeightedSum([VaderSentiment("neg"), CharCount(".")], [1.0, 0.25])
    assert describe_reward(reward) == {
        "class_path": "rewards.weighted_sum.WeightedSum",
        "init_args": {
            "rewards": [
                {"class_path": "rewards.vader.VaderSentiment", "init_args": {"direction": "neg"}},
                {"class_path": "rewards.char_count.CharCount", "init_args": {"char": "."}},
            ],
            "weights": [1.0, 0.25],
        },
    }
    expected = "WeightedSum(rewards=[VaderSentiment(direction='neg'), CharCount(char='.')], weights=[1.0, 0.25])"
    assert repr(reward) == expected


class Scaled(RewardModule):
    """A reward holding a parameter, standing in for a classifier."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.constant_(self.scale.weight, 3.0)

    def score(self, samples):
        lengths = torch.tensor([[float(len(s))] for s in samples], device=self.device)
        return self.scale(lengths).squeeze(-1).cpu()


def test_weighted_sum_holds_network_components_as_frozen_child_modules():
    scaled = Scaled()
    reward = WeightedSum([CharCount(), scaled], [1.0, 0.5])
    assert isinstance(reward, torch.nn.Module)
    assert [p is scaled.scale.weight for p in reward.parameters()] == [True]  # moved by .to() with it
    parent = torch.nn.Module()
    parent.reward = reward
    parent.train()
    assert not any(m.training for m in reward.modules())
    out = reward(SAMPLES)
    assert not scaled.scale.weight.requires_grad  # frozen once prepared
    assert not out.requires_grad
    assert_close(out, torch.tensor([3 + 0.5 * 24, 0.5 * 6, 1 + 0.5 * 9]), atol=1e-5, rtol=0)


def test_weighted_sum_from_yaml_through_the_cli(tmp_path, monkeypatch):
    import sys

    from grpo_lightning import cli, policy_models

    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])
    monkeypatch.setattr(policy_models, "load_causal_lm", None)  # nothing may load: run=False
    config = tmp_path / "weighted.yaml"
    config.write_text(
        "model:\n"
        "  reward:\n"
        "    class_path: rewards.WeightedSum\n"
        "    init_args:\n"
        "      rewards:\n"
        "        - class_path: rewards.VaderSentiment\n"
        "          init_args: {direction: neg}\n"
        "        - class_path: rewards.CharFrequency\n"
        "          init_args: {char: '!'}\n"
        "      weights: [1.0, 2.0]\n"
    )
    app = cli.make_cli(["--config", str(config), "--trainer.default_root_dir", str(tmp_path)], run=False)
    reward = app.model.reward
    assert isinstance(reward, WeightedSum) and reward.weights == [1.0, 2.0]
    assert [type(r).__name__ for r in reward.rewards] == ["VaderSentiment", "CharFrequency"]
    assert reward.rewards[0].direction == "neg" and reward.rewards[1].char == "!"
    vader = VaderSentiment("neg")(["Awful!!", "Fine."])
    assert_close(reward(["Awful!!", "Fine."]), vader + 2 * torch.tensor([2 / 7, 0.0]), atol=1e-6, rtol=0)
