"""The GRPO objective as small pure tensor functions.

Nothing here knows about Lightning: tensors in, tensor out. Shapes follow the legend of the
design notes: ``B`` sequences in the group, ``b`` in a minibatch, ``T`` generated tokens
(``gen_len``), ``V`` vocabulary size.

Signs: every function returns a quantity in the direction the reference chapter writes it.
The objective to *maximise* is ``clipped_surrogate - kl_penalty``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fused_training import fused_training_kernels
from .interrupt import stop_point
from .shared_prompts import shareable_prompt_groups, shared_prompt_logits

# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def compute_grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages ``(r - mean(r)) / (std(r) + eps)``.

    rewards: (B,), one group (all rollouts share one prompt). std is the unbiased (n-1) one,
    as in the reference. A group of equal rewards gives zeros, not NaN, thanks to ``eps``.
    Returns (B,).
    """
    rewards = rewards.float()
    # One sample, or all equal: no signal. Tested explicitly because in float32 the mean of equal
    # values can be one rounding step off them, and (r - mean) / (std + eps) would then be a
    # same-signed ~0.05 for every sample instead of 0.
    if rewards.numel() < 2 or bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + eps)


# ---------------------------------------------------------------------------------------------
# Log-probabilities of the generated tokens
# ---------------------------------------------------------------------------------------------


def get_logprobs(logits: Tensor, tokens: Tensor, gen_len: int) -> Tensor:
    """Log-probabilities of the last ``gen_len`` tokens of ``tokens``, in float32.

    logits: (b, S', V) with S' >= gen_len + 1 (only the last gen_len + 1 positions are read), in any
    float dtype (bf16 under autocast). tokens: (b, S), the last gen_len of which were generated.
    Returns (b, T). The logits at position s predict the token at s + 1, hence the shift.
    """
    logits = logits[:, -gen_len - 1 : -1]  # (b, T, V)
    targets = tokens[:, -gen_len:]  # (b, T)
    b, T, V = logits.shape
    return selective_log_softmax(logits.reshape(b * T, V), targets.reshape(b * T)).view(b, T)


# Rows of the vocabulary-wide float32 work done at once: ~32 MB for SmolLM2's 49152 tokens.
LOG_SOFTMAX_CHUNK_ELEMENTS = 2**23


def selective_log_softmax(logits: Tensor, targets: Tensor) -> Tensor:
    """``log_softmax(logits.float())[i, targets[i]]`` for each row: (N, V), (N,) -> (N,) float32.

    The same values and gradient as ``logits.float().log_softmax(-1).gather(...)``, without its full
    (N, V) float32 tensors: a learning step of 32 x 30 tokens over 49152 tokens would otherwise hold
    three of them (the float32 copy, the log-softmax saved for backward, its gradient), 190 MB each.
    Here the work is done a few rows at a time in float32, and backward keeps only the logits as they
    came (bf16 under autocast) and one log-sum-exp per row.
    """
    return _SelectiveLogSoftmax.apply(logits, targets)


