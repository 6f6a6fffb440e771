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


def get_optimizer_and_scheduler(args, model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with ``maximize=True`` over the trainable parameters of ``model`` (frozen ones, such as
    a LoRA base, are left out), and the per-phase LambdaLR schedule of ``warmup_linear_decay``.

    ``args`` needs ``lr``, ``total_phases``, ``warmup_steps`` and ``final_scale``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.is_cuda for p in params)  # one kernel for the whole update on GPU
    optimizer = torch.optim.AdamW(params, lr=args.lr, maximize=True, fused=fused)
    lr_lambda = warmup_linear_decay(args.total_phases, args.warmup_steps, args.final_scale)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lr_lambda)
    return optimizer, scheduler
