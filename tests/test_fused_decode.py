"""The fused decode kernels (grpo_lightning/csrc/decode_step.cpp) compute the PyTorch formulas they replace: each
kernel against a float64 reference written out by hand, the decoder's fused steps against the model's own forward
(plain, grouped queries, Qwen2's biases, left-padded prompts), and the fallback where the kernels are off or
cannot be built."""

from __future__ import annotations

import logging
import os
import types

import pytest
import torch
from conftest import bf16_products_only, build_tiny_llama, needs_a_compiler
from test_fast_decode import build_tiny_qwen2, full_forward, left_padded_prompts, needs_bf16_products

from grpo_lightning import fast_decode, fused_decode, packed_linear
from grpo_lightning.fast_decode import LeanDecoder

pytestmark = needs_a_compiler(without="the decoder runs its PyTorch operations")


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_adds_in_place_and_returns_the_models_norm(kernels, with_delta):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 96, generator=generator) * 3
    delta = torch.randn(5, 96, generator=generator) if with_delta else None
    weight = torch.rand(96, generator=generator) + 0.5
    expected_hidden = hidden + delta if with_delta else hidden.clone()
    normed = kernels.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, expected_hidden)  # the residual add, in place, is one float32 add per entry
    torch.testing.assert_close(normed.double(), reference_norm(expected_hidden, weight, 1e-5), rtol=1e-6, atol=1e-6)


def test_add_rms_norm_keeps_eps_for_a_zero_row(kernels):
    normed = kernels.add_rms_norm(torch.zeros(1, 8), None, torch.ones(8), 1e-6)
    assert torch.equal(normed, torch.zeros(1, 8))  # 0 * rsqrt(0 + eps): no NaN from a zero mean square


def rotary_tables(length: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (L, hd) as Llama's rotary embedding lays them out: each frequency twice, halves side by side."""
    inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inverse[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The models' rotary formula, x * cos + rotate_half(x) * sin, with rotate_half(x1, x2) = (-x2, x1)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def reference_attention(qkv, keys, values, cos, sin, pads, position, kv_heads, groups, scaling):
    """Per row: rotate at its own position (counted from its first real token), write k and v at ``position``,
    softmax over the keys from its first real column to ``position``, weighted values. Float64, by the formulas."""
    rows, head_dim = qkv.shape[0], keys.shape[-1]
    heads = kv_heads * groups
    keys, values = keys.double().clone(), values.double().clone()
    out = torch.empty(rows, heads, head_dim, dtype=torch.float64)
    split = qkv.double().view(rows, heads + 2 * kv_heads, head_dim)
    for r in range(rows):
        first = int(pads[r]) if pads.numel() else 0
        at = position - first
        keys[r, :, position] = rotate(split[r, heads : heads + kv_heads], cos[at], sin[at])
        values[r, :, position] = split[r, heads + kv_heads :]
        for h in range(heads):
            k = h // groups  # query head h = k * groups + g reads key/value head k
            query = rotate(split[r, h], cos[at], sin[at])
            scores = keys[r, k, first : position + 1] @ query * scaling
            out[r, h] = torch.softmax(scores, dim=0) @ values[r, k, first : position + 1]
    return out.view(rows, heads * head_dim), keys, values


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("kv_heads, groups", [(2, 2), (1, 3), (3, 1)])
def test_decode_attention_rotates_writes_the_caches_and_attends_over_visible_keys(kernels, padded, kv_heads, groups):
    generator = torch.Generator().manual_seed(kv_heads * 10 + groups)
    rows, head_dim, length, position = 4, 16, 12, 7
    heads = kv_heads * groups
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator)
    keys = torch.randn(rows, kv_heads, length, head_dim, generator=generator)  # positions before 7: earlier steps
    values = torch.randn(rows, kv_heads, length, head_dim, generator=generator)
    cos, sin = rotary_tables(length, head_dim)
    half = head_dim // 2
    signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # the sign of rotate_half, as the decoder keeps it
    pads = torch.tensor([0, 3, 1, 6]) if padded else torch.empty(0, dtype=torch.long)
    scaling = head_dim**-0.5
    expected, expected_keys, expected_values = reference_attention(
        qkv, keys, values, cos, sin, pads, position, kv_heads, groups, scaling
    )
    out = kernels.decode_attention(qkv, keys, values, cos.float(), signed_sin.float(), pads, position, kv_heads, groups, scaling)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys.double(), expected_keys, rtol=1e-5, atol=1e-6)
    assert torch.equal(values.double(), expected_values)  # values are copied as they are


