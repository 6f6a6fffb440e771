"""``grpo-lightning reward-model fit``: a Bradley-Terry reward model learns a hidden rule from labelled
pairs (held-out accuracy far above chance), is saved in Hugging Face format, and bad preference data
stops with one line naming the file and line, before any model loads."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import period_rule_pairs, write_jsonl
from grpo_lightning.cli import main
from grpo_lightning.preferences import PreferenceError, parse_line, read_preferences, training_pairs
from grpo_lightning.reward_model import bradley_terry_loss, split_pairs

# Measured: 400 rule-labelled pairs (100 held out), 6 epochs at lr 3e-3 on the tiny Llama of conftest:
# held-out accuracy 0.99 (99 of 100), val/margin 3.5, in ~7 s on 2 cores. Chance is 0.5.
ACCURACY_THRESHOLD = 0.9


def fit(tmp_path, data: str, model_dir: str, *extra: str) -> None:
    main([
        "reward-model", "fit", "--model.model_name_or_path", model_dir, "--data.path", data,
        "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.precision", "32-true",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", *extra,
    ])  # fmt: skip


def scalars(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_learns_a_hidden_rule_from_pairs(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "prefs.jsonl", period_rule_pairs(400, seed=0))
    fit(tmp_path, data, tiny_model_dir, "--model.lr", "3e-3", "--trainer.max_epochs", "6",
        "--data.batch_size", "16", "--data.max_length", "32", "--data.val_fraction", "0.25")  # fmt: skip
    run = tmp_path / "runs" / "lightning_logs" / "version_0"
    logged = scalars(run)
    assert {"train/loss", "train/accuracy", "val/loss", "val/accuracy", "val/margin"} <= set(logged)
    assert logged["val/accuracy"][-1] >= ACCURACY_THRESHOLD
    assert logged["val/margin"][-1] > 1.0
    assert logged["train/loss"][-1] < math.log(2)  # below chance's loss

    # Saved in Hugging Face format, and the latest link points at it; it orders fresh pairs by the rule.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from grpo_lightning.reward_model import prepare_tokenizer, score_texts

    assert (tmp_path / "runs" / "latest_hf_model").resolve() == (run / "hf_model").resolve()
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "runs" / "latest_hf_model")
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(run / "hf_model"))
    fresh = period_rule_pairs(100, seed=99)
    chosen = score_texts(model, tokenizer, [r["prompt"] + r["chosen"] for r in fresh], 32)
    rejected = score_texts(model, tokenizer, [r["prompt"] + r["rejected"] for r in fresh], 32)
    assert (chosen > rejected).float().mean() >= ACCURACY_THRESHOLD


def test_lora_exports_a_plain_merged_model(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "prefs.jsonl", period_rule_pairs(40, seed=1))
    fit(tmp_path, data, tiny_model_dir, "--model.lora", "true", "--model.lr", "1e-2", "--trainer.max_epochs", "1")
    out = tmp_path / "runs" / "lightning_logs" / "version_0" / "hf_model"
    from safetensors.torch import load_file

    keys = load_file(out / "model.safetensors").keys()
    assert "score.weight" in keys and not any("lora" in key for key in keys)
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out).num_labels == 1


def refuse(*args, **kwargs):
    raise AssertionError("a model was loaded although the data is invalid")


BAD = [
    ("", "prefs.jsonl: no pairs (the file is empty)"),
    ('{"prompt": "a", "chosen": " b", "rejected": " c"}\n{"prompt": "a", "chosen": " b", "rejected": " c"',
     "prefs.jsonl:2: not valid JSON (Expecting ',' delimiter at column 49) (the last line is incomplete"),
    ('{"prompt": "a", "chosen": " b", "rejected": " c"}\n\n{"prompt": "a", "chosen": " b"}\n',
     "prefs.jsonl:3: missing column 'rejected'"),
    ('{"prompt": "a", "chosen": " b", "rejected": " b"}\n', "prefs.jsonl:1: 'chosen' and 'rejected' are the same text"),
    ('{"prompt": "a", "chosen": [{"role": "user"}], "rejected": " b"}\n',
     "prefs.jsonl:1: column 'chosen' must be a string, got list (conversational"),
    ('["a", "b"]\n', "prefs.jsonl:1: expected a JSON object"),
    ('{"prompt": "a", "chosen": " b", "rejected": " b", "tie": true}\n', "prefs.jsonl: only ties (1)"),
    (b'{"prompt": "a", "chosen": " \xff", "rejected": " b"}\n', "prefs.jsonl:1: not UTF-8 text"),
]  # fmt: skip


@pytest.mark.parametrize("content, message", BAD)
def test_bad_data_is_one_line_and_loads_no_model(monkeypatch, capsys, tmp_path, tiny_model_dir, content, message):
    for name in ("load_tokenizer", "load_reward_backbone"):
        monkeypatch.setattr(f"grpo_lightning.reward_model.{name}", refuse)
    path = tmp_path / "prefs.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SystemExit) as stop:
        fit(tmp_path, str(path), tiny_model_dir)  # a real model directory: only the data is at fault
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert path.read_bytes() == (content if isinstance(content, bytes) else content.encode())  # nothing lost


def test_a_missing_file_is_one_line(capsys, tmp_path, tiny_model_dir):
    with pytest.raises(SystemExit) as stop:
        fit(tmp_path, str(tmp_path / "none.jsonl"), tiny_model_dir)
    assert stop.value.code == 2
    assert "none.jsonl: no such preference file" in capsys.readouterr().err


def test_implicit_prompt_format_and_ties(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"chosen": "Q: hi A: hello", "rejected": "Q: hi A: go away"},
        {"prompt": "x", "chosen": " y", "rejected": " y", "tie": True},
        {"prompt": "x", "chosen": " y", "rejected": " z", "score_chosen": 7},  # extra columns are ignored
    ])  # fmt: skip
    pairs = read_preferences(path)
    assert pairs[0].chosen_text == "Q: hi A: hello" and pairs[0].prompt == ""
    assert [p.tie for p in pairs] == [False, True, False]
    assert [p.chosen_text for p in training_pairs(path)] == ["Q: hi A: hello", "x y"]
    with pytest.raises(PreferenceError, match="f:7: column 'tie' must be true or false"):
        parse_line('{"chosen": "a", "rejected": "b", "tie": "yes"}\n', "f:7")


def test_bradley_terry_loss_and_split():
    assert bradley_terry_loss(torch.zeros(3), torch.zeros(3)).item() == pytest.approx(math.log(2))
    assert bradley_terry_loss(torch.tensor([5.0]), torch.tensor([-5.0])).item() < 1e-4
    train, val = split_pairs(list(range(10)), 0.2, seed=3)
    assert sorted(train + val) == list(range(10)) and len(val) == 2
    assert split_pairs(list(range(10)), 0.2, seed=3) == (train, val)  # seeded
    assert split_pairs(list(range(10)), 0.0, seed=3)[1] == []


def test_the_experiment_config_parses(tmp_path, monkeypatch):
    from grpo_lightning.reward_model import make_reward_model_cli

    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])
    config = str(Path(__file__).resolve().parents[1] / "experiments" / "reward_model.yaml")
    data = write_jsonl(tmp_path / "p.jsonl", period_rule_pairs(10))
    app = make_reward_model_cli(["--config", config, "--data.path", data, "--trainer.default_root_dir", str(tmp_path)],
                                run=False)  # fmt: skip
    assert app.model.hparams.model_name_or_path is None and app.datamodule.model_name_or_path is None  # linked
    assert len(app.datamodule.train_pairs) == 8 and len(app.datamodule.val_pairs) == 2
