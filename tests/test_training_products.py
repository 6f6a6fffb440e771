"""The learning step's products through oneDNN (grpo_lightning.training_products): the same values and
gradients as F.linear to float rounding, the fallbacks, the choice per machine, and a whole model."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_tiny_llama
from torch.nn import functional as F

from grpo_lightning import training_products
from grpo_lightning.config import GRPOError
from grpo_lightning.lora import LoraSettings, apply_lora
from grpo_lightning.objectives import generated_logprobs
from grpo_lightning.packed_linear import _linear_weight
from grpo_lightning.training_products import (
    OneDNNLinearFunction,
    TrainingLinear,
    training_matmul_backend,
    use_training_products,
)

needs_onednn = pytest.mark.skipif(not training_products._onednn_available(), reason="this PyTorch has no oneDNN")


def grads_of(fn, *tensors):
    """fn(*tensors) and the gradients of sum(out * w) for a fixed random w, for each tensor needing one."""
    out = fn(*tensors)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * weights).sum().backward()
    return out.detach(), [None if t is None or t.grad is None else t.grad.clone() for t in tensors]


def leaves(*shapes, grad=(True, True, True)):
    gen = torch.Generator().manual_seed(0)
    return [None if s is None else torch.randn(s, generator=gen).requires_grad_(g) for s, g in zip(shapes, grad)]


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_f_linear(bias):
    shapes = ((3, 5, 48), (40, 48), (40,) if bias else None)
    ours = grads_of(OneDNNLinearFunction.apply, *leaves(*shapes))
    theirs = grads_of(F.linear, *leaves(*shapes))
    assert ours[0].shape == (3, 5, 40)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    for mine, reference in zip(ours[1], theirs[1]):
        assert (mine is None) == (reference is None)
        if mine is not None:
            torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_frozen_weight_gets_no_gradient():
    """A LoRA base layer: the weight is frozen, only the input's gradient is computed."""
    x, weight, bias = leaves((7, 48), (40, 48), (40,), grad=(True, False, False))
    _, (grad_x, grad_w, grad_b) = grads_of(OneDNNLinearFunction.apply, x, weight, bias)
    x2 = x.detach().clone().requires_grad_(True)
    _, (expected_x, _, _) = grads_of(F.linear, x2, weight, bias)
    assert grad_w is None and grad_b is None
    torch.testing.assert_close(grad_x, expected_x, rtol=1e-5, atol=1e-5)


