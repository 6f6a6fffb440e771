"""The README's "Writing your own reward" example, run exactly as written: its module and its YAML
are copied out of the README into a temporary directory and trained through the command line for
one short phase on the tiny model."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from grpo_lightning import cli
from rewards import Reward

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")


def readme_section(title: str) -> str:
    text = open(README, encoding="utf-8").read()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def code_blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.fixture
def example(tmp_path, monkeypatch):
    """The README's module and config, written where their first comment line says."""
    section = readme_section("Writing your own reward")
    (python,) = code_blocks(section, "python")
    (yaml,) = code_blocks(section, "yaml")
    assert python.startswith("# my_rewards.py\n") and yaml.startswith("# my_exclamations.yaml\n")
    (tmp_path / "my_rewards.py").write_text(python)
    (tmp_path / "my_exclamations.yaml").write_text(yaml)
    monkeypatch.syspath_prepend(str(tmp_path))  # what PYTHONPATH=. does in the README's command
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])
    yield tmp_path
    sys.modules.pop("my_rewards", None)


def test_readme_example_is_short_and_its_command_uses_the_yaml():
    section = readme_section("Writing your own reward")
    (python,) = code_blocks(section, "python")
    assert len(python.strip().splitlines()) <= 20
    (command,) = code_blocks(section, "bash")
    assert "--config experiments/quickstart.yaml --config my_exclamations.yaml" in command


def test_readme_example_scores_by_hand(example):
    from my_rewards import Exclamations

    reward = Exclamations(cap=3)
    assert isinstance(reward, Reward)
    out = reward(["Wow!", "no", "!!!!!", "a!b!"])
    assert out.dtype == torch.float32
    assert out.tolist() == [1.0, 0.0, 3.0, 2.0]


def test_readme_example_trains_through_the_command_line(example, tiny_model_dir, capsys, monkeypatch):
    root = example / "runs"
    cli.main([
        "fit", "--config", os.path.join(REPO, "experiments", "quickstart.yaml"),
        "--config", str(example / "my_exclamations.yaml"),
        "--model.model_name_or_path", tiny_model_dir, "--model.total_phases", "1", "--model.warmup_steps", "0",
        "--model.batch_size", "4", "--model.num_minibatches", "2", "--model.gen_len", "6", "--model.samples_shown", "4",
        "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
    ])  # fmt: skip
    assert "Phase 001/001, Mean reward:" in capsys.readouterr().out
    run_dir = root / "lightning_logs" / "version_0"
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    reward = checkpoint["hyper_parameters"]["reward"]
    assert reward == {"class_path": "my_rewards.Exclamations", "init_args": {"cap": 3}}

    # the rewards shown for the phase's 4 samples are the example's, computed by hand here
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    (table,) = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("rollout/samples/text_summary")]
    # | Reward | Advantage | Ref log-prob | Sample |, the sample markdown-escaped ("!" is left as is)
    rows = re.findall(r"^\| ([-\d.]+) \| \S+ \| \S+ \| (.*) \|$", table, flags=re.M)
    assert len(rows) == 4, table
    for reward, cell in rows:
        assert cell.startswith("This is")  # quickstart's prompt
        assert float(reward) == min(cell.count("!"), 3), (reward, cell)
