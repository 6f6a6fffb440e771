"""Decode-shaped fp32 matrix products on the CPU, through the library that runs them fastest there.

Sampling runs the policy on one new token per sequence per step: every linear layer multiplies a thin
(B, d_in) activation by a (d_out, d_in) weight. For such shapes PyTorch's ``F.linear`` (MKL's sgemm on
x86) is far from the CPU's fp32 matmul peak, and which library does better depends on the CPU's maker
(measured on 2 cores, B = 32 and 128, weights read cold from memory as in a decode step; README,
"Performance"):

- ``"mkl"``: MKL's packed sgemm, the weight laid out once in the kernel's own blocked format. On an
  Intel Xeon (Sapphire Rapids) it reached 80-95 % of the peak at B = 32, where ``F.linear`` reached half.
  The weights do not change during a rollout, so they are packed once at its start for exactly B rows.
- ``"onednn"``: oneDNN's fp32 inner product, the weight laid out once in oneDNN's blocked format; that
  layout serves any row count. On an AMD EPYC (Zen 4) the model's decode products ran at about 80 % of
  the peak at B = 32 (53 % for the thin key/value products, 88 % for the MLP's) and about all of it at
  B = 128, where MKL, packed or not, reached 40-55 % and 65-80 %: MKL takes slower code paths on CPUs that
  are not Intel's.
- ``"aten"``: ``F.linear`` itself, where neither library is present.

``decode_matmul_backend`` picks by the CPU's vendor (deterministically: a run and its resumed run multiply
alike); ``GRPO_LIGHTNING_DECODE_MATMUL`` overrides it. The products agree with ``F.linear`` to float
rounding; a LoRA layer, prepared as its merged weight, rounds as a merged weight does
(tests/test_fast_decode.py).

Under bf16 autocast (bf16-mixed runs) the products are oneDNN's bf16 inner product on a bf16 copy of the
weight, laid out once: what autocast's ``F.linear`` computes (input, weight and bias rounded to bf16, a bf16
result), without the cast and the layout of the weight at every call. On the Zen 4 machine a decode step's
products at B = 32 took 41-43 ms against 104-115 ms through autocast (weights of the model's shapes, read cold). There MKL has no bf16 product:
oneDNN serves every CPU, where this PyTorch's oneDNN has bf16 kernels (``_bf16_products_available``).

Only where it helps and is safe: fp32 weights on the CPU, in fp32 or under bf16 autocast (not fp16), and
under ``torch.no_grad``: with gradients enabled a layer runs its own forward (these products have no
backward). MKL's packed product also needs the packed row count: another input (the prompt's forward) takes
the ordinary ``F.linear``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from .config import GRPOError
from .precision import cpu_info

# Below this many weight entries a layer is cheap anyway (LoRA's adapters, tiny test models): left alone.
MIN_PACKED_WEIGHT = 64 * 64
DECODE_MATMUL_ENV = "GRPO_LIGHTNING_DECODE_MATMUL"
DECODE_MATMUL_BACKENDS = ("mkl", "onednn", "aten")
KEEP_REFERENCE_LAYOUT_ENV = "GRPO_LIGHTNING_KEEP_REFERENCE_LAYOUT"  # see GRPOModule.keeps_reference_layout


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


def _bf16_products_available() -> bool:
    return _onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def product_setting(model: torch.nn.Module) -> tuple[str, torch.dtype] | None:
    """``(library, dtype)`` of the decode products for ``model`` now, or None where they do not apply.

    fp32 weights on the CPU are required. Outside autocast: ``decode_matmul_backend()`` in float32 (None for
    "aten"). Under CPU bf16 autocast: oneDNN in bfloat16, where its bf16 kernels exist and the library was
    not set to "aten". Under any other autocast (fp16): None."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    return cpu_fp32_product_setting()


