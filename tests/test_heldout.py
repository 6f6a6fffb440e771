"""Held-out evaluation in Lightning's validation loop (grpo_lightning.heldout): what it scores, when it runs,
where the numbers go, and ``grpo-lightning validate``."""

from __future__ import annotations


import pytest
import torch
import yaml

from grpo_lightning import cli
from grpo_lightning.config import GRPOConfigError
from grpo_lightning.evaluation import greedy_rewards
from grpo_lightning.heldout import HeldOutScores, examples_markdown, heldout_line, heldout_loader
from grpo_lightning.models import load_causal_lm, load_tokenizer
from grpo_lightning.prompts import PromptList
from grpo_lightning.rollout import prompt_text
from grpo_lightning.tasks import ArithmeticProblems
from rewards import CharCount

pytestmark = pytest.mark.usefixtures("plain_argv")  # the tests that run the command line need it

EVAL_ROWS = ["The cat", "This is", "Dr. Smith", "I thought", "Periods end", "Commas"]


def test_scores_are_the_mean_reward_and_the_share_of_full_rewards():
    scores = HeldOutScores(examples_kept=2)
    rows = [{"prompt": "p1", "answer": "1"}, {"prompt": "p2"}, {"prompt": "p3"}]
    scores.update(rows, ["a", "b", "c"], torch.tensor([1.0, 0.0, 2.0]))
    scores.update([{"prompt": "p4"}], ["d"], torch.tensor([0.5]))
    values = scores.compute()
    assert values["eval/mean_reward"].item() == pytest.approx((1 + 0 + 2 + 0.5) / 4, abs=1e-7)
    assert values["eval/accuracy"].item() == pytest.approx(2 / 4, abs=1e-7)  # 1.0 and 2.0 are full rewards
    assert values["eval/prompts"].item() == 4
    assert heldout_line("after phase 3/10", values) == "Held-out after phase 3/10: accuracy 50.0 % (2/4), mean reward 0.875"
    assert scores.examples == [("p1", "1", "a", 1.0), ("p2", "", "b", 0.0)]
    assert examples_markdown([("1 | 2", "3", "x\ny", 0.5)]).splitlines()[-1] == "| 1 \\| 2 | 3 | x y | 0.500 |"
    scores.reset()
    scores.update([{"prompt": "p"}], ["e"], torch.tensor([0.25]))
    assert scores.compute()["eval/mean_reward"].item() == 0.25 and scores.examples == [("p", "", "e", 0.25)]


def test_the_loader_gives_every_held_out_row_in_order_and_refuses_a_stream():
    assert heldout_loader(None) == []
    batches = list(heldout_loader(PromptList(EVAL_ROWS[:5]), batch_size=2))
    assert [[row["prompt"] for row in batch] for batch in batches] == [EVAL_ROWS[:2], EVAL_ROWS[2:4], EVAL_ROWS[4:5]]
    rows = [row for batch in heldout_loader(ArithmeticProblems(split="heldout")) for row in batch]
    assert rows == ArithmeticProblems(split="heldout").all_rows() and len(rows) == 60
    state = torch.random.get_rng_state()
    list(heldout_loader(PromptList(EVAL_ROWS)))
    assert torch.equal(torch.random.get_rng_state(), state)  # a resumed run sees the same random numbers
    with pytest.raises(GRPOConfigError, match="eval_prompts must be a fixed set of prompts, but ArithmeticProblems is not one"):
        heldout_loader(ArithmeticProblems(split="train"))


def write_config(path, model_dir: str, root, **model) -> str:
    settings = {
        "model_name_or_path": model_dir,
        "reward": {"class_path": "rewards.CharCount", "init_args": {"char": "e"}},
        "prompts": {"class_path": "grpo_lightning.prompts.PromptList", "init_args": {"rows": ["a b", "The", "I"]}},
        "eval_prompts": {"class_path": "grpo_lightning.prompts.PromptList", "init_args": {"rows": EVAL_ROWS}},
        "eval_every_n_phases": 1, "prompts_per_phase": 2, "batch_size": 4, "num_minibatches": 2,
        "batches_per_learning_phase": 1, "gen_len": 6, "total_phases": 2, "warmup_steps": 0, "lr": 0.02,
        "kl_coef": 0.0, "samples_shown": 2,
        **model,
    }  # fmt: skip
    # On the CPU everywhere: the checks below count on the CPU's sampled stream moving the greedy answers (on
    # an H200 the fp32 run's stream left them where they were).
    trainer = {"accelerator": "cpu", "precision": "32-true", "default_root_dir": str(root), "enable_progress_bar": False}
    path.write_text(yaml.safe_dump({"model": settings, "trainer": trainer}))
    return str(path)


