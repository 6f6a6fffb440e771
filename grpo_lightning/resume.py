"""Resuming from a checkpoint means what the user typed.

A run resumed with ``--ckpt_path`` takes its settings from three places, later ones winning:
the defaults, the checkpoint's own settings, and what the user typed (config files and flags).
Settings that shape the trained weights (the model, LoRA on or off and its rank and target layers)
and the reward's kind cannot change: a conflict is refused, naming each. Everything else may
change, and each change is said on the run's first lines; raising ``total_phases`` extends a
finished run. A checkpoint that has already run all its phases is refused rather than "resumed"
into a run that trains nothing.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from .checkpointing import CheckpointError, find_last_checkpoint, load_checkpoint_file
from .config import GRPOConfigError


class ResumeError(CheckpointError, GRPOConfigError):
    """A ``--ckpt_path`` that cannot be resumed as asked (a usage error)."""


def resolve_ckpt_path(ckpt_path: str, root_dir: str | os.PathLike) -> str:
    """``last`` means the newest checkpoint under the run directory; anything else must be a file."""
    if ckpt_path == "last":
        return str(find_last_checkpoint(root_dir))
    return ckpt_path


def read_checkpoint_settings(path: str) -> tuple[dict[str, Any], int]:
    """The checkpoint's module settings (hyperparameters) and how many phases it completed.

    Memory-mapped: the weights are not read, only the small dictionaries around them."""
    checkpoint = load_checkpoint_file(path, mmap=True)
    settings = dict(checkpoint.get("hyper_parameters") or {})
    settings.pop("_instantiator", None)
    return settings, phases_done(checkpoint)


def phases_done(checkpoint: dict[str, Any]) -> int:
    """Completed phases (epochs) of a checkpoint written at the end of a phase: Lightning saves it after the
    epoch's training is processed, before the epoch is marked completed, and resumes with the next one."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    if "processed" in progress:
        return int(progress["processed"])
    return int(checkpoint.get("epoch", -1)) + 1


# ---- comparing the checkpoint's settings with the run's -------------------------------------------


def _reward_kind(reward: Any) -> str:
    """The reward's class as ``module.Class`` (null is the default period count), however it was named."""
    if reward is None:
        reward = {"class_path": "rewards.CharCount"}
    class_path = str(reward.get("class_path") if isinstance(reward, dict) else reward)
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return class_path
    return f"{cls.__module__}.{cls.__qualname__}"


def _lora_shape(lora: Any) -> str:
    """What of the LoRA settings shapes the trained weights: off, or its rank and target layers."""
    if not lora:
        return "off"
    if lora is True:
        lora = {}
    targets = lora.get("target_modules")
    return f"r={lora.get('r', 16)}, target_modules={sorted(targets) if targets else 'default'}"


def _model_id(name: Any) -> str:
    if name is None:
        return "the embedded default"
    path = os.path.expanduser(str(name))
    return os.path.realpath(path) if os.path.isdir(path) else str(name)


def _reward_name(reward: Any) -> str:
    if reward is None:
        return "rewards.CharCount (the default)"
    return str(reward.get("class_path") if isinstance(reward, dict) else reward)


FIXED_ON_RESUME = {
    # setting: (what must stay equal, how to show it)
    "model_name_or_path": (_model_id, _model_id),
    "lora": (_lora_shape, _lora_shape),
    "reward": (_reward_kind, _reward_name),
}


def resume_conflicts(saved: dict[str, Any], asked: dict[str, Any]) -> list[str]:
    """A description of each setting that cannot change on resume and was asked to."""
    saved, asked = _plain(saved), _plain(asked)
    conflicts = []
    for name, (key, shown) in FIXED_ON_RESUME.items():
        if name in saved and key(saved.get(name)) != key(asked.get(name)):
            conflicts.append(f"{name} is {shown(saved.get(name))} in the checkpoint, not {shown(asked.get(name))}")
    return conflicts


def _plain(value: Any) -> Any:
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def changed_settings(saved: dict[str, Any], asked: dict[str, Any]) -> list[str]:
    """``name old -> new`` for each setting that may change and does."""
    changes = []
    for name in sorted(saved):
        if name in FIXED_ON_RESUME or name not in asked:
            continue
        old, new = _plain(saved[name]), _plain(asked[name])
        if old != new:
            changes.append(f"{name} {old!r} -> {new!r}")
    return changes


def check_resume(path: str, saved: dict[str, Any], done: int, asked: dict[str, Any], extending: bool = True) -> str:
    """Refuses a resume that cannot mean what was asked; returns the line that says what it will do.
    ``extending``: the run trains (fit), so a checkpoint with no phase left to run is refused."""
    conflicts = resume_conflicts(saved, asked)
    if conflicts:
        raise ResumeError(
            f"cannot resume {path}: {'; '.join(conflicts)}. These cannot change on resume: drop them to continue "
            "the run as it was, or start a new run without --ckpt_path"
        )
    total = asked.get("total_phases")
    if extending and total is not None and done >= total:
        raise ResumeError(
            f"{path} has already run {done} of total_phases {total}: nothing is left to train; pass "
            f"--model.total_phases above {done} to extend it"
        )
    changes = changed_settings(saved, asked)
    said = f"resuming {path}: {done} of {total} phases done" if extending else f"evaluating {path}, after {done} of {total} phases"
    return said + (f"; changed: {', '.join(changes)}" if changes else "; settings as in the checkpoint")
