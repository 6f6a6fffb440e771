"""``grpo-lightning fit --config experiments/quickstart.yaml``: LightningCLI over GRPOModule.

``grpo-lightning diagnose ...`` is a separate argparse command (``grpo_lightning.diagnostics``),
dispatched before LightningCLI is built.

Settings errors end in one line (``error: ...``) instead of a usage dump or a traceback.
"""

from __future__ import annotations

import sys

from jsonargparse import ArgumentError
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_only

from .config import GRPOError
from .module import GRPOModule
from .precision import choose_precision, precision_warning, resolve_accelerator


class GRPOLightningCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # One epoch is one phase: the number of epochs *is* total_phases, so it is set in one place.
        parser.link_arguments("model.total_phases", "trainer.max_epochs")
        parser.link_arguments("model.max_grad_norm", "trainer.gradient_clip_val")

    def before_instantiate_classes(self) -> None:
        trainer = (self.config[self.subcommand] if self.subcommand else self.config).trainer
        trainer.precision = settle_precision(trainer.precision, trainer.accelerator)


def settle_precision(precision, accelerator) -> str | int:
    """The precision a run uses: the one asked for, or (unset) the machine's default, said on the run's first
    line. A bf16 request on a CPU without native bf16 is kept, with a warning of its cost."""
    device = resolve_accelerator(accelerator)
    if precision is None:
        precision, reason = choose_precision(device)
        _say(f"precision {precision}: {reason} (set trainer.precision to choose another)")
    else:
        warning = precision_warning(precision, device)
        if warning:
            _say(f"warning: {warning}", file=sys.stderr)
    return precision


def _say(message: str, file=None) -> None:
    if rank_zero_only.rank == 0:  # once per run, not once per process
        print(message, file=file or sys.stdout, flush=True)


def trainer_defaults() -> dict:
    """Fresh per run: a callback instance keeps the state (directory, best paths) of the run it served."""
    return {
        "default_root_dir": "runs",
        "log_every_n_steps": 1,  # a phase has only a handful of steps
        "num_sanity_val_steps": 0,
        # A checkpoint at the end of every phase (last.ckpt links to it), never mid-phase: a mid-phase
        # checkpoint would resume with an empty replay memory.
        "callbacks": [ModelCheckpoint(save_last="link", save_top_k=1, every_n_epochs=1, save_on_train_epoch_end=True)],
    }


def make_cli(args=None, run: bool = True) -> GRPOLightningCLI:
    """The project's LightningCLI; ``run=False`` parses and instantiates without fitting."""
    return GRPOLightningCLI(
        GRPOModule,
        trainer_defaults=trainer_defaults(),
        seed_everything_default=False,  # sampling is seeded per phase from model.seed
        parser_kwargs={"exit_on_error": False},
        args=args,
        run=run,
    )


def main(args=None) -> int | None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["diagnose"]:
        from .diagnostics import main as diagnose

        code = diagnose(argv[1:])
        if code:
            sys.exit(code)
        return code
    try:
        make_cli(args)
    except (GRPOError, ArgumentError, ValueError) as error:
        # jsonargparse wraps an error raised while building a reward from YAML in a ValueError of
        # its own: report the project's error it carries, if any.
        own = _project_error(error)
        if own is None and not isinstance(error, ArgumentError):
            raise
        print(f"error: {_one_line(own or error)}", file=sys.stderr)
        sys.exit(1 if own is not None else 2)


def _project_error(error: BaseException | None) -> GRPOError | None:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, GRPOError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


if __name__ == "__main__":
    main()
