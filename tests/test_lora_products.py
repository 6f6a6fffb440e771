"""A LoRA layer's fused learning-step forward (grpo_lightning.lora_products): peft's values and gradients to
float rounding, by hand and on a whole model, with oneDNN and PyTorch base products; peft's own forward
wherever the fused one does not apply; and everything else about the layer left as peft's."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import build_tiny_llama

from grpo_lightning import training_products
from grpo_lightning.lora import LoraSettings, apply_lora
from grpo_lightning.lora_products import FusedLoraLinear, LoraLinearFunction, use_lora_products
from grpo_lightning.objectives import generated_logprobs
from grpo_lightning.training_products import use_training_products

needs_onednn = pytest.mark.skipif(not training_products._onednn_available(), reason="this PyTorch has no oneDNN")


def live_lora_model(seed: int = 3, r: int = 4, **settings):
    """A tiny Llama with LoRA adapters whose B is not zero (peft starts it at zero: no delta to compare)."""
    model = apply_lora(build_tiny_llama(300, seed=seed), LoraSettings(r=r, **settings), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def step_gradients(model: torch.nn.Module, ids: torch.Tensor):
    """Log-probabilities of the last 4 tokens and every gradient of a weighted sum of them."""
    model.zero_grad(set_to_none=True)
    logprobs = generated_logprobs(model, ids, gen_len=4)
    (logprobs * torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("onednn", [False, pytest.param(True, marks=needs_onednn)])
def test_the_function_against_the_formula(onednn):
    """y = x W^T + b + s (x A^T) B^T and its gradients, written out by hand: dx = dy W + s (dy B) A,
    dA = s (dy B)^T x, dB = s dy^T (x A^T); no gradient for the frozen W and b."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 24, generator=gen, requires_grad=True)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    lora_a = torch.randn(3, 24, generator=gen, requires_grad=True)
    lora_b = torch.randn(40, 3, generator=gen, requires_grad=True)
    dy = torch.randn(2, 5, 40, generator=gen)
    scaling = 1.5

    out = LoraLinearFunction.apply(x, weight, bias, lora_a, lora_b, scaling, onednn)
    out.backward(dy)

    rows, dy_rows = x.detach().reshape(10, 24).double(), dy.reshape(10, 40).double()
    w, a, b = weight.double(), lora_a.detach().double(), lora_b.detach().double()
    expected = rows @ w.T + bias.double() + scaling * (rows @ a.T) @ b.T
    torch.testing.assert_close(out.detach().reshape(10, 40).double(), expected, rtol=1e-5, atol=1e-5)
    grad_x = dy_rows @ w + scaling * (dy_rows @ b) @ a
    torch.testing.assert_close(x.grad.reshape(10, 24).double(), grad_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lora_a.grad.double(), scaling * (dy_rows @ b).T @ rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lora_b.grad.double(), scaling * dy_rows.T @ (rows @ a.T), rtol=1e-5, atol=1e-5)
    assert out.shape == (2, 5, 40)


@pytest.mark.parametrize("onednn", [False, pytest.param(True, marks=needs_onednn)])
def test_a_whole_model_learns_as_with_peft(monkeypatch, onednn):
    """Every adapted layer of a tiny Llama fused: the log-probabilities and every adapter's gradient as
    peft's own layers give them, to float rounding, with the base products of either library."""
    monkeypatch.setenv(training_products.TRAIN_MATMUL_ENV, "onednn" if onednn else "aten")
    model = live_lora_model()
    use_training_products(model, min_weight=0)
    reference = copy.deepcopy(model)
    adapted = sum(hasattr(m, "lora_A") for m in model.modules())
    assert use_lora_products(model) == adapted == 14  # 7 projections x 2 layers
    assert model.state_dict().keys() == reference.state_dict().keys()

    calls = []
    original = LoraLinearFunction.forward
    monkeypatch.setattr(LoraLinearFunction, "forward", staticmethod(lambda ctx, *a: calls.append(1) or original(ctx, *a)))
    ids = torch.randint(1, 300, (4, 10), generator=torch.Generator().manual_seed(1))
    ours, our_grads = step_gradients(model, ids)
    theirs, their_grads = step_gradients(reference, ids)
    assert len(calls) == adapted  # every adapted layer took the fused path, once
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert our_grads.keys() == their_grads.keys() and len(our_grads) == 2 * adapted  # A and B of each
    for name in our_grads:
        # An element near zero is a sum of terms as large as the largest elements: its rounding error is on
        # their scale (measured: at most 1.6e-6 of the largest element, adapters through MKL here and
        # through oneDNN in peft's layers), so the absolute tolerance follows the gradient's scale.
        scale = float(their_grads[name].abs().max())
        torch.testing.assert_close(our_grads[name], their_grads[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_peft_forward_where_the_fused_one_does_not_apply(monkeypatch):
    """Disabled adapters (the reference pass), no gradients, bf16 autocast and live dropout take peft's
    forward, and give what peft's does."""
    model = live_lora_model(dropout=0.5)
    reference = copy.deepcopy(model)
    use_lora_products(model)
    monkeypatch.setattr(LoraLinearFunction, "apply", lambda *a: pytest.fail("the fused function ran"))
    ids = torch.randint(1, 300, (2, 8), generator=torch.Generator().manual_seed(4))

    with model.disable_adapter(), reference.disable_adapter():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    model.train()  # dropout 0.5 now live: peft's own forward draws its mask
    reference.train()
    torch.manual_seed(5)
    ours = model(ids).logits
    torch.manual_seed(5)
    torch.testing.assert_close(ours, reference(ids).logits, rtol=0, atol=0)


def test_a_trainable_base_layer_takes_peft_forward(monkeypatch):
    """The fused backward gives no gradient to the base weight, so a base weight that trains is left to peft."""
    model = live_lora_model()
    use_lora_products(model)
    layer = next(m for m in model.modules() if isinstance(m, FusedLoraLinear))
    layer.base_layer.weight.requires_grad_(True)
    monkeypatch.setattr(LoraLinearFunction, "apply", lambda *a: pytest.fail("the fused function ran"))
    out = layer(torch.randn(3, layer.in_features, requires_grad=True))
    out.sum().backward()
    assert layer.base_layer.weight.grad is not None


def test_merging_pickling_and_copying_stay_peft_s():
    """The fused class only changes forward: a pickled or copied model is fused still, and merging and
    unloading (the export's merge_on_export) give plain linear layers with the adapters' delta in them."""
    model = live_lora_model()
    use_lora_products(model)
    ids = torch.randint(1, 300, (2, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model(ids).logits
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert sum(isinstance(m, FusedLoraLinear) for m in twin.modules()) == 14
    merged = copy.deepcopy(model).merge_and_unload()
    assert not any(isinstance(m, FusedLoraLinear) for m in merged.modules())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)
