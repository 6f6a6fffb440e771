"""Held-out evaluation, run by Lightning's validation loop: how well the policy answers prompts it never
trained on, decoded greedily so that the number moves only when the policy does.

With ``model.eval_prompts`` set (a fixed ``PromptSource``, e.g. ``ArithmeticProblems`` with
``split: heldout``), every ``eval_every_n_phases`` phases (and once before the first phase, unless
``eval_before_training`` is false) each held-out prompt is asked the way training asks it (chat
template or start token), answered greedily up to ``gen_len`` tokens (ending at the end-of-turn token
with ``stop_at_eos``), and scored with the training reward, row and all. Logged:

  ``eval/mean_reward``  the mean reward of the greedy answers
  ``eval/accuracy``     the share of prompts whose greedy answer earns the full reward (>= 1), which is
                        the share of right answers for an exact-answer reward (``rewards.ExactAnswer``)

to TensorBoard (with a table of a few answers) and as one console line. ``grpo-lightning validate
--config ... --ckpt_path ...`` evaluates a checkpoint; without ``--ckpt_path``, the starting model.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric, SumMetric

from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from .config import GRPOConfigError
from .distributed import rank_and_world
from .evaluation import greedy_rewards
from .prompts import PromptSource, Row
from .rollout import prompt_text

# Prompts decoded together. A batch is also the unit a requested stop waits for (a few seconds on a CPU).
EVAL_BATCH_SIZE = 20

# An answer earns "full reward" at this reward or above: 1 is what an exact-answer reward pays.
SOLVED_AT = 1.0


def heldout_rows(source: PromptSource) -> list[Row]:
    """Every row of a fixed prompt source, or a one-line error for a source without a fixed set."""
    try:
        rows = source.all_rows()
    except NotImplementedError as error:
        raise GRPOConfigError(
            f"eval_prompts must be a fixed set of prompts, but {type(source).__name__} is not one ({error})"
        ) from error
    if not rows:
        raise GRPOConfigError(f"eval_prompts ({type(source).__name__}) holds no prompts")
    return rows


def heldout_loader(source: PromptSource | None, batch_size: int = EVAL_BATCH_SIZE) -> DataLoader | list:
    """The held-out rows in batches of plain row lists, in order; an empty list (no validation) without a
    source. The loader has a generator of its own, so iterating it draws nothing from the global RNG
    (a resumed run must see the same random numbers as an uninterrupted one)."""
    if source is None:
        return []
    return DataLoader(heldout_rows(source), batch_size=batch_size, collate_fn=list, generator=torch.Generator())


class HeldOutScores(torch.nn.Module):
    """The scores of one held-out evaluation, accumulated over its batches; torchmetrics sums them over
    processes in a multi-process run. Its states are not saved in checkpoints."""

    def __init__(self, examples_kept: int = 8):
        super().__init__()
        self.mean_reward = MeanMetric()
        self.accuracy = MeanMetric()
        self.count = SumMetric()
        self.examples_kept = examples_kept
        self.examples: list[tuple[str, str, str, float]] = []  # (prompt, answer, completion, reward), this process

    def update(self, rows: list[Row], completions: list[str], rewards: torch.Tensor) -> None:
        rewards = rewards.float().cpu()
        self.mean_reward.update(rewards)
        self.accuracy.update((rewards >= SOLVED_AT).float())
        self.count.update(float(len(rewards)))
        for row, completion, reward in zip(rows, completions, rewards.tolist()):
            if len(self.examples) < self.examples_kept:
                self.examples.append((row["prompt"], str(row.get("answer", "")), completion, reward))

    def compute(self) -> dict[str, torch.Tensor]:
        return {
            "eval/accuracy": self.accuracy.compute(),
            "eval/mean_reward": self.mean_reward.compute(),
            "eval/prompts": self.count.compute(),
        }

    def reset(self) -> None:
        for metric in (self.mean_reward, self.accuracy, self.count):
            metric.reset()
        self.examples = []


def heldout_line(when: str, scores: dict[str, torch.Tensor]) -> str:
    """One console line: "Held-out after phase 5/60: accuracy 45.0 % (27/60), mean reward 0.450"."""
    count = int(scores["eval/prompts"])
    accuracy = float(scores["eval/accuracy"])
    right = round(accuracy * count) if math.isfinite(accuracy) else 0
    return (
        f"Held-out {when}: accuracy {100 * accuracy:.1f} % ({right}/{count}), "
        f"mean reward {float(scores['eval/mean_reward']):.3f}"
    )


def examples_markdown(examples: list[tuple[str, str, str, float]]) -> str:
    """A few held-out answers as a Markdown table for TensorBoard's text tab."""
    lines = ["| prompt | answer | greedy completion | reward |", "|---|---|---|---|"]
    for prompt, answer, completion, reward in examples:
        cells = [text.replace("|", "\\|").replace("\n", " ") for text in (prompt, answer, completion)]
        lines.append(f"| {cells[0]} | {cells[1]} | {cells[2]} | {reward:.3f} |")
    return "\n".join(lines)


