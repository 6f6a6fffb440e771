"""A lean KV-cached decoder for Llama-shaped models, for sampling on the CPU.

Generating one token runs every decoder layer on a (B, 1, d) activation. The matrix products are the
work; on a CPU what surrounds them costs nearly as much when done through the general Hugging Face
forward: a key/value cache grown with ``torch.cat`` at every step, grouped-query keys and values copied
``heads / kv_heads`` times (``repeat_kv``) at every step, masks and rotary tables rebuilt per call, and
layers of keyword plumbing. This decoder runs the model's own modules (embeddings, activation; the norms as
the same formula; the projections and head as the model's weights), so the arithmetic per module is the
model's, and replaces the glue:

- keys and values go into preallocated buffers, (B, kv_heads, P + T, head_dim), written in place, in the
  dtype attention reads them in (under bf16 autocast the rotated keys are rounded to bf16 once, as they are
  written, not at every step: 6 % off sampling at G = 128 on the Zen 4 machine, the same bits). (Keys
  kept transposed, the layout the attention product reads, made that product about 15 % faster alone, but
  the scattered writes cost more: a whole sampling run was 1-2 % slower that way.)
- attention groups the query heads by key/value head ((B, kv, heads/kv * n, head_dim) against the
  (B, kv, S, head_dim) keys), so shared keys are read where they lie instead of being copied;
- the rotary cos/sin come from the model's own rotary module, once per sequence for all positions;
- a prompt that every row shares (a GRPO group: one prompt, G completions) runs once, on one row, and
  its keys and values are copied to the G rows: the prompt's forward costs 1/G of what it did. With a
  chat template the prompt is tens of tokens, and its forward over G rows cost as much as all decode
  steps together;
- the linear layers run as products prepared once per decoder for B rows (``packed_linear.prepared_product``:
  oneDNN's blocked layout or MKL's packing, LoRA adapters merged; under bf16 autocast oneDNN's bf16 product,
  live adapters left to their modules) where the CPU and dtype allow, and the
  query, key and value projections as one product, whose thin key/value parts ran at half the peak alone,
  and the MLP's gate and up projections as another;
- the query and key heads are rotated in one pass, as ``x * cos + swap_halves(x) * signed_sin`` (the sign
  of ``rotate_half`` moved into a sin table made once), and the RMS norms run as PyTorch's fused one where
  the activations are float32: fewer operations on (B, 1, d) tensors, whose dispatch is their cost;
- steps of one token on the CPU go further: everything between the products (residual adds and norms,
  rotation, cache writes and attention, the gated activation) runs as three compiled float32 kernels
  (``fused_decode``), each one pass over its data, where the machine can build them. Under bf16 autocast too,
  where the products are prepared in bf16: their inputs are rounded to bf16 as autocast rounds them, their
  bf16 results widened to float32 (exactly) for the kernels, and the caches kept in float32. So only the
  products round to bf16; autocast's eager operations also round the rotated queries and keys, the attention
  products and the gated activation. Logits differ from the eager path's by a bf16 rounding here and there, as
  any two bf16 paths do (tests/test_fused_decode.py). On 2 Intel cores with native bf16 (AMX) a sampling of
  128 rows took 3.8-4.0 s this way against 5.0-5.2 s through the eager operations (benchmarks/MEASUREMENTS.md).

The same products as the eager forward: logits agree with it to float rounding (tests/test_fast_decode.py
compares them, with and without prepared products). Models of another shape are sampled through their own
forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .fused_decode import fused_kernels
from .packed_linear import prepared_product

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


@dataclass
class _LayerProducts:
    """The linear maps of one decoder layer: prepared products (``packed_linear.prepared_product``) where they
    apply, else the model's own modules."""

    qkv: Callable[[Tensor], Tensor]  # x -> cat(q_proj(x), k_proj(x), v_proj(x)): one product for the three
    o: Callable[[Tensor], Tensor]
    gate_up: Callable[[Tensor], tuple[Tensor, Tensor]]  # x -> (gate_proj(x), up_proj(x)): one product for the two
    down: Callable[[Tensor], Tensor]
    # The single products, where prepared: x -> cat(q, k, v) and x -> cat(gate, up), as the fused kernels read them
    joined_qkv: Callable[[Tensor], Tensor] | None = None
    joined_gate_up: Callable[[Tensor], Tensor] | None = None


