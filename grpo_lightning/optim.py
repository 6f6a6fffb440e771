"""AdamW (maximising) and the warmup-then-linear-decay schedule, stepped once per phase."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def warmup_linear_decay(total_phases: int, warmup_steps: int, final_scale: float) -> Callable[[int], float]:
    """LR multiplier after ``step`` scheduler steps (phases): linear warmup from 1/(warmup+1) to 1,
    then linear decay to ``final_scale`` at ``step == total_phases``."""

    def lr_lambda(step: int) -> float:
        assert step <= total_phases, f"Step = {step} should be at most total_phases = {total_phases}."
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return 1 - (1 - final_scale) * (step - warmup_steps) / (total_phases - warmup_steps)

    return lr_lambda


def get_optimizer_and_scheduler(
    args, model: nn.Module, fused: bool | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with ``maximize=True`` over the trainable parameters of ``model`` (frozen ones, such as
    a LoRA base, are left out), and the per-phase LambdaLR schedule of ``warmup_linear_decay``.

    ``args`` needs ``lr``, ``total_phases``, ``warmup_steps`` and ``final_scale``. ``fused``: None
    picks the fused kernel wherever it runs (CPU and CUDA floating-point parameters).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    # One fused kernel for the whole update: on a 2-core CPU it is ~4x faster than the foreach path
    # for a 135M model (0.07 s vs 0.26+ s a step), with the same arithmetic.
    if fused is None:
        fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    optimizer = torch.optim.AdamW(params, lr=args.lr, maximize=True, fused=fused)
    lr_lambda = warmup_linear_decay(args.total_phases, args.warmup_steps, args.final_scale)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lr_lambda)
    return optimizer, scheduler
