"""``grpo-lightning fit --config experiments/quickstart.yaml``: LightningCLI over GRPOModule.

``grpo-lightning diagnose ...`` is a separate argparse command (``grpo_lightning.diagnostics``),
dispatched before LightningCLI is built.

Settings errors end in one line (``error: ...``) instead of a usage dump or a traceback.
"""

from __future__ import annotations

import sys

import torch
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


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX), about 2x its fp32 rate.
    Without it, bf16 autocast on a CPU is emulated and slower than fp32."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def default_precision() -> str | None:
    """bf16-mixed when training runs on a CPU with native bf16 (the rollout and every training step under
    bf16 autocast, weights, optimizer and log-softmax in fp32): 1.5-1.8x faster per phase than fp32 there, and
    learning no worse (benchmarks/results/curves_*.json). Otherwise None: Lightning's default, 32-true."""
    on_cpu = not torch.cuda.is_available() and not torch.backends.mps.is_available()
    return "bf16-mixed" if on_cpu and cpu_has_fast_bf16() else None


def trainer_defaults() -> dict:
    """Fresh per run: a callback instance keeps the state (directory, best paths) of the run it served."""
    precision = default_precision()
    return {
        **({"precision": precision} if precision else {}),
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
