"""The rollout's sampling: one GRPO group of completions per prompt row, stacked into one batch.

The groups of a phase are sampled together, up to ``ROWS_PER_DECODE`` rows in one decode: prompts of
different lengths are left-padded, each distinct prompt runs once, and every decode step runs all rows.
A decode step costs about as much for 64 rows as for 16 (its small operations cost per call, not per
row), so four groups of 16 take half the time together that they take one after another. Each group
is then kept unpadded; stacked again, with left padding, the completions stay the last ``gen_len``
columns and an attention mask marks the padding. With a single prompt (the chapter's run) nothing is
padded and the mask is None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import GRPOConfigError
from .sampling import decode_completions, default_start_token, sample_completions_with_logprobs


@dataclass
class GroupRollout:
    """What sampling produced for ``len(rows)`` groups of ``group_size`` completions (N = groups x size)."""

    sample_ids: Tensor  # (N, S) prompt + completion ids, prompts left-padded to the longest
    attention_mask: Tensor | None  # (N, S) 1 for real tokens; None when no prompt was padded
    logprobs: Tensor  # (N, T) log pi_old of each generated token (0 on padding)
    entropy: Tensor  # (N, T)
    completion_mask: Tensor | None  # (N, T) bool, False on padding after an answer ended; None: fixed length
    completions: list[str]  # (N,) the generated text
    rows: list[dict]  # (N,) each sample's row (its prompt and other columns)

    @property
    def samples(self) -> list[str]:
        """prompt + completion: the strings rewards written for ``score(samples)`` read."""
        return [row["prompt"] + completion for row, completion in zip(self.rows, self.completions)]


def prompt_text(tokenizer, prompt: str, start_token: str | None, chat_template: bool) -> str:
    """The text the model is asked: the prompt rendered through the tokenizer's chat template as one user
    turn, ready for the assistant's answer; or (the chapter's way) a start-of-document token + the prompt."""
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise GRPOConfigError("chat_template is true but this tokenizer has no chat template; set it to false")
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return (default_start_token(tokenizer) if start_token is None else start_token) + prompt


def prompt_ids(tokenizer, prompt: str, start_token: str | None = None, chat_template: bool = False) -> Tensor:
    """(1, P) ids of ``prompt_text`` (the template already holds its special tokens: none are added)."""
    text = prompt_text(tokenizer, prompt, start_token, chat_template)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False, verbose=False).input_ids


def left_pad(sequences: list[Tensor], pad_id: int) -> tuple[Tensor, Tensor | None]:
    """Stacks (n_i, S_i) id blocks into (sum n_i, max S_i), padding on the left; the mask is None if
    every block already had the longest length."""
    longest = max(block.shape[1] for block in sequences)
    if all(block.shape[1] == longest for block in sequences):
        return torch.cat(sequences), None
    ids, masks = [], []
    for block in sequences:
        pad = longest - block.shape[1]
        ids.append(torch.nn.functional.pad(block, (pad, 0), value=pad_id))
        mask = torch.ones_like(block)
        masks.append(torch.nn.functional.pad(mask, (pad, 0), value=0))
    return torch.cat(ids), torch.cat(masks)


@dataclass
class Group:
    """One prompt's group: ``group_size`` completions of ``row["prompt"]``, unpadded."""

    row: dict
    sample_ids: Tensor  # (G, P + T)
    logprobs: Tensor  # (G, T)
    entropy: Tensor  # (G, T)
    completion_mask: Tensor | None  # (G, T)
    completions: list[str]


# Rows decoded together, at most (a group larger than this is decoded alone). On the Zen 4 machine (2 cores),
# 4 arithmetic groups of 16, up to 32 tokens, took 7.4 s one after another and 3.9 s together in bf16-mixed,
# 9.7 s and 6.5 s in fp32 (medians, benchmarks/group_decoding.py); at 128 rows the products already run near
# the peak, while the key/value cache grows with every row.
ROWS_PER_DECODE = 128


