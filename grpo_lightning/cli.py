"""``grpo-lightning fit --config experiments/quickstart.yaml``: LightningCLI over GRPOModule.

Settings errors end in one line (``error: ...``) instead of a usage dump or a traceback.
"""

from __future__ import annotations

import sys

from jsonargparse import ArgumentError
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from .config import GRPOError
from .module import GRPOModule


class GRPOLightningCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # One epoch is one phase: the number of epochs *is* total_phases, so it is set in one place.
        parser.link_arguments("model.total_phases", "trainer.max_epochs")
        parser.link_arguments("model.max_grad_norm", "trainer.gradient_clip_val")


TRAINER_DEFAULTS = {
    "default_root_dir": "runs",
    "log_every_n_steps": 1,  # a phase has only a handful of steps
    "num_sanity_val_steps": 0,
    # A checkpoint at the end of every phase (last.ckpt), never mid-phase: a mid-phase checkpoint
    # would resume with an empty replay memory.
    "callbacks": [ModelCheckpoint(save_last="link", save_top_k=1, every_n_epochs=1, save_on_train_epoch_end=True)],
}


def make_cli(args=None, run: bool = True) -> GRPOLightningCLI:
    """The project's LightningCLI; ``run=False`` parses and instantiates without fitting."""
    return GRPOLightningCLI(
        GRPOModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=False,  # sampling is seeded per phase from model.seed
        parser_kwargs={"exit_on_error": False},
        args=args,
        run=run,
    )


def main(args=None) -> None:
    try:
        make_cli(args)
    except (GRPOError, ArgumentError) as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        sys.exit(2 if isinstance(error, ArgumentError) else 1)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


if __name__ == "__main__":
    main()