def test_decode_attention_with_one_visible_key_returns_its_value(kernels):
    qkv = torch.randn(1, 3 * 8, generator=torch.Generator().manual_seed(1)) * 50  # large scores: softmax of one is 1
    keys, values = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    cos, sin = torch.ones(4, 8), torch.zeros(4, 8)
    out = kernels.decode_attention(qkv, keys, values, cos, sin, torch.tensor([2]), 2, 1, 1, 1.0)
    assert torch.equal(out, qkv[:, 16:])  # the value just written, weight exactly 1


def test_silu_mul_is_silu_of_the_gate_times_up(kernels):
    generator = torch.Generator().manual_seed(2)
    gate = torch.cat([torch.randn(3, 40, generator=generator) * 4, torch.tensor([[-200.0, -88.0, -30.0, 0.0, 30.0, 90.0, 200.0, 1e-3]] * 3)], dim=1)
    up = torch.randn(3, gate.shape[1], generator=generator)
    out = kernels.silu_mul(torch.cat([gate, up], dim=1), gate.shape[1])
    expected = gate.double() * up.double() / (1 + torch.exp(-gate.double()))
    torch.testing.assert_close(out.double(), expected, rtol=4e-7, atol=1e-30)  # exp within 2 ulp, and three roundings


def test_silu_mul_propagates_nan(kernels):
    out = kernels.silu_mul(torch.tensor([[float("nan"), 1.0, 2.0, float("nan")]]), 2)
    assert out[0, 0].isnan() and out[0, 1].isnan()


def softmax_parts_float64(logits):
    """Sampling weights exp(logits - max), log sum exp and entropy, by their formulas in float64 (0 * -inf as 0),
    from logits - max as float32 gives it (every float32 path rounds that difference, 2e-6 of exp at |d| = 40)."""
    x = logits.double()
    d = (logits - logits.amax(-1, keepdim=True)).double()
    e = torch.exp(d)
    total = e.sum(-1, keepdim=True)
    terms = torch.where(e > 0, e * d, torch.zeros_like(d))
    return e, x.amax(-1, keepdim=True) + total.log(), total.log().squeeze(-1) - terms.sum(-1) / total.squeeze(-1)


# 1003 columns: the vector loops' blocks (32 for the maximum, 8 for the rest) and entries past them
@pytest.mark.parametrize("vocab", [1003, 49152])
def test_sampling_softmax_is_the_formula(kernels, vocab):
    generator = torch.Generator().manual_seed(4)
    buffer = torch.randn(5, vocab + 7, generator=generator) * 6
    logits = buffer[:, :vocab]  # rows of stride vocab + 7, as a slice of the model's output
    logits[1, -3:] = float("-inf")  # impossible tokens past the last vector, and inside one
    logits[1, 8:12] = float("-inf")
    logits[2, 0] = 200.0  # every other token of this row lies below exp's float range: weight exactly 0
    weights, log_normaliser, entropy = kernels.sampling_softmax(logits)
    expected_weights, expected_lse, expected_entropy = softmax_parts_float64(logits)
    rows = [0, 1, 3, 4]  # the ordinary rows: exp within 2 ulp, sums in float64
    torch.testing.assert_close(weights[rows].double(), expected_weights[rows], rtol=3e-7, atol=1e-30)
    torch.testing.assert_close(log_normaliser.double(), expected_lse, rtol=1e-7, atol=1e-6)
    torch.testing.assert_close(entropy.double(), expected_entropy, rtol=1e-6, atol=1e-6)
    assert weights.shape == (5, vocab) and log_normaliser.shape == (5, 1) and entropy.shape == (5,)
    assert (weights[1, -3:] == 0).all() and (weights[1, 8:12] == 0).all()
    assert weights[2, 0] == 1.0 and (weights[2, 1:] == 0).all() and entropy[2] == 0.0 and log_normaliser[2, 0] == 200.0


def test_sampling_softmax_passes_nan_on(kernels):
    logits = torch.tensor([[0.0, 1.0, float("nan"), 2.0] * 5, [0.0, float("inf"), 1.0, 2.0] * 5])
    weights, log_normaliser, entropy = kernels.sampling_softmax(logits)
    assert log_normaliser.isnan().all() and entropy.isnan().all()
    assert weights[0, 2].isnan() and weights[1, 1].isnan()