@torch.no_grad()
def sample_prompt_groups(
    model: torch.nn.Module,
    tokenizer,
    rows: list[dict],
    group_size: int,
    gen_len: int,
    temperature: float = 1.0,
    start_token: str | None = None,
    stop_tokens: list[int] | None = None,
    chat_template: bool = False,
    max_positions: int | None = None,
) -> list[Group]:
    """``group_size`` completions of each row's prompt, one ``Group`` per row, in order."""
    device = next(model.parameters()).device
    prompts = [prompt_ids(tokenizer, row["prompt"], start_token, chat_template).to(device) for row in rows]
    for row, ids in zip(rows, prompts):
        if max_positions is not None and ids.shape[1] + gen_len > max_positions:
            raise GRPOConfigError(
                f"the prompt {row['prompt'][:40]!r}... is {ids.shape[1]} tokens: with gen_len {gen_len} it exceeds "
                f"the model's context of {max_positions}; shorten it or lower gen_len"
            )
    per_decode = max(1, ROWS_PER_DECODE // group_size)
    groups = []
    for first in range(0, len(rows), per_decode):
        batch = slice(first, first + per_decode)
        groups += _sample_together(model, tokenizer, rows[batch], prompts[batch], group_size, gen_len, temperature,
                                   stop_tokens)  # fmt: skip
    return groups


def _sample_together(model, tokenizer, rows, prompts, group_size, gen_len, temperature, stop_tokens) -> list[Group]:
    """One decode for the groups of ``rows``, whose (1, P_i) prompt ids are ``prompts``; each group unpadded."""
    ids, mask = left_pad([prompt.repeat(group_size, 1) for prompt in prompts], pad_token_id(tokenizer, stop_tokens))
    sampled = sample_completions_with_logprobs(model, ids, gen_len, temperature, stop_tokens, attention_mask=mask)
    texts = decode_completions(tokenizer, sampled, gen_len)
    groups, longest = [], ids.shape[1]
    for index, (row, prompt) in enumerate(zip(rows, prompts)):
        members = slice(index * group_size, (index + 1) * group_size)
        completion_mask = None if sampled.completion_mask is None else sampled.completion_mask[members]
        unpadded = sampled.sample_ids[members, longest - prompt.shape[1] :]
        groups.append(Group(row, unpadded, sampled.logprobs[members], sampled.entropy[members], completion_mask,
                            texts[members]))  # fmt: skip
    return groups


def stack_groups(groups: list[Group], pad_id: int) -> GroupRollout:
    """The groups as one batch, in order, prompts left-padded to the longest."""
    sample_ids, attention_mask = left_pad([group.sample_ids for group in groups], pad_id)
    masks = [group.completion_mask for group in groups]
    return GroupRollout(
        sample_ids=sample_ids,
        attention_mask=attention_mask,
        logprobs=torch.cat([group.logprobs for group in groups]),
        entropy=torch.cat([group.entropy for group in groups]),
        completion_mask=None if masks[0] is None else torch.cat(masks),
        completions=[text for group in groups for text in group.completions],
        rows=[group.row for group in groups for _ in group.completions],
    )


def pad_token_id(tokenizer, stop_tokens: list[int] | None) -> int:
    return stop_tokens[0] if stop_tokens else (tokenizer.pad_token_id or tokenizer.eos_token_id or 0)


def flat_groups(rewards: Tensor, group_size: int) -> list[int]:
    """Indices of the groups whose rewards are all equal: their advantages are all zero, no signal."""
    groups = rewards.view(-1, group_size)
    return [int(i) for i in torch.nonzero((groups == groups[:, :1]).all(dim=1)).flatten()]


def refill_seed(seed: int, round_: int, rank: int = 0) -> int:
    """The seed of the prompts drawn to replace flat groups, in refill round ``round_`` (1, 2, ...): its own
    stream, so refills never change which prompts the phase drew first; and under DDP one per rank, which
    refills its own flat groups (so that two ranks do not draw the same replacements)."""
    return (seed * 1_000_003 + round_ * 104_729 + rank * 7_919_113 + 5) % (2**63)
