"""Hyperparameters of a GRPO run, their defaults, and the checks that stop bad settings early.

``GRPO_Args`` keeps the reference chapter's names and defaults so that code written against the
chapter (``ReplayMemory(args, ...)``, ``get_optimizer_and_scheduler(args, model)``) runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


class GRPOError(Exception):
    """Base class of the errors this library raises for a user to read (one line, no traceback).
    The command line exits with code 1 for these (a runtime failure: a reward raising mid-run,
    damaged model files), and 2 for a ``GRPOConfigError``."""


class GRPOConfigError(GRPOError, ValueError):
    """A usage error: a setting, path or input that cannot work; the message names it and how to fix
    it. The command line exits with code 2 for these, as for any other usage error."""


def _zero_reward(samples: list[str]) -> torch.Tensor:
    return torch.zeros(len(samples))


@dataclass
class GRPO_Args:
    """The reference chapter's ``GRPO_Args`` (minus wandb), validated on construction."""

    seed: int = 1
    total_phases: int = 100  # one phase = one rollout + one learning phase = one Lightning epoch
    prompt: str = "This is"
    batch_size: int = 128  # the group size G: completions sampled per phase
    num_minibatches: int = 4
    batches_per_learning_phase: int = 2  # shuffled passes over the group per phase
    lr: float = 1e-5
    max_grad_norm: float = 1.0
    warmup_steps: int = 10  # in phases
    final_scale: float = 0.1  # LR multiplier reached at the last phase
    clip_coef: float = 0.2
    kl_coef: float = 0.3
    base_model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    gen_len: int = 30
    temperature: float = 1.0
    reward_fn: Callable = field(default=_zero_reward, repr=False)

    def __post_init__(self) -> None:
        validate_args(self)
        self.minibatch_size = self.batch_size // self.num_minibatches


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise GRPOConfigError(message)


def validate_args(args: GRPO_Args) -> None:
    """Raises GRPOConfigError, naming the setting, for the first setting that cannot work.
    Checked in order, so that e.g. num_minibatches >= 1 holds before anything divides by it."""
    # A group of one has advantage 0 (its reward minus its own mean) on every phase: it trains on nothing.
    _require(
        args.batch_size >= 2,
        f"batch_size ({args.batch_size}) must be at least 2: each completion is scored against the others "
        "of its group, so a group of one has advantage 0 and learns nothing",
    )
    _require(args.num_minibatches >= 1, f"num_minibatches ({args.num_minibatches}) must be at least 1")
    _require(
        args.batch_size % args.num_minibatches == 0,
        f"batch_size ({args.batch_size}) must be divisible by num_minibatches ({args.num_minibatches})",
    )
    _require(
        args.batches_per_learning_phase >= 1,
        f"batches_per_learning_phase ({args.batches_per_learning_phase}) must be at least 1",
    )
    _require(args.warmup_steps >= 0, f"warmup_steps ({args.warmup_steps}) must be >= 0")
    _require(
        args.total_phases > args.warmup_steps,
        f"total_phases ({args.total_phases}) must be greater than warmup_steps ({args.warmup_steps})",
    )
    _require(args.gen_len >= 1, f"gen_len ({args.gen_len}) must be at least 1")
    _require(args.temperature > 0, f"temperature ({args.temperature}) must be > 0")
    _require(0 < args.clip_coef < 1, f"clip_coef ({args.clip_coef}) must lie strictly between 0 and 1")
    _require(args.kl_coef >= 0, f"kl_coef ({args.kl_coef}) must be >= 0")
    _require(args.lr > 0, f"lr ({args.lr}) must be > 0")
    _require(args.max_grad_norm > 0, f"max_grad_norm ({args.max_grad_norm}) must be > 0")
    _require(args.final_scale >= 0, f"final_scale ({args.final_scale}) must be >= 0")
    _require(
        isinstance(args.prompt, str) and args.prompt.strip() != "",
        "prompt must be a non-empty string (it is what every completion continues)",
    )


def validate_module_settings(
    *, kl_estimator: str, clip_coef_high: float | None, samples_shown: int, max_nonfinite_steps: int,
    has_prompts: bool, prompts_per_phase: int, refill_flat_groups: int, batch_size: int, num_minibatches: int,
    eval_every_n_phases: int = 1,
) -> None:  # fmt: skip
    """The GRPOModule settings beyond the chapter's ``GRPO_Args``; raises GRPOConfigError naming the first
    that cannot work."""
    from .kl import KL_ESTIMATORS

    if clip_coef_high is not None and clip_coef_high <= 0:
        raise GRPOConfigError(f"clip_coef_high ({clip_coef_high}) must be > 0 (or null for clip_coef)")
    if kl_estimator not in KL_ESTIMATORS:
        raise GRPOConfigError(f"kl_estimator ({kl_estimator!r}) must be one of {', '.join(map(repr, KL_ESTIMATORS))}")
    _require(samples_shown >= 0, f"samples_shown ({samples_shown}) must be >= 0")
    _require(max_nonfinite_steps >= 1, f"max_nonfinite_steps ({max_nonfinite_steps}) must be at least 1")
    _require(prompts_per_phase >= 1, f"prompts_per_phase ({prompts_per_phase}) must be at least 1")
    _require(eval_every_n_phases >= 1, f"eval_every_n_phases ({eval_every_n_phases}) must be at least 1")
    _require(
        refill_flat_groups >= 0 and (has_prompts or not refill_flat_groups),
        f"refill_flat_groups ({refill_flat_groups}) must be >= 0, and needs prompts to draw new ones from",
    )
    _require(
        has_prompts or prompts_per_phase == 1,
        f"prompts_per_phase ({prompts_per_phase}) needs prompts to draw from: set model.prompts, "
        "or leave prompts_per_phase at 1 for the single prompt",
    )
    _require(
        prompts_per_phase == 1 or (batch_size * prompts_per_phase) % num_minibatches == 0,
        f"batch_size x prompts_per_phase ({batch_size} x {prompts_per_phase}) must be divisible by "
        f"num_minibatches ({num_minibatches})",
    )
