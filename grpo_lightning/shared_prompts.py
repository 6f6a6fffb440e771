"""Log-probabilities of generated tokens with each distinct prompt run once, for learning and the reference.

A GRPO minibatch holds G completions of a few prompts. A causal model's activations at the prompt's
positions do not depend on what follows them, so they are the same in every row of a group: running
them once per distinct prompt, and letting every row's completion attend to that one copy of the
prompt's keys and values, computes the same function with fewer positions. Backward sums each row's
gradient into the shared prompt positions, which is what the per-row computation sums too, so the
gradient is the same up to float rounding.

It pays where prompts are long next to completions: a chat template puts tens of tokens before each
question (46 for the arithmetic task, against 32 generated), and a minibatch of 32 rows from 4 prompts
then runs 4 x 46 + 32 x 31 positions instead of 32 x 77. For a prompt of a few tokens there is nothing
to win, and the second model call costs a little, so it is used only where the positions saved are at
least ``MIN_SAVED_SHARE`` of those run.

Used for Llama-shaped models (Llama, Mistral, Qwen2, SmolLM2: the shapes ``fast_decode`` knows, whose
forward takes a key/value cache and explicit positions), and not where decoder layers are checkpointed
(Hugging Face drops the cache there) or the model is sharded by FSDP (two forward passes of each shard
before one backward: not measured here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .activation_checkpointing import checkpointed_layers
from .fast_decode import SUPPORTED_MODEL_TYPES, _cache_argument, _language_model, distinct_rows

# The prompt positions saved, as a share of the positions a per-row forward runs, from which the prompts
# are run once. On the Zen 4 machine, fp32: a learning step of 16 rows of a 3-token prompt (9 % saved) took as
# long either way (medians 2.93 s whole, 3.01 s shared); 32 rows of 4 chat prompts of 44-47 tokens (53 % saved)
# took 6.7 s instead of 14.4 s.
MIN_SAVED_SHARE = 0.15


@dataclass
class PromptGroups:
    """Which rows share a prompt: ``first_rows`` (u,) one row of each distinct prompt, ``row_prompt`` (b,)
    the index in ``first_rows`` of each row's prompt."""

    first_rows: Tensor
    row_prompt: Tensor


def prompt_groups(sample_ids: Tensor, gen_len: int, attention_mask: Tensor | None) -> PromptGroups:
    """The distinct prompts of (b, S) ids whose last ``gen_len`` columns are generated. Rows share a prompt
    when their prompt columns hold the same ids and, with left padding, the same mask."""
    prompts = sample_ids[:, :-gen_len]
    if attention_mask is not None:
        prompts = torch.cat([prompts, attention_mask[:, :-gen_len].to(prompts.dtype)], dim=1)
    return PromptGroups(*distinct_rows(prompts))


def saved_share(groups: PromptGroups, prompt_len: int, gen_len: int) -> float:
    """Positions not run when the prompts run once, over those a per-row forward runs (the last token is
    never run: nothing it predicts is scored)."""
    rows, distinct = len(groups.row_prompt), len(groups.first_rows)
    return (rows - distinct) * prompt_len / (rows * (prompt_len + gen_len - 1))


def can_share_prompts(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward can run the prompts once (see the module's docstring)."""
    lm = _language_model(model)
    if getattr(getattr(lm, "config", None), "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if checkpointed_layers(model):
        return False
    return not any(isinstance(module, _fsdp_classes()) for module in model.modules())


def _fsdp_classes() -> tuple[type, ...]:
    """FSDP's wrapper class and FSDP2's ``fully_shard`` base class, as far as this torch has them."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed import fsdp

    return tuple(getattr(fsdp, name) for name in ("FullyShardedDataParallel", "FSDPModule") if hasattr(fsdp, name))


def shareable_prompt_groups(
    model: torch.nn.Module, sample_ids: Tensor, gen_len: int, attention_mask: Tensor | None
) -> PromptGroups | None:
    """The distinct prompts of the rows where running each once pays (see the module's docstring), else None."""
    if gen_len < 2 or not can_share_prompts(model):
        return None
    groups = prompt_groups(sample_ids, gen_len, attention_mask)
    return groups if saved_share(groups, sample_ids.shape[1] - gen_len, gen_len) >= MIN_SAVED_SHARE else None


def shared_prompt_logits(
    model: torch.nn.Module, sample_ids: Tensor, gen_len: int, attention_mask: Tensor | None, groups: PromptGroups
) -> tuple[Tensor, Tensor]:
    """The logits that predict the ``gen_len`` generated tokens, with each distinct prompt run once:
    ``(first, rest)``, where ``first`` (u, V) are the prompts' last positions (predicting each row's first
    generated token; row r's is ``first[groups.row_prompt[r]]``) and ``rest`` (b, T - 1, V) the completions'
    positions but the last."""
    prompt_len = sample_ids.shape[1] - gen_len
    prompt_options, completion_options = {}, {}
    if attention_mask is not None:  # left padding: positions count from each row's first real token
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        prompt_options = {
            "attention_mask": attention_mask[groups.first_rows, :prompt_len],
            "position_ids": positions[groups.first_rows, :prompt_len],
        }
        completion_options = {"attention_mask": attention_mask[:, :-1], "position_ids": positions[:, prompt_len:-1]}
    cache_name = _cache_argument(model)  # "cache", or "past_key_values" before transformers 5
    prompts = model(
        input_ids=sample_ids[groups.first_rows, :prompt_len], use_cache=True, logits_to_keep=1, **prompt_options
    )
    cache = getattr(prompts, cache_name)
    cache.reorder_cache(groups.row_prompt)  # (u, ...) -> (b, ...): each row reads its prompt's keys and values
    predicting = torch.arange(gen_len - 1, device=sample_ids.device)  # all positions run; see generated_logprobs
    completions = model(
        input_ids=sample_ids[:, prompt_len:-1],
        use_cache=True,
        logits_to_keep=predicting,
        **{cache_name: cache},
        **completion_options,
    )
    return prompts.logits[:, -1], completions.logits