def _layer_products(layer: torch.nn.Module, rows: int, prepare: bool, unprepared: list) -> _LayerProducts:
    """The layer's products; with ``prepare``, the modules that must run themselves are added to ``unprepared``."""
    attn, mlp = layer.self_attn, layer.mlp

    def joined(*modules):
        product = prepare and prepared_product(modules, rows)
        if prepare and not product:
            unprepared.extend(modules)
        return product

    def own(module):
        return joined(module) or module

    def separate_qkv(x: Tensor) -> Tensor:
        return torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)

    joined_qkv = joined(attn.q_proj, attn.k_proj, attn.v_proj)
    qkv = joined_qkv or separate_qkv
    joined_gate_up = joined(mlp.gate_proj, mlp.up_proj)
    width = mlp.gate_proj.out_features

    def separate_gate_up(x: Tensor) -> tuple[Tensor, Tensor]:
        return mlp.gate_proj(x), mlp.up_proj(x)

    def split_gate_up(x: Tensor) -> tuple[Tensor, Tensor]:
        both = joined_gate_up(x)
        return both[..., :width], both[..., width:]

    gate_up = split_gate_up if joined_gate_up else separate_gate_up
    return _LayerProducts(qkv, own(attn.o_proj), gate_up, own(mlp.down_proj), joined_qkv or None, joined_gate_up or None)


