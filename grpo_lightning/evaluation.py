"""Greedy evaluation: what a model answers, deterministically, to a list of prompts.

``greedy_complete`` decodes each prompt by argmax until one of the stop tokens (an end-of-turn token of a
chat model, see ``sampling.stop_token_ids``) or ``max_new_tokens``; prompts are batched with left padding
and an attention mask, and every row gives what it would give alone (tests/test_tasks.py checks both
against step-by-step argmax without a cache). ``chat_prompt`` renders a user message through the
tokenizer's chat template, the way an instruct model was trained to see questions.

Used by ``benchmarks/arithmetic_baseline.py`` to measure held-out accuracy, and by the training run's
held-out evaluation in Lightning's validation loop (``grpo_lightning.heldout``).
"""

from __future__ import annotations

from typing import Callable

import torch

from .sampling import decoding


def chat_prompt(tokenizer, prompt: str) -> str:
    """``prompt`` as a user turn of the tokenizer's chat template, ending where the assistant's answer
    begins; the prompt unchanged for a tokenizer without a chat template. Tokenize the result with
    ``add_special_tokens=False`` (the template already holds its special tokens)."""
    if not getattr(tokenizer, "chat_template", None):
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)


@torch.no_grad()
def greedy_complete(
    model: torch.nn.Module,
    tokenizer,
    prompt_texts: list[str],
    max_new_tokens: int,
    stop_tokens: list[int] | None = None,
    batch_size: int = 64,
) -> list[str]:
    """The greedy (argmax) completion of each of ``prompt_texts``, decoded without special tokens.

    Each text is tokenized as it is (``add_special_tokens=False``: render chat prompts with ``chat_prompt``
    first). A completion ends at the first of ``stop_tokens`` it produces (not included in the text) or
    after ``max_new_tokens`` tokens. ``batch_size`` prompts are decoded together, left-padded, with an
    attention mask and positions counted from each row's first real token, so padding changes nothing
    but float rounding; through the lean decoder where the model allows (``sampling.decoding``)."""
    completions: list[str] = []
    for start in range(0, len(prompt_texts), batch_size):
        completions += _greedy_batch(model, tokenizer, prompt_texts[start : start + batch_size], max_new_tokens, stop_tokens)
    return completions


def _greedy_batch(model, tokenizer, texts: list[str], max_new_tokens: int, stop_tokens: list[int] | None) -> list[str]:
    if not texts:
        return []
    device = next(model.parameters()).device
    encoded = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    if any(not ids for ids in encoded):
        raise ValueError("greedy_complete: a prompt encodes to no tokens")
    width = max(len(ids) for ids in encoded)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = stop_tokens[0] if stop_tokens else (tokenizer.eos_token_id or 0)
    ids = torch.tensor([[pad_id] * (width - len(row)) + row for row in encoded], device=device)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in encoded], device=device)
    stops = torch.tensor(stop_tokens or [], dtype=torch.long, device=device)

    generated: list[torch.Tensor] = []
    running = torch.ones(len(texts), dtype=torch.bool, device=device)
    with decoding(model, len(texts), width + max_new_tokens) as decoder:
        logits = decoder.prompt(ids, mask)  # (B, V)
        for step in range(max_new_tokens):
            next_ids = logits.argmax(-1)
            next_ids = torch.where(running, next_ids, torch.full_like(next_ids, pad_id))
            generated.append(next_ids)
            running = running & ~torch.isin(next_ids, stops)
            if not running.any() or step + 1 == max_new_tokens:
                break
            logits = decoder.step(next_ids.unsqueeze(-1))

    completions = []
    columns = torch.stack(generated, dim=1).tolist() if generated else [[] for _ in texts]
    stop_set = set(stop_tokens or [])
    for row in columns:
        kept = []
        for token in row:
            if token in stop_set:
                break
            kept.append(token)
        completions.append(tokenizer.decode(kept, skip_special_tokens=True))
    return completions


def greedy_rewards(
    model: torch.nn.Module,
    tokenizer,
    rows: list[dict],
    reward,
    max_new_tokens: int,
    stop_tokens: list[int] | None = None,
    chat: bool = True,
    render: Callable[[str], str] | None = None,
) -> tuple[list[str], torch.Tensor]:
    """The greedy completion of each row's prompt and its reward (B,), scored with the row
    (``reward_checks.score_samples``). The mean of an exact-answer reward is the held-out accuracy.

    The prompt is asked as ``render(prompt)`` where given (the training run passes its own rendering:
    chat template, or start token + prompt), else through the chat template where ``chat`` and the
    tokenizer has one, else as it is."""
    from .reward_checks import score_samples

    prompts = [row["prompt"] for row in rows]
    if render is None:
        render = (lambda prompt: chat_prompt(tokenizer, prompt)) if chat else (lambda prompt: prompt)
    texts = [render(prompt) for prompt in prompts]
    completions = greedy_complete(model, tokenizer, texts, max_new_tokens, stop_tokens)
    samples = [prompt + completion for prompt, completion in zip(prompts, completions)]
    return completions, score_samples(reward, samples, completions, rows)
