"""Decode-shaped fp32 matrix products on the CPU, with weights packed once per rollout.

Sampling runs the policy on one new token per sequence per step: every linear layer multiplies a thin
(B, d_in) activation by a (d_out, d_in) weight. For such shapes PyTorch's ``F.linear`` (a transposed-weight
sgemm) reaches only half of the CPU's fp32 matmul peak at B = 32; MKL's packed sgemm, which lays the weight
out once in the kernel's own blocked format, reaches 80-95 % (benchmarks in the README, "Performance").
The weights do not change during a rollout, so they are packed once at its start and every decode step
reuses them. The products agree with ``F.linear`` to float rounding (bit for bit in the cases measured); a
LoRA layer, packed as its merged weight, rounds as a merged weight does (tests/test_fast_decode.py).

Only where it helps and is safe: fp32 weights on a CPU with MKL, outside autocast (bf16-mixed runs use
oneDNN's bf16 kernels), and under ``torch.no_grad``: with gradients enabled a layer runs its own forward (the
packed product has no backward), and an input whose row count is not the packed one (the prompt's forward)
takes the ordinary ``F.linear``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.nn import functional as F

# Below this many weight entries a layer is cheap anyway (LoRA's adapters, tiny test models): not packed.
MIN_PACKED_WEIGHT = 64 * 64


def packing_available(model: torch.nn.Module) -> bool:
    """Whether MKL packing applies to ``model`` now: fp32 weights on the CPU, MKL present, no autocast."""
    weight = next(model.parameters(), None)
    return (
        weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
        and not torch.is_autocast_enabled("cpu")
    )


def _packed_forward(module: torch.nn.Module, weight: Tensor, bias: Tensor | None, rows: int):
    """A forward for ``module`` computing ``F.linear(x, weight, bias)`` with ``weight`` packed for inputs of
    ``rows`` rows. With gradients enabled it is the module's own forward (the packed product has no backward)."""
    own_forward = type(module).forward.__get__(module)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)

    def forward(x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            return own_forward(x)
        if x.numel() // x.shape[-1] != rows:  # e.g. the prompt's forward
            return F.linear(x, weight, bias)
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)

    return forward


def _active_lora_delta(layer: torch.nn.Module) -> Tensor | None:
    """For a peft LoRA linear layer whose adapters are on: the sum of their ``scaling * B @ A``, which its
    forward adds to the base layer's output (dropout is off in eval mode). None for any other layer, or
    when a variant (DoRA, ...) or a mixed batch makes the adapters more than a weight delta."""
    if not (hasattr(layer, "get_delta_weight") and isinstance(getattr(layer, "base_layer", None), torch.nn.Linear)):
        return None
    if layer.disable_adapters or layer.merged or getattr(layer, "lora_variant", None):
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    return sum(layer.get_delta_weight(name) for name in active) if active else None


@contextlib.contextmanager
def packed_linear_weights(model: torch.nn.Module, rows: int):
    """Within the block, ``model``'s linear layers multiply inputs of ``rows`` rows with MKL-packed weights.

    ``rows`` is the number of token positions per decode step (the group size B). A LoRA layer whose
    adapters are on is packed as one merged weight ``W + scaling * B @ A`` (the same function, one product
    instead of three); with its adapters off, its base layer is packed. Packing takes one pass over the
    weights and as much memory again as the linear weights; both are freed at the end."""
    if not packing_available(model):
        yield
        return
    patched, covered = [], set()  # covered: modules a patched LoRA layer no longer calls
    with torch.no_grad():
        for module in model.modules():  # parents come before their children
            delta = _active_lora_delta(module)
            if delta is not None:
                base = module.base_layer
                # an instance attribute shadows the class's forward
                module.forward = _packed_forward(module, base.weight + delta, base.bias, rows)
                covered.update(map(id, module.modules()))
            elif type(module) is torch.nn.Linear and id(module) not in covered and module.weight.numel() >= MIN_PACKED_WEIGHT:
                module.forward = _packed_forward(module, module.weight, module.bias, rows)
            else:
                continue
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)
