"""``--ckpt_path``: what the user typed wins over the checkpoint, which wins over the defaults; settings that
shape the weights or the reward's kind are refused if changed; a finished run is extended, never re-run."""

from __future__ import annotations

import sys

import pytest
import torch
import yaml
from conftest import refuse_model_loading

from grpo_lightning import cli, policy_models
from grpo_lightning.optim import warmup_linear_decay
from grpo_lightning.resume import changed_settings, phases_done, resume_conflicts

LR = 0.004


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])


def first_run(model_dir: str, root) -> list[str]:
    return [
        "--model.model_name_or_path", model_dir, "--model.total_phases", "2", "--model.warmup_steps", "0",
        "--model.batch_size", "4", "--model.num_minibatches", "2", "--model.gen_len", "5", "--model.lr", str(LR),
        "--model.reward", "rewards.CharCount", "--model.reward.char", "e", "--model.samples_shown", "0",
        "--model.export_dir", "null", "--trainer.precision", "32-true", "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    ]  # fmt: skip


@pytest.fixture
def finished_run(tiny_model_dir, tmp_path, capsys):
    cli.main(["fit", *first_run(tiny_model_dir, tmp_path)])
    capsys.readouterr()
    return tmp_path


def exit_of(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    return exit_info.value.code, capsys.readouterr().err


def test_extending_a_finished_run_takes_the_untyped_settings_from_the_checkpoint(finished_run, capsys):
    root = finished_run
    # Neither the model nor gen_len nor the reward is typed: they come from the checkpoint, not the defaults.
    cli.main([
        "fit", "--ckpt_path", "last", "--model.total_phases", "4", "--model.lr", "0.002",
        "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
        "--trainer.precision", "32-true",
    ])  # fmt: skip
    out = capsys.readouterr().out
    checkpoint_path = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"resuming {checkpoint_path}: 2 of 4 phases done; changed: lr 0.004 -> 0.002, total_phases 2 -> 4" in out
    assert "Phase 003/004" in out and "Phase 004/004" in out and "Phase 002/004" not in out
    settings = yaml.safe_load((root / "lightning_logs" / "version_1" / "config.yaml").read_text())["model"]
    assert settings["gen_len"] == 5 and settings["model_name_or_path"].endswith("tiny-llama0")
    assert settings["reward"] == {"class_path": "rewards.CharCount", "init_args": {"char": "e"}}
    final = torch.load(root / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["global_step"] == 4 * 2 * 2  # 4 phases of 2 minibatches x 2 passes
    # The schedule is laid out again over 4 phases with the new lr: after 4 scheduler steps, lr x final_scale.
    group = final["optimizer_states"][0]["param_groups"][0]
    assert group["initial_lr"] == 0.002
    assert group["lr"] == pytest.approx(0.002 * warmup_linear_decay(4, 0, 0.1)(4), rel=1e-12)


def test_a_finished_run_is_not_resumed_into_nothing(finished_run, capsys):
    code, err = exit_of(["fit", "--ckpt_path", "last", "--trainer.default_root_dir", str(finished_run)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "has already run 2 of total_phases 2: nothing is left to train; pass --model.total_phases above 2" in err


def test_settings_that_shape_the_weights_or_the_reward_cannot_change(finished_run, tmp_path, monkeypatch, capsys):
    refuse_model_loading(monkeypatch, policy_models)
    other_model = tmp_path / "other-model"
    other_model.mkdir()
    code, err = exit_of([
        "fit", "--ckpt_path", "last", "--trainer.default_root_dir", str(finished_run), "--model.total_phases", "4",
        "--model.model_name_or_path", str(other_model), "--model.lora", "true",
        "--model.reward", "rewards.VaderSentiment",
    ], capsys)  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: cannot resume ")
    assert f"model_name_or_path is {finished_run}" not in err  # it names the model directories
    assert f"not {other_model}" in err
    assert "lora is off in the checkpoint, not r=16, target_modules=default" in err
    assert "reward is rewards.CharCount in the checkpoint, not rewards.VaderSentiment" in err
    assert err.rstrip().endswith("drop them to continue the run as it was, or start a new run without --ckpt_path")


def test_last_with_no_checkpoint_is_one_line(tmp_path, monkeypatch, capsys):
    refuse_model_loading(monkeypatch, policy_models)
    code, err = exit_of(["fit", "--ckpt_path", "last", "--trainer.default_root_dir", str(tmp_path)], capsys)
    assert code == 2 and err == f"error: --ckpt_path last: no checkpoint under {tmp_path}/ (a checkpoint is written at the end of each phase); start without --ckpt_path, or pass a .ckpt file\n"


def test_a_missing_or_truncated_checkpoint_is_one_line_before_any_model_loads(tmp_path, monkeypatch, capsys):
    refuse_model_loading(monkeypatch, policy_models)
    code, err = exit_of(["fit", "--ckpt_path", str(tmp_path / "no.ckpt")], capsys)
    assert code == 2 and err.startswith(f"error: no checkpoint at {tmp_path / 'no.ckpt'}: pass an existing .ckpt file")
    truncated = tmp_path / "cut.ckpt"
    torch.save({"state_dict": {"w": torch.randn(64, 64)}}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:3000])
    code, err = exit_of(["fit", "--ckpt_path", str(truncated)], capsys)
    assert code == 2 and err.count("\n") == 1 and "cut.ckpt is truncated or not a checkpoint" in err


# ---- the comparisons, by hand ---------------------------------------------------------------------


def test_conflicts_are_each_named_and_equal_spellings_are_not_conflicts(tmp_path):
    saved = {"model_name_or_path": None, "lora": None, "reward": None, "lr": 1e-5}
    assert resume_conflicts(saved, {"model_name_or_path": None, "lora": False, "reward": {"class_path": "rewards.CharCount"}}) == []
    assert resume_conflicts(saved, dict(saved, reward={"class_path": "rewards.char_count.CharCount"})) == []
    lora = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "merge_on_export": False}
    with_lora = dict(saved, lora=lora)
    # alpha, dropout and export are not part of the weights' shape: they may change
    assert resume_conflicts(with_lora, dict(with_lora, lora=dict(lora, alpha=64, merge_on_export=True))) == []
    assert resume_conflicts(with_lora, dict(with_lora, lora=dict(lora, r=4))) == [
        "lora is r=8, target_modules=['q_proj', 'v_proj'] in the checkpoint, not r=4, target_modules=['q_proj', 'v_proj']"
    ]
    assert resume_conflicts(saved, dict(saved, model_name_or_path="org/other")) == [
        "model_name_or_path is the embedded default in the checkpoint, not org/other"
    ]


def test_changed_settings_are_listed_in_order_without_the_fixed_ones():
    saved = {"lr": 1e-5, "total_phases": 10, "gen_len": 30, "reward": None, "seed": 1}
    asked = {"lr": 2e-5, "total_phases": 20, "gen_len": 30, "reward": {"class_path": "rewards.CharCount"}, "seed": 1}
    assert changed_settings(saved, asked) == ["lr 1e-05 -> 2e-05", "total_phases 10 -> 20"]


def test_phases_done_counts_processed_epochs():
    progress = {"loops": {"fit_loop": {"epoch_progress": {"current": {"ready": 3, "started": 3, "processed": 3, "completed": 2}}}}}
    assert phases_done(progress) == 3
    assert phases_done({"epoch": 4}) == 5  # no loop state: saved at the end of epoch 4


def test_a_setting_this_version_does_not_know_is_said_and_ignored(finished_run, capsys):
    path = finished_run / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["hyper_parameters"]["retired_setting"] = 7
    older = finished_run / "older.ckpt"
    torch.save(checkpoint, older)
    cli.main(["fit", "--ckpt_path", str(older), "--model.total_phases", "3", "--trainer.default_root_dir",
              str(finished_run), "--trainer.enable_progress_bar", "false"])  # fmt: skip
    out = capsys.readouterr().out
    assert f"warning: {older} has a setting model.retired_setting that this version does not know; ignored" in out
    assert "Phase 003/003" in out
