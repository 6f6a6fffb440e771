"""Prompts as data: sources, reproducible draws, one group per prompt, rewards that read the row, chat
prompts, padded prompts of different lengths, and a multi-prompt run with ending answers that resumes."""

from __future__ import annotations

import json
import sys

import lightning as L
import pytest
import torch
from test_module import make_module

from grpo_lightning import cli, policy_models
from grpo_lightning.config import GRPOConfigError
from grpo_lightning.objectives import generated_logprobs
from grpo_lightning.prompts import PromptFile, PromptList, describe_source
from grpo_lightning.rollout import left_pad, prompt_text

ROWS = [
    {"prompt": "This is", "answer": "a"},
    {"prompt": "The cat sat on the mat and", "answer": "b"},
    {"prompt": "Dr. Smith went", "answer": "c"},
]


# ---- sources ---------------------------------------------------------------------------------------


def test_files_of_each_kind_give_the_same_rows(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(row) for row in ROWS) + "\n\n")
    (tmp_path / "p.json").write_text(json.dumps(ROWS))
    (tmp_path / "p.csv").write_text("answer,text\n" + "".join(f'{r["answer"]},"{r["prompt"]}"\n' for r in ROWS))
    for name, column in (("p.jsonl", "prompt"), ("p.json", "prompt"), ("p.csv", "text")):
        source = PromptFile(str(tmp_path / name), prompt_column=column)
        assert source.all_rows() == ROWS, name
    assert PromptList(["x", {"prompt": "y", "k": 1}]).all_rows() == [{"prompt": "x"}, {"prompt": "y", "k": 1}]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\n{"prompt": \n', r"p\.jsonl:2: not a JSON object"),
    ('{"text": "a"}\n', r"row 1 has no 'prompt' column \(its columns: text\); name the prompt column with prompt_column"),
    ('{"prompt": ""}\n', r"row 1's prompt must be a non-empty string"),
    ("\n", r"p\.jsonl: no rows"),
])  # fmt: skip
def test_a_bad_prompt_file_is_one_line_naming_the_line(content, message, tmp_path):
    (tmp_path / "p.jsonl").write_text(content)
    with pytest.raises(GRPOConfigError, match=message):
        PromptFile(str(tmp_path / "p.jsonl"))


def test_draws_depend_on_seed_and_phase_only_and_cover_every_row_once_per_pass():
    source = PromptList([f"prompt {i}" for i in range(5)])
    phases = [source.draw(seed=3, phase=p, count=2) for p in range(5)]  # 10 draws: two passes over 5 rows
    assert phases == [source.draw(seed=3, phase=p, count=2) for p in range(5)]
    drawn = [row["prompt"] for rows in phases for row in rows]
    assert sorted(drawn[:5]) == sorted(drawn[5:]) == [f"prompt {i}" for i in range(5)]
    assert drawn[:5] != drawn[5:]  # each pass in its own order (fixed by the seed: checked, not assumed)
    assert [source.draw(seed=4, phase=p, count=2) for p in range(5)] != phases


def test_a_source_is_recorded_as_plain_data(tmp_path):
    assert describe_source(PromptList(["a"])) == {
        "class_path": "grpo_lightning.prompts.PromptList", "init_args": {"rows": ["a"], "prompt_column": "prompt"}
    }  # fmt: skip


# ---- padded prompts -----------------------------------------------------------------------------------


def test_left_padded_sequences_get_the_log_probabilities_they_get_alone(tiny_model_dir):
    from grpo_lightning import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    torch.manual_seed(0)
    short, long = torch.randint(1, 300, (2, 5)), torch.randint(1, 300, (3, 9))
    ids, mask = left_pad([short, long], pad_id=0)
    assert ids.shape == (5, 9) and mask[:2].tolist() == [[0] * 4 + [1] * 5] * 2 and bool(mask[2:].all())
    together = generated_logprobs(model, ids, gen_len=3, attention_mask=mask)
    alone = torch.cat([generated_logprobs(model, short, 3), generated_logprobs(model, long, 3)])
    assert torch.allclose(together, alone, rtol=0, atol=1e-5)
    assert left_pad([short, short], 0)[1] is None  # nothing padded: no mask


