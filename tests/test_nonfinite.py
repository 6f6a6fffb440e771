"""A NaN or inf loss or gradient skips that learning step (nothing applied), is counted and logged; too many
in a row stop the run with one line, its last checkpoint intact."""

from __future__ import annotations

import sys

import lightning as L
import pytest
import torch
from test_module import make_module

from grpo_lightning import cli, module

PHASE = dict(batch_size=4, num_minibatches=2, batches_per_learning_phase=1, gen_len=4)  # 2 steps a phase


class PoisonStep(torch.autograd.Function):
    """Passes the loss through unchanged, with a NaN gradient: the loss is finite, the gradient is not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def poison(monkeypatch, steps: set[int], kind: str) -> None:
    """Makes the surrogate of the given training steps (counted from 1 in this process) NaN, or its gradient."""
    original = module.calc_clipped_surrogate_objective
    calls = 0

    def surrogate(*args, **kwargs):
        nonlocal calls
        calls += 1
        value = original(*args, **kwargs)
        if calls not in steps:
            return value
        return value * float("nan") if kind == "loss" else PoisonStep.apply(value)

    monkeypatch.setattr(module, "calc_clipped_surrogate_objective", surrogate)


class WeightsPerStep(L.Callback):
    """The trainable weights and AdamW's step count before and after each training step."""

    def __init__(self):
        self.changed: list[bool] = []
        self.adam_steps: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = [p.detach().clone() for p in pl_module.policy.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        after = list(pl_module.policy.parameters())
        self.changed.append(any(not torch.equal(a, b) for a, b in zip(after, self.before)))
        state = trainer.optimizers[0].state
        self.adam_steps.append(max((float(s["step"]) for s in state.values()), default=0.0))


@pytest.mark.parametrize("kind", ["loss", "gradient"])
def test_a_nonfinite_step_applies_nothing_and_is_counted(kind, tiny_model_dir, tmp_path, monkeypatch):
    poison(monkeypatch, steps={2, 3}, kind=kind)  # phase 1's second step and phase 2's first
    watcher = WeightsPerStep()
    grpo = make_module(tiny_model_dir, kl_coef=0.0, **PHASE)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[watcher], gradient_clip_val=1.0)  # fmt: skip
    trainer.fit(grpo)
    assert watcher.changed == [True, False, False, True]
    assert watcher.adam_steps == [1.0, 1.0, 1.0, 2.0]  # AdamW never saw the skipped steps
    assert grpo.nonfinite.total == 2 and grpo.nonfinite.in_a_row == 0
    assert all(torch.isfinite(p).all() for p in grpo.policy.parameters())


def test_too_many_in_a_row_stop_with_one_line_and_the_last_checkpoint(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])
    poison(monkeypatch, steps=set(range(3, 100)), kind="loss")  # from phase 2 on: every step is NaN
    with pytest.raises(SystemExit) as exit_info:
        cli.main([
            "fit", "--model.model_name_or_path", tiny_model_dir, "--model.total_phases", "4",
            "--model.warmup_steps", "0", "--model.batch_size", "4", "--model.num_minibatches", "2",
            "--model.batches_per_learning_phase", "1", "--model.gen_len", "4", "--model.max_nonfinite_steps", "3",
            "--model.export_dir", "null", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.enable_progress_bar", "false", "--trainer.precision", "32-true",
        ])  # fmt: skip
    err = capsys.readouterr().err  # model loading's progress bars come first
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 1 and errors == [err.splitlines()[-1]] and "Traceback" not in err
    err = errors[0]
    last = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert err.startswith("error: 3 learning steps in a row had a NaN or inf loss (the last at phase 3, step 5)")
    assert err.rstrip().endswith(f"the last checkpoint, intact, is {last} (resume with --ckpt_path {last})")
    # phase 2's two skipped steps did not count as progress, but the phase ended and was checkpointed
    assert torch.load(last, weights_only=True)["nonfinite_steps"] == {"total": 2, "in_a_row": 2}


def test_the_limit_must_be_positive(tiny_model_dir):
    with pytest.raises(module.GRPOConfigError, match=r"max_nonfinite_steps \(0\) must be at least 1"):
        make_module(tiny_model_dir, max_nonfinite_steps=0)
