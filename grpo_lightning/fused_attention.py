"""The learning step's causal self-attention as one fused CPU kernel, forward and backward (float32).

Between a Llama layer's q/k/v projections and its output projection, Hugging Face's eager attention makes about a
dozen PyTorch operations (the rotary embedding's products and ``rotate_half``, ``repeat_kv``'s copies of the shared
key/value heads, two batched products, the mask, the softmax, transposes), each a pass over a (B, heads, T, hd) or
(B, heads, T, T) tensor, and as many again in its backward. For the short sequences of a GRPO learning step their
arithmetic is tiny (T = 32: 20 MFLOP a layer) and the passes are what costs. ``csrc/train_attention.cpp`` does them
in one pass forward and one backward, reading q, k and v as the projections lay them out and writing the output as
the output projection reads it. On 2 Zen 4 cores (SmolLM2-135M, a minibatch of 16 x 32 tokens, fp32, interleaved
in one process, medians of 12) a learning step's forward and backward took 2.38 s with it against 2.46 s with eager
attention, and a no-grad reference pass 0.94 against 0.97 s; peak memory fell by about 300 MB (no repeat_kv
copies, no rotated copies kept twice). benchmarks/MEASUREMENTS.md has the runs.

- ``FusedCausalAttention``: ``softmax(rope(q) rope(k)^T * scaling + mask) v`` per query head, query head ``h``
  reading key/value head ``h // (heads / kv_heads)``. Query i attends to keys 0..i. It keeps the probabilities
  (B, heads, T, T) and the rotated q and k for the backward, as the eager graph keeps its own.

Under bf16 autocast (bf16-mixed runs) it runs too, on the projections' bf16 results widened to float32: the
products stay bf16, as autocast makes them, and the attention between them is float32. Eager attention under
autocast rounds more: the rotated queries and keys, the scores and the weighted values to bf16, as it runs its
two batched products in bf16. So a bf16-mixed step's log-probabilities move by bf16 roundings; they stay as near
the sampling's, whose fused decode attends in float32 as well (benchmarks/MEASUREMENTS.md).

``use_fused_attention(model)`` gives a model's Llama attention layers a forward that runs it where it applies:
float32 CPU hidden states (the projections' results may be bf16, under bf16 autocast), eager attention chosen
(``attn_implementation="eager"``, the module's choice for short sequences), no key/value cache (the learning
step and the reference pass; sampling has its own decoder), no attention dropout in training, a head_dim that is
a multiple of 16 (the kernel's vector width), the kernels built, and neither ``GRPO_LIGHTNING_FUSED_TRAINING`` nor ``GRPO_LIGHTNING_FUSED_ATTENTION`` 0. Anything else runs
the layer's own forward. Only layers whose forward is the very code of ``LlamaAttention.forward`` are changed.

The mask: eager attention is given a (B, 1, T, T) float mask, 0 where a query may attend and the float32 minimum
elsewhere (the causal part and left padding). The kernel adds it to the scores of keys 0..i. Wherever a query has a
key to attend to, eager attention's weights on later keys are exactly 0 (exp of the minimum underflows), so the two
agree to float rounding; a padding query, which attends to nothing, differs (eager spreads it over every key), but
its output reaches no real position and no gradient (tests/test_fused_attention.py).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention

from .fast_decode import _float32
from .fused_decode import switched_on
from .fused_training import _fused_class, _plain_cpu_fp32, _same_code, fused_training_kernels

FUSED_ATTENTION_ENV = "GRPO_LIGHTNING_FUSED_ATTENTION"
HEAD_DIM_BLOCK = 16  # the kernel works on blocks of 16 features (csrc/train_attention.cpp, combine16)


class FusedCausalAttention(torch.autograd.Function):
    """q: (B, T, heads * hd); k, v: (B, T, kv_heads * hd); cos, sin: (B or 1, T, hd); mask: (B or 1, T, T) or an
    empty tensor -> (B, T, heads * hd)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, heads: int,
                kv_heads: int, scaling: float, kernels) -> Tensor:  # fmt: skip
        out, probs, q_rot, k_rot = kernels.causal_attention_forward(q, k, v, cos, sin, mask, heads, kv_heads, scaling)
        ctx.save_for_backward(probs, q_rot, k_rot, v, cos, sin)
        ctx.kernels, ctx.heads, ctx.kv_heads, ctx.scaling = kernels, heads, kv_heads, scaling
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        probs, q_rot, k_rot, v, cos, sin = ctx.saved_tensors
        grad_q, grad_k, grad_v = ctx.kernels.causal_attention_backward(
            grad_out.contiguous(), probs, q_rot, k_rot, v, cos, sin, ctx.heads, ctx.kv_heads, ctx.scaling
        )
        return grad_q, grad_k, grad_v, None, None, None, None, None, None, None


