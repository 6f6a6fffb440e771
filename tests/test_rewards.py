"""The rewards package and score_samples' refusal of unusable rewards."""

from __future__ import annotations

import re

import pytest
import torch
from torch.testing import assert_close

from grpo_lightning.config import GRPOError
from grpo_lightning.reward_checks import RewardError, score_samples
from rewards import CharCount, Reward, reward_fn_char_count, reward_name

A = "This is a test."
B = "......"
C = "Whatever"


# ---------------------------------------------------------------------------------------------
# reward_fn_char_count / CharCount (the reference's checks)
# ---------------------------------------------------------------------------------------------


def test_char_count_reference_checks():
    out = reward_fn_char_count([A])
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor([1.0]), atol=0, rtol=0)
    assert_close(reward_fn_char_count([A, B, C]), torch.tensor([1.0, 6.0, 0.0]), atol=0, rtol=0)
    assert_close(reward_fn_char_count([A], " "), torch.tensor([3.0]), atol=0, rtol=0)


def test_char_count_counts_characters_not_tokens():
    # a run of 64 periods is one token for GPT-2's tokenizer but 64 characters
    assert reward_fn_char_count(["." * 64 + " end."]).tolist() == [65.0]


def test_char_count_empty_batch():
    out = reward_fn_char_count([])
    assert out.shape == (0,)
    assert out.dtype == torch.float32


def test_char_count_class():
    reward = CharCount()
    assert isinstance(reward, Reward)
    assert reward.name == "CharCount"
    assert reward_name(reward) == "CharCount"
    assert reward.char == "."
    assert_close(reward([A, B, C]), torch.tensor([1.0, 6.0, 0.0]), atol=0, rtol=0)
    assert_close(CharCount(" ")([A, B, C]), torch.tensor([3.0, 0.0, 0.0]), atol=0, rtol=0)
    assert_close(CharCount("e").score([A, C]), torch.tensor([1.0, 2.0]), atol=0, rtol=0)


@pytest.mark.parametrize("bad", ["", "ab", 1, None])
def test_char_count_class_rejects_non_single_characters(bad):
    with pytest.raises(ValueError, match="single character"):
        CharCount(bad)


class Length(Reward):
    def score(self, samples):
        return torch.tensor([float(len(s)) for s in samples])


class Named(Reward):
    @property
    def name(self):
        return "my-named-reward"

    def score(self, samples):
        return torch.ones(len(samples))


def test_reward_subclass_usage():
    reward = Length()
    assert reward.name == "Length"
    assert_close(reward(["ab", "", "abcd"]), torch.tensor([2.0, 0.0, 4.0]), atol=0, rtol=0)
    assert_close(score_samples(reward, ["ab", "", "abcd"]), torch.tensor([2.0, 0.0, 4.0]), atol=0, rtol=0)
    assert reward_name(Named()) == "my-named-reward"


def test_reward_is_abstract():
    class NoScore(Reward):
        pass

    with pytest.raises(TypeError):
        NoScore()


def test_reward_name_of_plain_callables():
    def my_reward(samples):
        return torch.zeros(len(samples))

    assert reward_name(my_reward).endswith("my_reward")
    assert reward_name(reward_fn_char_count) == "reward_fn_char_count"


# ---------------------------------------------------------------------------------------------
# score_samples
# ---------------------------------------------------------------------------------------------


def test_score_samples_passes_good_rewards():
    out = score_samples(reward_fn_char_count, [A, B, C])
    assert out.dtype == torch.float32
    assert out.device.type == "cpu"
    assert_close(out, torch.tensor([1.0, 6.0, 0.0]), atol=0, rtol=0)


def test_score_samples_detaches():
    w = torch.tensor(2.0, requires_grad=True)
    out = score_samples(lambda s: w * torch.ones(len(s)), ["a", "b"])
    assert not out.requires_grad
    assert_close(out, torch.tensor([2.0, 2.0]), atol=0, rtol=0)


