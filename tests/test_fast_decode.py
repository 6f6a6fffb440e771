"""The sampling fast path computes what the model computes: the lean decoder against the model's own forward
(plain, GQA, LoRA, bf16 autocast), the decode products (MKL packed, oneDNN) against F.linear, and the per-step softmax by hand."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_tiny_llama

from grpo_lightning.fast_decode import LeanDecoder, ModelDecoder, make_decoder, supports_fast_decode
from grpo_lightning.lora import LoraSettings, apply_lora
from grpo_lightning import fast_decode, packed_linear
from grpo_lightning.config import GRPOError
from grpo_lightning.packed_linear import prepared_linear_layers, product_setting
from grpo_lightning.sampling import sample_completions_with_logprobs, softmax_parts


def decode_all(decoder, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits (B, L - prompt_len + 1, V) at the last prompt position and after each later token."""
    steps = [decoder.step(ids[:, :prompt_len])]
    steps += [decoder.step(ids[:, t : t + 1]) for t in range(prompt_len, ids.shape[1])]
    return torch.stack(steps, dim=1)


def full_forward(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    return model(input_ids=ids).logits[:, prompt_len - 1 :]


@pytest.fixture
def tiny_model():
    return build_tiny_llama(vocab_size=300, seed=3)  # 4 query heads over 2 key/value heads: grouped attention


@pytest.mark.parametrize("prompt_len", [1, 3])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@torch.no_grad()
def test_lean_decoder_matches_the_full_forward(tiny_model, prompt_len, attention):
    tiny_model.config._attn_implementation = attention
    ids = torch.randint(0, 300, (5, 9), generator=torch.Generator().manual_seed(0))
    expected = full_forward(tiny_model, ids, prompt_len)
    decoder = make_decoder(tiny_model, batch=5, max_len=9)
    assert isinstance(decoder, LeanDecoder)
    torch.testing.assert_close(decode_all(decoder, ids, prompt_len), expected, rtol=0, atol=1e-5)


@torch.no_grad()
def test_a_prompt_shared_by_the_group_runs_once_and_decodes_as_if_run_on_every_row(tiny_model):
    prompt = torch.randint(0, 300, (1, 4), generator=torch.Generator().manual_seed(4))
    tokens = torch.randint(0, 300, (6, 3), generator=torch.Generator().manual_seed(5))  # each row its own
    ids = torch.cat([prompt.repeat(6, 1), tokens], dim=1)
    expected = full_forward(tiny_model, ids, 4)
    decoder = LeanDecoder(tiny_model, 6, 7)
    calls = []
    hook = tiny_model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    try:
        first = decoder.prompt(ids[:, :4])
    finally:
        hook.remove()
    assert calls == [torch.Size([1, 4, tiny_model.config.hidden_size])]  # the shared prompt ran on one row
    assert first.shape == (6, 300) and decoder.keys[0].shape[0] == 6  # ... and every row has its cache
    later = [decoder.step(ids[:, t : t + 1]) for t in range(4, 7)]
    torch.testing.assert_close(torch.stack([first, *later], dim=1), expected, rtol=0, atol=1e-5)


@torch.no_grad()
def test_prompts_that_differ_run_row_by_row_as_before(tiny_model):
    ids = torch.randint(0, 300, (3, 6), generator=torch.Generator().manual_seed(6))
    ids[1, :3] = ids[0, :3]  # two rows alike are not enough: all must be
    decoder = LeanDecoder(tiny_model, 3, 6)
    first = decoder.prompt(ids[:, :3])
    later = [decoder.step(ids[:, t : t + 1]) for t in range(3, 6)]
    torch.testing.assert_close(torch.stack([first, *later], dim=1), full_forward(tiny_model, ids, 3), rtol=0, atol=1e-5)


def left_padded_prompts(lengths: list[int], rows_each: int, extra: int, seed: int):
    """Prompts of ``lengths`` tokens, each on ``rows_each`` rows, left-padded with id 0 to the longest, followed by
    ``extra`` tokens of each row's own: (ids, mask, [each row unpadded])."""
    generator = torch.Generator().manual_seed(seed)
    longest, ids, mask, alone = max(lengths), [], [], []
    for length in lengths:
        prompt = torch.randint(1, 300, (1, length), generator=generator)
        for _ in range(rows_each):
            row = torch.cat([prompt, torch.randint(1, 300, (1, extra), generator=generator)], dim=1)
            alone.append(row)
            ids.append(torch.nn.functional.pad(row, (longest - length, 0)))
            mask.append(torch.cat([torch.zeros(1, longest - length, dtype=torch.long), torch.ones_like(row)], dim=1))
    return torch.cat(ids), torch.cat(mask), alone


def tiny_gpt2():
    """Absolute learned positions, where a row's positions must count from its first real token."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(5)
    return GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()


@pytest.mark.parametrize("decoder_kind", ["lean", "model", "model-gpt2"])
@torch.no_grad()
def test_left_padded_prompts_decode_as_each_row_alone(tiny_model, decoder_kind):
    # two prompts of 3 and 5 tokens, 3 rows each, then 3 tokens per row: one decode, as each row would alone
    ids, mask, alone = left_padded_prompts([3, 5], rows_each=3, extra=3, seed=7)
    model = tiny_gpt2() if decoder_kind == "model-gpt2" else tiny_model
    decoder = LeanDecoder(model, 6, 8) if decoder_kind == "lean" else ModelDecoder(model)
    calls = []
    embeddings = model.get_input_embeddings()
    hook = embeddings.register_forward_hook(lambda module, inputs, output: calls.append(inputs[0].shape))
    try:
        first = decoder.prompt(ids[:, :5], mask[:, :5])
    finally:
        hook.remove()
    later = [decoder.step(ids[:, t : t + 1]) for t in range(5, 8)]
    together = torch.stack([first, *later], dim=1)  # (6, 4, V)
    expected = torch.cat([full_forward(model, row, row.shape[1] - 3) for row in alone])
    torch.testing.assert_close(together, expected, rtol=0, atol=1e-5)
    assert calls == [torch.Size([2 if decoder_kind == "lean" else 6, 5])]  # the lean decoder runs each prompt once


def test_a_mask_that_pads_on_the_right_is_refused(tiny_model):
    with pytest.raises(ValueError, match="pad on the left only"):
        LeanDecoder(tiny_model, 2, 6).prompt(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]]))


@torch.no_grad()
def test_sampling_left_padded_prompts_keeps_the_log_probabilities_the_learning_step_computes(tiny_model):
    from grpo_lightning.objectives import generated_logprobs

    ids, mask, _ = left_padded_prompts([2, 6, 4], rows_each=2, extra=0, seed=8)
    torch.manual_seed(0)
    sampled = sample_completions_with_logprobs(tiny_model, ids, gen_len=5, attention_mask=mask)
    full_mask = torch.cat([mask, torch.ones(6, 5, dtype=torch.long)], dim=1)
    recomputed = generated_logprobs(tiny_model, sampled.sample_ids, 5, full_mask)
    torch.testing.assert_close(sampled.logprobs, recomputed, rtol=0, atol=1e-5)
    assert torch.equal(sampled.sample_ids[:, :6], ids)


@torch.no_grad()
def test_lean_decoder_runs_lora_adapters_and_their_switch(tiny_model):
    lora = lora_with_live_adapters(tiny_model)
    ids = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(1))
    with_adapters = full_forward(lora, ids, 2)
    torch.testing.assert_close(decode_all(LeanDecoder(lora, 3, 7), ids, 2), with_adapters, rtol=0, atol=1e-5)
    with lora.disable_adapter():
        without = full_forward(lora, ids, 2)
        torch.testing.assert_close(decode_all(LeanDecoder(lora, 3, 7), ids, 2), without, rtol=0, atol=1e-5)
    assert (with_adapters - without).abs().max() > 0.1  # the adapters really changed the logits


@torch.no_grad()
def test_lean_decoder_under_bf16_autocast_matches_the_models_own_cached_decode(tiny_model):
    ids = torch.randint(0, 300, (4, 8), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lean = decode_all(LeanDecoder(tiny_model, 4, 8), ids, 3).float()
        own = decode_all(ModelDecoder(tiny_model), ids, 3).float()
    exact = full_forward(tiny_model, ids, 3)
    # bf16 keeps 8 significant bits: both cached decodes round alike and stay near the fp32 forward
    torch.testing.assert_close(lean, own, rtol=0, atol=2e-2)
    torch.testing.assert_close(lean, exact, rtol=0, atol=5e-2)


def test_other_shapes_and_long_sequences_use_the_models_forward(tiny_model):
    assert supports_fast_decode(tiny_model, 64)
    tiny_model.config.model_type = "gpt2"
    assert not supports_fast_decode(tiny_model, 64)
    assert isinstance(make_decoder(tiny_model, 2, 8), ModelDecoder)
    with pytest.raises(ValueError, match="holds 4 positions; 5 were asked for"):
        tiny_model.config.model_type = "llama"
        LeanDecoder(tiny_model, 1, 4).step(torch.zeros(1, 5, dtype=torch.long))


BACKEND_AVAILABLE = {"mkl": packed_linear._mkl_available(), "onednn": packed_linear._onednn_available()}
needs_backend = pytest.mark.parametrize(
    "backend", [pytest.param(name, marks=pytest.mark.skipif(not ok, reason=f"this PyTorch has no {name}")) for name, ok in BACKEND_AVAILABLE.items()]
)


@pytest.fixture
def decode_matmul(monkeypatch):
    """Chooses the decode products' library by name, as a user would with the environment variable."""
    return lambda name: monkeypatch.setenv(packed_linear.DECODE_MATMUL_ENV, name)


@needs_backend
@torch.no_grad()
def test_decode_products_give_f_linear_results(decode_matmul, backend):
    decode_matmul(backend)
    layer = torch.nn.Linear(96, 80)
    other = torch.nn.Linear(8, 8)  # too small to prepare: left alone
    model = torch.nn.Sequential(layer, other)
    x = torch.randn(6, 1, 96)
    assert product_setting(model) == (backend, torch.float32)
    with prepared_linear_layers(model, rows=6):
        assert "forward" in vars(layer) and "forward" not in vars(other)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-6, atol=1e-6)
        x7 = torch.randn(7, 96)  # another row count: MKL's packing does not fit it, the ordinary product runs
        exact = backend == "mkl"
        expected7 = torch.nn.functional.linear(x7, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x7), expected7, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6)
    assert "forward" not in vars(layer)  # restored


