"""The learning step's fp32 matrix products on the CPU, through oneDNN where PyTorch's own are slow.

A learning step is mostly the policy's linear layers, forward and backward: ``y = x W^T + b``, then
``dx = dy W`` and ``dW = dy^T x``. PyTorch runs fp32 products through MKL's sgemm, which on CPUs that are
not Intel's takes its AVX2 code path even where the CPU has AVX-512: on 2 cores of an AMD EPYC of the
Zen 5 class (AVX-512), a 2048^3 fp32 product ran at 192 GFLOP/s through ``torch.matmul`` and 418 through
oneDNN, and the model's linear layers, forward and backward, for one minibatch of 1056 token positions
(32 x 33) took 4.4 s through MKL and 2.4 s through oneDNN (README, "Performance"). With oneDNN held to AVX2
(``ONEDNN_MAX_CPU_ISA=AVX2``, what a CPU without AVX-512 offers it) the two took about as long (4.6 and
4.4 s), so the switch is made only where it was measured to pay.

``TrainingLinear`` is ``nn.Linear`` with that forward and backward: oneDNN's inner product
(``torch.ops.mkldnn._linear_pointwise``) for all three products, on the tensors as they are (the
transposed operands of the backward are strided views, which oneDNN reads without a copy). It applies
to fp32 CPU tensors with gradients enabled and outside autocast; anything else (no_grad passes, bf16
autocast, a GPU, a sharded weight) runs ``nn.Linear``'s own forward. The results are ``F.linear``'s to
float rounding (another summation order; tests/test_training_products.py).

``use_training_products(model)`` turns a model's large linear layers into ``TrainingLinear`` where
``training_matmul_backend()`` says "onednn": by default on non-Intel CPUs whose PyTorch dispatches
AVX-512 kernels; ``GRPO_LIGHTNING_TRAIN_MATMUL=onednn|aten`` chooses. The choice depends on the machine
only, so a run and its resumed run multiply alike.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor
from torch.nn import functional as F

from .config import GRPOError
from .fused_training import fused_training_kernels
from .packed_linear import MIN_PACKED_WEIGHT, _cpu_vendor, _onednn_available

TRAIN_MATMUL_ENV = "GRPO_LIGHTNING_TRAIN_MATMUL"
TRAIN_MATMUL_BACKENDS = ("onednn", "aten")


def _avx512_kernels() -> bool:
    """Whether this PyTorch dispatches its CPU kernels at the AVX-512 level here (the CPU has AVX-512F and
    friends, and ``ATEN_CPU_CAPABILITY`` does not hold it lower)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def training_matmul_backend() -> str:
    """``"onednn"`` or ``"aten"``: the library for the learning step's fp32 products (module docstring).

    ``$GRPO_LIGHTNING_TRAIN_MATMUL`` chooses by name; otherwise oneDNN on non-Intel CPUs with AVX-512
    kernels, where this PyTorch has oneDNN, and PyTorch's own products (MKL) everywhere else."""
    chosen = os.environ.get(TRAIN_MATMUL_ENV, "").strip().lower()
    if chosen:
        if chosen not in TRAIN_MATMUL_BACKENDS:
            raise GRPOError(f"{TRAIN_MATMUL_ENV}={chosen!r} is not one of {', '.join(TRAIN_MATMUL_BACKENDS)} (or unset it)")
        return chosen if chosen == "aten" or _onednn_available() else "aten"
    if _cpu_vendor() != "GenuineIntel" and _avx512_kernels() and _onednn_available():
        return "onednn"
    return "aten"


def _inner_product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight^T + bias`` for a 2-D ``x``, through oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` with its forward and backward products through oneDNN.

    x: (..., d_in); weight: (d_out, d_in); bias: (d_out,) or None -> (..., d_out)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (n, d_in)
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        ctx.input_shape = x.shape
        return _inner_product(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        rows, weight = ctx.saved_tensors
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])  # (n, d_out)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _inner_product(grad_rows, weight.t()).view(ctx.input_shape)  # dy @ W: (n, d_in)
        if ctx.needs_input_grad[1]:
            grad_weight = _inner_product(_transposed(grad_rows), rows.t())  # dy^T @ x: (d_out, d_in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(0)
        return grad_x, grad_weight, grad_bias


def _transposed(x: Tensor) -> Tensor:
    """``x.t()`` laid out for oneDNN's inner product, whose source operand must be contiguous: by the fused
    kernels' transpose where they are built (oneDNN would have PyTorch copy the view, on one thread: 1.6 ms of
    a 4.9 ms weight-gradient product of 512 x 1536 by 512 x 576 in a learning step on 2 Zen 4 cores)."""
    kernels = fused_training_kernels()
    return x.t() if kernels is None else kernels.transpose_copy(x)


def _plain_cpu_fp32(tensor: Tensor | None) -> bool:
    # A sharded (DTensor) or otherwise wrapped weight takes nn.Linear's own path.
    return tensor is None or (type(tensor) in (Tensor, torch.nn.Parameter) and tensor.device.type == "cpu"
                              and tensor.dtype == torch.float32)  # fmt: skip


class TrainingLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose products with gradients run through oneDNN (``OneDNNLinearFunction``): fp32
    CPU tensors, gradients enabled, no autocast. Everything else is ``nn.Linear``'s own forward."""

    plain_linear_map = True  # one linear map, as nn.Linear: packed_linear prepares it like one

    def forward(self, x: Tensor) -> Tensor:
        if (torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu") and x.dtype == torch.float32
                and x.device.type == "cpu" and _plain_cpu_fp32(self.weight) and _plain_cpu_fp32(self.bias)):  # fmt: skip
            return OneDNNLinearFunction.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_training_products(model: torch.nn.Module, min_weight: int = MIN_PACKED_WEIGHT) -> int:
    """Makes ``model``'s linear layers of at least ``min_weight`` weights ``TrainingLinear``s where
    ``training_matmul_backend()`` is "onednn" (smaller ones cost little either way); returns how many. The
    weights, their names and the state dict stay as they are (only the layers' class changes); LoRA
    adapters and base layers are layers like any other."""
    if training_matmul_backend() != "onednn":
        return 0
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.numel() >= min_weight:
            module.__class__ = TrainingLinear
            changed += 1
    return changed
