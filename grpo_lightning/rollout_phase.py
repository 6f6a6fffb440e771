"""A phase's rollout, in the order it runs: draw the prompts, sample one group per prompt, score it,
replace groups without signal (dynamic sampling), take the old and reference log-probabilities, zero
the padding, fold the KL into the rewards if asked, and compute advantages within each group.

``run_rollout(module)`` returns the replay memory for the learning phase and the record the reports
read; ``GRPOModule.rollout_phase`` calls it under no_grad, in the training precision.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kl import kl_in_reward
from .losses import group_advantages
from .memory import ReplayMemory
from .objectives import compute_grpo_advantages, get_logprobs_batched
from .phase_logging import RolloutRecord
from .reward_checks import score_samples
from .rollout import Group, flat_groups, pad_token_id, refill_seed, sample_prompt_groups, stack_groups


def sample_groups(module, rows: list[dict]) -> list[Group]:
    """One group of ``batch_size`` completions per row, sampled together, timed as "generate"."""
    args = module.args
    with module.timer.measure("generate"):
        return sample_prompt_groups(module.policy, module.tokenizer, rows, args.batch_size, args.gen_len,
                                    args.temperature, module.start_token, module.stop_tokens, module.chat_template,
                                    module.max_positions)  # fmt: skip


def score_groups(module, groups: list[Group]) -> Tensor:
    """The reward of every completion of ``groups`` (B,), timed as "score"."""
    batch = stack_groups(groups, pad_token_id(module.tokenizer, module.stop_tokens))
    with module.timer.measure("score"):
        return score_samples(module.reward, batch.samples, batch.completions, batch.rows)


def refill_flat_groups(module, groups: list[Group], rewards: Tensor) -> tuple[list[Group], Tensor, int]:
    """Dynamic sampling: a group whose rewards are all equal has zero advantages and teaches nothing;
    it is replaced by a group of a newly drawn prompt, for up to ``refill_flat_groups`` rounds (the
    new prompts come from a stream of their own, fixed by the seed, the phase and the round; under DDP each
    rank refills its own groups, from a stream of its own)."""
    refilled, size = 0, module.args.batch_size
    for round_ in range(1, module.refill_rounds + 1):
        flat = flat_groups(rewards, size)
        if not flat:
            break
        seed = refill_seed(module.args.seed, round_, module.global_rank)
        rows = module.prompts.draw(seed, module.current_epoch, len(flat))
        new_groups = sample_groups(module, rows)
        new_rewards = score_groups(module, new_groups).view(-1, size)
        rewards = rewards.clone()
        for slot, group, values in zip(flat, new_groups, new_rewards):
            groups[slot] = group
            rewards[slot * size : (slot + 1) * size] = values
        refilled += len(flat)
    return groups, rewards, refilled


def run_rollout(module) -> tuple[ReplayMemory, RolloutRecord, int]:
    """The phase's rollout: (replay memory, the record its reports read, groups refilled)."""
    args, timer = module.args, module.timer
    groups = sample_groups(module, module.draw_rows())
    rewards = score_groups(module, groups)
    refilled = 0
    if module.refill_rounds:
        groups, rewards, refilled = refill_flat_groups(module, groups, rewards)
    sampled = stack_groups(groups, pad_token_id(module.tokenizer, module.stop_tokens))
    sample_ids, mask, padding = sampled.sample_ids, sampled.completion_mask, sampled.attention_mask
    samples = sampled.samples
    logprobs = sampled.logprobs
    if module.recompute_old_logprobs:
        with timer.measure("old_logprobs"):
            chunk = module.phase_args.minibatch_size
            logprobs = get_logprobs_batched(module.policy, sample_ids, args.gen_len, chunk, padding)
    with timer.measure("ref_logprobs"):
        ref_logprobs = module.get_ref_logprobs(sample_ids, padding)
    if mask is not None:  # padding after an answer ended: 0, so that sums over tokens skip it
        logprobs = logprobs * mask
        ref_logprobs = None if ref_logprobs is None else ref_logprobs * mask
    scored_rewards = rewards.to(module.device)
    if module.kl_estimator == "k1_reward" and ref_logprobs is not None:
        scored_rewards = kl_in_reward(scored_rewards, logprobs, ref_logprobs, args.kl_coef)
    if module.prompts is None and module.variant.scale_by_std:
        advantages = compute_grpo_advantages(scored_rewards)  # the chapter's: one group
    else:  # one group per prompt, never across groups; Dr. GRPO: centred only
        advantages = group_advantages(scored_rewards, args.batch_size, scale_by_std=module.variant.scale_by_std)
    completion_ids = sample_ids[:, -args.gen_len :]
    record = RolloutRecord(
        samples=samples,
        completions=sampled.completions,
        completion_ids=completion_ids,
        rewards=rewards,
        advantages=advantages,
        entropy=sampled.entropy,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        completion_mask=mask,
    )
    if ref_logprobs is None:  # kl_coef=0: the KL term is skipped, these zeros are never read
        ref_logprobs = torch.zeros_like(logprobs)
    memory = ReplayMemory(
        module.phase_args, sample_ids, logprobs, ref_logprobs, advantages, completion_mask=mask, attention_mask=padding
    )
    return memory, record, refilled
