"""How well k1, k2 and k3 recover the exact KL from one sampled token: the chapter's estimator comparison.

The reference ``pi_ref`` is a model at temperature 1; the policy ``pi`` is the same model with its
logits divided by a temperature a little below 1, a cheap stand-in for an RL-tuned policy that only
sharpens what the base model already does (so the KL stays in the small regime training lives in).
At every position of every context the exact ``KL(pi || pi_ref)`` over the whole vocabulary is the
ground truth; each estimator sees only one token drawn from ``pi`` there. Their mean, bias and
spread are what the ``grpo-lightning diagnose kl-estimators`` table reports.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from .config import GRPOError
from .kl import exact_kl, kl_k1, kl_k2, kl_k3
from .sampling import encode_prompt, sample_completions

Progress = Callable[[str], None]

ESTIMATORS = {"k1": ("log r", kl_k1), "k2": ("(log r)^2 / 2", kl_k2), "k3": ("1/r - 1 + log r", kl_k3)}

# The token draws use their own random stream (seed + this offset), so they are not the very
# uniforms that drew the sampled contexts from the same seed.
_DRAW_STREAM_OFFSET = 1


class DiagnoseError(GRPOError):
    """A diagnostics input that cannot work (bad flag value, missing or empty text file)."""


@dataclass(frozen=True)
class EstimatorStats:
    name: str
    formula: str
    mean: float
    relative_bias: float | None  # (mean - true) / true; None when the true KL is 0
    std_over_true: float | None  # sample stdev / true KL; None when the true KL is 0
    # std_over_true / sqrt(n): how much of relative_bias is just sampling noise (an unbiased
    # estimator's relative_bias is within ~2 of these most of the time)
    bias_standard_error: float | None


@dataclass(frozen=True)
class KLComparison:
    temperature: float
    seed: int
    n_contexts: int
    n_tokens: int
    true_kl: float
    estimators: list[EstimatorStats]

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Contexts
# ---------------------------------------------------------------------------------------------


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def sample_contexts(
    model: torch.nn.Module,
    tokenizer,
    n_seqs: int,
    seq_len: int,
    batch_size: int,
    seed: int,
    start_token: str | None = None,
    progress: Progress | None = None,
) -> list[Tensor]:
    """``n_seqs`` contexts of ``seq_len`` tokens drawn from ``model`` itself after the start-of-document token.

    Text the model writes is text it assigns high probability to, the natural stand-in for a corpus
    when none is at hand. Seeded inside a forked RNG, so the same seed gives the same contexts and the
    caller's global random state is left untouched.
    """
    prompt_ids = encode_prompt(tokenizer, "", start_token)
    if prompt_ids.shape[1] == 0:
        raise DiagnoseError("the tokenizer has no start-of-document token to sample from; pass --start-token")
    if seq_len <= prompt_ids.shape[1]:
        raise DiagnoseError(f"--seq-len ({seq_len}) must be longer than the start token ({prompt_ids.shape[1]} tokens)")
    device = _model_device(model)
    gen_len = seq_len - prompt_ids.shape[1]
    contexts: list[Tensor] = []
    n_batches = -(-n_seqs // batch_size)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for i, start in enumerate(range(0, n_seqs, batch_size)):
            began = time.perf_counter()
            rows = min(batch_size, n_seqs - start)
            batch = sample_completions(model, prompt_ids.to(device).repeat(rows, 1), gen_len, temperature=1.0)
            contexts.extend(batch.cpu())
            if progress:
                progress(f"sampling contexts: batch {i + 1}/{n_batches} ({time.perf_counter() - began:.1f} s)")
    return contexts


def split_texts(text: str) -> list[str]:
    """Paragraphs when the text has blank lines between them, else one text per non-empty line."""
    if re.search(r"\n\s*\n", text.strip()):
        parts = re.split(r"\n\s*\n", text)
    else:
        parts = text.splitlines()
    return [part.strip() for part in parts if part.strip()]


def read_text_contexts(
    tokenizer, path: str | Path, n_seqs: int, seq_len: int, start_token: str | None = None
) -> list[Tensor]:
    """The first ``n_seqs`` texts of ``path``, each as start token + text, truncated to ``seq_len`` tokens.

    Texts shorter than two tokens give no position to evaluate and are skipped.
    """
    path = Path(path)
    if not path.is_file():
        raise DiagnoseError(f"--text-file: no file at '{path}'")
    texts = split_texts(path.read_text(encoding="utf-8", errors="replace"))
    contexts = [encode_prompt(tokenizer, text, start_token)[0, :seq_len] for text in texts]
    contexts = [ids for ids in contexts if ids.numel() >= 2][:n_seqs]
    if not contexts:
        raise DiagnoseError(f"--text-file: '{path}' holds no text (expected one text per line or per paragraph)")
    return contexts


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------


def _pad_right(contexts: list[Tensor]) -> tuple[Tensor, Tensor]:
    """(b, L) ids padded on the right with token 0, and the (b,) lengths.

    Right padding needs no attention mask: under causal attention a real token never sees a later pad,
    and the padded positions are dropped before anything is measured.
    """
    lengths = torch.tensor([len(ids) for ids in contexts])
    batch = torch.zeros(len(contexts), int(lengths.max()), dtype=torch.long)
    for row, ids in enumerate(contexts):
        batch[row, : len(ids)] = ids
    return batch, lengths


@torch.no_grad()
def batch_log_ratios(
    model: torch.nn.Module, contexts: list[Tensor], temperature: float, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Exact per-position KL(pi || pi_ref) and the log-ratio of one token drawn from pi, for one batch.

    The positions are those whose next token lies inside the context (all but the last of each),
    flattened over the batch: two (n,) float32 tensors.
    """
    device = _model_device(model)
    ids, lengths = _pad_right(contexts)
    logits = model(input_ids=ids.to(device)).logits[:, :-1].float()  # (b, L-1, V)
    valid = torch.arange(logits.shape[1])[None, :] < (lengths[:, None] - 1)  # (b, L-1)
    logits = logits[valid.to(device)]  # (n, V)
    ref_logprobs = logits.log_softmax(-1)  # pi_ref: temperature 1
    logprobs = (logits / temperature).log_softmax(-1)  # pi: sharpened
    true_kl = exact_kl(logprobs, ref_logprobs)  # (n,)
    drawn = torch.multinomial(logprobs.exp(), 1, generator=generator)  # (n, 1), one token per position
    log_ratio = kl_k1(logprobs.gather(-1, drawn), ref_logprobs.gather(-1, drawn)).squeeze(-1)
    return true_kl.cpu(), log_ratio.cpu()