def _rms_norm(norm: torch.nn.Module, x: Tensor) -> Tensor:
    """``norm(x)`` for the models' RMSNorm (``weight * x / sqrt(mean(x ** 2) + eps)``, computed in float32), as
    PyTorch's one fused operation where ``x`` and the weight are float32 already: the module's forward is
    eight operations on a (B, 1, d) activation, and at one token per step their dispatch is the cost."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if eps is None or weight is None or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return norm(x)
    return torch.rms_norm(x, weight.shape, weight, eps)


def _cached_key_dtype(k: Tensor) -> torch.dtype:
    """The dtype to keep rotated keys in. Under autocast they come in float32 (the rotation's float32 cos and
    sin promote the bf16 projection) and the scores product reads them in the autocast dtype: rounded once as
    they are written, they are the same values as when rounded at every step, without a copy of the cache
    per layer and step."""
    device = k.device.type
    if k.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return k.dtype


class LeanDecoder:
    """Runs ``model`` over B sequences of at most ``max_len`` tokens, a few new tokens per call.

    ``prompt(ids)`` takes the (B, P) prompts and ``step(ids)`` then (B, 1) new token ids, one token at a
    time; each returns the logits of the last new position, (B, V). Use under ``torch.no_grad()``: built
    there, its linear layers run as products prepared for B rows (``packed_linear.prepared_product``, where
    the CPU and dtype allow), from the weights as they are at construction."""

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int):
        lm = _language_model(model)
        self.lm, self.body, self.config = lm, lm.model, lm.config
        self.max_len, self.length = max_len, 0
        self.pads: Tensor | None = None  # (B,) left-padding columns of each row; None: no row is padded
        attention = self.body.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.kv_heads = self.config.num_key_value_heads
        self.groups = self.config.num_attention_heads // self.kv_heads  # query heads per key/value head
        self.scaling = attention.scaling
        prepare = not torch.is_grad_enabled()  # the prepared products have no backward
        # Linear modules that run themselves: a LoRA layer with live adapters under bf16, a DoRA layer (or all of
        # them, where no products apply). The caller may prepare their own linear layers (prepared_linear_layers).
        self.unprepared: list[torch.nn.Module] = []
        self.products = [_layer_products(layer, batch, prepare, self.unprepared) for layer in self.body.layers]
        self.head = (prepare and prepared_product((lm.lm_head,), batch)) or lm.lm_head
        if prepare and self.head is lm.lm_head:
            self.unprepared.append(lm.lm_head)
        self.keys: list[Tensor] = []  # per layer (B, kv_heads, max_len, head_dim)
        self.values: list[Tensor] = []  # per layer (B, kv_heads, max_len, head_dim)
        positions = torch.arange(max_len, device=lm.device).unsqueeze(0)  # (1, max_len)
        probe = self.body.embed_tokens.weight[:1].unsqueeze(0)  # dtype and device for the rotary module
        cos, sin = self.body.rotary_emb(probe, positions)  # (1, max_len, head_dim) each
        # rotate_half(x) * sin = (-x2, x1) * (s1, s2) = (x2, x1) * (-s1, s2): the halves swapped, and the sign in sin
        half = self.head_dim // 2
        self.cos, self.signed_sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        self.fused = _fused_step_kernels(self) if prepare else None  # kernels for one-token steps, or None
        # The autocast state the products were prepared in: steps are fused only in it, so that every step runs
        # the same products (bf16 ones under bf16 autocast, float32 ones outside it)
        self.autocast = torch.is_autocast_enabled("cpu")

    def prompt(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The first call: the prompts (B, P), left-padded where ``attention_mask`` (B, P) is 0 (prompts of
        different lengths). Each distinct prompt runs once, on one row, and its keys and values are copied to
        the rows that share it: the G rows of a GRPO group, or of each group where several are decoded together."""
        if self.length:
            return self.step(ids)
        self.pads = left_padding(attention_mask)
        distinct = ids if self.pads is None else torch.cat([ids, self.pads[:, None]], dim=1)
        first_rows, row_prompt = distinct_rows(distinct)
        if len(first_rows) == ids.shape[0]:
            return self.step(ids)
        logits = self._forward(ids[first_rows], None if self.pads is None else self.pads[first_rows])  # (u, V)
        for cache in (self.keys, self.values):
            cache[:] = [layer.index_select(0, row_prompt) for layer in cache]
        return logits[row_prompt]

    def step(self, ids: Tensor) -> Tensor:
        return self._fused_step(ids) if self._steps_fused(ids) else self._forward(ids, self.pads)

    def _steps_fused(self, ids: Tensor) -> bool:
        """Whether this call is one token per row after the prompt (the caches exist), in the autocast state the
        decoder was built in, with float32 caches."""
        if self.fused is None or ids.shape[1] != 1 or len(self.keys) != len(self.products):
            return False
        fp32_caches = self.keys[0].dtype == torch.float32 and self.values[0].dtype == torch.float32
        return fp32_caches and torch.is_autocast_enabled("cpu") == self.autocast and not torch.is_grad_enabled()

    def _fused_step(self, ids: Tensor) -> Tensor:
        """``_forward`` of one new token per row on the CPU: the products as there, the operations between them
        as the fused float32 kernels (``fused_decode``); bf16 products' results are widened to float32 for them
        (module docstring). ``hidden`` is updated in place by each residual add."""
        kernels, position = self.fused, self.length
        if position >= self.max_len:
            raise ValueError(f"LeanDecoder holds {self.max_len} positions; {position + 1} were asked for")
        pads = self.pads if self.pads is not None else _NO_PADS
        hidden = self.body.embed_tokens(ids).view(ids.shape[0], -1)  # (B, d): a new tensor, not the embedding's
        delta = None  # what the last MLP adds to hidden
        for layer, products, keys, values in zip(self.body.layers, self.products, self.keys, self.values):
            normed = kernels.add_rms_norm(hidden, delta, *_norm_parameters(layer.input_layernorm))
            attended = kernels.decode_attention(
                _float32(products.joined_qkv(normed)), keys, values, self.cos, self.signed_sin, pads, position,
                self.kv_heads, self.groups, self.scaling,
            )
            attention_out = _float32(products.o(attended))
            normed = kernels.add_rms_norm(hidden, attention_out, *_norm_parameters(layer.post_attention_layernorm))
            width = layer.mlp.gate_proj.out_features
            delta = _float32(products.down(kernels.silu_mul(_float32(products.joined_gate_up(normed)), width)))
        self.length = position + 1
        return self.head(kernels.add_rms_norm(hidden, delta, *_norm_parameters(self.body.norm)))  # (B, V)

    def _forward(self, ids: Tensor, pads: Tensor | None) -> Tensor:
        new = ids.shape[1]
        start, end = self.length, self.length + new
        if end > self.max_len:
            raise ValueError(f"LeanDecoder holds {self.max_len} positions; {end} were asked for")
        if pads is None:
            cos = self.cos[start:end].view(1, new, 1, self.head_dim)  # broadcasts over (B, n, heads, hd)
            sin = self.signed_sin[start:end].view(1, new, 1, self.head_dim)
            mask = None
            if new > 1:  # causal within the new positions; every cached position is visible to each of them
                mask = torch.ones(new, end, dtype=torch.bool, device=ids.device).tril(diagonal=start)
        else:
            cos, sin, mask = self._padded_positions(pads, start, end)
        hidden = self.body.embed_tokens(ids)  # (B, n, d)
        for index, (layer, products) in enumerate(zip(self.body.layers, self.products)):
            attended = self._attention(products, _rms_norm(layer.input_layernorm, hidden), index, start, cos, sin, mask)
            hidden = hidden + attended
            gate, up = products.gate_up(_rms_norm(layer.post_attention_layernorm, hidden))
            hidden = hidden + products.down(layer.mlp.act_fn(gate) * up)  # the gated MLP
        self.length = end
        last = _rms_norm(self.body.norm, hidden[:, -1:])  # (B, 1, d): only the last position's logits are needed
        return self.head(last)[:, 0]  # (B, V)

    def _padded_positions(self, pads: Tensor, start: int, end: int) -> tuple[Tensor, Tensor, Tensor]:
        """Rotary tables and attention mask for rows with ``pads`` (B,) padding columns on the left: each row's
        positions count from its first real token, as the training forward counts them (from the attention
        mask), and no query sees a padding key. A padding query sees itself only: its values are never read,
        but a query that sees nothing would make NaNs, which the masked weights (0 * NaN) would spread. (Rotary
        scores depend on position differences only, so shifted positions would give the same values; counted
        as the training forward counts them, they also round as it does.)"""
        columns = torch.arange(start, end, device=pads.device)
        positions = (columns[None, :] - pads[:, None]).clamp(min=0)  # (B, n)
        cos, sin = self.cos[positions].unsqueeze(2), self.signed_sin[positions].unsqueeze(2)  # (B, n, 1, hd)
        keys = torch.arange(end, device=pads.device)
        causal = keys[None, :] <= columns[:, None]  # (n, S)
        visible = (causal[None] & (keys[None, None, :] >= pads[:, None, None])) | (keys[None, :] == columns[:, None])
        return cos, sin, visible[:, None, None]  # mask (B, 1, 1, n, S): broadcasts over (B, kv, groups, n, S)

    def _attention(self, products: _LayerProducts, x: Tensor, index: int, start: int, cos, sin, mask) -> Tensor:
        batch, new, _ = x.shape
        kv, groups, hd = self.kv_heads, self.groups, self.head_dim
        heads, end = kv * groups, start + new
        qkv = products.qkv(x).view(batch, new, heads + 2 * kv, hd)
        qk = qkv[:, :, : heads + kv]  # the query and key heads take the same rotation: in one pass
        swapped = qk.unflatten(-1, (2, hd // 2)).flip(-2).flatten(-2)  # (x2, x1); sin carries the sign
        qk = torch.addcmul(qk * cos, swapped, sin)
        # Query head h = k * groups + g serves key/value head k: (B, n, heads, hd) -> (B, kv, groups * n, hd).
        q = qk[:, :, :heads].reshape(batch, new, kv, groups, hd).permute(0, 2, 3, 1, 4)
        q = q.reshape(batch, kv, groups * new, hd)
        k = qk[:, :, heads:].transpose(1, 2)  # (B, kv, n, hd)
        v = qkv[:, :, heads + kv :].transpose(1, 2)  # (B, kv, n, hd)
        if index == len(self.keys):  # first call: buffers in the dtypes the attention reads k and v in
            fused = self.fused is not None  # the fused steps' float32 (the bf16 values widen exactly)
            key_dtype, value_dtype = (torch.float32, torch.float32) if fused else (_cached_key_dtype(k), v.dtype)
            self.keys.append(torch.empty((batch, kv, self.max_len, hd), dtype=key_dtype, device=k.device))
            self.values.append(torch.empty((batch, kv, self.max_len, hd), dtype=value_dtype, device=v.device))
        self.keys[index][:, :, start:end] = k
        self.values[index][:, :, start:end] = v
        keys = self.keys[index][:, :, :end].transpose(-1, -2)  # (B, kv, hd, S): a view, which the product reads as is
        scores = torch.matmul(q, keys).mul_(self.scaling)  # (B, kv, groups * n, S)
        if mask is not None:
            scores = scores.view(batch, kv, groups, new, end).masked_fill(~mask, float("-inf")).view_as(scores)
        weights = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, self.values[index][:, :, :end])  # (B, kv, groups * n, hd)
        out = out.view(batch, heads, new, hd).transpose(1, 2).reshape(batch, new, heads * hd)
        return products.o(out)


_NO_PADS = torch.empty(0, dtype=torch.long)  # decode_attention's "no row is padded"


def _float32(x: Tensor) -> Tensor:
    """A product's result as the fused kernels read it: float32 as it is, a bf16 one widened (exactly)."""
    return x if x.dtype == torch.float32 else x.float()


def _norm_parameters(norm: torch.nn.Module) -> tuple[Tensor, float]:
    return norm.weight, norm.variance_epsilon


def _is_silu(module: torch.nn.Module) -> bool:
    """PyTorch's SiLU module or transformers' (``ACT2FN["silu"]``, whose forward is ``F.silu``)."""
    kind = type(module)
    return kind is torch.nn.SiLU or (kind.__name__ == "SiLUActivation" and kind.__module__ == "transformers.activations")


def _fused_step_kernels(decoder: LeanDecoder):
    """The fused kernels where they compute ``decoder``'s one-token steps as its ``_forward`` does: float32
    weights on the CPU, every layer's q/k/v and gate/up as single prepared products (float32 ones, or bf16 ones
    under bf16 autocast: the module docstring says how those steps round), SiLU gating and RMS norms with float32
    weights. None otherwise (and where they cannot be built, or are turned off)."""
    body = decoder.body
    embedding = body.embed_tokens.weight
    if embedding.device.type != "cpu" or embedding.dtype != torch.float32 or decoder.cos.dtype != torch.float32:
        return None
    if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") != torch.bfloat16:
        return None
    norms = [body.norm] + [n for layer in body.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if not all(
        isinstance(getattr(norm, "weight", None), Tensor) and norm.weight.dtype == torch.float32
        and norm.weight.is_contiguous() and isinstance(getattr(norm, "variance_epsilon", None), float)
        for norm in norms
    ):
        return None
    if not all(_is_silu(layer.mlp.act_fn) for layer in body.layers):
        return None
    if not all(p.joined_qkv and p.joined_gate_up for p in decoder.products):
        return None
    return fused_kernels()


class ModelDecoder:
    """The same interface over the model's own KV-cached forward: any causal LM."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.cache, self.mask = model, None, None
        self.cache_arg = _cache_argument(model)

    def prompt(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        self.mask = None if left_padding(attention_mask) is None else attention_mask.long()
        return self.step(ids)

    def step(self, ids: Tensor) -> Tensor:
        options = {} if self.cache is None else {self.cache_arg: self.cache}
        if self.mask is not None:  # left padding: the mask grows with each token; positions count real tokens
            if self.cache is not None:
                self.mask = torch.cat([self.mask, self.mask.new_ones(ids.shape)], dim=1)
            positions = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
            options.update(attention_mask=self.mask, position_ids=positions)
        outputs = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **options)
        self.cache = getattr(outputs, self.cache_arg)
        return outputs.logits[:, -1]  # (B, V)


def left_padding(attention_mask: Tensor | None) -> Tensor | None:
    """The padding columns (B,) of each row of a left-padded (B, P) ``attention_mask`` (zeros, then ones);
    None where nothing is padded."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    mask = attention_mask.long()
    if bool((mask[:, 1:] < mask[:, :-1]).any()) or bool((mask[:, -1] == 0).any()):
        raise ValueError("attention_mask must pad on the left only: zeros, then ones, and a real last token")
    return mask.shape[1] - mask.sum(-1)


def distinct_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """``(first_rows, row_index)`` of (B, k) ``rows``: one row index of each distinct row (u,), and for each
    row the index in ``first_rows`` of its distinct row (B,)."""
    _, row_index = torch.unique(rows, dim=0, return_inverse=True)
    count = int(row_index.max()) + 1
    first_rows = torch.empty(count, dtype=torch.long, device=rows.device)
    first_rows.scatter_(0, row_index, torch.arange(len(row_index), device=rows.device))
    return first_rows, row_index


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

