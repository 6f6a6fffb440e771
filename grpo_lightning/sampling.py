"""Exact sampling of completions.

The policy gradient assumes the tokens come from exactly the distribution whose log-probabilities
we train on, so there is no top-k / top-p truncation. By default every completion has exactly
``gen_len`` tokens (no early stop at end-of-text), the chapter's setting. With stop tokens, a
completion ends at the first one it samples (which it keeps: ending is a choice the policy learns);
the positions after it are padding, marked 0 in a completion mask, so the batch stays rectangular.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from .fast_decode import ModelDecoder, make_decoder
from .fused_decode import fused_kernels
from .interrupt import stop_point
from .packed_linear import prepared_linear_layers

# A start-of-document token marks "a new text begins here", the context the model saw at the start
# of its pretraining documents. Tokenizers name it differently; the first one found is used.
_START_OF_DOCUMENT_CANDIDATES = ("<|endoftext|>", "<s>", "<|begin_of_text|>", "<bos>")
# Tokens that end an answer: end-of-turn tokens of chat models (SmolLM2 and Qwen's <|im_end|>, Llama 3's
# <|eot_id|>, Phi's <|end|>, Gemma's <end_of_turn>) and end-of-document ones, besides eos_token.
_END_TOKEN_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def stop_token_ids(tokenizer) -> list[int]:
    """The ids that end a completion for this tokenizer: its ``eos_token`` first, then every known
    end-of-turn or end-of-document token in its vocabulary."""
    vocab = tokenizer.get_vocab()
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += [vocab[token] for token in _END_TOKEN_CANDIDATES if token in vocab]
    return list(dict.fromkeys(ids))  # unique, in order


def in_vocabulary(tokenizer, token: str) -> bool:
    """Whether ``token`` is one token of ``tokenizer``'s vocabulary (added tokens included).

    Looked up by id and back, not in ``get_vocab()``: that builds a dict of the whole vocabulary, 40 ms
    for SmolLM2's 49,152 tokens, and the start token is looked up for every prompt of every phase. A token
    that is not in the vocabulary maps to the unknown token's id (or None), which maps back to another token."""
    index = tokenizer.convert_tokens_to_ids(token)
    return index is not None and tokenizer.convert_ids_to_tokens(index) == token


def default_start_token(tokenizer) -> str:
    """The start-of-document token to prepend to prompts for this tokenizer.

    GPT-2, SmolLM2 and Qwen use ``<|endoftext|>`` (for SmolLM2 the tokenizer's ``bos_token`` is the
    chat token ``<|im_start|>``, so the vocabulary is searched first); otherwise the tokenizer's own
    ``bos_token`` or ``eos_token``.
    """
    for token in _START_OF_DOCUMENT_CANDIDATES:
        if in_vocabulary(tokenizer, token):
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


@dataclass
class SampledCompletions:
    """What sampling produced, per generated token: B sequences, T = gen_len."""

    sample_ids: Tensor  # (B, P + T) prompt + completion ids (padding after a stop token)
    logprobs: Tensor  # (B, T) float32 log pi(token), at temperature 1, as sampling computed it (0 on padding)
    entropy: Tensor  # (B, T) float32 entropy (nats) of pi at each generated position, at temperature 1 (0 on padding)
    completion_mask: Tensor | None = None  # (B, T) bool: True for generated tokens; None: all are (no stop tokens)


@contextlib.contextmanager
def decoding(model: torch.nn.Module, batch: int, max_len: int):
    """A KV-cached decoder (``fast_decode.make_decoder``) for ``batch`` rows of at most ``max_len`` tokens, its
    products prepared for decode shapes while the block runs: the lean decoder prepares its own, the model's
    own forward gets its linear layers prepared in place, and so do the modules the lean decoder leaves to
    themselves (live LoRA adapters under bf16: their base layers). Use under ``torch.no_grad()``."""
    decoder = make_decoder(model, batch, max_len)
    products = contextlib.nullcontext()
    if isinstance(decoder, ModelDecoder):
        products = prepared_linear_layers(model, rows=batch)
    elif decoder.unprepared:
        products = prepared_linear_layers(torch.nn.ModuleList(decoder.unprepared), rows=batch)
    with products:
        yield decoder


