"""The learning step's RMS norms and gated activations as fused CPU kernels, forward and backward (float32).

Between the matrix products of a learning step, Hugging Face's eager layers make a dozen PyTorch operations
per RMS norm and gated MLP, and their backward as many more, each a pass over a (tokens, width) activation:
on 2 Zen 4 cores (SmolLM2-135M, a minibatch of 16 x 32 tokens, fp32) a norm's forward and backward took
1.34 ms through them and ``silu(gate) * up`` 1.68 ms, timed alone and warm: ~130 ms a step for the model's
61 norms and 30 MLPs. ``csrc/train_step.cpp`` does each in one pass forward and one backward:

- ``FusedRMSNorm``: ``weight * (x * r)``, ``r = 1 / sqrt(mean(x^2) + eps)``, keeping ``r`` per row for the
  backward (``dx = r (g - xh mean(g xh))`` with ``xh = x r``, ``g = dy weight``; ``dweight = sum(dy xh)``,
  summed in float64);
- ``FusedSiLUMul``: ``silu(gate) * up``, keeping gate and up (the eager graph also keeps ``silu(gate)``).

``use_fused_layers(model)`` gives a model's norms and MLPs a forward that runs them where they apply: float32
CPU tensors outside autocast, with the kernels built (``fused_decode.compiled_kernels``) and
``GRPO_LIGHTNING_FUSED_TRAINING`` not 0; under bf16 autocast the norms too, whose input (the residual stream) is
float32 there and which compute in float32 either way. Anything else (the MLP under autocast, whose gate and up
are bf16 products: widened for the kernel it was no faster on 2 Intel cores; a GPU, a sharded weight) runs the
layer's own forward. Only layers whose forward is the very code of Llama's (``LlamaRMSNorm``, ``LlamaMLP``
with SiLU) are changed, which covers the models that copy it (Qwen2, Mistral, SmolLM, ...); the projections
are called as they are (LoRA layers and ``TrainingLinear`` included). Results agree with the eager layers to
float rounding (tests/test_fused_training.py).

The forward comes with the layer's class: each changed layer becomes an instance of a subclass of its own class
(``FusedLlamaRMSNorm`` for ``LlamaRMSNorm``) that differs in ``forward`` only. A forward set on the instance would
not last: transformers' kernel hub (the ``kernels`` package, which transformers installs) goes over a model loaded
by ``from_pretrained`` at each of its ``train()``/``eval()`` switches and, where it has no kernel for the device (a
CPU), puts back the class's forward of each layer it knows (``LlamaRMSNorm`` among them) by deleting the
instance's. Lightning's ``model.train()`` at the start of fit did exactly that, and every learning step ran eager
norms. On a GPU the hub's kernel, where it has one, still replaces the forward as it would the class's.

The same extension gives ``objectives.selective_log_softmax`` its float32 kernel and ``training_products``
its transposes. With all three, a whole step of that minibatch (forward, backward, AdamW) took a median
2.31 s against 2.42 s without them, alternating in one process (README, "Performance").
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from .fast_decode import _is_silu
from .fused_decode import FUSED_TRAINING_ENV, compiled_kernels, switched_on


def fused_training_kernels():
    """The compiled kernels for the learning step, or None where ``$GRPO_LIGHTNING_FUSED_TRAINING`` is 0 or
    they cannot be built here."""
    return compiled_kernels() if switched_on(FUSED_TRAINING_ENV) else None


def _plain_cpu_fp32(*tensors: Tensor) -> bool:
    # A sharded (DTensor) or otherwise wrapped tensor takes the layer's own path.
    return all(type(t) in (Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32
               for t in tensors)  # fmt: skip


def _applies(*tensors: Tensor, under_autocast: bool = False):
    """The kernels, where they compute this layer's forward on these tensors; None otherwise. ``under_autocast``:
    the layer computes the same under autocast as outside it, where its tensors are float32 (the norm)."""
    if (torch.is_autocast_enabled("cpu") and not under_autocast) or not _plain_cpu_fp32(*tensors):
        return None
    return fused_training_kernels()


class FusedRMSNorm(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` over the last dimension. x: (..., d); weight: (d,)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, kernels) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out, inverse_rms = kernels.rms_norm_forward(rows, weight.contiguous(), eps)
        ctx.save_for_backward(rows, weight, inverse_rms)
        ctx.kernels, ctx.shape = kernels, x.shape
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        rows, weight, inverse_rms = ctx.saved_tensors
        grad_rows = grad_out.reshape(rows.shape).contiguous()
        grad_x, grad_weight = ctx.kernels.rms_norm_backward(grad_rows, rows, weight.contiguous(), inverse_rms,
                                                            ctx.needs_input_grad[1])  # fmt: skip
        return grad_x.view(ctx.shape), (grad_weight if ctx.needs_input_grad[1] else None), None, None


class FusedSiLUMul(torch.autograd.Function):
    """``silu(gate) * up``. gate, up: (..., f) of one shape."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, kernels) -> Tensor:
        width = gate.shape[-1]
        gate_rows, up_rows = _rows(gate, width), _rows(up, width)
        ctx.save_for_backward(gate_rows, up_rows)
        ctx.kernels, ctx.shape = kernels, gate.shape
        return kernels.silu_mul_forward(gate_rows, up_rows).view(gate.shape)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        gate_rows, up_rows = ctx.saved_tensors
        grad_gate, grad_up = ctx.kernels.silu_mul_backward(grad_out.reshape(gate_rows.shape).contiguous(), gate_rows, up_rows)
        return grad_gate.view(ctx.shape), grad_up.view(ctx.shape), None


