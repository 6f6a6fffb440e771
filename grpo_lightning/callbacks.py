"""Callbacks every CLI run gets (see ``grpo_lightning.cli.trainer_defaults``)."""

from __future__ import annotations

import os
import sys

import lightning as L

from .checkpointing import CheckpointError, wait_for_checkpoint_writes
from .interrupt import stop_point


class StopAtSafePoints(L.Callback):
    """Checks for a requested stop between training steps and before each rollout, and, whatever ends a
    run early, notes on the exception which checkpoint a resume would start from."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        stop_point()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        stop_point()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # The checkpoint still being written in the background is finished first, so that it is the one
        # reported; if it cannot be, the run says why, and the one before it is reported.
        try:
            wait_for_checkpoint_writes(trainer)
        except CheckpointError as error:  # one the run had not raised yet: its own error is the one ending it
            if trainer.is_global_zero:
                print(f"error: {error}", file=sys.stderr, flush=True)
        callback = trainer.checkpoint_callback
        # This run's newest whole checkpoint; before it wrote one, the checkpoint it resumed from (if any).
        last = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "") or trainer.ckpt_path
        if last and not os.path.exists(last):  # the write that failed was this run's first
            last = trainer.ckpt_path
        try:
            exception.grpo_last_checkpoint = last or None
            exception.grpo_phase = trainer.current_epoch + 1
            exception.grpo_total_phases = trainer.max_epochs
        except AttributeError:  # an exception type that refuses attributes: nothing to say then
            pass