@torch.no_grad()
def sample_completions_with_logprobs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    gen_len: int,
    temperature: float = 1.0,
    stop_tokens: list[int] | None = None,
    attention_mask: Tensor | None = None,
) -> SampledCompletions:
    """Samples ``gen_len`` tokens after each row of ``prompt_ids`` (B, P), keeping log pi of each token.

    A KV-cached loop (``grpo_lightning.fast_decode``): one forward of the prompts (each distinct prompt
    once), then one token per step sampled from ``softmax(logits / temperature)`` over the full vocabulary.
    ``attention_mask`` (B, P): 0 on the left padding of prompts shorter than the longest, None where none
    is; positions count from each row's first real token, as the learning step counts them, so the context
    sampled from is the one log-probabilities are taken on.

    The log-probabilities and entropies are those of the policy itself (temperature 1), in float32,
    from the very logits the tokens were drawn from: they are log pi_old of the rollout, so the
    learning phase needs no second forward pass to recompute them.

    ``stop_tokens``: ids that end a completion (see ``stop_token_ids``); the first one sampled is kept,
    and the rest of the row is padding (the first stop token again), with log-probability and entropy 0
    and ``completion_mask`` False. Sampling ends early once every row has ended. None: ``gen_len``
    tokens each, and no mask. Rows draw their random numbers the same way either way.
    """
    batch, prompt_len = prompt_ids.shape
    new_ids, logprobs, entropy, alive = [], [], [], []
    stops = None if not stop_tokens else torch.tensor(stop_tokens, device=prompt_ids.device)
    running = torch.ones(batch, 1, dtype=torch.bool, device=prompt_ids.device)  # not yet ended
    with decoding(model, batch, prompt_len + gen_len) as decoder:
        logits = decoder.prompt(prompt_ids, attention_mask).float()  # (B, V)
        for step in range(gen_len):
            stop_point()  # Ctrl-C / SIGTERM abandons a rollout at the next token
            weights, log_normaliser, step_entropy = softmax_parts(logits)
            if temperature != 1.0:
                weights = softmax_parts(logits / temperature)[0]
            next_ids = sample_categorical(weights)  # (B, 1)
            token_logprob, step_entropy = logits.gather(-1, next_ids) - log_normaliser, step_entropy.unsqueeze(-1)
            if stops is not None:
                next_ids = torch.where(running, next_ids, stops[0])
                token_logprob, step_entropy = token_logprob * running, step_entropy * running
                alive.append(running)
                running = running & ~torch.isin(next_ids, stops)
            new_ids.append(next_ids)
            logprobs.append(token_logprob)
            entropy.append(step_entropy)
            if stops is not None and not running.any():
                break
            if step + 1 < gen_len:
                logits = decoder.step(next_ids).float()
    padding = gen_len - len(new_ids)  # steps not taken: every row had ended
    if padding:
        new_ids.append(stops[0].expand(batch, padding))
        for values in (logprobs, entropy):
            values.append(torch.zeros(batch, padding, device=prompt_ids.device))
        alive.append(torch.zeros(batch, padding, dtype=torch.bool, device=prompt_ids.device))
    return SampledCompletions(
        sample_ids=torch.cat([prompt_ids, *new_ids], dim=1),
        logprobs=torch.cat(logprobs, dim=1),
        entropy=torch.cat(entropy, dim=1),
        completion_mask=torch.cat(alive, dim=1) if stops is not None else None,
    )