def test_the_groups_of_a_phase_are_sampled_together_as_each_would_be_alone(tiny_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    from grpo_lightning import load_causal_lm, rollout

    model, tokenizer = load_causal_lm(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": "The cat"}, {"prompt": "Periods end sentences, and so on"}, {"prompt": "I thought"}]
    decoded = []
    sample = rollout.sample_completions_with_logprobs
    monkeypatch.setattr(rollout, "sample_completions_with_logprobs",
                        lambda model, ids, *args, **kw: decoded.append(ids.shape[0]) or sample(model, ids, *args, **kw))
    monkeypatch.setattr(rollout, "ROWS_PER_DECODE", 8)  # groups of 4: two groups per decode
    torch.manual_seed(0)
    groups = rollout.sample_prompt_groups(model, tokenizer, rows, group_size=4, gen_len=5)  # fmt: skip
    assert decoded == [8, 4]
    for row, group in zip(rows, groups):
        prompt = rollout.prompt_ids(tokenizer, row["prompt"])
        assert group.row is row and group.sample_ids.shape == (4, prompt.shape[1] + 5)
        assert torch.equal(group.sample_ids[:, : prompt.shape[1]], prompt.expand(4, -1))  # unpadded
        # log pi_old kept from the padded decode = the group's own log pi, run alone and unpadded
        alone = generated_logprobs(model, group.sample_ids, 5)
        torch.testing.assert_close(group.logprobs, alone, rtol=0, atol=1e-5)
        assert group.completions == tokenizer.batch_decode(group.sample_ids[:, -5:], skip_special_tokens=True)


def test_chat_prompts_use_the_template_or_refuse(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert prompt_text(tokenizer, "Hi", None, chat_template=False) == "<|endoftext|>Hi"
    with pytest.raises(GRPOConfigError, match="no chat template"):
        prompt_text(tokenizer, "Hi", None, chat_template=True)
    tokenizer.chat_template = "{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}<a>"
    assert prompt_text(tokenizer, "Hi", None, chat_template=True) == "<u>Hi</u><a>"


# ---- a run with several prompts ------------------------------------------------------------------------


def answer_rewards(samples, completions, rows):
    """A function reward reading the row: the completion's length, plus 100 for rows whose answer is "b"."""
    return torch.tensor([len(c) + (100.0 if row["answer"] == "b" else 0.0) for c, row in zip(completions, rows)])


class KeepRollouts(L.Callback):
    def __init__(self):
        self.memories, self.rows = [], []

    def on_train_epoch_end(self, trainer, pl_module):
        self.memories.append(pl_module.memory)


def test_each_phase_samples_one_group_per_drawn_prompt_and_normalises_within_groups(tiny_model_dir, tmp_path):
    keep = KeepRollouts()
    source = PromptList(ROWS)
    grpo = make_module(tiny_model_dir, reward=answer_rewards, prompts=source, prompts_per_phase=2, batch_size=4,
                       num_minibatches=2, gen_len=4, total_phases=2)  # fmt: skip
    seen_rows = []
    original = grpo.draw_rows
    grpo.draw_rows = lambda: seen_rows.append(original()) or seen_rows[-1]
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[keep])  # fmt: skip
    trainer.fit(grpo)
    for phase, (memory, rows) in enumerate(zip(keep.memories, seen_rows)):
        assert rows == source.draw(seed=grpo.args.seed, phase=phase, count=2)
        assert memory.sample_ids.shape[0] == 8 and len(memory) == 2 * 2
        groups = memory.advantages.view(2, 4)
        assert torch.allclose(groups.sum(dim=1), torch.zeros(2), atol=1e-5)  # centred within each group
        # the +100 of row "b" is constant within its group: it never reaches the advantages
        assert groups.abs().max().item() < 2.0
        lengths = [len(r["prompt"]) for r in rows]
        if len(set(lengths)) > 1:
            assert memory.attention_mask is not None


def multi_prompt_args(model_dir: str, prompts: str, root) -> list[str]:
    return [
        "fit", "--model.model_name_or_path", model_dir, "--model.prompts", "grpo_lightning.prompts.PromptFile",
        "--model.prompts.path", prompts, "--model.prompts_per_phase", "2", "--model.batch_size", "4",
        "--model.num_minibatches", "2", "--model.gen_len", "6", "--model.stop_at_eos", "true",
        "--model.total_phases", "3", "--model.warmup_steps", "0", "--model.lr", "0.01",
        "--model.reward", "rewards.CharCount", "--model.reward.char", "e", "--model.export_dir", "null",
        "--trainer.precision", "32-true", "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar",
        "false",
    ]  # fmt: skip


def test_a_multi_prompt_run_with_ending_answers_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])
    monkeypatch.setattr(policy_models, "stop_token_ids", lambda tokenizer: list(range(20, 120)))  # answers end early
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(row) for row in ROWS))
    cli.main(multi_prompt_args(tiny_model_dir, str(prompts), tmp_path / "whole"))
    cli.main([*multi_prompt_args(tiny_model_dir, str(prompts), tmp_path / "cut"), "--trainer.max_steps", "8"])
    cli.main([*multi_prompt_args(tiny_model_dir, str(prompts), tmp_path / "cut"), "--ckpt_path", "last"])
    assert "resuming" in capsys.readouterr().out
    whole = torch.load(tmp_path / "whole/lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    resumed = torch.load(tmp_path / "cut/lightning_logs/version_1/checkpoints/last.ckpt", weights_only=True)
    assert whole["global_step"] == resumed["global_step"] == 3 * 4
    for key, value in whole["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key


def test_prompt_settings_are_checked(tiny_model_dir):
    with pytest.raises(GRPOConfigError, match=r"prompts_per_phase \(2\) needs prompts to draw from"):
        make_module(tiny_model_dir, prompts_per_phase=2)
    with pytest.raises(GRPOConfigError, match=r"batch_size x prompts_per_phase \(3 x 3\) must be divisible by num_minibatches \(2\)"):
        make_module(tiny_model_dir, prompts=PromptList(ROWS), prompts_per_phase=3, batch_size=3, num_minibatches=2)


def test_parquet_files_and_dataset_directories_give_the_same_rows(tmp_path):
    datasets = pytest.importorskip("datasets")  # installed by the dev extras, so CI runs this
    dataset = datasets.Dataset.from_list(ROWS)
    dataset.to_parquet(str(tmp_path / "p.parquet"))
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "splits"))
    for path in ("p.parquet", "saved", "splits"):
        assert PromptFile(str(tmp_path / path)).all_rows() == ROWS, path


