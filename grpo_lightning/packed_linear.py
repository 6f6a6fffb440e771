"""Decode-shaped fp32 matrix products on the CPU, through the library that runs them fastest there.

Sampling runs the policy on one new token per sequence per step: every linear layer multiplies a thin
(B, d_in) activation by a (d_out, d_in) weight. For such shapes PyTorch's ``F.linear`` (MKL's sgemm on
x86) is far from the CPU's fp32 matmul peak, and which library does better depends on the CPU's maker
(measured on 2 cores, B = 32 and 128, weights read cold from memory as in a decode step; README,
"Performance"):

- ``"mkl"``: MKL's packed sgemm, the weight laid out once in the kernel's own blocked format. On an
  Intel Xeon (Sapphire Rapids) it reached 80-95 % of the peak at B = 32, where ``F.linear`` reached half.
  The weights do not change during a rollout, so they are packed once at its start for exactly B rows.
- ``"onednn"``: oneDNN's fp32 inner product on the weights as they are (no copy, any row count). On an
  AMD EPYC (Zen 4) it reached 65-73 % of the peak at B = 32 and about all of it at B = 128, where MKL,
  packed or not, reached 40-55 % and 65-80 %: MKL takes slower code paths on CPUs that are not Intel's.
- ``"aten"``: ``F.linear`` itself, where neither library is present.

``decode_matmul_backend`` picks by the CPU's vendor (deterministically: a run and its resumed run multiply
alike); ``GRPO_LIGHTNING_DECODE_MATMUL`` overrides it. The products agree with ``F.linear`` to float
rounding; a LoRA layer, prepared as its merged weight, rounds as a merged weight does
(tests/test_fast_decode.py).

Only where it helps and is safe: fp32 weights on the CPU, outside autocast (bf16-mixed runs use oneDNN's
bf16 kernels already), and under ``torch.no_grad``: with gradients enabled a layer runs its own forward
(these products have no backward). MKL's packed product also needs the packed row count: another input
(the prompt's forward) takes the ordinary ``F.linear``.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch import Tensor
from torch.nn import functional as F

from .config import GRPOError
from .precision import cpu_info

# Below this many weight entries a layer is cheap anyway (LoRA's adapters, tiny test models): left alone.
MIN_PACKED_WEIGHT = 64 * 64
DECODE_MATMUL_ENV = "GRPO_LIGHTNING_DECODE_MATMUL"
DECODE_MATMUL_BACKENDS = ("mkl", "onednn", "aten")


def _mkl_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def _cpu_vendor() -> str:
    return cpu_info().vendor  # read once: /proc/cpuinfo does not change, and every rollout asks


def decode_matmul_backend() -> str:
    """``"mkl"``, ``"onednn"`` or ``"aten"``: the library for this CPU's decode products (module docstring).

    ``$GRPO_LIGHTNING_DECODE_MATMUL`` chooses one by name; otherwise MKL on Intel CPUs and oneDNN on the
    others, each only where this PyTorch build has it."""
    chosen = os.environ.get(DECODE_MATMUL_ENV, "").strip().lower()
    if chosen:
        if chosen not in DECODE_MATMUL_BACKENDS:
            raise GRPOError(f"{DECODE_MATMUL_ENV}={chosen!r} is not one of {', '.join(DECODE_MATMUL_BACKENDS)} (or unset it)")
        available = {"mkl": _mkl_available(), "onednn": _onednn_available(), "aten": True}[chosen]
        return chosen if available else "aten"
    if _cpu_vendor() == "GenuineIntel" and _mkl_available():
        return "mkl"
    if _onednn_available():
        return "onednn"
    return "mkl" if _mkl_available() else "aten"


def packing_available(model: torch.nn.Module) -> bool:
    """Whether the decode products apply to ``model`` now: fp32 weights on the CPU, MKL or oneDNN present,
    no autocast."""
    weight = next(model.parameters(), None)
    return (
        weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and decode_matmul_backend() != "aten"
    )


def _packed_forward(module: torch.nn.Module, weight: Tensor, bias: Tensor | None, rows: int, backend: str):
    """A forward for ``module`` computing ``F.linear(x, weight, bias)`` through ``backend`` ("mkl": ``weight``
    packed for inputs of ``rows`` rows; "onednn": any rows). With gradients enabled it is the module's own
    forward (these products have no backward)."""
    own_forward = type(module).forward.__get__(module)
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if backend == "onednn":

        def forward(x: Tensor) -> Tensor:
            if torch.is_grad_enabled():
                return own_forward(x)
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

        return forward

    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)

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
def packed_linear_weights(model: torch.nn.Module, rows: int | None):
    """Within the block, ``model``'s linear layers multiply without gradients through ``decode_matmul_backend()``.

    ``rows`` is the number of token positions per decode step (the group size B), which MKL packs for;
    None for passes of any row count (the reference's), where only oneDNN, which needs no packing, applies. A
    LoRA layer whose adapters are on is prepared as one merged weight ``W + scaling * B @ A`` (the same
    function, one product instead of three); with its adapters off, its base layer is. MKL's packing takes
    one pass over the weights and as much memory again as the linear weights; both are freed at the end."""
    backend = decode_matmul_backend()
    # rows=None: passes of varying row counts (the reference's), which MKL's packing cannot serve.
    if not packing_available(model) or (rows is None and backend == "mkl"):
        yield
        return
    patched, covered = [], set()  # covered: modules a patched LoRA layer no longer calls
    with torch.no_grad():
        for module in model.modules():  # parents come before their children
            delta = _active_lora_delta(module)
            if delta is not None:
                base = module.base_layer
                # an instance attribute shadows the class's forward
                module.forward = _packed_forward(module, base.weight + delta, base.bias, rows, backend)
                covered.update(map(id, module.modules()))
            elif type(module) is torch.nn.Linear and id(module) not in covered and module.weight.numel() >= MIN_PACKED_WEIGHT:
                module.forward = _packed_forward(module, module.weight, module.bias, rows, backend)
            else:
                continue
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)