def _row_chunks(logits: Tensor):
    rows = max(1, LOG_SOFTMAX_CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    return [slice(start, start + rows) for start in range(0, logits.shape[0], rows)]


def _float32_rows(logits: Tensor, rows: slice) -> tuple[Tensor, bool]:
    """``(logits[rows].float(), whether that is a copy of our own)``: a float32 copy of bf16 logits can be
    worked on in place; float32 logits themselves cannot."""
    chunk = logits[rows]
    return (chunk, False) if chunk.dtype == torch.float32 else (chunk.float(), True)


def _logsumexp_rows(chunk: Tensor, in_place: bool) -> Tensor:
    """``chunk.logsumexp(-1)`` computed as torch computes it (the row maxima, an infinite one taken as 0; the
    log of the sum of exp of the values shifted by them; the maxima added back), so to the same bits, but
    shifting ``chunk`` in place where ``in_place``: one float32 (rows, V) tensor fewer to allocate and write."""
    largest = chunk.amax(-1, keepdim=True)
    largest.masked_fill_(largest.abs() == float("inf"), 0)
    shifted = chunk.sub_(largest) if in_place else chunk - largest
    return shifted.exp_().sum(-1).log_().add_(largest.squeeze(-1))


def _fused_kernels_for(logits: Tensor):
    """The fused kernels where they compute this softmax: float32 logits on the CPU with rows of unit stride,
    the kernels built and not turned off (``fused_training``); None otherwise. They read each (V,) row twice
    forward (the second time from cache) and once backward, writing its gradient once, where the chunks
    below make about a dozen passes (max, shift, exp, sum; shift, exp, scale, scatter); the values agree to
    float rounding (their exp is within 2 ulp)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or type(logits) is not Tensor or logits.stride(-1) != 1:
        return None
    return fused_training_kernels()


def _check_targets_fit(targets: Tensor, vocab: int) -> None:
    """Refuses token ids outside [0, vocab) here, before the fused kernel reads row[target]. The kernel
    checks too, but an error thrown from inside the C++ extension killed the process (a segfault, not a
    RuntimeError) under torch 2.11's CUDA build on a GPU host; PyTorch's own path raises in ``gather``."""
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        bad = targets[(targets < 0) | (targets >= vocab)][0]
        raise RuntimeError(f"target {int(bad)} outside the vocabulary of {vocab}")


class _SelectiveLogSoftmax(torch.autograd.Function):
    # Under bf16 autocast each chunk's float32 copy is worked on in place, forward and backward: a bf16
    # learning step of 32 x 30 tokens took 2-3.5 % less on the Zen 4 machine (3.16-3.31 s against 3.27-3.38 s,
    # alternated 5 times), with the same bits. (Subtracting float32 from bf16 directly, without the copy, is
    # slower: mixed-dtype arithmetic takes 4-7 ms per 170 x 49152 chunk on the CPU, the copy and an in-place
    # subtraction 3 ms.)
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor) -> Tensor:
        ctx.kernels = _fused_kernels_for(logits)
        if ctx.kernels is not None:  # float32 logits on the CPU: one kernel pass per row (fused_training)
            _check_targets_fit(targets, logits.shape[-1])
            picked, logsumexp = ctx.kernels.pick_log_softmax_forward(logits, targets)
            ctx.save_for_backward(logits, targets, logsumexp)
            return picked
        logsumexp = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        picked = torch.empty_like(logsumexp)
        for rows in _row_chunks(logits):
            chunk, own = _float32_rows(logits, rows)
            picked[rows] = chunk.gather(-1, targets[rows, None]).squeeze(-1)  # before any in-place shift
            logsumexp[rows] = _logsumexp_rows(chunk, in_place=own)
        ctx.save_for_backward(logits, targets, logsumexp)
        return picked - logsumexp

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        # d log p_i[t_i] / d logits_ij = [j == t_i] - softmax(logits_i)_j
        logits, targets, logsumexp = ctx.saved_tensors
        grad_out = grad_out.float()
        if ctx.kernels is not None:
            return ctx.kernels.pick_log_softmax_backward(grad_out, logits, targets, logsumexp), None
        grad_logits = torch.empty_like(logits)
        for rows in _row_chunks(logits):
            chunk, own = _float32_rows(logits, rows)
            # float32 logits: computed right in grad_logits; bf16: in their float32 copy, then rounded into it
            lse = logsumexp[rows, None]
            grad = chunk.sub_(lse) if own else torch.sub(chunk, lse, out=grad_logits[rows])
            grad.exp_().mul_(-grad_out[rows, None])
            grad.scatter_add_(-1, targets[rows, None], grad_out[rows, None])
            if own:
                grad_logits[rows] = grad
        return grad_logits, None


def get_logits(model: torch.nn.Module, sample_ids: Tensor, gen_len: int) -> Tensor:
    """Runs ``model`` on (b, S) ids; returns its logits for the last ``gen_len + 1`` positions, in the
    model's output dtype (bf16 under bf16 autocast: ``get_logprobs`` does its softmax in float32).

    ``logits_to_keep`` makes the model unembed only those positions, which is where most of the
    memory of a forward pass goes (a (b, S, V) tensor otherwise).
    """
    return model(input_ids=sample_ids, logits_to_keep=gen_len + 1).logits


def generated_logprobs(
    model: torch.nn.Module, sample_ids: Tensor, gen_len: int, attention_mask: Tensor | None = None
) -> Tensor:
    """``get_logprobs(get_logits(model, sample_ids, gen_len), sample_ids, gen_len)``: (b, S) ids -> (b, T)
    float32 log-probabilities of the generated tokens, with the unembedding run on exactly the T positions
    that predict them. ``get_logits`` keeps T + 1 positions and ``get_logprobs`` drops the last: that costs
    one more position of the (d_model x V) head and, in a learning step, a copy of the (b, T, V) logits
    and a zero-filled gradient for the dropped column. The last token is not run at all: nothing it
    predicts is scored.

    Where rows share long prompts (a GRPO group's G completions of one prompt), each distinct prompt runs
    once and the completions attend to its keys and values (``shared_prompts``): the same values, to float
    rounding, for fewer positions.

    ``attention_mask`` (b, S): 0 on left padding (prompts of different lengths in one batch); the
    positions then count from each sequence's first real token, as if it were unpadded."""
    targets = sample_ids[:, -gen_len:]  # (b, T)
    groups = shareable_prompt_groups(model, sample_ids, gen_len, attention_mask)
    if groups is not None:
        first, rest = shared_prompt_logits(model, sample_ids, gen_len, attention_mask, groups)  # (u, V), (b, T-1, V)
        b, _, V = rest.shape
        first_logprobs = selective_log_softmax(first[groups.row_prompt], targets[:, 0])  # (b,)
        rest_logprobs = selective_log_softmax(rest.reshape(-1, V), targets[:, 1:].reshape(-1)).view(b, gen_len - 1)
        return torch.cat([first_logprobs[:, None], rest_logprobs], dim=1)
    run = sample_ids[:, :-1]  # (b, S - 1)
    seq_len = run.shape[1]
    # Position s predicts the token at s + 1. Given as indices, not a slice: indexing copies the (b, T, d)
    # hidden states into one contiguous block, which the unembedding multiplies as a single matrix product;
    # a strided slice of them sends it through a batched product with the weight broadcast per sequence,
    # 2-3x slower forward and backward when the weight is frozen (LoRA).
    predicting = torch.arange(seq_len - gen_len, seq_len, device=sample_ids.device)
    padding = {}
    if attention_mask is not None:
        position_ids = (attention_mask[:, :-1].long().cumsum(-1) - 1).clamp(min=0)
        padding = {"attention_mask": attention_mask[:, :-1], "position_ids": position_ids}
    logits = model(input_ids=run, logits_to_keep=predicting, **padding, **_without_cache(model)).logits  # (b, T, V)
    b, T, V = logits.shape
    return selective_log_softmax(logits.reshape(b * T, V), targets.reshape(b * T)).view(b, T)


def _without_cache(model: torch.nn.Module) -> dict:
    """``use_cache=False`` for a model whose config has a key/value cache (Hugging Face's): a pass that ends here
    needs none, and the fused attention of ``grpo_lightning.fused_attention`` runs only where there is none. Nothing
    for other models, whose forward may not take the argument."""
    return {"use_cache": False} if hasattr(getattr(model, "config", None), "use_cache") else {}


@torch.no_grad()
def get_logprobs_batched(
    model: torch.nn.Module, sample_ids: Tensor, gen_len: int, chunk_size: int, attention_mask: Tensor | None = None
) -> Tensor:
    """Log-probabilities (B, T) of the generated tokens under ``model``, ``chunk_size`` sequences at a time
    (``attention_mask``: see ``generated_logprobs``)."""
    masks = [None] * len(sample_ids.split(chunk_size)) if attention_mask is None else attention_mask.split(chunk_size)
    chunks = []
    for chunk, mask in zip(sample_ids.split(chunk_size), masks):
        stop_point()  # Ctrl-C / SIGTERM stops between chunks
        chunks.append(generated_logprobs(model, chunk, gen_len, mask))
    return torch.cat(chunks)


# ---------------------------------------------------------------------------------------------
# KL to the reference policy
# ---------------------------------------------------------------------------------------------


# The estimators and the chapter's penalty functions live in grpo_lightning.kl; re-exported here under
# the names code written against this module imports.
from .kl import calc_kl_penalty, calc_kl_penalty_naive, kl_k1, kl_k2, kl_k3  # noqa: E402

__all__ = [
    "compute_grpo_advantages", "get_logprobs", "get_logits", "get_logprobs_batched", "generated_logprobs",
    "calc_kl_penalty", "calc_kl_penalty_naive", "kl_k1", "kl_k2", "kl_k3",
    "calc_clipped_surrogate_objective", "clip_fraction",
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Clipped surrogate
# ---------------------------------------------------------------------------------------------


def calc_clipped_surrogate_objective(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_coef: float
) -> Tensor:
    """Mean over (b, T) of ``min(rho * A, clip(rho, 1 - eps, 1 + eps) * A)``, to be maximised.

    logprobs: (b, T) under the current policy (with grad); old_logprobs: (b, T) at rollout time;
    advantages: (b,), broadcast over each sequence's tokens. rho is formed from the log-ratio so
    that nothing is divided.
    """
    assert logprobs.shape == old_logprobs.shape and advantages.shape == logprobs.shape[:1]
    ratio = (logprobs - old_logprobs).exp()
    advantages = advantages[:, None]  # (b, 1)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_coef, 1 + clip_coef) * advantages
    return torch.minimum(unclipped, clipped).mean()


def clip_fraction(logprobs: Tensor, old_logprobs: Tensor, clip_coef: float) -> Tensor:
    """Fraction of tokens whose importance ratio lies outside [1 - eps, 1 + eps] (a statistic, no grad)."""
    ratio = (logprobs.detach() - old_logprobs).exp()
    return ((ratio - 1).abs() > clip_coef).float().mean()
