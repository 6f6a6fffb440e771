"""The Reward and RewardModule base classes: setup runs once, networks stay frozen and in eval
mode under any trainer precision, and describe_reward records rewards as plain data."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from grpo_lightning.reward_checks import RewardError, score_samples
from rewards import CharCount, Reward, RewardModule, describe_reward, prepare_reward, reward_fn_char_count


class CountsSetups(Reward):
    def __init__(self, fail_first: bool = False):
        self.fail_first = fail_first
        self._setups = 0
        self._table = None

    def setup(self):
        self._setups += 1
        if self.fail_first and self._setups == 1:
            raise OSError("disk not ready")
        self._table = {"a": 1.0, "b": 2.0}

    def score(self, samples):
        return torch.tensor([self._table.get(s, 0.0) for s in samples])


def test_setup_runs_once_before_the_first_score():
    reward = CountsSetups()
    assert reward._setups == 0
    assert_close(reward(["a", "b", "c"]), torch.tensor([1.0, 2.0, 0.0]), atol=0, rtol=0)
    reward(["a"])
    prepare_reward(reward)
    assert reward._setups == 1


def test_a_failed_setup_is_reported_and_retried():
    reward = CountsSetups(fail_first=True)
    with pytest.raises(RewardError, match=r"^reward CountsSetups raised OSError: disk not ready$"):
        score_samples(reward, ["a"])
    assert_close(score_samples(reward, ["b"]), torch.tensor([2.0]), atol=0, rtol=0)
    assert reward._setups == 2


def test_prepare_reward_accepts_plain_functions():
    prepare_reward(reward_fn_char_count)  # nothing to set up, no error


class Doubler(RewardModule):
    """len(sample) through a dropout-then-linear network with weight 2: deterministic only in eval mode."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Dropout(0.9), torch.nn.Linear(1, 1, bias=False))
        torch.nn.init.constant_(self.net[1].weight, 2.0)

    def score(self, samples):
        self.seen_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        x = torch.tensor([[float(len(s))] for s in samples], device=self.device)
        out = self.net(x).squeeze(-1)
        self.seen_grad = torch.is_grad_enabled()
        self.out_dtype = out.dtype
        return out


def test_reward_module_is_frozen_deterministic_and_full_precision():
    reward = Doubler()
    parent = torch.nn.Module()
    parent.reward = reward
    parent.train()  # a trainer switching everything to train mode must not switch dropout on
    samples = ["abc", "a" * 1000]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the trainer's bf16-mixed rollout context
        out = reward(samples)
    assert_close(out, torch.tensor([6.0, 2000.0]), atol=0, rtol=0)
    assert reward.seen_dtype is None and reward.out_dtype == torch.float32  # autocast was off inside
    assert reward.seen_grad is False
    assert not reward.net[1].weight.requires_grad
    assert not reward.training and not reward.net[0].training
    assert reward.device == torch.device("cpu")
    assert_close(reward(["a" * 1001]), torch.tensor([2002.0]), atol=0, rtol=0)  # 2002 is not bf16-representable


def test_reward_module_and_abc_mix():
    assert isinstance(Doubler(), Reward) and isinstance(Doubler(), torch.nn.Module)

    class NoScore(RewardModule):
        pass

    with pytest.raises(TypeError):
        NoScore()


def test_describe_reward_plain_and_not_plain():
    assert describe_reward(CharCount(",")) == {"class_path": "rewards.char_count.CharCount", "init_args": {"char": ","}}
    assert describe_reward(CountsSetups(True)) == {
        "class_path": f"{__name__}.CountsSetups",
        "init_args": {"fail_first": True},  # underscore attributes are state, not settings
    }
    assert describe_reward(Doubler()) == {"class_path": f"{__name__}.Doubler", "init_args": {}}

    class HoldsAnObject(Reward):
        def __init__(self):
            self.table = {"a": 1}

        def score(self, samples):
            return torch.zeros(len(samples))

    assert describe_reward(HoldsAnObject()) == "HoldsAnObject(table={'a': 1})"  # repr, not pickled
    assert describe_reward(reward_fn_char_count) == "rewards.char_count.reward_fn_char_count"


class LoadsInSetup(RewardModule):
    def __init__(self):
        super().__init__()
        self._net = None

    def setup(self):
        self._net = torch.nn.Linear(1, 1)

    def score(self, samples):
        return torch.zeros(len(samples))


def test_networks_loaded_in_setup_join_the_device_the_reward_was_moved_to():
    reward = LoadsInSetup()
    assert reward.device == torch.device("cpu")
    parent = torch.nn.Module()
    parent.reward = reward
    parent.to("meta")  # as Lightning moves the LightningModule to the training device, before any score
    assert reward.device.type == "meta"
    reward.prepare()
    assert [p.device.type for p in reward.parameters()] == ["meta", "meta"]
    assert list(parent.state_dict()) == ["reward._net.weight", "reward._net.bias"]  # the marker is not saved