def cpu_fp32_product_setting() -> tuple[str, torch.dtype] | None:
    """``product_setting`` of any model with fp32 weights on the CPU, here and now (in or out of autocast)."""
    backend = decode_matmul_backend()
    if torch.is_autocast_enabled("cpu"):
        bf16 = torch.get_autocast_dtype("cpu") == torch.bfloat16
        return ("onednn", torch.bfloat16) if bf16 and backend != "aten" and _bf16_products_available() else None
    return None if backend == "aten" else (backend, torch.float32)


def _product(
    weight: Tensor, bias: Tensor | None, rows: int | None, backend: str, dtype: torch.dtype = torch.float32
) -> Callable[[Tensor], Tensor]:
    """``x -> F.linear(x, weight, bias)`` through ``backend`` ("mkl": ``weight`` packed for inputs of ``rows``
    rows, other inputs take ``F.linear``; "onednn": any rows), for use without gradients (no backward).
    ``dtype=torch.bfloat16`` (oneDNN only): what bf16 autocast computes, the input, weight and bias rounded
    to bf16 and a bf16 result."""
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if dtype == torch.bfloat16:
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x.to(dtype), blocked, bias, "none", [], "")
    if backend == "onednn":
        # oneDNN's blocked layout, laid out once: a product on the plain weight reorders it on every call
        # (measured on 2 Zen 4 cores, B = 32, weights cold: 55-128 GFLOP/s plain, 97-162 blocked). The
        # layout serves any row count; ``rows`` is only a hint, and the results are the plain weight's.
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")

    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)

    def product(x: Tensor) -> Tensor:
        if x.numel() // x.shape[-1] != rows:  # e.g. the prompt's forward
            return F.linear(x, weight, bias)
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)

    return product


def _packed_forward(module: torch.nn.Module, weight: Tensor, bias: Tensor | None, rows: int | None, setting):
    """A forward for ``module`` computing ``F.linear(x, weight, bias)`` as ``setting`` (library, dtype) says
    (``_product``). With gradients enabled it is the module's own forward (these products have no backward)."""
    own_forward = type(module).forward.__get__(module)
    product = _product(weight, bias, rows, *setting)

    def forward(x: Tensor) -> Tensor:
        return own_forward(x) if torch.is_grad_enabled() else product(x)

    return forward


def _linear_weight(module: torch.nn.Module, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor | None] | None:
    """``(weight, bias)`` of the linear map ``module`` computes: an ``nn.Linear``'s own; for a peft LoRA layer,
    its base layer's plus, with adapters on, their ``scaling * B @ A`` (the weight delta its forward adds;
    dropout is off in eval mode). None for anything more than one linear map (another module, a LoRA
    variant such as DoRA with its adapters on), and for a LoRA layer with adapters on when the products are
    bf16: rounded into a bf16 weight (8 significant bits), an adapter's small delta would be partly or wholly
    lost, where autocast's forward adds it as a product of its own."""
    if type(module) is torch.nn.Linear or getattr(type(module), "plain_linear_map", False):
        return module.weight, module.bias
    base = getattr(module, "base_layer", None)
    if not (hasattr(module, "get_delta_weight") and isinstance(base, torch.nn.Linear)):
        return None
    active = [name for name in module.active_adapters if name in module.lora_A]
    if module.disable_adapters or module.merged or not active:  # merged: the delta is in the base weight
        return base.weight, base.bias
    if getattr(module, "lora_variant", None) or dtype != torch.float32:
        return None
    return _merged_weight(module, base.weight, active), base.bias


