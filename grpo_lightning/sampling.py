"""Exact sampling of fixed-length completions.

The policy gradient assumes the tokens come from exactly the distribution whose log-probabilities
we train on, so there is no top-k / top-p truncation, and every completion has exactly ``gen_len``
tokens (no early stop at end-of-text), which keeps the batch rectangular and unpadded.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

# A start-of-document token marks "a new text begins here", the context the model saw at the start
# of its pretraining documents. Tokenizers name it differently; the first one found is used.
_START_OF_DOCUMENT_CANDIDATES = ("<|endoftext|>", "<s>", "<|begin_of_text|>", "<bos>")


def default_start_token(tokenizer) -> str:
    """The start-of-document token to prepend to prompts for this tokenizer.

    GPT-2, SmolLM2 and Qwen use ``<|endoftext|>`` (for SmolLM2 the tokenizer's ``bos_token`` is the
    chat token ``<|im_start|>``, so the vocabulary is searched first); otherwise the tokenizer's own
    ``bos_token`` or ``eos_token``.
    """
    vocab = tokenizer.get_vocab()
    for token in _START_OF_DOCUMENT_CANDIDATES:
        if token in vocab:
            return token
    for token in (tokenizer.bos_token, tokenizer.eos_token):
        if token:
            return token
    return ""


def encode_prompt(tokenizer, prompt: str, start_token: str | None = None) -> Tensor:
    """(1, P) ids of ``start_token + prompt``; ``start_token=None`` picks the tokenizer's default."""
    if start_token is None:
        start_token = default_start_token(tokenizer)
    return tokenizer(start_token + prompt, return_tensors="pt", add_special_tokens=False).input_ids


def _cache_argument(model: torch.nn.Module) -> str:
    """Name of the KV-cache argument of ``model.forward``: ``cache`` in recent transformers,
    ``past_key_values`` before (the old name still works there, with a deprecation warning)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # see through peft wrappers
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@torch.no_grad()
def sample_completions(model: torch.nn.Module, prompt_ids: Tensor, gen_len: int, temperature: float = 1.0) -> Tensor:
    """Samples ``gen_len`` tokens after each row of ``prompt_ids`` (B, P); returns (B, P + T).

    A plain KV-cached loop: one forward of the prompt, then one token per step sampled from
    ``softmax(logits / temperature)`` over the full vocabulary. The attention mask is all ones
    (there is no padding), so the context sampled from is the one log-probabilities are taken on.
    """
    cache_arg = _cache_argument(model)
    sample_ids = prompt_ids
    outputs = model(input_ids=prompt_ids, use_cache=True, logits_to_keep=1)
    for step in range(gen_len):
        logits = outputs.logits[:, -1].float() / temperature  # (B, V)
        next_ids = torch.multinomial(logits.softmax(dim=-1), num_samples=1)  # (B, 1)
        sample_ids = torch.cat([sample_ids, next_ids], dim=1)
        if step + 1 < gen_len:
            cache = getattr(outputs, cache_arg)
            outputs = model(input_ids=next_ids, use_cache=True, **{cache_arg: cache})
    return sample_ids


@torch.no_grad()
def get_samples(
    model: torch.nn.Module,
    tokenizer,
    prompt: str,
    batch_size: int,
    gen_len: int,
    temperature: float = 1.0,
    start_token: str | None = None,
) -> tuple[Tensor, list[str]]:
    """Samples ``batch_size`` completions of ``gen_len`` tokens of one prompt.

    Returns ``sample_ids`` (B, P + T), whose last ``gen_len`` columns are the completions, and
    ``samples``: prompt + decoded completion (special tokens skipped), the strings rewards score.
    """
    device = next(model.parameters()).device
    prompt_ids = encode_prompt(tokenizer, prompt, start_token).to(device).repeat(batch_size, 1)
    sample_ids = sample_completions(model, prompt_ids, gen_len, temperature)
    completions = tokenizer.batch_decode(sample_ids[:, -gen_len:], skip_special_tokens=True)
    return sample_ids, [prompt + completion for completion in completions]