def expected_scores(model_dir: str) -> tuple[float, float]:
    """(accuracy, mean reward) of the held-out prompts, computed apart from the run: greedy answers of the
    model in ``model_dir`` to start token + prompt, scored by CharCount("e")."""
    model, tokenizer = load_causal_lm(model_dir), load_tokenizer(model_dir)
    rows = [{"prompt": prompt} for prompt in EVAL_ROWS]
    render = lambda prompt: prompt_text(tokenizer, prompt, None, False)  # noqa: E731
    _, rewards = greedy_rewards(model, tokenizer, rows, CharCount("e"), max_new_tokens=6, render=render)
    return (rewards >= 1).float().mean().item(), rewards.mean().item()


def scalars(run_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_a_run_evaluates_before_training_and_after_each_phase_and_validate_evaluates_a_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    config = write_config(tmp_path / "run.yaml", tiny_model_dir, tmp_path / "runs")
    cli.main(["fit", "--config", config])
    out = capsys.readouterr().out
    run_dir = tmp_path / "runs/lightning_logs/version_0"
    logged = scalars(run_dir)
    # Before training (step 0), then after each phase of 2 steps, at the step of the phase's other epoch
    # metrics: its last one (1 and 3), as Lightning logs them.
    assert logged["eval/accuracy"].keys() == logged["eval/prompts"].keys() == {0, 1, 3}
    assert set(logged["eval/prompts"].values()) == {6.0}
    assert sorted(logged["rollout/reward_mean"]) == [1, 3]

    before = expected_scores(tiny_model_dir)
    after = expected_scores(str(run_dir / "hf_model"))  # the exported policy: the weights after phase 2
    assert before != after  # lr 0.02: the policy's greedy answers moved, so the check below can tell them apart
    for step, (accuracy, mean_reward) in ((0, before), (3, after)):
        assert logged["eval/accuracy"][step] == pytest.approx(accuracy, abs=1e-6)
        assert logged["eval/mean_reward"][step] == pytest.approx(mean_reward, abs=1e-6)
    right = round(before[0] * 6)
    assert f"Held-out before training: accuracy {100 * before[0]:.1f} % ({right}/6), mean reward {before[1]:.3f}" in out
    assert "Held-out after phase 1/2: accuracy" in out and "Held-out after phase 2/2: accuracy" in out

    # grpo-lightning validate: the checkpoint of phase 2 scores what the run logged after phase 2
    checkpoint = run_dir / "checkpoints/last.ckpt"
    cli.main(["validate", "--config", config, "--ckpt_path", str(checkpoint)])
    out = capsys.readouterr().out
    assert f"evaluating {checkpoint}, after 2 of 2 phases" in out
    right = round(after[0] * 6)
    assert f"Held-out of {checkpoint}: accuracy {100 * after[0]:.1f} % ({right}/6), mean reward {after[1]:.3f}" in out
    # without a checkpoint: the starting model
    right = round(before[0] * 6)
    cli.main(["validate", "--config", config])
    out = capsys.readouterr().out
    assert f"Held-out of the starting model: accuracy {100 * before[0]:.1f} % ({right}/6), mean reward {before[1]:.3f}" in out


def test_evaluation_every_n_phases_and_not_before_training(tiny_model_dir, tmp_path, monkeypatch):
    config = write_config(tmp_path / "run.yaml", tiny_model_dir, tmp_path / "runs", total_phases=4,
                          eval_every_n_phases=2, eval_before_training=False)  # fmt: skip
    cli.main(["fit", "--config", config])
    logged = scalars(tmp_path / "runs/lightning_logs/version_0")
    assert sorted(logged["eval/accuracy"]) == [3, 7]  # after phases 2 and 4 (2 steps each), none at 0


def test_validate_without_held_out_prompts_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path / "run.yaml", tiny_model_dir, tmp_path / "runs", eval_prompts=None)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["validate", "--config", config])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: validate needs held-out prompts: set model.eval_prompts (see experiments/arithmetic.yaml)"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fit", "--config", config, "--model.eval_every_n_phases", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: eval_every_n_phases (0) must be at least 1"


def test_a_held_out_stream_is_one_line_before_any_weights_load(tiny_model_dir, tmp_path, no_model_loading, capsys):
    stream = {"class_path": "grpo_lightning.tasks.ArithmeticProblems", "init_args": {"split": "train"}}
    config = write_config(tmp_path / "run.yaml", tiny_model_dir, tmp_path / "runs", eval_prompts=stream)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fit", "--config", config])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: eval_prompts must be a fixed set of prompts, but ArithmeticProblems is not one (ArithmeticProblems(split='train') is an endless stream"
    )
    assert not (tmp_path / "runs").exists()
