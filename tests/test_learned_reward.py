"""``rewards.LearnedReward``: a trained reward model used as a reward, by one class_path in a GRPO config:
it scores like the model it loads, is frozen, stays out of checkpoints, and the trained policy's
checkpoint can be labelled again (``label --ckpt``), closing the loop."""

from __future__ import annotations

import io
import sys

import lightning as L
import pytest
import torch

from conftest import period_rule_pairs, write_jsonl
from grpo_lightning import cli, label
from grpo_lightning.preferences import read_preferences
from grpo_lightning.reward_model import PreferenceData, RewardModelModule
from rewards import LearnedReward


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A tiny reward model trained on the period rule (the recipe of test_reward_model), exported."""
    root = tmp_path_factory.mktemp("reward-model")
    data = PreferenceData(write_jsonl(root / "prefs.jsonl", period_rule_pairs(400)), val_fraction=0.25, batch_size=16,
                          max_length=32, model_name_or_path=tiny_model_dir)  # fmt: skip
    module = RewardModelModule(tiny_model_dir, lr=3e-3)
    trainer = L.Trainer(max_epochs=6, default_root_dir=str(root), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, precision="32-true")  # fmt: skip
    trainer.fit(module, data)
    return str(root / "hf_model")


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])


def test_scores_order_the_rule_and_do_not_depend_on_batching(reward_model_dir):
    reward = LearnedReward(reward_model_dir, max_length=32)
    fresh = period_rule_pairs(64, seed=7)
    chosen = reward([r["prompt"] + r["chosen"] for r in fresh])
    rejected = reward([r["prompt"] + r["rejected"] for r in fresh])
    assert chosen.shape == (64,) and chosen.dtype == torch.float32
    assert (chosen > rejected).float().mean() >= 0.9
    one_at_a_time = LearnedReward(reward_model_dir, batch_size=1, max_length=32)(["The cat.", "The cat sat on. the mat."])
    torch.testing.assert_close(one_at_a_time, reward(["The cat.", "The cat sat on. the mat."]))  # padding is ignored
    squashed = LearnedReward(reward_model_dir, output="sigmoid", max_length=32)([r["prompt"] + r["chosen"] for r in fresh])
    torch.testing.assert_close(squashed, torch.sigmoid(chosen))
    assert not any(p.requires_grad for p in reward.parameters()) and not reward.training


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"output": "probability"}, "LearnedReward: output must be one of ['raw', 'sigmoid']"),
        ({"batch_size": 0}, "LearnedReward: batch_size (0) must be at least 1"),
        ({"model_name_or_path": "./no/such/reward-model"}, "LearnedReward: model_name_or_path: no model directory"),
    ],
)
def test_bad_settings_name_the_reward(reward_model_dir, kwargs, message):
    with pytest.raises(ValueError) as error:
        LearnedReward(**{"model_name_or_path": reward_model_dir, **kwargs})
    assert message in str(error.value)


def test_a_grpo_config_trains_against_it_and_labels_the_result(tiny_model_dir, reward_model_dir, tmp_path, capsys):
    cli.main([
        "fit", "--model.model_name_or_path", tiny_model_dir, "--model.prompt", "The", "--model.total_phases", "2",
        "--model.warmup_steps", "0", "--model.batch_size", "4", "--model.num_minibatches", "2", "--model.gen_len", "6",
        "--model.reward", "rewards.LearnedReward", "--model.reward.model_name_or_path", reward_model_dir,
        "--model.reward.max_length", "32", "--trainer.default_root_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false",
    ])  # fmt: skip
    assert "Phase 002/002, Mean reward:" in capsys.readouterr().out
    ckpt = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, weights_only=True)
    assert not [key for key in checkpoint["state_dict"] if key.startswith("reward.")]  # kept out of checkpoints
    assert checkpoint["hyper_parameters"]["reward"]["class_path"] == "rewards.LearnedReward"

    # The trained policy, labelled again: its checkpoint's prompt by default.
    out = tmp_path / "round2.jsonl"
    argv = ["--ckpt", str(ckpt), "--out", str(out), "--gen-len", "6", "--auto", "periods", "--pairs", "4"]
    assert label.main(argv, out=io.StringIO()) == 0
    pairs = read_preferences(out)
    assert len(pairs) >= 4 and {p.prompt for p in pairs} == {"The"}


def test_a_bad_output_in_a_config_is_one_line(reward_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["fit", "--model.reward", "rewards.LearnedReward", "--model.reward.model_name_or_path", reward_model_dir,
                  "--model.reward.output", "logit", "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "LearnedReward: output must be one of ['raw', 'sigmoid']" in err[-1]