def test_the_readme_examples_of_rewards_that_read_the_row_work():
    import os
    import re

    from rewards import Reward
    from rewards.base import call_reward

    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    code = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "class ExactNumber" in block)
    scope = {"Reward": Reward, "torch": torch}
    exec(code, scope)
    rows = [{"prompt": "What is 7 + 5?", "answer": "12"}] * 2
    completions = [" 12", " twelve, I think"]
    samples = [r["prompt"] + c for r, c in zip(rows, completions)]
    assert call_reward(scope["ExactNumber"](), samples, completions, rows).tolist() == [1.0, 0.0]
    assert call_reward(scope["answer_length"], samples, completions, rows).tolist() == [1.0, 0.0]
    with pytest.raises(TypeError, match="reads each sample's row"):
        scope["ExactNumber"]()(samples)  # no rows: said, not guessed


def flat_or_ranked(samples, completions, rows):
    """0 for every sample of a "flat" row (a group without signal); the sample's place in its group of 4 otherwise."""
    return torch.tensor([0.0 if row["answer"] == "flat" else float(i % 4) for i, row in enumerate(rows)])


class LoggedRefills(L.Callback):
    def __init__(self):
        self.refilled, self.zero = [], []

    def on_train_epoch_end(self, trainer, pl_module):
        self.refilled.append(float(trainer.callback_metrics["rollout/refilled_groups"]))
        self.zero.append(float(trainer.callback_metrics["rollout/zero_advantage_groups"]))


def test_dynamic_sampling_replaces_flat_groups_by_new_prompts(tiny_model_dir, tmp_path):
    from grpo_lightning.rollout import refill_seed

    rows = [{"prompt": f"flat {i}", "answer": "flat"} for i in range(3)] + [{"prompt": f"p {i}", "answer": "x"} for i in range(3)]
    source, logged = PromptList(rows), LoggedRefills()
    grpo = make_module(tiny_model_dir, reward=flat_or_ranked, prompts=source, prompts_per_phase=2, batch_size=4,
                       num_minibatches=2, gen_len=3, total_phases=3, refill_flat_groups=2)  # fmt: skip
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[logged])  # fmt: skip
    trainer.fit(grpo)
    for phase in range(3):  # what the draws say, by hand: flat groups are replaced up to twice
        drawn = source.draw(grpo.args.seed, phase, 2)
        flat = [i for i, row in enumerate(drawn) if row["answer"] == "flat"]
        refilled = 0
        for round_ in (1, 2):
            if not flat:
                break
            refilled += len(flat)
            new = source.draw(refill_seed(grpo.args.seed, round_), phase, len(flat))
            flat = [slot for slot, row in zip(flat, new) if row["answer"] == "flat"]
        assert logged.refilled[phase] == refilled
        assert logged.zero[phase] == len(flat) / 2
    assert sum(logged.refilled) > 0  # the draws did hit flat rows: the test exercised the refill


def test_dynamic_sampling_needs_prompts(tiny_model_dir):
    with pytest.raises(GRPOConfigError, match=r"refill_flat_groups \(1\) must be >= 0, and needs prompts"):
        make_module(tiny_model_dir, refill_flat_groups=1)
