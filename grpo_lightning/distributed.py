"""Many processes: what each rank of a DDP run rolls out, and what the ranks share.

Under ``--trainer.strategy ddp --trainer.devices N [--trainer.num_nodes K]`` there are W = N x K ranks:

- Each phase's prompt rows are drawn whole and identically on every rank (by seed and phase), and rank r
  takes ``rows[r::W]``: whole groups, never split, so advantages are normalised within groups exactly
  as in one process. With the single prompt (no ``model.prompts``) each rank samples its own group of
  ``batch_size`` (its sampling seed includes the rank): W groups of the same prompt per phase.
- Every rank holds the same number of sequences, so the same number of minibatches and steps per phase;
  DDP averages the gradients, so a step is one process's step over the union of the ranks' minibatches
  (``token_mean_denominator`` keeps that true for a token-level mean over completions that end).
- The rollout's record is gathered onto every rank before the phase's scalars, sample table and
  histograms are computed (``gather_rollout``), so what is logged is the whole phase's.
- The exported model is written once, by rank 0, while the others wait (``export_once``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import torch
from torch import Tensor

from .config import GRPOConfigError
from .phase_logging import RolloutRecord


def rank_and_world(module) -> tuple[int, int]:
    """(this process's global rank, number of processes); (0, 1) for a module no trainer drives."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return 0, 1
    return trainer.global_rank, trainer.world_size


def rank_share(rows: list, rank: int, world_size: int) -> list:
    """Rank ``rank``'s share of a phase's rows: every ``world_size``-th, starting at ``rank``."""
    return rows[rank::world_size]


def check_process_split(module, world_size: int) -> None:
    """Refuses a phase of prompts that does not split into the same number of whole groups on every rank.
    (Each rank's share, batch_size x prompts_per_phase / world_size, then divides into num_minibatches, as
    batch_size does.)"""
    if world_size > 1 and module.prompts is not None and module.prompts_per_phase % world_size:
        raise GRPOConfigError(
            f"prompts_per_phase ({module.prompts_per_phase}) must be divisible by the number of processes "
            f"({world_size}: trainer.devices x trainer.num_nodes): each process rolls out the same number of "
            "whole groups, so that all take the same number of steps"
        )


def planned_processes(accelerator, devices, num_nodes) -> int | None:
    """The processes a Trainer with these settings will run (devices x num_nodes, devices read the way
    Lightning reads them), known before it is built; None where that is unclear (Lightning will say why)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    from .precision import resolve_accelerator

    try:
        kind = AcceleratorRegistry[resolve_accelerator(accelerator)]["accelerator"]
        count = kind.auto_device_count() if devices in (None, "auto") else kind.parse_devices(devices)
        count = len(count) if isinstance(count, (list, tuple)) else int(count)
        return count * int(num_nodes or 1)
    except Exception:  # noqa: BLE001 - an accelerator object or devices Lightning itself refuses: it says why
        return None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def all_gather_objects(value) -> list:
    """``value`` of every rank, in rank order (``[value]`` in one process). A collective: every rank must call it."""
    if not _distributed() or torch.distributed.get_world_size() == 1:
        return [value]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def _to_cpu(record: RolloutRecord) -> RolloutRecord:
    return RolloutRecord(**{
        name: value.detach().cpu() if isinstance(value, Tensor) else value
        for name, value in vars(record).items()
    })  # fmt: skip


def merge_records(records: list[RolloutRecord]) -> RolloutRecord:
    """The ranks' records as one, in rank order: each rank's groups stay whole and contiguous."""
    merged = {}
    for field in dataclasses.fields(RolloutRecord):
        values = [getattr(record, field.name) for record in records]
        if values[0] is None:
            merged[field.name] = None  # the same on every rank (kl_coef = 0, fixed-length completions)
        elif isinstance(values[0], Tensor):
            merged[field.name] = torch.cat(values)
        else:
            merged[field.name] = [item for value in values for item in value]
    return RolloutRecord(**merged)


def gather_rollout(record: RolloutRecord, components: dict[str, Tensor]) -> tuple[RolloutRecord, dict[str, Tensor]]:
    """The whole phase's rollout record and reward components (e.g. ``WeightedSum``'s terms), from every
    rank's own. A collective under DDP: every rank calls it, and every rank gets the same.

    Gathered whole rather than reduced metric by metric: the standard deviation, the minimum, the distinct
    fractions and the sample table of the union are not functions of the ranks' own values."""
    local = (_to_cpu(record), {name: value.detach().cpu() for name, value in components.items()})
    gathered = all_gather_objects(local)
    if len(gathered) == 1:
        return record, components
    records, component_dicts = zip(*gathered)
    merged_components = {name: torch.cat([c[name] for c in component_dicts]) for name in component_dicts[0]}
    return merge_records(list(records)), merged_components


def token_mean_denominator(mask: Tensor, trainer) -> Tensor | None:
    """For a token-level mean (DAPO's ``sum / tokens``) under W processes: the tokens of all ranks' minibatches
    divided by W, as this rank's denominator; None in one process (its own count is right).

    DDP averages gradients: (1/W) sum_r grad(S_r / D_r). With D_r = N / W for every rank, N the tokens of
    all ranks, that is grad(sum_r S_r / N), the token mean over the union minibatch; with each rank's own
    count D_r = n_r it would weigh the tokens of ranks with shorter completions more."""
    if trainer.world_size <= 1:
        return None
    tokens = trainer.strategy.reduce(mask.sum().to(torch.float32), reduce_op="sum")
    return tokens.clamp(min=1) / trainer.world_size  # as one process clamps its own count


def export_once(trainer, export_dir: str, write: Callable[[str], None]) -> None:
    """Calls ``write(<run directory>/export_dir)`` on rank 0 only, while the other ranks wait for it: no rank
    leaves (and closes its connections) while rank 0 still needs them. ``trainer.log_dir`` is itself a
    collective under DDP (rank 0's directory is broadcast), so every rank asks for it."""
    out = os.path.join(trainer.log_dir or trainer.default_root_dir, export_dir)
    if trainer.is_global_zero:
        write(out)
    trainer.strategy.barrier("export")


def explain_strategy_error(error: BaseException) -> str | None:
    """One line for a strategy Lightning refuses on this machine (FSDP on a CPU), or None."""
    text = " ".join(str(error).split())
    if "requires a GPU accelerator" not in text:
        return None
    lightning_says = text.split(". ")[0]  # "The strategy `fsdp` requires a GPU accelerator, but received ..."
    return (
        f"trainer.strategy fsdp needs CUDA GPUs: Lightning refuses it on the CPU ({lightning_says}); "
        "on CPUs use --trainer.strategy ddp, on GPUs --trainer.accelerator gpu"
    )