class HeldOutEvaluation:
    """The validation-loop hooks of ``GRPOModule`` (a mixin): they read its ``eval_prompts``, ``policy``,
    ``tokenizer``, ``reward``, ``start_token``, ``chat_template``, ``stop_tokens``, ``args`` and
    ``heldout`` (a ``HeldOutScores``), and ``rollout_precision_context`` for the evaluation before training."""

    @property
    def validate_command(self) -> bool:
        """Whether this is ``trainer.validate`` (``grpo-lightning validate``), not a fit's validation loop."""
        return self.trainer.state.fn == TrainerFn.VALIDATING

    def val_dataloader(self):
        if self.eval_prompts is None and self.validate_command:
            raise GRPOConfigError("validate needs held-out prompts: set model.eval_prompts (see experiments/arithmetic.yaml)")
        return heldout_loader(self.eval_prompts)

    def validation_step(self, rows: list[dict], batch_idx: int) -> None:
        render = lambda prompt: prompt_text(self.tokenizer, prompt, self.start_token, self.chat_template)  # noqa: E731
        completions, rewards = greedy_rewards(self.policy, self.tokenizer, rows, self.reward, self.args.gen_len,
                                              self.stop_tokens, render=render)  # fmt: skip
        self.heldout.update(rows, completions, rewards)

    def on_validation_epoch_end(self) -> None:
        scores = self.heldout.compute()
        self.log_dict(scores, batch_size=1)
        if self.validate_command:  # a checkpoint, or the starting model
            path = self.trainer.ckpt_path
            when = f"of {path}" if path else "of the starting model"
        else:
            when = f"after phase {self.current_epoch + 1}/{self.args.total_phases}"
        self.report_heldout(scores, when)

    def evaluate_starting_model(self) -> None:
        """The held-out scores of the model before any training, logged at step 0 (Lightning's validation
        loop cannot run before the first epoch)."""
        self.policy.eval()
        rank, world_size = rank_and_world(self)
        with torch.no_grad(), self.rollout_precision_context():
            for index, rows in enumerate(heldout_loader(self.eval_prompts)):
                if index % world_size == rank:  # under DDP each rank its share of the batches; compute() sums them
                    self.validation_step(rows, index)
        scores = self.heldout.compute()
        if self.logger is not None:
            self.logger.log_metrics({name: float(value) for name, value in scores.items()}, step=0)
        self.report_heldout(scores, "before training")

    def report_heldout(self, scores: dict[str, Tensor], when: str) -> None:
        if self.trainer.is_global_zero:
            print(f"\n{heldout_line(when, scores)}", flush=True)
            experiment = getattr(self.logger, "experiment", None)
            if hasattr(experiment, "add_text") and self.heldout.examples:
                experiment.add_text("eval/answers", examples_markdown(self.heldout.examples), self.global_step)
        self.heldout.reset()
