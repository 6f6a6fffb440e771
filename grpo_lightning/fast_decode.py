"""A lean KV-cached decoder for Llama-shaped models, for sampling on the CPU.

Generating one token runs every decoder layer on a (B, 1, d) activation. The matrix products are the
work; on a CPU what surrounds them costs nearly as much when done through the general Hugging Face
forward: a key/value cache grown with ``torch.cat`` at every step, grouped-query keys and values copied
``heads / kv_heads`` times (``repeat_kv``) at every step, masks and rotary tables rebuilt per call, and
layers of keyword plumbing. This decoder runs the model's own modules (embeddings, norms, projections,
LoRA adapters included, MLP, head), so the arithmetic per module is the model's, and replaces only the glue:

- keys and values go into preallocated (B, kv_heads, P + T, head_dim) buffers, written in place;
- attention groups the query heads by key/value head ((B, kv, heads/kv * n, head_dim) against
  (B, kv, S, head_dim)), so shared keys are read where they lie instead of being copied;
- the rotary cos/sin come from the model's own rotary module, once per sequence for all positions;
- a prompt that every row shares (a GRPO group: one prompt, G completions) runs once, on one row, and
  its keys and values are copied to the G rows: the prompt's forward costs 1/G of what it did. With a
  chat template the prompt is tens of tokens, and its forward over G rows cost as much as all decode
  steps together.

The same products in the same order as the eager forward: logits agree with it to float rounding
(tests/test_fast_decode.py compares them). Models of another shape are sampled through their own forward.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

# Architectures whose decoder layer is exactly: x + attn(norm(x)), then x + mlp(norm(x)), with rotary
# embeddings on q and k, grouped-query attention and a gated MLP (Qwen2's q/k/v biases live in its modules).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def _language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM under a peft wrapper, if any (its adapters stay active inside the modules)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def supports_fast_decode(model: torch.nn.Module, total_len: int) -> bool:
    """Whether ``LeanDecoder`` reproduces ``model``'s forward for sequences of ``total_len`` tokens."""
    lm = _language_model(model)
    config = getattr(lm, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    body = getattr(lm, "model", None)
    if not all(hasattr(body, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", window is not None)
    return not (uses_window and window is not None and window < total_len)


class LeanDecoder:
    """Runs ``model`` over B sequences of at most ``max_len`` tokens, a few new tokens per call.

    ``prompt(ids)`` takes the (B, P) prompts and ``step(ids)`` then (B, 1) new token ids, one token at a
    time; each returns the logits of the last new position, (B, V). Use under ``torch.no_grad()``."""

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int):
        lm = _language_model(model)
        self.lm, self.body, self.config = lm, lm.model, lm.config
        self.max_len, self.length = max_len, 0
        attention = self.body.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.kv_heads = self.config.num_key_value_heads
        self.groups = self.config.num_attention_heads // self.kv_heads  # query heads per key/value head
        self.scaling = attention.scaling
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        positions = torch.arange(max_len, device=lm.device).unsqueeze(0)  # (1, max_len)
        probe = self.body.embed_tokens.weight[:1].unsqueeze(0)  # dtype and device for the rotary module
        cos, sin = self.body.rotary_emb(probe, positions)  # (1, max_len, head_dim) each
        self.cos, self.sin = cos[0], sin[0]

    def prompt(self, ids: Tensor) -> Tensor:
        """The first call: the prompts (B, P). Rows that are all one prompt run as one row."""
        batch = ids.shape[0]
        if batch == 1 or self.length or not bool((ids == ids[:1]).all()):
            return self.step(ids)
        logits = self.step(ids[:1])  # (1, V)
        for cache in (self.keys, self.values):
            cache[:] = [layer.expand(batch, *layer.shape[1:]).clone() for layer in cache]
        return logits.expand(batch, -1)

    def step(self, ids: Tensor) -> Tensor:
        new = ids.shape[1]
        start, end = self.length, self.length + new
        if end > self.max_len:
            raise ValueError(f"LeanDecoder holds {self.max_len} positions; {end} were asked for")
        cos = self.cos[start:end].view(1, 1, 1, new, self.head_dim)  # broadcasts over (B, kv, groups, n, hd)
        sin = self.sin[start:end].view(1, 1, 1, new, self.head_dim)
        mask = None
        if new > 1:  # causal within the new positions; every cached position is visible to each of them
            mask = torch.ones(new, end, dtype=torch.bool, device=ids.device).tril(diagonal=start)
        hidden = self.body.embed_tokens(ids)  # (B, n, d)
        for index, layer in enumerate(self.body.layers):
            attended = self._attention(layer.self_attn, layer.input_layernorm(hidden), index, start, cos, sin, mask)
            hidden = hidden + attended
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        self.length = end
        last = self.body.norm(hidden[:, -1:])  # (B, 1, d): only the last position's logits are needed
        return self.lm.lm_head(last)[:, 0]  # (B, V)

    def _attention(self, attn, x: Tensor, index: int, start: int, cos: Tensor, sin: Tensor, mask) -> Tensor:
        batch, new, _ = x.shape
        kv, groups, hd = self.kv_heads, self.groups, self.head_dim
        end = start + new
        # (B, n, heads * hd) -> (B, kv, groups, n, hd): query head h = k * groups + g serves kv head k.
        q = attn.q_proj(x).view(batch, new, kv, groups, hd).permute(0, 2, 3, 1, 4)
        k = attn.k_proj(x).view(batch, new, kv, 1, hd).permute(0, 2, 3, 1, 4)  # (B, kv, 1, n, hd)
        v = attn.v_proj(x).view(batch, new, kv, hd).transpose(1, 2)  # (B, kv, n, hd)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if index == len(self.keys):  # first call: buffers in the dtype the projections produce (bf16 under autocast)
            shape = (batch, kv, self.max_len, hd)
            self.keys.append(torch.empty(shape, dtype=k.dtype, device=k.device))
            self.values.append(torch.empty(shape, dtype=v.dtype, device=v.device))
        self.keys[index][:, :, start:end] = k[:, :, 0]
        self.values[index][:, :, start:end] = v
        keys, values = self.keys[index][:, :, :end], self.values[index][:, :, :end]  # (B, kv, S, hd)
        q = q.reshape(batch, kv, groups * new, hd)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scaling  # (B, kv, groups * n, S)
        if mask is not None:
            scores = scores.view(batch, kv, groups, new, end).masked_fill(~mask, float("-inf")).view_as(scores)
        weights = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, values)  # (B, kv, groups * n, hd)
        out = out.view(batch, kv * groups, new, hd).transpose(1, 2).reshape(batch, new, kv * groups * hd)
        return attn.o_proj(out)


class ModelDecoder:
    """The same interface over the model's own KV-cached forward: any causal LM."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.cache = model, None
        self.cache_arg = _cache_argument(model)

    def prompt(self, ids: Tensor) -> Tensor:
        return self.step(ids)

    def step(self, ids: Tensor) -> Tensor:
        cache = {} if self.cache is None else {self.cache_arg: self.cache}
        outputs = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache)
        self.cache = getattr(outputs, self.cache_arg)
        return outputs.logits[:, -1]  # (B, V)


def make_decoder(model: torch.nn.Module, batch: int, max_len: int) -> LeanDecoder | ModelDecoder:
    """The lean decoder where the model's shape allows it, else the model's own forward."""
    if supports_fast_decode(model, max_len):
        return LeanDecoder(model, batch, max_len)
    return ModelDecoder(model)


def _cache_argument(model: torch.nn.Module) -> str:
    """Name of the KV-cache argument of ``model.forward``: ``cache`` in recent transformers,
    ``past_key_values`` before (the old name still works there, with a deprecation warning)."""
    base = _language_model(model)
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
