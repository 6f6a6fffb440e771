"""On a CUDA GPU: the default precision, tiny fits from the command line (full and LoRA) and a resume.

Skipped where no GPU is seen, as in CI; they run wherever one is (README, "Precision per machine",
says where they last ran). The phases are spied on, so a run that silently stayed on the CPU fails.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lightning import cli
from grpo_lightning.module import GRPOModule

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("plain_argv"),
]


def tiny_fit(model_dir, root, *extra):
    return [
        "fit", "--model.model_name_or_path", model_dir, "--model.total_phases", "2", "--model.warmup_steps", "0",
        "--model.batch_size", "8", "--model.num_minibatches", "2", "--model.gen_len", "6",
        "--model.reward", "rewards.CharCount", "--model.reward.char", " ",
        "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false", *extra,
    ]  # fmt: skip


@pytest.fixture
def seen(monkeypatch):
    """Records, per rollout and per learning step, the module's device and whether CUDA autocast was on."""
    record = {"rollout": [], "step": []}
    rollout, step = GRPOModule.on_train_epoch_start, GRPOModule.training_step

    def spied_rollout(self):
        record["rollout"].append(self.device.type)
        return rollout(self)

    def spied_step(self, *args, **kwargs):
        loss = step(self, *args, **kwargs)
        record["step"].append((self.device.type, torch.is_autocast_enabled("cuda"), loss.device.type))
        return loss

    monkeypatch.setattr(GRPOModule, "on_train_epoch_start", spied_rollout)
    monkeypatch.setattr(GRPOModule, "training_step", spied_step)
    return record


def test_the_default_on_a_gpu_is_bf16_mixed_where_it_computes_bf16_and_the_fit_runs_there(
    tiny_model_dir, tmp_path, capsys, seen
):
    bf16 = torch.cuda.is_bf16_supported()
    expected = "bf16-mixed" if bf16 else "32-true"
    cli.main(tiny_fit(tiny_model_dir, tmp_path))
    out, err = capsys.readouterr()
    assert out.startswith(f"precision {expected}: ")
    assert "warning: precision" not in err
    assert "Phase 002/002, Mean reward:" in out
    assert seen["rollout"] == ["cuda", "cuda"]
    assert seen["step"] == [("cuda", bf16, "cuda")] * 8  # 2 phases x 2 minibatches x 2 passes
    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert (run_dir / "checkpoints" / "last.ckpt").exists() and (run_dir / "hf_model" / "config.json").exists()


def test_an_explicit_fp32_on_a_gpu_is_kept_silently(tiny_model_dir, tmp_path, capsys, seen):
    cli.main(tiny_fit(tiny_model_dir, tmp_path, "--trainer.precision", "32-true"))
    out, err = capsys.readouterr()
    assert not out.startswith("precision ") and "warning: precision" not in err
    assert seen["step"] == [("cuda", False, "cuda")] * 8


def test_lora_trains_on_the_gpu_and_resumes_there(tiny_model_dir, tmp_path, capsys, seen):
    cli.main(tiny_fit(tiny_model_dir, tmp_path, "--model.lora", "true"))
    cli.main(["fit", "--ckpt_path", "last", "--model.total_phases", "3", "--trainer.default_root_dir", str(tmp_path),
              "--trainer.enable_progress_bar", "false"])  # fmt: skip
    out = capsys.readouterr().out
    assert "2 of 3 phases done" in out and "Phase 003/003" in out and "Phase 002/003" not in out
    assert seen["rollout"] == ["cuda"] * 3
    final = torch.load(tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["global_step"] == 3 * 2 * 2
    assert all("lora_" in name for name in final["state_dict"])  # the adapters alone are trained and kept
