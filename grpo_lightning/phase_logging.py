"""What a phase reports: the rollout's scalars, histograms and sample tables, and per-part timings.

Everything a user needs to spot reward hacking (reward up, samples odd, KL up) and mode collapse
(distinct samples and distinct-n falling, entropy falling, all-equal groups) is computed here from
the rollout's tensors, so ``GRPOModule`` only has to call these and hand the results to Lightning.
Tag groups: ``rollout/`` once per phase, ``train/`` once per step, ``perf/`` once per phase.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from .kl import kl_k1, kl_k3
from .reporting import SampleRow, sample_table_rows
from .rollout_stats import distinct_fraction, distinct_n, select_sample_indices, zero_advantage_fraction


@dataclass
class RolloutRecord:
    """The tensors of one rollout that the reports read; B = group size, T = gen_len."""

    samples: list[str]  # prompt + completion, as the reward scored them
    completions: list[str]  # the generated text only
    completion_ids: Tensor  # (B, T)
    rewards: Tensor  # (B,) as the reward function returned them
    advantages: Tensor  # (B,)
    entropy: Tensor  # (B, T) policy entropy at each sampled position, nats
    logprobs: Tensor  # (B, T) log pi_old
    ref_logprobs: Tensor | None  # (B, T) log pi_ref; None without a reference (kl_coef = 0)
    completion_mask: Tensor | None = None  # (B, T) bool, True for generated tokens; None: all are


def masked_mean(values: Tensor, mask: Tensor | None) -> Tensor:
    """The mean of ``values`` over the positions ``mask`` keeps (all of them for None)."""
    return values.float().mean() if mask is None else values.float()[mask].mean()


def rollout_scalars(record: RolloutRecord, group_size: int) -> dict[str, Tensor]:
    """The per-phase ``rollout/`` scalars, as 0-dim float tensors."""
    rewards = record.rewards.float()
    scalars = {
        "rollout/reward_mean": rewards.mean(),
        "rollout/reward_std": rewards.std() if len(rewards) > 1 else torch.tensor(0.0),
        "rollout/reward_min": rewards.min(),
        "rollout/reward_max": rewards.max(),
        "rollout/entropy": masked_mean(record.entropy, record.completion_mask),
        "rollout/zero_advantage_groups": torch.tensor(zero_advantage_fraction(rewards, group_size)),
        "rollout/distinct_samples": torch.tensor(distinct_fraction(record.completions)),
    }
    for n in (1, 2):
        if record.completion_ids.shape[1] >= n:
            scalars[f"rollout/distinct_{n}"] = torch.tensor(distinct_n(record.completion_ids, n, record.completion_mask))
    if record.ref_logprobs is not None:
        # k1 averaged over the batch is the reference's measurement (steady once the policy has drifted);
        # k3 is unbiased and low-variance while the policy is still close.
        scalars["rollout/kl_k1"] = masked_mean(kl_k1(record.logprobs, record.ref_logprobs), record.completion_mask)
        scalars["rollout/kl_k3"] = masked_mean(kl_k3(record.logprobs, record.ref_logprobs), record.completion_mask)
    if record.completion_mask is not None:  # answers that end: how long, and how many ended
        lengths = record.completion_mask.sum(dim=1).float()
        scalars["rollout/completion_tokens"] = lengths.mean()
        scalars["rollout/ended_fraction"] = (lengths < record.completion_mask.shape[1]).float().mean()
    return {name: value.detach().float().cpu() for name, value in scalars.items()}


def sample_table(record: RolloutRecord, count: int) -> list[SampleRow]:
    """``count`` rows, the best and worst of the group included, sorted by reward."""
    indices = select_sample_indices(record.rewards.float().cpu(), count)
    ref = None if record.ref_logprobs is None else record.ref_logprobs.float().cpu()
    return sample_table_rows(record.samples, record.rewards.float().cpu(), record.advantages.float().cpu(), ref, indices)


def write_histograms(experiment, record: RolloutRecord, step: int) -> None:
    """Reward and advantage histograms of the phase (TensorBoard's ``add_histogram``)."""
    experiment.add_histogram("rollout/rewards", record.rewards.float().cpu(), step)
    experiment.add_histogram("rollout/advantages", record.advantages.float().cpu(), step)


class PhaseTimer:
    """Wall-clock seconds per named part of a phase, reset each phase: ``rollout`` (which contains
    ``generate``, ``score``, ``old_logprobs`` and ``ref_logprobs``) and ``learn`` (the training steps)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @property
    def phase_seconds(self) -> float:
        """The whole phase: rollout + learning (checkpoint writing excluded)."""
        return self.seconds.get("rollout", 0.0) + self.seconds.get("learn", 0.0)

    def reset(self) -> None:
        self.seconds = {}

    @contextmanager
    def measure(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - start


def perf_scalars(timer: PhaseTimer, generated_tokens: int) -> dict[str, Tensor]:
    """``perf/<part>_s`` for each timed part and the whole phase, and generated tokens per second."""
    seconds = {**timer.seconds, "phase": timer.phase_seconds}
    scalars = {f"perf/{part}_s": torch.tensor(value) for part, value in seconds.items()}
    if seconds.get("generate", 0.0) > 0:
        scalars["perf/generated_tokens_per_s"] = torch.tensor(generated_tokens / seconds["generate"])
    return scalars