def test_training_linear_falls_back_to_its_own_forward(monkeypatch):
    """Without gradients, under bf16 autocast, or in float64, TrainingLinear is nn.Linear to the bit."""
    def refuse(*args):
        raise AssertionError("the oneDNN function ran")

    monkeypatch.setattr(OneDNNLinearFunction, "apply", refuse)
    layer = torch.nn.Linear(48, 40)
    trained = copy.deepcopy(layer)
    trained.__class__ = TrainingLinear
    x = torch.randn(6, 48)
    with torch.no_grad():
        assert torch.equal(trained(x), layer(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(trained(x), layer(x))
    assert torch.equal(trained.double()(x.double()), layer.double()(x.double()))


@pytest.mark.parametrize(
    "vendor, avx512, env, expected",
    [
        ("AuthenticAMD", True, "", "onednn"),  # measured: MKL's AVX2 path against oneDNN's AVX-512
        ("AuthenticAMD", False, "", "aten"),  # AVX2 only: the two measured alike, so nothing changes
        ("GenuineIntel", True, "", "aten"),  # MKL runs its best path on Intel's CPUs
        ("GenuineIntel", True, "onednn", "onednn"),
        ("AuthenticAMD", True, " ATEN ", "aten"),
    ],
)
def test_choice_per_machine(monkeypatch, vendor, avx512, env, expected):
    monkeypatch.setattr(training_products, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(training_products, "_avx512_kernels", lambda: avx512)
    monkeypatch.setattr(training_products, "_onednn_available", lambda: True)
    monkeypatch.setenv(training_products.TRAIN_MATMUL_ENV, env)
    assert training_matmul_backend() == expected


def test_choice_without_onednn_and_a_bad_name(monkeypatch):
    monkeypatch.setattr(training_products, "_onednn_available", lambda: False)
    monkeypatch.setattr(training_products, "_cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(training_products, "_avx512_kernels", lambda: True)
    monkeypatch.setenv(training_products.TRAIN_MATMUL_ENV, "")
    assert training_matmul_backend() == "aten"
    monkeypatch.setenv(training_products.TRAIN_MATMUL_ENV, "onednn")
    assert training_matmul_backend() == "aten"
    monkeypatch.setenv(training_products.TRAIN_MATMUL_ENV, "mkl")
    with pytest.raises(GRPOError, match=r"GRPO_LIGHTNING_TRAIN_MATMUL='mkl' is not one of onednn, aten"):
        training_matmul_backend()


def test_aten_choice_changes_nothing(monkeypatch):
    monkeypatch.setenv(training_products.TRAIN_MATMUL_ENV, "aten")
    model = build_tiny_llama(300, seed=3)
    assert use_training_products(model, min_weight=0) == 0
    assert not any(isinstance(m, TrainingLinear) for m in model.modules())


def learning_step_gradients(model, ids):
    """The gradients of a learning step's log-probabilities (a fixed weighting of them) by parameter name."""
    model.zero_grad()
    logprobs = generated_logprobs(model, ids, gen_len=6)  # (b, T)
    (logprobs * torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# How far a float32 learning step's gradient may sit from the float64 one, as a fraction of the largest entry
# of that gradient tensor. A gradient entry is a sum of many products that partly cancel, so its float32
# error scales with the tensor's magnitude, not with the entry's own (an entry near zero may carry an error
# of ~1e-6 of its neighbours). Measured on a tiny Llama with LoRA: the stock model's own float32 gradients
# sit up to 3.2e-6 of the scale from float64 (MKL on an AVX2 Zen 3), oneDNN's up to 4.1e-6; two float32
# paths can thus differ by ~7e-6, which is why they are each compared with float64 and not with each other.
# A wrong product (a transpose, a dropped term, a missing scale) is off by a large fraction of the scale.
FLOAT32_GRADIENT_TOLERANCE = 2e-5


def assert_near_float64(grads, exact_grads, path):
    """Every gradient within FLOAT32_GRADIENT_TOLERANCE of its tensor's largest float64 entry."""
    assert grads.keys() == exact_grads.keys() and len(grads) > 0
    for name, exact in exact_grads.items():
        atol = FLOAT32_GRADIENT_TOLERANCE * exact.abs().max().item()
        torch.testing.assert_close(grads[name].double(), exact, rtol=0, atol=atol, msg=f"{path}: {name}")


@needs_onednn
@pytest.mark.parametrize("lora", [False, True])
def test_a_whole_model_learns_alike(monkeypatch, lora):
    """Every linear layer of a tiny Llama (with and without LoRA adapters) swapped: the same parameter names
    and state dict, and log-probabilities and every parameter's gradient as near a float64 run of the same
    model as the model's own float32 ones are (the stock model is held to the same bound)."""
    monkeypatch.setenv(training_products.TRAIN_MATMUL_ENV, "onednn")
    model = build_tiny_llama(300, seed=3)
    if lora:
        model = apply_lora(model, LoraSettings(r=4))
        for name, param in model.named_parameters():  # B starts at zero: give the adapters a live delta
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
    reference = copy.deepcopy(model)
    # The same weights in float64, through the stock layers. Only the log-softmax at the end stays float32
    # (generated_logprobs returns float32): ~1e-7 relative, far inside the tolerance.
    exact = copy.deepcopy(model).double()
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert use_training_products(model, min_weight=0) == linears > 0
    assert sum(isinstance(m, TrainingLinear) for m in model.modules()) == linears
    assert model.state_dict().keys() == reference.state_dict().keys()

    ids = torch.randint(1, 300, (4, 10), generator=torch.Generator().manual_seed(1))
    ours, our_grads = learning_step_gradients(model, ids)
    theirs, their_grads = learning_step_gradients(reference, ids)
    exact_logprobs, exact_grads = learning_step_gradients(exact, ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, exact_logprobs.float(), rtol=1e-5, atol=1e-5)
    assert_near_float64(their_grads, exact_grads, "the stock float32 model")
    assert_near_float64(our_grads, exact_grads, "the oneDNN products")


def test_a_training_linear_is_prepared_and_copied_as_a_linear():
    """packed_linear's decode products take it as the one linear map it is, and a deep copy (the LoRA
    export's) computes with its own weights."""
    layer = torch.nn.Linear(48, 40)
    layer.__class__ = TrainingLinear
    weight, bias = _linear_weight(layer)
    assert weight is layer.weight and bias is layer.bias
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.fill_(2.0)
    assert type(twin) is TrainingLinear
    assert torch.equal(twin(torch.randn(3, 48, requires_grad=True)), torch.full((3, 40), 2.0))


@needs_onednn
def test_strided_input_and_an_expanded_gradient():
    """A transposed view as input, and out.sum()'s gradient (ones expanded with zero strides): as F.linear."""
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(3, 48, 5, generator=gen)
    weight, bias = torch.randn(40, 48, generator=gen), torch.randn(40, generator=gen)
    results = []
    for fn in (OneDNNLinearFunction.apply, F.linear):
        x = base.clone().transpose(1, 2).requires_grad_(True)  # (3, 5, 48), not contiguous
        w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
        out = fn(x, w, b)
        out.sum().backward()
        results.append((out.detach(), x.grad, w.grad, b.grad))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("env", ["GRPO_LIGHTNING_TRAIN_MATMUL", "GRPO_LIGHTNING_DECODE_MATMUL"])
def test_a_misspelt_library_is_one_line_before_any_weights_load(tiny_model_dir, monkeypatch, env):
    from conftest import refuse_model_loading

    from grpo_lightning import policy_models
    from grpo_lightning.module import GRPOModule

    refuse_model_loading(monkeypatch, policy_models)
    monkeypatch.setenv(env, "mkl2")
    with pytest.raises(GRPOError, match=rf"^{env}='mkl2' is not one of "):
        GRPOModule(model_name_or_path=tiny_model_dir, batch_size=4, num_minibatches=2).check_inputs()
