"""The learning step's fused causal attention (grpo_lightning/csrc/train_attention.cpp, grpo_lightning.fused_attention):
the kernel against the attention formula written out in float64, forward and backward (grouped key/value heads,
left padding, shared and per-row rotary tables, NaN), whole models against their eager attention, and where it must
not apply."""

from __future__ import annotations

import copy
import inspect
import types

import pytest
import torch
from conftest import bf16_products_only, build_tiny_llama, needs_a_compiler
from test_fused_training import assert_same_model_results, loss_and_grads

from grpo_lightning import fused_attention, fused_decode
from grpo_lightning.fused_attention import FusedCausalAttention, use_fused_attention

pytestmark = needs_a_compiler(without="attention runs transformers' eager operations")

MASKED = torch.finfo(torch.float32).min  # what transformers' eager mask holds where a query may not look


def rotary_tables(rows: int, tokens: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of (rows, tokens, head_dim), each angle repeated in both halves, as Llama's rotary embedding has it."""
    generator = torch.Generator().manual_seed(seed)
    angles = torch.rand(rows, tokens, head_dim // 2, generator=generator, dtype=torch.float64) * 6
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def causal_mask(batch: int, tokens: int, left_padding: list[int]) -> torch.Tensor:
    """(B, T, T): 0 where query i may look at key j (j <= i, j not padding), the float32 minimum elsewhere."""
    mask = torch.zeros(batch, tokens, tokens, dtype=torch.float64)
    mask.masked_fill_(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), MASKED)
    for row, pads in enumerate(left_padding):
        mask[row, :, :pads] = MASKED
    return mask


def attention_float64(q, k, v, cos, sin, mask, heads, kv_heads, scaling):
    """The formula: rotate q and k (x cos + rotate_half(x) sin), scores q k^T * scaling + mask over the keys j <= i
    only, softmax, the weighted sum of v; query head h reads key/value head h // (heads / kv_heads)."""
    batch, tokens, _ = q.shape
    head_dim = q.shape[-1] // heads
    half = head_dim // 2

    def rotate(x):  # (B, T, n, hd)
        rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos[:, :, None] + rotated_half * sin[:, :, None]

    q_rot = rotate(q.view(batch, tokens, heads, head_dim)).transpose(1, 2)  # (B, H, T, hd)
    k_rot = rotate(k.view(batch, tokens, kv_heads, head_dim)).transpose(1, 2)
    values = v.view(batch, tokens, kv_heads, head_dim).transpose(1, 2)
    shared = heads // kv_heads
    k_rot, values = k_rot.repeat_interleave(shared, dim=1), values.repeat_interleave(shared, dim=1)
    scores = q_rot @ k_rot.transpose(-1, -2) * scaling + mask[:, None]
    later = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(later, float("-inf")).softmax(-1)
    return (probs @ values).transpose(1, 2).reshape(batch, tokens, heads * head_dim)


def random_inputs(batch, tokens, heads, kv_heads, head_dim, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads * head_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, tokens, kv_heads * head_dim, generator=generator, dtype=torch.float64)
    v = torch.randn(batch, tokens, kv_heads * head_dim, generator=generator, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("tables", ["per_row", "shared"])
def test_the_kernel_gives_the_attention_formula_and_its_gradients(kernels, tables):
    # T = 21: one full block of 16 keys and a partial one; 6 query heads share 2 key/value heads; row 1 has 2 tokens
    # of left padding and row 2 has 5.
    batch, tokens, heads, kv_heads, head_dim, scaling = 3, 21, 6, 2, 32, 32**-0.5
    q, k, v = random_inputs(batch, tokens, heads, kv_heads, head_dim, seed=0)
    cos, sin = rotary_tables(batch if tables == "per_row" else 1, tokens, head_dim, seed=1)
    padding = [0, 2, 5]
    mask = causal_mask(batch, tokens, padding)
    real = torch.ones(batch, tokens, 1, dtype=torch.bool)  # padding queries attend to nothing: left out
    for row, pads in enumerate(padding):
        real[row, :pads] = False
    generator = torch.Generator().manual_seed(2)
    grad_out = torch.randn(batch, tokens, heads * head_dim, generator=generator, dtype=torch.float64) * real

    q32, k32, v32 = (x.float().requires_grad_(True) for x in (q, k, v))
    out = FusedCausalAttention.apply(q32, k32, v32, cos.float(), sin.float(), mask.float(), heads, kv_heads, scaling,
                                     kernels)  # fmt: skip
    out.backward(grad_out.float())
    q64, k64, v64 = (x.clone().requires_grad_(True) for x in (q, k, v))
    expected = attention_float64(q64, k64, v64, cos, sin, mask, heads, kv_heads, scaling)
    expected.backward(grad_out)

    torch.testing.assert_close((out.detach().double() * real), expected.detach() * real, rtol=0, atol=2e-6)
    for name, fused, formula in (("q", q32, q64), ("k", k32, k64), ("v", v32, v64)):
        torch.testing.assert_close(fused.grad.double(), formula.grad, rtol=0, atol=5e-6, msg=name)
    assert fused.grad[1, :2].abs().max() == 0  # no gradient reaches the padding


def test_without_a_mask_the_kernel_is_causal_attention(kernels):
    batch, tokens, heads, kv_heads, head_dim = 2, 9, 4, 4, 16  # as many key/value heads as query heads
    q, k, v = random_inputs(batch, tokens, heads, kv_heads, head_dim, seed=3)
    cos, sin = rotary_tables(1, tokens, head_dim, seed=4)
    out = FusedCausalAttention.apply(q.float(), k.float(), v.float(), cos.float(), sin.float(), torch.empty(0), heads,
                                     kv_heads, 0.25, kernels)  # fmt: skip
    expected = attention_float64(q, k, v, cos, sin, causal_mask(batch, tokens, [0, 0]), heads, kv_heads, 0.25)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6)
    # The first query sees only itself: its output is its own value, exactly as the formula says.
    torch.testing.assert_close(out[:, 0].double(), v[:, 0], rtol=0, atol=1e-6)


def test_a_nan_reaches_the_output_as_in_eager_attention(kernels):
    batch, tokens, heads, kv_heads, head_dim = 1, 5, 2, 1, 16
    q, k, v = random_inputs(batch, tokens, heads, kv_heads, head_dim, seed=5)
    q[0, 3, :head_dim] = float("nan")  # query 3 of head 0
    cos, sin = rotary_tables(1, tokens, head_dim, seed=6)
    out = FusedCausalAttention.apply(q.float(), k.float(), v.float(), cos.float(), sin.float(), torch.empty(0), heads,
                                     kv_heads, 0.25, kernels)  # fmt: skip
    assert out[0, 3, :head_dim].isnan().all()  # not a row of zeros: the nonfinite guards must see it
    nan_free = torch.ones_like(out, dtype=torch.bool)
    nan_free[0, 3, :head_dim] = False
    assert out[nan_free].isfinite().all()


def build_llama_with_wide_heads(seed: int = 0):
    """A tiny Llama whose heads are 16 wide (the kernel's block), with eager attention, as the module runs short
    sequences."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         attn_implementation="eager")  # fmt: skip
    return LlamaForCausalLM(config)


def count_kernel_calls(monkeypatch) -> list[int]:
    calls = []
    original = FusedCausalAttention.apply
    monkeypatch.setattr(FusedCausalAttention, "apply", lambda *args: calls.append(1) or original(*args))
    return calls


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_a_models_fused_attention_gives_its_log_probs_and_gradients(kernels, monkeypatch, padded):
    eager = build_llama_with_wide_heads().train()
    fused = copy.deepcopy(eager)
    assert use_fused_attention(fused) == 2 and use_fused_attention(fused) == 0  # once a layer
    calls = count_kernel_calls(monkeypatch)
    ids = torch.randint(1, 300, (3, 14), generator=torch.Generator().manual_seed(8))
    mask = None
    if padded:  # prompts of different lengths: rows 1 and 2 start later
        mask = torch.ones(3, 14, dtype=torch.long)
        mask[1, :2] = 0
        mask[2, :4] = 0
    results = loss_and_grads(fused, ids, mask)
    assert len(calls) == 2  # both layers ran the kernel
    assert_same_model_results(fused, eager, results, loss_and_grads(eager, ids, mask))


def test_the_layers_own_forward_runs_wherever_the_kernel_does_not_apply(kernels, monkeypatch):
    eager = build_llama_with_wide_heads().eval()
    fused = copy.deepcopy(eager)
    use_fused_attention(fused)
    calls = count_kernel_calls(monkeypatch)
    ids = torch.randint(1, 300, (2, 8), generator=torch.Generator().manual_seed(9))
    with torch.autocast("cpu", dtype=torch.float16):  # fp16 autocast: its own
        assert torch.equal(fused(ids, use_cache=False).logits, eager(ids, use_cache=False).logits)
    # with a key/value cache (generation): the cache must be filled, which the kernel does not do
    cached, expected = fused(ids, use_cache=True), eager(ids, use_cache=True)
    assert torch.equal(cached.logits, expected.logits)
    assert torch.equal(cached.past_key_values.layers[0].keys, expected.past_key_values.layers[0].keys)
    monkeypatch.setenv(fused_attention.FUSED_ATTENTION_ENV, "0")
    assert torch.equal(fused(ids, use_cache=False).logits, eager(ids, use_cache=False).logits)
    monkeypatch.delenv(fused_attention.FUSED_ATTENTION_ENV)
    monkeypatch.setenv(fused_decode.FUSED_TRAINING_ENV, "0")  # the learning step's kernels all off
    assert torch.equal(fused(ids, use_cache=False).logits, eager(ids, use_cache=False).logits)
    monkeypatch.delenv(fused_decode.FUSED_TRAINING_ENV)
    assert calls == []
    fused(ids, use_cache=False)
    assert calls == [1, 1]  # and with nothing in the way, both layers run it


@torch.no_grad()
def test_under_bf16_autocast_the_kernel_attends_in_float32_between_bf16_products(kernels, monkeypatch):
    model = build_llama_with_wide_heads().eval()
    eager_layer = model.model.layers[0].self_attn
    fused = copy.deepcopy(model)
    use_fused_attention(fused)
    calls = count_kernel_calls(monkeypatch)
    hidden = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(11))
    positions = torch.arange(8).unsqueeze(0)
    tables = model.model.rotary_emb(hidden, positions)
    mask = torch.full((8, 8), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused.model.layers[0].self_attn(hidden, tables, mask)[0]
        autocast_eager = eager_layer(hidden, tables, mask)[0]
    assert calls == [1] and out.dtype == torch.bfloat16  # the output projection's bf16 result, as autocast's
    # The layer in float32 with only its four products rounded to bf16: what the kernel computes between them, to a
    # rounding of the output product's input or result that float32 sums of another order may tip
    rounded = bf16_products_only(copy.deepcopy(eager_layer))(hidden, tables, mask)[0]
    torch.testing.assert_close(out.float(), rounded, rtol=2**-7, atol=1e-4)
    # Eager attention under autocast rounds the scores and weighted values as well: further from it
    assert (out.float() - rounded).abs().mean() < (autocast_eager.float() - rounded).abs().mean()


def test_heads_that_are_not_whole_blocks_of_16_keep_eager_attention(kernels, monkeypatch):
    eager = build_tiny_llama(300)  # 4 heads of 8
    eager.config._attn_implementation = "eager"
    fused = copy.deepcopy(eager)
    assert use_fused_attention(fused) == 2
    calls = count_kernel_calls(monkeypatch)
    ids = torch.randint(1, 300, (2, 8), generator=torch.Generator().manual_seed(10))
    assert torch.equal(fused(ids, use_cache=False).logits, eager(ids, use_cache=False).logits) and calls == []


def test_only_llamas_attention_is_changed():
    from test_fast_decode import build_tiny_qwen2

    assert use_fused_attention(build_tiny_qwen2(300)) == 0  # Qwen2's attention has its own forward (sliding windows)


def test_a_copy_of_llamas_forward_with_its_own_rotary_embedding_is_left_alone():
    """A model file may copy Llama's attention forward word for word but rotate its own way (partial rotary, pairs
    interleaved): the forward's code alone does not decide."""
    from transformers.models.llama import modeling_llama

    def interleaved_rotary(q, k, cos, sin, unsqueeze_dim=1):  # not Llama's formula
        return q * cos.unsqueeze(unsqueeze_dim), k * sin.unsqueeze(unsqueeze_dim)

    forward = inspect.unwrap(modeling_llama.LlamaAttention.forward)
    own_globals = dict(forward.__globals__, apply_rotary_pos_emb=interleaved_rotary)
    copied = types.FunctionType(forward.__code__, own_globals, forward.__name__, forward.__defaults__,
                                forward.__closure__)  # fmt: skip
    OtherAttention = type("OtherAttention", (modeling_llama.LlamaAttention,), {"forward": copied})
    model = build_llama_with_wide_heads()
    for layer in model.model.layers:
        layer.self_attn.__class__ = OtherAttention
    assert use_fused_attention(model) == 0