def _rows(x: Tensor, width: int) -> Tensor:
    """x as (rows, width) with unit stride along the width, copied only where it has to be."""
    rows = x.reshape(-1, width)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _norm_forward(self, hidden_states: Tensor) -> Tensor:
    # Under bf16 autocast too: the residual stream it normalizes stays float32 there (a bf16 product's result
    # added to a float32 one), and Llama's norm computes in float32 and returns its input's dtype, autocast or not.
    kernels = _applies(hidden_states, self.weight, under_autocast=True)
    if kernels is None:
        return self.eager_forward(hidden_states)
    return FusedRMSNorm.apply(hidden_states, self.weight, float(self.variance_epsilon), kernels)


def _mlp_forward(self, x: Tensor) -> Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    kernels = _applies(gate, up)
    hidden = self.act_fn(gate) * up if kernels is None else FusedSiLUMul.apply(gate, up, kernels)
    return self.down_proj(hidden)


def _same_code(method, reference) -> bool:
    """Whether ``method`` is ``reference``'s code: the same bytecode, constants and names (so also a copy of it
    in another model's file)."""
    code, ref = getattr(method, "__code__", None), reference.__code__
    return code is not None and (code.co_code, code.co_consts, code.co_names) == (ref.co_code, ref.co_consts, ref.co_names)


def _is_llama_norm(module: torch.nn.Module) -> bool:
    return (_same_code(type(module).forward, LlamaRMSNorm.forward) and isinstance(getattr(module, "weight", None), Tensor)
            and module.weight.dim() == 1 and isinstance(getattr(module, "variance_epsilon", None), float))  # fmt: skip


def _is_llama_mlp(module: torch.nn.Module) -> bool:
    return (_same_code(type(module).forward, LlamaMLP.forward) and _is_silu(getattr(module, "act_fn", None))
            and all(isinstance(getattr(module, name, None), torch.nn.Module) for name in ("gate_proj", "up_proj", "down_proj")))  # fmt: skip


_FUSED_CLASSES: dict[type, type] = {}  # one fused subclass per layer class


def _fused_class(cls: type, forward) -> type:
    """The subclass of ``cls`` whose ``forward`` is ``forward`` (``cls``'s own stays reachable as
    ``eager_forward``), made once per class."""
    fused = _FUSED_CLASSES.get(cls)
    if fused is None:
        name = f"Fused{cls.__name__}"
        fused = type(name, (cls,), {"forward": forward, "eager_forward": cls.forward, "__module__": __name__,
                                    "__qualname__": name})  # fmt: skip
        _FUSED_CLASSES[cls] = fused
    return fused


def use_fused_layers(model: torch.nn.Module) -> int:
    """Gives ``model``'s Llama-style RMS norms and SiLU-gated MLPs the fused forward (module docstring); returns
    how many. Only each layer's class changes, to a subclass that differs in ``forward``: weights, names and the
    state dict stay as they are."""
    changed = 0
    for module in model.modules():
        if "forward" in vars(module):
            continue  # someone else's forward
        if _is_llama_norm(module):
            module.__class__ = _fused_class(type(module), _norm_forward)
        elif _is_llama_mlp(module):
            module.__class__ = _fused_class(type(module), _mlp_forward)
        else:
            continue  # changed already (its class's forward is now ours), or not Llama's code
        changed += 1
    return changed
