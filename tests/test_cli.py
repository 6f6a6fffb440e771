"""The command line: one-line errors before any model loads, the experiment configs, a tiny real fit."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from grpo_lightning import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# reward_model.yaml configures `grpo-lightning reward-model fit` (tests/test_reward_model.py), not GRPO.
EXPERIMENTS = sorted(p for p in glob.glob(os.path.join(REPO, "experiments", "*.yaml")) if "reward_model" not in p)


# Every test here runs the command line (conftest.plain_argv).
pytestmark = pytest.mark.usefixtures("plain_argv")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.batch_size", "6", "--model.num_minibatches", "4"], "batch_size (6) must be divisible by num_minibatches (4)"),
        (["--model.total_phases", "5", "--model.warmup_steps", "5"], "total_phases (5) must be greater than warmup_steps (5)"),
        (["--model.gen_len", "0"], "gen_len (0) must be at least 1"),
        (["--model.temperature", "0"], "temperature (0.0) must be > 0"),
        (["--model.clip_coef", "1.0"], "clip_coef (1.0) must lie strictly between 0 and 1"),
        (["--model.kl_coef", "-0.1"], "kl_coef (-0.1) must be >= 0"),
        (["--model.prompt", " "], "prompt must be a non-empty string"),
        (["--model.model_name_or_path", "./no/such/model"], "no model directory at './no/such/model'"),
    ],
)
def test_bad_settings_stop_with_one_line_before_any_model_loads(flags, message, capsys, no_model_loading, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", *flags, "--trainer.default_root_dir", str(tmp_path)])
    assert exit_info.value.code == 2  # a usage error
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]
    assert not [line for line in err if "Traceback" in line]


def test_unknown_option_is_one_line_too(capsys, no_model_loading):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--model.batch_szie", "3"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: unrecognized arguments: --model.batch_szie 3 (did you mean model.batch_size?)"
    )


def test_fit_keeps_freed_memory_for_the_next_step(monkeypatch, no_model_loading):
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory_for_reuse", lambda: calls.append(True))
    with pytest.raises(SystemExit):
        cli.main(["fit", "--model.batch_szie", "3"])
    assert calls == [True]  # set before anything is parsed or loaded (machine.keep_freed_memory_for_reuse)


@pytest.mark.parametrize("config", EXPERIMENTS, ids=os.path.basename)
def test_every_experiment_config_parses_and_instantiates(config, no_model_loading, tmp_path):
    # A learned reward names a reward model directory, which only a `reward-model fit` run makes: any directory here.
    learned = ["--model.reward.init_args.model_name_or_path", str(tmp_path)]
    learned = learned if os.path.basename(config).startswith("rlhf") else []
    app = cli.make_cli(["--config", config, "--trainer.default_root_dir", str(tmp_path), *learned], run=False)
    args = app.model.args
    assert app.trainer.max_epochs == args.total_phases  # one epoch per phase, linked
    assert app.trainer.gradient_clip_val == args.max_grad_norm
    assert callable(app.model.reward)


def test_experiments_exist():
    names = {os.path.basename(p) for p in EXPERIMENTS}
    assert {"quickstart.yaml", "smoke_kl0.yaml", "periods_kl025.yaml"} <= names


def test_fit_from_the_command_line_writes_logs_checkpoint_and_export(tiny_model_dir, tmp_path, capsys):
    cli.main([
        "fit", "--model.model_name_or_path", tiny_model_dir, "--model.total_phases", "2", "--model.warmup_steps", "0",
        "--model.batch_size", "4", "--model.num_minibatches", "2", "--model.gen_len", "4",
        "--model.reward", "rewards.CharCount", "--model.reward.char", " ",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert "Phase 001/002, Mean reward:" in out and "Phase 002/002, Mean reward:" in out
    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert list(run_dir.glob("events.out.tfevents.*"))
    assert (run_dir / "hf_model" / "config.json").exists() and (run_dir / "hf_model" / "tokenizer.json").exists()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    per_phase = {
        "rollout/reward_mean", "rollout/reward_std", "rollout/reward_min", "rollout/reward_max",
        "rollout/kl_k1", "rollout/kl_k3", "rollout/entropy", "rollout/zero_advantage_groups",
        "rollout/distinct_samples", "rollout/distinct_1", "rollout/distinct_2",
        "train/ratio_mean_phase", "train/ratio_max_phase",
        "perf/generate_s", "perf/score_s", "perf/ref_logprobs_s", "perf/learn_s", "perf/phase_s",
        "perf/generated_tokens_per_s", "perf/checkpoint_wait_s",
    }  # fmt: skip
    per_step = {
        "train/objective", "train/clipped_surrogate", "train/kl_penalty", "train/clip_fraction",
        "train/ratio_mean", "train/ratio_max", "train/lr", "train/grad_norm",
    }  # fmt: skip
    assert per_phase | per_step <= scalars, sorted(per_phase | per_step - scalars)
    assert [len(events.Scalars(tag)) for tag in sorted(per_phase)] == [2] * len(per_phase)
    assert [len(events.Scalars(tag)) for tag in sorted(per_step)] == [8] * len(per_step)  # 2 phases x 2 minibatches x 2 passes
    # 16 tokens generated per phase (4 completions x 4 tokens): tokens/s x seconds gives them back.
    for rate, seconds in zip(events.Scalars("perf/generated_tokens_per_s"), events.Scalars("perf/generate_s")):
        assert rate.value * seconds.value == pytest.approx(16, rel=1e-5)
    for distinct in events.Scalars("rollout/distinct_samples"):
        assert distinct.value in (0.25, 0.5, 0.75, 1.0)  # 1 to 4 distinct of 4 completions
    assert {"rollout/rewards", "rollout/advantages"} <= set(events.Tags()["histograms"])
    assert [len(events.Histograms(tag)) for tag in ("rollout/rewards", "rollout/advantages")] == [2, 2]
    assert "rollout/samples/text_summary" in events.Tags()["tensors"]
    table = events.Tensors("rollout/samples/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "Advantage" in table and table.count("\n") >= 4 + 1  # header, rule and all 4 samples (8 asked)


def test_python_dash_m_and_console_script_start_the_cli():
    console_script = os.path.join(os.path.dirname(sys.executable), "grpo-lightning")  # installed beside python
    for command in ([sys.executable, "-m", "grpo_lightning", "fit", "--help"], [console_script, "fit", "--help"]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "--model.kl_coef" in result.stdout and "--model.reward" in result.stdout


def test_a_run_prints_no_lightning_advertisement_or_empty_validation_warning():
    """Lightning's hosted-logger tip and its warning about the empty validation loader (no held-out prompts: no
    validation, on purpose) are kept off the run's output; Lightning's other lines and other warnings stay."""
    script = (
        "import logging, warnings\n"
        "import grpo_lightning.module\n"
        "from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "rank_zero_info('💡 Tip: For seamless cloud logging, try installing [litlogger]')\n"
        "rank_zero_info('GPU available: False, used: False')\n"
        "rank_zero_warn('Total length of `list` across ranks is zero. Please make sure this was your intention.')\n"
        "rank_zero_warn('Total length of `DataLoader` across ranks is zero. Please make sure this was your intention.')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "GPU available: False, used: False" in result.stderr
    assert "Total length of `DataLoader`" in result.stderr  # a loader that should have held batches still warns
    assert "💡" not in result.stderr and "litlogger" not in result.stderr
    assert "Total length of `list`" not in result.stderr