def _merged_weight(module: torch.nn.Module, weight: Tensor, active: list[str]) -> Tensor:
    """``weight + scaling * B @ A`` of a LoRA layer's active adapters. One adapter (the usual case) is one ``addmm``,
    a single pass that writes the merged weight, where peft's ``get_delta_weight`` writes ``B @ A``, scales it into a
    new tensor and adds that to the weight: a LoRA phase's rollout products were prepared in 0.32 s against 0.41-0.43
    (SmolLM2-135M in fp32, 2 cores of an Intel Xeon with native bf16; benchmarks/MEASUREMENTS.md). The same weight as peft's merge to the bit where the scaling is a power of two
    (alpha / r = 32 / 16 by default: scaling the product is exact), to float rounding otherwise. Several adapters, or
    a layer that stores its weight transposed (``fan_in_fan_out``), take peft's delta."""
    with torch.no_grad():  # prepared products are gradient-free: no graph through A and B
        if len(active) == 1 and not getattr(module, "fan_in_fan_out", False):
            lora_a, lora_b = module.lora_A[active[0]].weight, module.lora_B[active[0]].weight
            if lora_a.dtype == lora_b.dtype == weight.dtype:
                return torch.addmm(weight, lora_b, lora_a, alpha=module.scaling[active[0]])
        return weight + sum(module.get_delta_weight(name) for name in active)


def prepared_product(modules: Sequence[torch.nn.Module], rows: int | None) -> Callable[[Tensor], Tensor] | None:
    """One product giving what the linear layers ``modules``, which read the same input, give side by side:
    ``x -> torch.cat([m(x) for m in modules], -1)``, through ``decode_matmul_backend()`` and without gradients.
    One product instead of several runs thin outputs (the key and value projections) nearer the peak.

    ``rows``: as for ``prepared_linear_layers``. None where the products do not apply (``product_setting``),
    where the weights are small (below ``MIN_PACKED_WEIGHT`` in all) or where a module is more than a linear
    map (``_linear_weight``): the caller then runs the modules themselves. A product computes with the weights
    as they were when it was prepared: prepare it again after they change (an optimizer step)."""
    setting = _setting_for(modules[0], rows) if modules else None
    if setting is None:
        return None
    weights = [_linear_weight(module, setting[1]) for module in modules]
    if any(pair is None for pair in weights) or sum(w.numel() for w, _ in weights) < MIN_PACKED_WEIGHT:
        return None
    with torch.no_grad():
        weight = torch.cat([w for w, _ in weights]) if len(weights) > 1 else weights[0][0]
        bias = None
        if any(b is not None for _, b in weights):  # e.g. Qwen2's q/k/v; a layer without one adds zeros
            bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in weights])
        return _product(weight, bias, rows, *setting)


@contextlib.contextmanager
def prepared_linear_layers(model: torch.nn.Module, rows: int | None):
    """Within the block, ``model``'s linear layers multiply without gradients through prepared products, as
    ``product_setting`` chooses them (fp32: ``decode_matmul_backend()``; bf16 autocast: oneDNN's bf16 product).

    ``rows`` is the number of token positions per decode step (the group size B), which MKL packs for;
    None for passes of any row count (the reference's), where only oneDNN, whose layout fits any row count,
    applies. A LoRA layer whose adapters are on is prepared as one merged weight ``W + scaling * B @ A`` (the
    same function, one product instead of three), except under bf16, where the merged weight would round the
    adapters' small delta away: there its base layer and its A and B are prepared each; with its adapters off,
    as its base layer's. Laying the weights out takes one pass over them and as much memory again as the
    linear weights; both are freed at the end."""
    setting = _setting_for(model, rows)
    if setting is None:
        yield
        return
    with _installed(_prepared_forwards(_linear_maps(model, setting[1]), rows, setting)):
        yield


def _setting_for(model: torch.nn.Module, rows: int | None) -> tuple[str, torch.dtype] | None:
    """``product_setting(model)``, or None where it cannot serve ``rows``: None rows (passes of varying row
    counts, the reference's) are beyond MKL's packing, which fits one row count."""
    setting = product_setting(model)
    return None if setting is None or (rows is None and setting[0] == "mkl") else setting