def summarise(true_kls: Tensor, log_ratios: Tensor, temperature: float, seed: int, n_contexts: int) -> KLComparison:
    """Mean, relative bias and stdev/true of each estimator, in float64, against the mean exact KL."""
    true_kl = true_kls.double().mean().item()
    log_ratios = log_ratios.double()
    zeros = torch.zeros_like(log_ratios)
    stats = []
    for name, (formula, estimator) in ESTIMATORS.items():
        values = estimator(log_ratios, zeros)  # every estimator is a function of log r alone
        mean = values.mean().item()
        std = values.std().item() if values.numel() > 1 else 0.0
        stats.append(
            EstimatorStats(
                name=name,
                formula=formula,
                mean=mean,
                relative_bias=(mean - true_kl) / true_kl if true_kl > 0 else None,
                std_over_true=std / true_kl if true_kl > 0 else None,
                bias_standard_error=std / true_kl / values.numel() ** 0.5 if true_kl > 0 else None,
            )
        )
    return KLComparison(temperature, seed, n_contexts, log_ratios.numel(), true_kl, stats)


def compare_kl_estimators(
    model: torch.nn.Module,
    contexts: list[Tensor],
    temperature: float = 0.9,
    batch_size: int = 8,
    seed: int = 0,
    progress: Progress | None = None,
) -> KLComparison:
    """The k1/k2/k3 table for ``model`` (pi_ref) against itself at ``temperature`` (pi) over ``contexts``.

    contexts: 1-D id tensors, any lengths >= 2. The token draws come from a generator seeded from
    ``seed``, so the same inputs give the same table.
    """
    if temperature <= 0:
        raise DiagnoseError(f"--temperature ({temperature}) must be > 0")
    generator = torch.Generator(device=_model_device(model)).manual_seed(seed + _DRAW_STREAM_OFFSET)
    true_kls, log_ratios = [], []
    n_batches = -(-len(contexts) // batch_size)
    for i, start in enumerate(range(0, len(contexts), batch_size)):
        began = time.perf_counter()
        true_kl, log_ratio = batch_log_ratios(model, contexts[start : start + batch_size], temperature, generator)
        true_kls.append(true_kl)
        log_ratios.append(log_ratio)
        if progress:
            seconds = time.perf_counter() - began
            progress(f"estimating: batch {i + 1}/{n_batches}, {log_ratio.numel()} tokens ({seconds:.1f} s)")
    return summarise(torch.cat(true_kls), torch.cat(log_ratios), temperature, seed, len(contexts))