def test_the_kernels_exp_takes_the_widest_vector_unit_of_this_cpu(kernels):
    """16 lanes where AVX-512 is present, 8 where AVX2 (with FMA) is the widest, none elsewhere, less what the
    build's flags hold back ($ATEN_CPU_CAPABILITY): an AVX-512 build once fell back to GCC's loops, 4-10x slower
    than PyTorch."""
    _, flags = fused_decode.parse_cpuinfo(fused_decode._read_cpuinfo())
    held = set(fused_decode.compile_flags())
    if "avx512f" in flags and "-mno-avx512f" not in held:
        expected = 16
    elif {"avx2", "fma"} <= flags and "-mno-avx2" not in held:
        expected = 8
    else:
        expected = 0
    assert kernels.vector_exp_lanes == expected


def test_softmax_parts_takes_the_kernel_for_float32_cpu_logits_only(kernels, monkeypatch):
    from grpo_lightning import sampling

    calls = []
    monkeypatch.setattr(sampling, "fused_kernels", lambda: calls.append(1) or kernels)
    logits = torch.randn(3, 100)
    fused = sampling.softmax_parts(logits)
    assert calls == [1]
    for other in (logits.double(), logits.t().contiguous().t(), logits.requires_grad_(True)):
        sampling.softmax_parts(other)
    assert calls == [1]  # float64, columns of stride 3, autograd: PyTorch's operations
    if not kernels.vector_exp_lanes:  # a build without AVX2: PyTorch's passes stay, the kernel is only checked above
        assert sampling._sampling_kernels(logits.detach()) is None
        return
    monkeypatch.setattr(sampling, "fused_kernels", lambda: types.SimpleNamespace(vector_exp_lanes=0))  # no AVX2
    assert sampling._sampling_kernels(logits.detach()) is None
    monkeypatch.setattr(sampling, "fused_kernels", lambda: None)  # turned off, or no compiler
    plain = sampling.softmax_parts(logits.detach())
    for got, want in zip(fused, plain):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.fixture
def fused_steps(monkeypatch, kernels):
    """Counts the decoder's fused steps; products prepared for the tiny layers too (the kernels need them)."""
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHT", 1)
    calls = []
    original = LeanDecoder._fused_step

    def counted(self, ids):
        calls.append(ids.shape)
        return original(self, ids)

    monkeypatch.setattr(LeanDecoder, "_fused_step", counted)
    return calls