def _rows_of(x: Tensor, tokens: int) -> Tensor:
    """cos/sin (1 or B, T, hd), or a mask (1 or B, 1, T, T), as the kernel reads them: (1 or B, T, last), contiguous
    (a view where they are already)."""
    return x.reshape(x.shape[0], tokens, x.shape[-1]).contiguous()


def fused_attention_applies(module: torch.nn.Module, hidden_states: Tensor, kwargs: dict):
    """The kernels, where they compute this attention layer's forward on these inputs; None otherwise."""
    if module.config._attn_implementation != "eager" or kwargs.get("cache") is not None:
        return None
    if kwargs.get("past_key_values") is not None or (module.training and module.attention_dropout > 0):
        return None
    if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") != torch.bfloat16:
        return None  # fp16 autocast: the layer's own forward
    if hidden_states.dim() != 3 or not _plain_cpu_fp32(hidden_states):
        return None
    return fused_training_kernels() if switched_on(FUSED_ATTENTION_ENV) else None


def _fits(hidden_states: Tensor, position_embeddings, attention_mask: Tensor | None, head_dim: int) -> bool:
    """Whether the kernel reads these rotary tables and this mask (float32 CPU tensors of (1 or B) rows) and heads
    of this width (whole blocks of 16 features)."""
    if position_embeddings is None or head_dim % HEAD_DIM_BLOCK != 0:
        return False
    tokens = hidden_states.shape[1]
    batches = (1, hidden_states.shape[0])
    tables_fit = all(_plain_cpu_fp32(t) and t.dim() == 3 and t.shape[1] == tokens and t.shape[0] in batches
                     for t in position_embeddings)  # fmt: skip
    mask = attention_mask
    mask_fits = mask is None or (_plain_cpu_fp32(mask) and mask.dim() == 4 and mask.shape[1] == 1
                                 and mask.shape[0] in batches and tuple(mask.shape[-2:]) == (tokens, tokens))  # fmt: skip
    return tables_fit and mask_fits


def _attention_forward(self, hidden_states: Tensor, position_embeddings=None, attention_mask=None, **kwargs):
    kernels = fused_attention_applies(self, hidden_states, kwargs)
    if kernels is None or not _fits(hidden_states, position_embeddings, attention_mask, self.head_dim):
        return self.eager_forward(hidden_states, position_embeddings, attention_mask, **kwargs)
    tokens = hidden_states.shape[1]
    cos, sin = position_embeddings
    # Under bf16 autocast the projections' bf16 results widen exactly; the kernel attends in float32 (below)
    q, k, v = (_float32(p(hidden_states)) for p in (self.q_proj, self.k_proj, self.v_proj))
    heads, kv_heads = q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim
    mask = q.new_empty(0) if attention_mask is None else _rows_of(attention_mask, tokens)
    attended = FusedCausalAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), _rows_of(cos, tokens), _rows_of(sin, tokens), mask, heads,
        kv_heads, float(self.scaling), kernels,
    )  # fmt: skip
    return self.o_proj(attended), None  # no attention weights, as sdpa and flash attention return none


# What the kernel computes, by the functions Llama's forward calls: a model file that copies the forward but rotates
# or attends its own way (partial rotary, interleaved pairs, soft-capped scores) keeps its own forward.
_LLAMA_HELPERS = ("apply_rotary_pos_emb", "rotate_half", "eager_attention_forward", "repeat_kv")


def _is_llama_attention(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is Llama attention's code (under transformers' decorators), calling helpers of
    Llama's code, on q/k/v/o projections."""
    forward = inspect.unwrap(type(module).forward)
    reference = inspect.unwrap(LlamaAttention.forward)
    if not _same_code(forward, reference):
        return False
    for name in _LLAMA_HELPERS:
        helper, llamas = getattr(forward, "__globals__", {}).get(name), getattr(modeling_llama, name)
        # Llama's own object (transformers wraps some helpers in a module of its kernel hub), or its very code
        same_code = inspect.isfunction(helper) and inspect.isfunction(llamas) and _same_code(helper, llamas)
        if helper is not llamas and not same_code:
            return False
    return hasattr(module, "config") and hasattr(module, "head_dim") and all(
        isinstance(getattr(module, name, None), torch.nn.Module) for name in ("q_proj", "k_proj", "v_proj", "o_proj")
    )


def use_fused_attention(model: torch.nn.Module) -> int:
    """Gives ``model``'s Llama attention layers the fused forward (module docstring); returns how many. Only each
    layer's class changes, to a subclass that differs in ``forward`` (as ``fused_training.use_fused_layers`` does,
    and for its reason): weights, names and the state dict stay as they are."""
    changed = 0
    for module in model.modules():
        if "forward" not in vars(module) and _is_llama_attention(module):
            module.__class__ = _fused_class(type(module), _attention_forward)
            changed += 1
    return changed