def test_score_samples_reward_raising():
    def exploding_reward(samples):
        raise ValueError("boom")

    with pytest.raises(RewardError) as excinfo:
        score_samples(exploding_reward, ["a"])
    message = str(excinfo.value)
    assert "exploding_reward" in message
    assert "ValueError" in message and "boom" in message
    assert isinstance(excinfo.value.__cause__, ValueError)
    assert isinstance(excinfo.value, GRPOError)


def test_score_samples_reward_subclass_raising_is_named_by_its_class():
    class Broken(Reward):
        def score(self, samples):
            raise KeyError("missing")

    with pytest.raises(RewardError, match=r"reward Broken raised KeyError"):
        score_samples(Broken(), ["a", "b"])


@pytest.mark.parametrize("n_out", [2, 4, 0])
def test_score_samples_wrong_length(n_out):
    def short_reward(samples):
        return torch.zeros(n_out)

    with pytest.raises(RewardError) as excinfo:
        score_samples(short_reward, ["a", "b", "c"])
    message = str(excinfo.value)
    assert "short_reward" in message
    assert f"({n_out},)" in message and "3 samples" in message, message


def test_score_samples_wrong_rank():
    def column_reward(samples):
        return torch.zeros(len(samples), 1)

    with pytest.raises(RewardError, match=re.escape("shape (3, 1)")):
        score_samples(column_reward, ["a", "b", "c"])


@pytest.mark.parametrize("value", ["1.0", None, {"a": 1.0}, ["x", "y"]])
def test_score_samples_wrong_type(value):
    def odd_reward(samples):
        return value

    with pytest.raises(RewardError) as excinfo:
        score_samples(odd_reward, ["a", "b"])
    message = str(excinfo.value)
    assert "odd_reward" in message
    assert type(value).__name__ in message, message


def test_score_samples_wrong_dtype():
    def complex_reward(samples):
        return torch.ones(len(samples), dtype=torch.complex64)

    with pytest.raises(RewardError, match="complex64"):
        score_samples(complex_reward, ["a", "b"])


@pytest.mark.parametrize(
    "values, indices",
    [
        ([1.0, float("nan"), 2.0, float("inf")], "[1, 3] (2 of 4)"),
        ([float("-inf"), 0.0, 0.0, 0.0], "[0] (1 of 4)"),
        ([0.0, 0.0, 0.0, float("nan")], "[3] (1 of 4)"),
    ],
)
def test_score_samples_non_finite_names_indices(values, indices):
    def bad_reward(samples):
        return torch.tensor(values)

    with pytest.raises(RewardError) as excinfo:
        score_samples(bad_reward, ["a", "b", "c", "d"])
    message = str(excinfo.value)
    assert "bad_reward" in message
    assert "NaN or inf" in message
    assert indices in message, message


def test_score_samples_non_finite_many_indices_are_truncated():
    def all_nan(samples):
        return torch.full((len(samples),), float("nan"))

    with pytest.raises(RewardError) as excinfo:
        score_samples(all_nan, ["x"] * 12)
    assert "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ...] (12 of 12)" in str(excinfo.value)


def test_score_samples_accepts_ints_and_lists():
    out = score_samples(lambda s: torch.tensor([1, 2, 3]), ["a", "b", "c"])
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor([1.0, 2.0, 3.0]), atol=0, rtol=0)

    out = score_samples(lambda s: [1, 0, 5], ["a", "b", "c"])
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor([1.0, 0.0, 5.0]), atol=0, rtol=0)

    out = score_samples(lambda s: [0.5, -1.25], ["a", "b"])
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor([0.5, -1.25]), atol=0, rtol=0)

    out = score_samples(lambda s: torch.tensor([0.25, 1.5], dtype=torch.float64), ["a", "b"])
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor([0.25, 1.5]), atol=0, rtol=0)

    out = score_samples(lambda s: torch.tensor([True, False]), ["a", "b"])
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor([1.0, 0.0]), atol=0, rtol=0)