def build_tiny_gqa3(vocab_size: int, seed: int):
    """6 query heads over 2 key/value heads, head_dim 8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("build", [build_tiny_llama, build_tiny_qwen2, build_tiny_gqa3], ids=["llama", "qwen2-biases", "gqa3"])
@torch.no_grad()
def test_fused_steps_give_the_models_logits(fused_steps, build):
    model = build(vocab_size=300, seed=5)
    prompt = torch.randint(0, 300, (1, 3), generator=torch.Generator().manual_seed(7))
    ids = torch.cat([prompt.repeat(4, 1), torch.randint(0, 300, (4, 5), generator=torch.Generator().manual_seed(8))], dim=1)
    decoder = LeanDecoder(model, 4, 8)
    assert decoder.fused is not None
    logits = torch.stack([decoder.prompt(ids[:, :3]), *(decoder.step(ids[:, t : t + 1]) for t in range(3, 8))], dim=1)
    assert fused_steps == [torch.Size([4, 1])] * 5  # every one-token step, not the prompt
    torch.testing.assert_close(logits, full_forward(model, ids, 3), rtol=0, atol=1e-5)


@torch.no_grad()
def test_fused_steps_of_left_padded_prompts_decode_as_each_row_alone(fused_steps):
    model = build_tiny_llama(vocab_size=300, seed=3)
    ids, mask, rows = left_padded_prompts([2, 5, 3], rows_each=2, extra=4, seed=11)
    prompt_len = 5  # the longest prompt; the mask covers each row's own 4 tokens after it too
    decoder = LeanDecoder(model, ids.shape[0], ids.shape[1])
    logits = [decoder.prompt(ids[:, :prompt_len], mask[:, :prompt_len])]
    logits += [decoder.step(ids[:, t : t + 1]) for t in range(prompt_len, ids.shape[1])]
    assert len(fused_steps) == 4
    for r, row in enumerate(rows):  # each row alone, unpadded, through the model's forward
        own = model(input_ids=row).logits[0, -5:]
        torch.testing.assert_close(torch.stack([step[r] for step in logits]), own, rtol=0, atol=1e-5)


@torch.no_grad()
def test_no_fused_steps_without_prepared_products_with_gradients_or_with_the_kernels_off(fused_steps, monkeypatch):
    model = build_tiny_llama(vocab_size=300, seed=3)
    ids = torch.randint(0, 300, (2, 4), generator=torch.Generator().manual_seed(3))
    with monkeypatch.context() as patched:  # bf16 autocast where oneDNN has no bf16 products: autocast's own
        patched.setattr(packed_linear, "_bf16_products_available", lambda: False)
        for dtype in (torch.bfloat16, torch.float16):  # nor under fp16 autocast, which has no prepared products
            with torch.autocast("cpu", dtype=dtype):
                decoder = LeanDecoder(model, 2, 4)
                assert decoder.fused is None
                decoder.prompt(ids[:, :2])
                decoder.step(ids[:, 2:3])
    with torch.enable_grad():  # built with gradients on: the modules' own forwards, no prepared products
        with_gradients = LeanDecoder(model, 2, 4)
        with_gradients.prompt(ids[:, :2])
        with_gradients.step(ids[:, 2:3])
    assert fused_steps == []
    monkeypatch.setattr(fast_decode, "fused_kernels", lambda: None)  # turned off, or not buildable here
    off = LeanDecoder(model, 2, 4)
    assert off.fused is None
    first = off.prompt(ids[:, :2])
    later = [off.step(ids[:, t : t + 1]) for t in range(2, 4)]
    assert fused_steps == []
    torch.testing.assert_close(torch.stack([first, *later], dim=1), full_forward(model, ids, 2), rtol=0, atol=1e-5)


@needs_bf16_products
@pytest.mark.parametrize("build", [build_tiny_llama, build_tiny_qwen2], ids=["llama", "qwen2-biases"])
@torch.no_grad()
def test_fused_steps_under_bf16_autocast_round_only_the_products(fused_steps, build):
    model = build(vocab_size=300, seed=5)
    prompt = torch.randint(0, 300, (1, 3), generator=torch.Generator().manual_seed(7))
    ids = torch.cat([prompt.repeat(4, 1), torch.randint(0, 300, (4, 5), generator=torch.Generator().manual_seed(8))], dim=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = LeanDecoder(model, 4, 8)
        assert decoder.fused is not None and decoder.products[0].joined_qkv is not None
        fused = torch.stack([decoder.prompt(ids[:, :3]), *(decoder.step(ids[:, t : t + 1]) for t in range(3, 8))], dim=1)
        eager = full_forward(model, ids, 3).float()  # autocast's own rounding, every operation in its dtype
    assert fused_steps == [torch.Size([4, 1])] * 5 and fused.dtype == torch.bfloat16  # bf16 logits, as autocast's
    assert decoder.keys[0].dtype == torch.float32 and decoder.values[0].dtype == torch.float32
    rounded = full_forward(bf16_products_only(model), ids, 3)
    # The fused steps round the products' inputs and results to bf16 and nothing else: the float32 forward with only
    # its products rounded, to one rounding of the bf16 logits that float32 sums of another order may tip (the
    # prompt's position is left out: the eager forward runs it, under autocast)
    fused, rounded, eager = fused[:, 1:].float(), rounded[:, 1:], eager[:, 1:]
    torch.testing.assert_close(fused, rounded, rtol=2**-8, atol=2**-9)
    # autocast's eager operations round more (queries, keys, attention, the gated activation): further from it
    assert (fused - rounded).abs().mean() < (eager - rounded).abs().mean()


def test_the_environment_variable_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv(fused_decode.FUSED_DECODE_ENV, "0")
    fused_decode.compiled_kernels.cache_clear()
    try:
        assert fused_decode.fused_kernels() is None
    finally:
        fused_decode.compiled_kernels.cache_clear()


def test_a_failed_build_says_so_in_one_line_and_returns_none(monkeypatch, caplog, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions\nsecond line")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built here, nothing left in the real cache
    path = os.environ.get("PATH")
    fused_decode.compiled_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="grpo_lightning.fused_decode"):
            assert fused_decode.fused_kernels() is None
    finally:
        fused_decode.compiled_kernels.cache_clear()
    assert os.environ.get("PATH") == path  # the venv's bin was on it for the build only
    [record] = caplog.records
    assert "Ninja is required" in record.getMessage() and "second line" not in record.getMessage()
    assert fused_decode.FUSED_DECODE_ENV in record.getMessage()


def test_the_build_name_follows_the_cpu(monkeypatch):
    here = fused_decode.extension_name()
    monkeypatch.setattr(fused_decode, "_read_cpuinfo", lambda: "model name\t: Other CPU\nflags\t\t: sse2 avx2\n")
    assert fused_decode.extension_name() != here  # -march=native code is not shared with another CPU