def _linear_maps(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[torch.nn.Module, Tensor, Tensor | None]]:
    """``(module, weight, bias)`` of each of ``model``'s modules that prepared products serve (``_linear_weight``),
    parents before their children; a LoRA layer taken whole covers its base layer and adapters."""
    maps, covered = [], set()  # covered: modules a LoRA layer taken whole no longer calls
    with torch.no_grad():
        for module in model.modules():  # parents come before their children
            linear = None if id(module) in covered else _linear_weight(module, dtype)
            if linear is None or linear[0].numel() < MIN_PACKED_WEIGHT:
                continue  # the base layer of a DoRA layer (or, in bf16, of a LoRA one), a child, is prepared on its own
            maps.append((module, *linear))
            covered.update(map(id, module.modules()))
    return maps


def _prepared_forwards(maps, rows: int | None, setting) -> list[tuple[torch.nn.Module, Callable[[Tensor], Tensor]]]:
    with torch.no_grad():
        return [(module, _packed_forward(module, weight, bias, rows, setting)) for module, weight, bias in maps]


@contextlib.contextmanager
def _installed(forwards: list[tuple[torch.nn.Module, Callable[[Tensor], Tensor]]]):
    for module, forward in forwards:
        module.forward = forward  # shadows the class's forward
    try:
        yield
    finally:
        for module, _ in forwards:
            module.__dict__.pop("forward", None)


class KeptLayout:
    """``prepared_linear_layers`` for a model whose linear weights do not change between its passes (the frozen
    reference, or a LoRA policy's base layers with its adapters off): the weights are laid out at the first
    block and the layout is used again by the next ones, as long as every weight is the same tensor, unchanged.

    Laying out SmolLM2-135M's weights took 134-174 ms on 2 AMD Zen 4 cores, 7-9 % of the reference pass of a
    small phase (32 x 33 tokens). The price: the layout (as much memory as the linear weights) is held
    between passes instead of being freed after each. A weight changed in place (an optimizer step, a
    checkpoint loaded into it: its version counter moves), a weight that is another tensor now, another
    ``rows``, precision or library: laid out again. A merged LoRA weight (adapters on) is a new tensor at every
    pass: such models are laid out every time, as ``prepared_linear_layers`` does."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._forwards: list = []
        self._weights: list[Tensor] = []  # held, so that no other tensor can take a weight's memory and key

    @contextlib.contextmanager
    def prepared(self, model: torch.nn.Module, rows: int | None = None):
        setting = _setting_for(model, rows)
        if setting is None:
            self.clear()
            yield
            return
        maps = _linear_maps(model, setting[1])
        key = _layout_key(model, maps, rows, setting)
        if key is None:  # a weight computed for this pass (a merged LoRA weight): nothing to keep
            self.clear()
            with _installed(_prepared_forwards(maps, rows, setting)):
                yield
            return
        if key != self._key:
            self.clear()  # the old layout goes before the new one is made: never both in memory
            self._forwards = _prepared_forwards(maps, rows, setting)
            self._weights = [t.detach() for _, weight, bias in maps for t in (weight, bias) if t is not None]
            self._key = key
        with _installed(self._forwards):
            yield

    @property
    def holds_layout(self) -> bool:
        """Whether a layout is kept now (and its memory held)."""
        return self._key is not None

    def clear(self) -> None:
        self._key, self._forwards, self._weights = None, [], []

    def __getstate__(self) -> dict:
        # A pickled or copied module (ddp_spawn sends it to each process) takes no layout along: the products
        # are closures, and a layout is only worth its memory in the process that made it. The copy lays out anew.
        return {"_key": None, "_forwards": [], "_weights": []}


def _layout_key(model: torch.nn.Module, maps, rows: int | None, setting) -> tuple | None:
    """What a kept layout depends on: the setting, ``rows`` and, per module, its weight and bias tensors (which
    tensor, where its data lies, its version counter); None if a weight is not one of the model's own tensors."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}

    def state(tensor: Tensor | None):
        return None if tensor is None else (id(tensor), tensor.data_ptr(), tensor._version, tuple(tensor.shape))

    if any(id(t) not in own for _, weight, bias in maps for t in (weight, bias) if t is not None):
        return None
    return (setting, rows, tuple((id(module), state(weight), state(bias)) for module, weight, bias in maps))
