"""A LoRA layer's learning-step forward and backward as one autograd function, in fewer passes.

peft's LoRA layer computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: besides the base product and
the two thin adapter products, a full (rows, d_out) tensor for the adapters' output, another for its scaled
copy and a third for the sum, each written and read again, forward and backward. At SmolLM2-135M's shapes
with r = 16, 1024 token positions, every projection of a layer adapted, that glue cost about a quarter of
the base products themselves (forward and input gradient: 88-91 ms a layer against 71-72 ms on 2 Zen 4
cores; ``benchmarks/MEASUREMENTS.md``).

``FusedLoraLinear.forward`` adds the adapters' update into the base product's result in place instead:
``y = base(x)``, ``h = x A^T`` (rows, r), then ``y += scaling * h B^T`` as one ``addmm_``. Its backward
likewise: ``g = dy B`` (rows, r), ``dx = dy W + scaling * g A`` (the second term added in place),
``dB = scaling * dy^T h``, ``dA = scaling * g^T x``. The same values and gradients as peft's forward to
float rounding (another order of summation; tests/test_lora_products.py). The base product runs as the base
layer's does: oneDNN where it is a ``TrainingLinear`` (``training_products``), PyTorch's otherwise.

It applies in the learning step of the plain case, where the base layer is a frozen fp32 ``nn.Linear`` on
the CPU, one adapter is active, unmerged, without bias, variant (DoRA) or live dropout, gradients are on and
autocast off. Everything else, the reference pass with adapters disabled included, is peft's own forward.

``use_lora_products(model)`` changes the class of ``model``'s peft LoRA ``Linear`` layers to
``FusedLoraLinear``, a subclass that differs in ``forward`` only: weights, names, the state dict, merging
and unloading stay peft's.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import Tensor
from torch.nn import functional as F

from .training_products import TrainingLinear, _inner_product, _plain_cpu_fp32


class LoraLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias) + scaling * (x @ lora_a.T) @ lora_b.T`` with a frozen ``weight`` and ``bias``.

    x: (..., d_in); weight: (d_out, d_in); lora_a: (r, d_in); lora_b: (d_out, r) -> (..., d_out).
    ``onednn``: the base products through oneDNN's inner product (``training_products``), else PyTorch's."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                scaling: float, onednn: bool) -> Tensor:  # fmt: skip
        rows = x.reshape(-1, x.shape[-1])  # (n, d_in)
        down = torch.mm(rows, lora_a.t())  # (n, r)
        out = _inner_product(rows, weight, bias) if onednn else F.linear(rows, weight, bias)  # (n, d_out)
        out.addmm_(down, lora_b.t(), alpha=scaling)  # the adapters' update, added where the result lies
        ctx.save_for_backward(rows, down, weight, lora_a, lora_b)
        ctx.scaling, ctx.onednn, ctx.input_shape = scaling, onednn, x.shape
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        rows, down, weight, lora_a, lora_b = ctx.saved_tensors
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])  # (n, d_out)
        grad_up = torch.mm(grad_rows, lora_b)  # dy B: (n, r), the adapters' gradient before scaling
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _inner_product(grad_rows, weight.t()) if ctx.onednn else torch.mm(grad_rows, weight)
            grad_x = grad_x.addmm_(grad_up, lora_a, alpha=ctx.scaling).view(ctx.input_shape)
        if ctx.needs_input_grad[3]:
            grad_a = torch.mm(grad_up.t(), rows).mul_(ctx.scaling)  # (r, d_in)
        if ctx.needs_input_grad[4]:
            # (h^T dy)^T, not dy^T h: the same sums (equal to float rounding), twice as fast through MKL (a product
            # with 16 output rows, not 16 output columns: 0.78 against 1.47 ms at 1024 x 1536 on 2 Intel cores)
            grad_b = torch.mm(down.t(), grad_rows).t().mul_(ctx.scaling)  # (d_out, r), transposed in memory
        return grad_x, None, None, grad_a, grad_b, None, None


def _frozen_cpu_fp32(tensor: Tensor | None) -> bool:
    return tensor is None or (_plain_cpu_fp32(tensor) and not tensor.requires_grad)


def _plain_adapter(layer: LoraLinear, x: Tensor) -> tuple | None:
    """The arguments of ``LoraLinearFunction`` after ``x`` where it computes ``layer``'s forward (module
    docstring), else None."""
    if layer.disable_adapters or layer.merged or not torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1 or active[0] in getattr(layer, "lora_variant", {}):
        return None
    name = active[0]
    lora_a, lora_b, dropout = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
    base = layer.base_layer
    if not (isinstance(dropout, torch.nn.Identity) or not dropout.training or dropout.p == 0):
        return None
    if not all(type(m) in (torch.nn.Linear, TrainingLinear) for m in (base, lora_a, lora_b)):
        return None
    if lora_a.bias is not None or lora_b.bias is not None:
        return None
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and _frozen_cpu_fp32(base.weight)
            and _frozen_cpu_fp32(base.bias) and _plain_cpu_fp32(lora_a.weight) and _plain_cpu_fp32(lora_b.weight)):  # fmt: skip
        return None
    return base.weight, base.bias, lora_a.weight, lora_b.weight, float(layer.scaling[name]), type(base) is TrainingLinear


class FusedLoraLinear(LoraLinear):
    """peft's LoRA ``Linear`` whose learning-step forward is ``LoraLinearFunction`` where it applies."""

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        parts = None if args or kwargs else _plain_adapter(self, x)
        if parts is None:
            return super().forward(x, *args, **kwargs)
        return LoraLinearFunction.apply(x, *parts)


def use_lora_products(model: torch.nn.Module) -> int:
    """Gives ``model``'s peft LoRA ``Linear`` layers the fused forward (module docstring); returns how many."""
    changed = 0
    for module in model.modules():
        if type(module) is LoraLinear:
            module.__class__ = FusedLoraLinear
            changed += 1
    return changed