def _sampling_kernels(logits: Tensor):
    """The fused kernels where ``sampling_softmax`` reads these logits (float32 (B, V) on the CPU, rows of unit
    stride, no autograd) and was built with a vector ``exp`` (AVX-512's 16 lanes or AVX2's 8); else None, and
    PyTorch's passes run (a CPU without AVX2, where the element loop would be slower than they are)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1:
        return None
    if type(logits) is not Tensor or logits.requires_grad:
        return None
    kernels = fused_kernels()
    return kernels if getattr(kernels, "vector_exp_lanes", 0) else None


def softmax_parts(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """What a sampling step needs of ``softmax(logits)`` (B, V), in a few passes over the vocabulary:
    the unnormalised probabilities ``exp(logits - max)`` (B, V), which ``sample_categorical`` draws from
    as they are; the log normaliser ``logsumexp(logits)`` (B, 1), so that ``log pi(i) = logits[i] - it``;
    and the entropy in nats (B,).

    Each full-vocabulary pass costs milliseconds per step at B = 128 (a (128, 49152) float32 tensor is
    25 MB), so this replaces log_softmax, exp, the entropy's masking and product with one subtraction,
    one exp, one sum and one product. Entropy: with ``d = logits - max``, ``e = exp(d)`` and ``s = sum e``,
    ``H = log s - sum(e * d) / s``. A ``-inf`` logit (probability exactly 0) gives ``e * d = 0 * -inf =
    NaN``, which ``nansum`` counts as 0, its true contribution.

    For float32 CPU logits with the fused kernels built with a vector ``exp`` (``_sampling_kernels``), one
    compiled pass after the row's maximum does it all (``csrc/decode_step.cpp``, ``sampling_softmax``): on 2
    Zen 3 cores 33-35 ms of a G = 32 sampling of 30 tokens and 116-127 ms of a G = 128 one, where the six
    PyTorch passes took 80-100 and 260-340 ms. Its sums are in float64, and a weight below exp's float range
    (``logits - max < -87.3``, a probability under 1e-38 of the largest) is exactly 0, as ``-inf`` gives;
    PyTorch's ``exp`` gives such entries denormals down to 1e-45. The same values to float rounding
    otherwise (tests/test_fused_decode.py)."""
    kernels = _sampling_kernels(logits)
    if kernels is not None:
        return kernels.sampling_softmax(logits)
    largest = logits.amax(dim=-1, keepdim=True)  # (B, 1)
    shifted = logits - largest  # (B, V), at most 0: exp never overflows
    weights = shifted.exp()
    total = weights.sum(dim=-1, keepdim=True)  # (B, 1), >= 1
    log_total = total.log()
    entropy = log_total.squeeze(-1) - shifted.mul_(weights).nansum(dim=-1) / total.squeeze(-1)
    return weights, largest + log_total, entropy


# Sampling a token = finding where a uniform draw falls in the cumulative distribution. In two levels:
# first the block of SAMPLING_BLOCK tokens, then the token inside it. Both cumulative sums are short, so
# they are exact in float64, and the whole draw costs about one pass over the probabilities. For
# (128, 49152) this takes ~1 ms where torch.multinomial takes ~120 ms (it draws an exponential
# variate per vocabulary entry), which made sampling a third of the generation time.
SAMPLING_BLOCK = 256


def sample_categorical(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One index per row of ``probs`` (B, V), drawn with probability ``probs[b, i] / probs[b].sum()``.

    Exact inverse-CDF sampling: indices with zero probability are never drawn. Returns (B, 1) int64.
    """
    batch, vocab = probs.shape
    pad = (-vocab) % SAMPLING_BLOCK  # padding copies the whole (B, V) tensor: only when V needs it
    padded = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = padded.reshape(batch, -1, SAMPLING_BLOCK)  # (B, nb, S)
    block_cdf = blocks.sum(-1).double().cumsum(-1)  # (B, nb)
    target = torch.rand(batch, 1, dtype=torch.float64, device=probs.device, generator=generator) * block_cdf[:, -1:]
    # The first block whose cumulative mass exceeds the target: never an empty block.
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)  # (B, 1)
    mass_before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(target))
    within_cdf = blocks[torch.arange(batch, device=probs.device), block.squeeze(1)].double().cumsum(-1)  # (B, S)
    index = torch.searchsorted(within_cdf, target - mass_before, right=True)
    # Rounding can put the target a hair past the block's own total: take its last token with mass then.
    last_with_mass = (within_cdf < within_cdf[:, -1:]).sum(-1, keepdim=True)
    return block * SAMPLING_BLOCK + torch.minimum(index, last_with_mass)


@torch.no_grad()
def sample_completions(model: torch.nn.Module, prompt_ids: Tensor, gen_len: int, temperature: float = 1.0) -> Tensor:
    """Samples ``gen_len`` tokens after each row of ``prompt_ids`` (B, P); returns the ids (B, P + T).
    See ``sample_completions_with_logprobs``."""
    return sample_completions_with_logprobs(model, prompt_ids, gen_len, temperature).sample_ids


@torch.no_grad()
def sample_group(
    model: torch.nn.Module,
    tokenizer,
    prompt: str,
    batch_size: int,
    gen_len: int,
    temperature: float = 1.0,
    start_token: str | None = None,
    stop_tokens: list[int] | None = None,
) -> tuple[SampledCompletions, list[str]]:
    """Samples ``batch_size`` completions of ``gen_len`` tokens of one prompt (one GRPO group), or fewer
    where a completion samples one of ``stop_tokens``.

    Returns the ``SampledCompletions`` (ids, whose last ``gen_len`` columns are the completions, and
    per-token log-probabilities and entropies) and ``samples``: prompt + decoded completion (special
    tokens and padding skipped), the strings rewards score.
    """
    device = next(model.parameters()).device
    prompt_ids = encode_prompt(tokenizer, prompt, start_token).to(device).repeat(batch_size, 1)
    sampled = sample_completions_with_logprobs(model, prompt_ids, gen_len, temperature, stop_tokens)
    completions = decode_completions(tokenizer, sampled, gen_len)
    return sampled, [prompt + completion for completion in completions]


def decode_completions(tokenizer, sampled: SampledCompletions, gen_len: int) -> list[str]:
    """The generated text of each row: its last ``gen_len`` ids, without the padding after an answer ended
    and without special tokens."""
    generated = sampled.sample_ids[:, -gen_len:]
    if sampled.completion_mask is None:
        return tokenizer.batch_decode(generated, skip_special_tokens=True)
    rows = [ids[mask].tolist() for ids, mask in zip(generated, sampled.completion_mask)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


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
    """The reference's interface to ``sample_group``: returns ``sample_ids`` (B, P + T) and ``samples``."""
    sampled, samples = sample_group(model, tokenizer, prompt, batch_size, gen_len, temperature, start_token)
    return sampled.sample_ids, samples
