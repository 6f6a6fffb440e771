"""``grpo-lightning fit --config experiments/quickstart.yaml``: LightningCLI over GRPOModule.

``grpo-lightning diagnose ...`` and ``grpo-lightning label ...`` are separate argparse commands
(``grpo_lightning.diagnostics``, ``grpo_lightning.label``), and ``grpo-lightning reward-model fit ...``
a LightningCLI of its own (``grpo_lightning.reward_model``), all dispatched before this one is built.

Bad input ends in one line (``error: ...``) instead of a usage dump or a traceback, with exit code 2
for a usage error (a setting, path, YAML file or context length that cannot work) and 1 for a runtime
failure (a reward raising mid-run, damaged model files). README: "Bad input: one line each".
"""

from __future__ import annotations

import errno
import logging
import os
import shlex
import signal
import sys

from jsonargparse import ArgumentError
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .callbacks import StopAtSafePoints
from .checkpointing import AtomicCheckpointIO, CheckpointError, PhaseCheckpoint
from .config import GRPOConfigError, GRPOError
from .distributed import check_process_split, explain_strategy_error, planned_processes
from .input_checks import check_run_dir, explain_instantiation_error, explain_parser_error, prepare_argv
from .interrupt import STOP, StopRequested
from .machine import keep_freed_memory_for_reuse
from .module import GRPOModule
from .precision import choose_precision, precision_warning, resolve_accelerator
from .resume import ResumeError, check_resume, read_checkpoint_settings, resolve_ckpt_path


class GRPOLightningCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # One epoch is one phase: the number of epochs *is* total_phases, so it is set in one place.
        parser.link_arguments("model.total_phases", "trainer.max_epochs")
        parser.link_arguments("model.max_grad_norm", "trainer.gradient_clip_val")
        parser.link_arguments("model.eval_every_n_phases", "trainer.check_val_every_n_epoch")
        parser.add_argument(
            "--checkpoint_every_n_phases", type=int, default=1,
            help="Write a checkpoint after every this many phases, and after the last (default 1: every phase). "
            "A stop or a kill loses the phases since the last one written; each write of a full fine-tuning "
            "checkpoint costs seconds (perf/checkpoint_wait_s).",
        )  # fmt: skip

    def parse_arguments(self, parser, args) -> None:
        self._args = args  # kept to parse them again over a checkpoint's settings (_parse_ckpt_path)
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """``--ckpt_path``: ``last`` is resolved, and the run's settings are the defaults, overridden by the
        checkpoint's settings, overridden by what the user typed (Lightning lets the checkpoint win)."""
        subcommand = self.config.get("subcommand")
        if not subcommand or not self.config[subcommand].get("ckpt_path"):
            return
        config = self.config[subcommand]
        try:
            path = resolve_ckpt_path(config.ckpt_path, config.trainer.default_root_dir or ".")
            saved, done = read_checkpoint_settings(path)
        except CheckpointError as error:  # the path the user typed: a usage error
            raise ResumeError(str(error)) from error
        model_parser = self._subcommand_parsers[subcommand]
        for name, value in saved.items():
            try:
                model_parser.set_defaults({f"model.{name}": value})
            except KeyError:  # a setting this version no longer has: the checkpoint's value has nowhere to go
                _say(f"warning: {path} has a setting model.{name} that this version does not know; ignored")
        self.parse_arguments(self.parser, self._args)
        config = self.config[subcommand]
        config.ckpt_path = path
        said = check_resume(path, saved, done, config.model.as_dict(), extending=subcommand == "fit")
        _say(said)

    def _instantiate_trainer(self, config: dict, callbacks: list):
        # Checkpoints are written atomically and read weights_only, unless the user brings a CheckpointIO of
        # their own. Added here, not in trainer_defaults, where the parser would try to serialize it.
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            config["plugins"] = [*plugins, AtomicCheckpointIO()]
        # A phase that does not split over the processes is refused here, before the trainer's banner and before
        # any other process starts, so that the one line is all a user sees (GRPOModule.setup checks it again).
        processes = planned_processes(config.get("accelerator"), config.get("devices"), config.get("num_nodes"))
        if processes is not None and isinstance(self.model, GRPOModule):
            check_process_split(self.model, processes)
        return super()._instantiate_trainer(config, callbacks)

    def before_instantiate_classes(self) -> None:
        trainer = (self.config[self.subcommand] if self.subcommand else self.config).trainer
        if self.subcommand is not None:  # a run, not a parse: refuse a run directory it cannot write
            check_run_dir(trainer.default_root_dir)
        trainer.precision = settle_precision(trainer.precision, trainer.accelerator)
        every = (self.config[self.subcommand] if self.subcommand else self.config).get("checkpoint_every_n_phases", 1)
        if every is None or every < 1:
            raise GRPOConfigError(f"checkpoint_every_n_phases ({every}) must be at least 1")

    def instantiate_trainer(self, **kwargs):
        # The model's inputs (path, tokenizer, context length, weight files) are checked before the
        # trainer is built, so that a refusal is the only line a run prints (the trainer prints a banner).
        if self.subcommand is not None and isinstance(self.model, GRPOModule):
            self.model.check_inputs()
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except ValueError as error:  # e.g. FSDP on a CPU, which Lightning refuses
            explained = explain_strategy_error(error)
            if explained is None:
                raise
            raise GRPOConfigError(explained) from error
        if self.subcommand is not None:
            every = self.config[self.subcommand].get("checkpoint_every_n_phases", 1)
            for callback in trainer.callbacks:
                if isinstance(callback, PhaseCheckpoint):
                    callback.every_n_phases = every
        return trainer


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
        # A checkpoint at the end of every phase (or of every checkpoint_every_n_phases, and the last; last.ckpt
        # links to it), never mid-phase: a mid-phase checkpoint would resume with an empty replay memory.
        # Written atomically, read weights_only.
        "callbacks": [
            PhaseCheckpoint(save_last="link", save_top_k=1, every_n_epochs=1, save_on_train_epoch_end=True),
            StopAtSafePoints(),
        ],
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


