"""Decode-shaped fp32 matrix products on the CPU, with weights packed once per rollout.

Sampling runs the policy on one new token per sequence per step: every linear layer multiplies a thin
(B, d_in) activation by a (d_out, d_in) weight. For such shapes PyTorch's ``F.linear`` (a transposed-weight
sgemm) reaches only half of the CPU's fp32 matmul peak at B = 32; MKL's packed sgemm, which lays the weight
out once in the kernel's own blocked format, reaches 80-95 % (benchmarks in the README, "Performance").
The weights do not change during a rollout, so they are packed once at its start and every decode step
reuses them. The results are the same sgemm's: the sampled tokens and their log-probabilities do not change.

Only where it helps and is safe: fp32 weights on a CPU with MKL, outside autocast (bf16-mixed runs use
oneDNN's bf16 kernels), and under ``torch.no_grad`` (the packed product has no backward). Anything else,
or an input whose row count is not the packed one (the prompt's forward), takes the ordinary ``F.linear``.
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


def _packed_forward(layer: torch.nn.Linear, rows: int):
    """A forward for ``layer`` that uses its weight packed for inputs of ``rows`` rows."""
    weight, bias = layer.weight, layer.bias
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)

    def forward(x: Tensor) -> Tensor:
        if x.numel() // x.shape[-1] != rows or torch.is_grad_enabled():
            return F.linear(x, weight, bias)
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)

    return forward


@contextlib.contextmanager
def packed_linear_weights(model: torch.nn.Module, rows: int):
    """Within the block, ``model``'s linear layers multiply inputs of ``rows`` rows with MKL-packed weights.

    ``rows`` is the number of token positions per decode step (the group size B). Packing takes one pass
    over the weights and as much memory again as the linear weights; both are freed at the end."""
    if not packing_available(model):
        yield
        return
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.numel() >= MIN_PACKED_WEIGHT]
    try:
        for layer in layers:
            layer.forward = _packed_forward(layer, rows)  # an instance attribute shadows the class's forward
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