@needs_backend
@torch.no_grad()
def test_passes_of_any_row_count_use_onednn_only(decode_matmul, backend):
    decode_matmul(backend)
    layer = torch.nn.Linear(96, 80)
    x = torch.randn(3, 11, 96)
    with prepared_linear_layers(layer, rows=None):  # the reference's forward: rows vary, nothing to pack for
        assert ("forward" in vars(layer)) == (backend == "onednn")
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "vendor, expected",
    [("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"), ("", "onednn")],  # MKL's fast paths are Intel's own
)
def test_the_decode_library_follows_the_cpu_vendor(monkeypatch, vendor, expected):
    monkeypatch.delenv(packed_linear.DECODE_MATMUL_ENV, raising=False)
    monkeypatch.setattr(packed_linear, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(packed_linear, "_mkl_available", lambda: True)
    monkeypatch.setattr(packed_linear, "_onednn_available", lambda: True)
    assert packed_linear.decode_matmul_backend() == expected
    monkeypatch.setattr(packed_linear, "_onednn_available", lambda: False)  # e.g. a build without oneDNN
    assert packed_linear.decode_matmul_backend() == "mkl"
    monkeypatch.setattr(packed_linear, "_mkl_available", lambda: False)
    assert packed_linear.decode_matmul_backend() == "aten"
    assert product_setting(torch.nn.Linear(96, 80)) is None


def test_the_decode_library_can_be_chosen_by_name(monkeypatch, decode_matmul):
    monkeypatch.setattr(packed_linear, "_mkl_available", lambda: True)
    monkeypatch.setattr(packed_linear, "_onednn_available", lambda: False)
    for name, expected in (("MKL", "mkl"), ("aten", "aten"), ("onednn", "aten")):  # not in this build: F.linear
        decode_matmul(name)
        assert packed_linear.decode_matmul_backend() == expected
    decode_matmul("cublas")
    with pytest.raises(GRPOError, match=r"GRPO_LIGHTNING_DECODE_MATMUL='cublas' is not one of mkl, onednn, aten \(or unset it\)"):
        packed_linear.decode_matmul_backend()


def test_packing_is_off_under_fp16_autocast_and_with_gradients():
    layer = torch.nn.Linear(96, 80)
    with torch.autocast("cpu", dtype=torch.float16):  # only bf16 autocast has prepared products
        assert product_setting(layer) is None
    x = torch.randn(4, 96, requires_grad=True)
    with prepared_linear_layers(layer, rows=4):
        layer(x).sum().backward()  # with gradients enabled the packed product (no backward) is not used
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(4, -1))