# Errors of the file system that name a path the run could not use (disk full is not among them).
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST}


def main(args=None) -> int | None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] in (["diagnose"], ["label"]):  # argparse commands of their own
        from .diagnostics import main as diagnose
        from .label import main as label

        code = (diagnose if argv[0] == "diagnose" else label)(argv[1:])
        if code:
            sys.exit(code)
        return code
    if argv[:1] == ["reward-model"]:  # a LightningCLI of its own (grpo_lightning.reward_model)
        from .reward_model import main as reward_model

        return reward_model(argv[1:])
    # Offline, huggingface_hub logs each of its connection retries; models.py fails at once instead.
    logging.getLogger("huggingface_hub.utils._http").setLevel(logging.ERROR)
    keep_freed_memory_for_reuse()  # each learning step's large tensors reuse the last step's memory
    STOP.install()
    try:
        prepared = prepare_argv(argv)
        if args is None:
            sys.argv[1:] = prepared  # LightningCLI warns if given both args and a command line
        make_cli(None if args is None else prepared)
    except (StopRequested, SIGTERMException, KeyboardInterrupt) as stop:
        sys.exit(report_stop(stop, argv))
    except (GRPOError, ArgumentError, ValueError) as error:
        # jsonargparse wraps an error raised while building a reward from YAML in a ValueError of
        # its own: report the project's error it carries, if any.
        own = _project_error(error)
        if own is not None:
            last = getattr(own, "grpo_last_checkpoint", None)  # the run had started: say what is kept
            kept = f"; the last checkpoint, intact, is {last} (resume with --ckpt_path {last})" if last else ""
            _fail(_one_line(own) + kept, exit_code(own))
        if isinstance(error, ArgumentError):
            _fail(explain_parser_error(_one_line(error)), 2)
        built = explain_instantiation_error(error)  # a class's own __init__ raised (user code): runtime
        if built is None:
            raise
        _fail(built, 1)
    except OSError as error:
        if error.errno not in _PATH_ERRNOS or not error.filename:
            raise
        _fail(f"cannot use '{error.filename}': {error.strerror}; check the path and its permissions", 1)
    finally:
        STOP.restore()


def exit_code(error: GRPOError) -> int:
    """2 for a usage error (GRPOConfigError), 1 for a runtime failure."""
    return 2 if isinstance(error, GRPOConfigError) else 1


def _fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def report_stop(stop: BaseException, argv: list[str]) -> int:
    """Says where a stopped run is and the exact command that resumes it; returns the exit code."""
    signum = getattr(stop, "signum", signal.SIGTERM if isinstance(stop, SIGTERMException) else signal.SIGINT)
    phase, total = getattr(stop, "grpo_phase", None), getattr(stop, "grpo_total_phases", None)
    where = f" during phase {phase} of {total}" if phase is not None else ""
    _say(f"stopped by {signal.Signals(signum).name}{where}; logs flushed", file=sys.stderr)
    last = getattr(stop, "grpo_last_checkpoint", None)
    if last:
        _say(f"the last checkpoint is {last}; resume with: {resume_command(argv, last)}", file=sys.stderr)
    else:
        _say("no phase had finished, so there is no checkpoint: run the same command to start again", file=sys.stderr)
    return 128 + signum


def resume_command(argv: list[str], checkpoint: str) -> str:
    """The command line that was run, with ``--ckpt_path`` (replaced if it was there) naming ``checkpoint``."""
    program = sys.argv[0] if os.path.basename(sys.argv[0]) == "grpo-lightning" else "grpo-lightning"
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return shlex.join([program, *kept, "--ckpt_path", str(checkpoint)])


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