needs_bf16_products = pytest.mark.skipif(
    not packed_linear._bf16_products_available(), reason="this PyTorch's oneDNN has no bf16 kernels on this CPU"
)


def test_bf16_autocast_takes_onednn_bf16_products_where_they_exist(monkeypatch, decode_matmul):
    layer = torch.nn.Linear(96, 80)
    monkeypatch.setattr(packed_linear, "_bf16_products_available", lambda: True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name in ("mkl", "onednn"):  # MKL has no bf16 product: oneDNN, whichever fp32 library is chosen
            decode_matmul(name)
            assert product_setting(layer) == ("onednn", torch.bfloat16)
        decode_matmul("aten")  # the user's switch for the products as autocast runs them
        assert product_setting(layer) is None
        decode_matmul("onednn")
        monkeypatch.setattr(packed_linear, "_bf16_products_available", lambda: False)
        assert product_setting(layer) is None
        assert packed_linear.prepared_product((layer,), rows=4) is None
    assert product_setting(layer.bfloat16()) is None  # bf16 weights: not these products


@needs_bf16_products
@torch.no_grad()
def test_bf16_products_compute_exactly_what_autocast_computes(decode_matmul):
    decode_matmul("onednn")
    q, k, v = torch.nn.Linear(96, 80), torch.nn.Linear(96, 48, bias=False), torch.nn.Linear(96, 48)
    x = torch.randn(6, 1, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        qkv = packed_linear.prepared_product((q, k, v), rows=6)
        expected = torch.cat([q(x), k(x), v(x)], dim=-1)
        assert qkv(x).dtype == torch.bfloat16 and torch.equal(qkv(x), expected)  # the same bf16 rounding, to the bit
        x3 = torch.randn(3, 96)  # any row count
        assert torch.equal(qkv(x3), torch.cat([q(x3), k(x3), v(x3)], dim=-1))
        expected3 = torch.nn.functional.linear(x3, q.weight, q.bias)
        with prepared_linear_layers(q, rows=None):  # the reference's pass: the layer itself, patched
            assert "forward" in vars(q) and torch.equal(q(x3), expected3)
    assert expected3.dtype == torch.bfloat16


@needs_bf16_products
@torch.no_grad()
def test_bf16_products_leave_live_lora_adapters_to_their_own_forward(decode_matmul, monkeypatch):
    decode_matmul("onednn")
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHT", 1)
    lora = lora_with_live_adapters(build_tiny_llama(vocab_size=300, seed=4))
    attn = lora.get_base_model().model.layers[0].self_attn
    ids = torch.randint(0, 300, (3, 5), generator=torch.Generator().manual_seed(6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # A delta merged into a bf16 weight would round away: the LoRA layer runs itself, on a prepared base
        assert packed_linear.prepared_product((attn.q_proj,), rows=3) is None
        expected = lora(input_ids=ids).logits
        with prepared_linear_layers(lora, rows=None):
            assert "forward" not in vars(attn.q_proj) and "forward" in vars(attn.q_proj.base_layer)
            assert torch.equal(lora(input_ids=ids).logits, expected)
        with lora.disable_adapter():  # the reference: the base weights alone, prepared whole
            base = packed_linear.prepared_product((attn.q_proj,), rows=3)
            x = torch.randn(3, 1, 32)
            assert torch.equal(base(x), attn.q_proj(x))


@needs_bf16_products
@torch.no_grad()
def test_lean_decoder_under_bf16_autocast_runs_prepared_products(tiny_model, decode_matmul, monkeypatch):
    decode_matmul("onednn")
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHT", 1)
    ids = torch.randint(0, 300, (4, 8), generator=torch.Generator().manual_seed(2))
    layer = tiny_model.model.layers[0]
    calls = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        own = decode_all(ModelDecoder(tiny_model), ids, 3).float()
        decoder = LeanDecoder(tiny_model, 4, 8)
        hooks = [m.register_forward_hook(lambda m, i, o: calls.append(m)) for m in (layer.self_attn.q_proj, layer.mlp.down_proj, tiny_model.lm_head)]
        try:
            lean = decode_all(decoder, ids, 3).float()
        finally:
            for hook in hooks:
                hook.remove()
    assert calls == []
    torch.testing.assert_close(lean, own, rtol=0, atol=2e-2)  # as the modules' own bf16 decode (test above)


def test_softmax_parts_by_hand():
    # p = (1/4, 3/4, 0): log normaliser log 4 (+ the row's offset), entropy log 4 - (3/4) log 3
    logits = torch.tensor([[0.0, math.log(3.0), -math.inf], [10.0, 10.0 + math.log(3.0), -math.inf]])
    weights, log_normaliser, entropy = softmax_parts(logits)
    torch.testing.assert_close(weights, torch.tensor([[1 / 3, 1.0, 0.0], [1 / 3, 1.0, 0.0]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(log_normaliser, torch.tensor([[math.log(4)], [10 + math.log(4)]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(entropy, torch.full((2,), math.log(4) - 0.75 * math.log(3)), rtol=1e-6, atol=0)
    one_hot = softmax_parts(torch.tensor([[5.0, -math.inf, -math.inf]]))
    assert one_hot[2].item() == 0.0 and one_hot[1].item() == 5.0


def lora_with_live_adapters(model):
    lora = apply_lora(model, LoraSettings(), seed=0)
    with torch.no_grad():
        for name, param in lora.named_parameters():  # adapters start as a no-op (B = 0): make them count
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.5)
    return lora


@needs_backend
def test_packed_lora_layers_compute_the_adapted_and_the_switched_off_model(decode_matmul, backend):
    decode_matmul(backend)
    model = build_tiny_llama(vocab_size=300, seed=4)
    lora = lora_with_live_adapters(model)  # its projections are below MIN_PACKED_WEIGHT: lowered below
    ids = torch.randint(0, 300, (3, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with_adapters = lora(input_ids=ids).logits
        with lora.disable_adapter():
            without = lora(input_ids=ids).logits
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed_linear, "MIN_PACKED_WEIGHT", 1)
        with torch.no_grad(), prepared_linear_layers(lora, rows=3 * 6):  # the whole sequence: every product packed
            q_proj = lora.get_base_model().model.layers[0].self_attn.q_proj
            assert "forward" in vars(q_proj) and "forward" not in vars(q_proj.base_layer)  # one merged product
            torch.testing.assert_close(lora(input_ids=ids).logits, with_adapters, rtol=0, atol=1e-5)
        with torch.no_grad(), lora.disable_adapter(), prepared_linear_layers(lora, rows=3 * 6):
            assert "forward" in vars(q_proj) and "forward" not in vars(q_proj.base_layer)  # adapters off: the base weight
            torch.testing.assert_close(lora(input_ids=ids).logits, without, rtol=0, atol=1e-5)
        with prepared_linear_layers(lora, rows=3 * 6):  # gradients on: the adapters' own forward, and their gradients
            lora(input_ids=ids).logits.sum().backward()
    grads = [p.grad for n, p in lora.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    assert not any("forward" in vars(m) for m in lora.modules())  # all restored


@pytest.mark.parametrize("alpha, bitwise", [(32, True), (24, False)])  # scaling alpha / r: 2, a power of two; 1.5
def test_a_lora_layer_is_prepared_as_peft_merges_it(alpha, bitwise):
    """The weight a LoRA layer is prepared as: peft's merge (base weight + its delta) to the bit where the scaling
    is a power of two (the default), to float rounding otherwise; no gradient graph through the adapters."""
    lora = apply_lora(build_tiny_llama(vocab_size=300, seed=6), LoraSettings(alpha=alpha), seed=0)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    layers = [m for m in lora.modules() if hasattr(m, "get_delta_weight")]
    assert len(layers) == 14 and layers[0].scaling["default"] == alpha / 16
    for layer in layers:
        weight, bias = packed_linear._linear_weight(layer)
        peft_merge = layer.base_layer.weight + layer.get_delta_weight("default")
        assert bias is None and not weight.requires_grad
        if bitwise:
            assert torch.equal(weight, peft_merge)
        else:
            torch.testing.assert_close(weight, peft_merge, rtol=1e-6, atol=1e-7)
            assert not torch.equal(weight, layer.base_layer.weight)


def build_tiny_qwen2(vocab_size: int = 300, seed: int = 0):
    """Qwen2's query/key/value projections have biases, its output projection has none."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):  # initialised to 0: make them count
                param.normal_(0.0, 0.5)
    return model


@needs_backend
@torch.no_grad()
def test_a_prepared_product_gives_what_its_layers_give_side_by_side(decode_matmul, backend):
    decode_matmul(backend)
    q, k, v = torch.nn.Linear(96, 80), torch.nn.Linear(96, 48, bias=False), torch.nn.Linear(96, 48)
    x = torch.randn(6, 1, 96)
    expected = torch.cat([q(x), k(x), v(x)], dim=-1)  # (6, 1, 176); k's part has no bias: zeros are added
    qkv = packed_linear.prepared_product((q, k, v), rows=6)
    torch.testing.assert_close(qkv(x), expected, rtol=1e-6, atol=1e-6)
    x3 = torch.randn(3, 96)  # another row count (MKL: the plain product on the joined weight)
    torch.testing.assert_close(qkv(x3), torch.cat([q(x3), k(x3), v(x3)], dim=-1), rtol=1e-6, atol=1e-6)
    one = packed_linear.prepared_product((k,), rows=6)
    torch.testing.assert_close(one(x), k(x), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        q.weight.add_(1.0)  # the product was prepared from the weights as they were
    torch.testing.assert_close(qkv(x), expected, rtol=1e-6, atol=1e-6)


def test_no_prepared_product_where_the_modules_must_run_themselves(monkeypatch, decode_matmul):
    layer = torch.nn.Linear(96, 80)
    assert packed_linear.prepared_product((torch.nn.Linear(8, 8),), rows=4) is None  # too small to be worth it
    assert packed_linear.prepared_product((torch.nn.LayerNorm(96), layer), rows=4) is None  # not a linear map
    with torch.autocast("cpu", dtype=torch.float16):
        assert packed_linear.prepared_product((layer,), rows=4) is None
    decode_matmul("aten")
    assert packed_linear.prepared_product((layer,), rows=4) is None
    decode_matmul("mkl")
    if BACKEND_AVAILABLE["mkl"]:
        assert packed_linear.prepared_product((layer,), rows=None) is None  # MKL packs for one row count only


@needs_backend
@torch.no_grad()
def test_prepared_lora_products_are_the_adapted_and_the_switched_off_layers(decode_matmul, backend):
    decode_matmul(backend)
    lora = lora_with_live_adapters(build_tiny_llama(vocab_size=300, seed=4))
    attn = lora.get_base_model().model.layers[0].self_attn
    x = torch.randn(5, 1, 32)
    modules = (attn.q_proj, attn.k_proj, attn.v_proj)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed_linear, "MIN_PACKED_WEIGHT", 1)
        adapted = torch.cat([m(x) for m in modules], dim=-1)
        torch.testing.assert_close(packed_linear.prepared_product(modules, rows=5)(x), adapted, rtol=1e-5, atol=1e-5)
        with lora.disable_adapter():
            base = torch.cat([m(x) for m in modules], dim=-1)
            torch.testing.assert_close(packed_linear.prepared_product(modules, rows=5)(x), base, rtol=1e-5, atol=1e-5)
        assert (adapted - base).abs().max() > 0.1
        attn.q_proj.lora_variant = {"default": object()}  # e.g. DoRA: more than a weight delta
        assert packed_linear.prepared_product(modules, rows=5) is None


@needs_backend
@pytest.mark.parametrize("build", [build_tiny_llama, build_tiny_qwen2], ids=["llama", "qwen2-biases"])
@torch.no_grad()
def test_lean_decoder_on_prepared_products_matches_the_full_forward(decode_matmul, backend, build, monkeypatch):
    decode_matmul(backend)
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHT", 1)  # the tiny layers too
    model = build(vocab_size=300, seed=5)
    prompt = torch.randint(0, 300, (1, 3), generator=torch.Generator().manual_seed(7))
    ids = torch.cat([prompt.repeat(4, 1), torch.randint(0, 300, (4, 4), generator=torch.Generator().manual_seed(8))], dim=1)
    decoder = LeanDecoder(model, 4, 7)
    calls = []
    layer = model.model.layers[0]
    linears = [layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    hooks = [m.register_forward_hook(lambda m, i, o: calls.append(m)) for m in linears]
    try:
        logits = torch.stack([decoder.prompt(ids[:, :3]), *(decoder.step(ids[:, t : t + 1]) for t in range(3, 7))], dim=1)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == []  # the prepared products ran (q/k/v as one, gate/up as one), not the modules
    torch.testing.assert_close(logits, full_forward(model, ids, 3), rtol=0, atol=1e-5)


def test_rms_norm_is_the_models_norm_fused_in_float32_and_the_module_itself_otherwise(tiny_model):
    norm = tiny_model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, norm.weight.numel()))
    x = torch.randn(3, 2, norm.weight.numel(), generator=torch.Generator().manual_seed(9))
    by_hand = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    torch.testing.assert_close(fast_decode._rms_norm(norm, x), by_hand, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast_decode._rms_norm(norm, x), norm(x), rtol=1e-6, atol=1e-6)
    calls = []
    hook = norm.register_forward_hook(lambda m, i, o: calls.append(o))
    try:
        out = fast_decode._rms_norm(norm, x.bfloat16())  # not float32: the module's own forward, as it is
    finally:
        hook.remove()
    assert len(calls) == 1 and torch.equal(out, norm(x.bfloat16()))


def test_lean_decoder_built_with_gradients_on_runs_the_modules(tiny_model, monkeypatch):
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHT", 1)
    decoder = LeanDecoder(tiny_model, 2, 4)  # gradients on: the prepared products (no backward) are not used
    attn = tiny_model.model.layers[0].self_attn
    assert decoder.products[0].o is attn.o_proj and decoder.head is tiny_model.lm_head
    logits = decoder.step(torch.tensor([[1, 2], [3, 4]]))
    logits.sum().backward()
    assert attn.q_proj.weight.grad is not None and attn.q_proj.weight.grad.abs().sum() > 0


@needs_bf16_products
def test_bf16_sampling_with_live_lora_adapters_prepares_their_base_layers(decode_matmul, monkeypatch):
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHT", 1)
    lora = lora_with_live_adapters(build_tiny_llama(vocab_size=300, seed=4))
    prompt = torch.randint(0, 300, (1, 3), generator=torch.Generator().manual_seed(3)).repeat(4, 1)
    prepared = []
    own_product = packed_linear._product
    monkeypatch.setattr(packed_linear, "_product", lambda weight, *rest: prepared.append(weight.shape) or own_product(weight, *rest))

    def sample(library):
        decode_matmul(library)
        torch.manual_seed(11)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return sample_completions_with_logprobs(lora, prompt, 5)

    as_autocast = sample("aten")  # nothing prepared: the products as autocast runs them
    assert prepared == []
    decode_matmul("onednn")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        unprepared = LeanDecoder(lora, 4, 8).unprepared
    layers = lora.get_base_model().model.layers
    assert len(unprepared) == 7 * len(layers)  # every adapted projection runs itself: q, k, v, o, gate, up, down
    prepared.clear()
    fast = sample("onednn")
    # the head by the decoder; in place, each adapted projection's base layer and its adapter's A and B (plain
    # linear layers, which bf16 products reproduce to the bit), not the three merged into one bf16 weight
    assert len(prepared) == 1 + 3 * 7 * len(layers)
    assert torch.equal(fast.sample_ids, as_autocast.sample_ids) and torch.equal(fast.logprobs, as_autocast.logprobs)
    assert all("forward" not in vars(module.base_layer) for module in unprepared)  # restored after sampling


@torch.no_grad()
def test_keys_are_kept_in_the_autocast_dtype_the_scores_read_them_in(tiny_model, monkeypatch):
    ids = torch.randint(0, 300, (4, 8), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = LeanDecoder(tiny_model, 4, 8)
        rounded_once = decode_all(decoder, ids, 3)
        monkeypatch.setattr(fast_decode, "_cached_key_dtype", lambda k: k.dtype)  # float32 keys, rounded at each step
        float32_keys = LeanDecoder(tiny_model, 4, 8)
        rounded_each_step = decode_all(float32_keys, ids, 3)
    assert decoder.keys[0].dtype == torch.bfloat16 and float32_keys.keys[0].dtype == torch.float32
    assert torch.equal(rounded_once, rounded_each_step)  # the same values reach the scores product
    monkeypatch.undo()
    fp32 = LeanDecoder(tiny_model, 4, 8)
    decode_all(fp32, ids, 3)
    assert fp32.keys[0].dtype == torch.float32  # outside autocast, as they come
