"""Two processes (Lightning's DDP on the CPU, gloo) against one, on the tiny model in fp32.

A phase draws 4 prompts (groups of 4 completions); each of 2 ranks rolls out 2 whole groups and takes 4
steps (2 minibatches of 4 sequences, 2 passes). tests/ddp_fit.py records what each rank sampled, how it
shuffled its minibatches, the gradient of every step and its weights after every phase. What must hold:

- Both ranks step with the same gradient (DDP's all-reduce leaves one tensor on both) and so hold the
  same weights after every phase, bit for bit.
- A step of 2 processes is a step of one process over the union of their minibatches: the default loss
  ("grpo") is a mean over sequences, so the union's loss is the mean of the ranks' losses (equal minibatch
  sizes), and its gradient the mean of their gradients, which is what DDP applies. So one process, fed the
  same samples (the ranks' groups in rank order) and at step k the union of the ranks' k-th minibatches,
  computes the same first gradient up to float rounding (summation order): relative error < 1e-6.
  After that AdamW amplifies rounding where it divides a nearly cancelled gradient element (|g| near its
  eps, 1e-8) by its own RMS: such an element's step can differ by a few per cent of lr. Measured over 4
  seeds: weights within 0.7 % of lr after 2 phases (gradients within 1e-4, relative); allowed: 2 % of lr
  (each phase moves weights by up to 4 lr), and 1e-3 for the later gradients. A sum instead of a mean
  (2x), a group split across ranks, or misaligned minibatches fail the first-gradient check at once.
- The logged phase metrics are the whole phase's (every rank's samples); the console prints once; the
  model is exported once; a DDP run cut after phase 1 and resumed with --ckpt_path last ends with the
  same weights and optimizer state, bit for bit, as the run never cut.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import repo_first_on_path

from grpo_lightning import GRPOModule, cli, load_causal_lm, memory, policy_models, rollout_phase
from grpo_lightning.checkpointing import find_last_checkpoint
from grpo_lightning.prompts import PromptFile
from grpo_lightning.rollout import Group
from rewards import CharCount

DRIVER = Path(__file__).with_name("ddp_fit.py")
REPO = DRIVER.parent.parent
RANKS = 2
PHASES = 2
STEPS_PER_PHASE = 4  # 2 minibatches x 2 passes
LR = 0.01
PROMPTS = ["This is", "The cat sat on the mat and", "Dr. Smith went", "I thought"]  # 3 lengths: padded batches
SETTINGS = dict(
    reward=CharCount("e"), prompts_per_phase=4, batch_size=4, num_minibatches=2, batches_per_learning_phase=2,
    gen_len=6, lr=LR, total_phases=PHASES, warmup_steps=0, samples_shown=2, seed=1,
)  # fmt: skip


def fit_args(model_dir: str, prompts: Path, root: Path, **overrides) -> list[str]:
    settings = {**SETTINGS, **overrides}
    return [
        "fit", "--model.model_name_or_path", model_dir,
        "--model.reward", "rewards.CharCount", "--model.reward.char", "e",
        "--model.prompts", "grpo_lightning.prompts.PromptFile", "--model.prompts.path", str(prompts),
        *[arg for name in ("prompts_per_phase", "batch_size", "num_minibatches", "batches_per_learning_phase",
                           "gen_len", "lr", "total_phases", "warmup_steps", "samples_shown", "seed")
          for arg in (f"--model.{name}", str(settings[name]))],
        "--model.eval_prompts", "grpo_lightning.prompts.PromptFile", "--model.eval_prompts.path", str(prompts),
        "--model.eval_every_n_phases", str(PHASES),  # before phase 1 and after the last
        "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.devices", str(RANKS),
        "--trainer.precision", "32-true", "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    ]  # fmt: skip


def run_ddp(args: list[str], record: Path) -> str:
    """Runs the 2-process fit through tests/ddp_fit.py, which must succeed; returns its output."""
    environment = {**os.environ, "GRPO_RECORD": str(record), "PYTHONPATH": repo_first_on_path()}
    done = subprocess.run([sys.executable, str(DRIVER), *args], cwd=REPO, env=environment, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in output, output[-3000:]
    return output


@pytest.fixture(scope="module")
def ddp_run(tiny_model_dir, tmp_path_factory):
    """One uninterrupted 2-process run: (its directory, its record directory, its output, the prompt file)."""
    root = tmp_path_factory.mktemp("ddp")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in PROMPTS))
    output = run_ddp(fit_args(tiny_model_dir, prompts, root / "runs"), root / "record")
    return root / "runs", root / "record", output, prompts


def load(record: Path, name: str):
    return torch.load(record / f"{name}.pt", weights_only=True)


def recorded_groups(record: Path, phase: int, rank: int) -> list[Group]:
    return [Group(**fields) for fields in load(record, f"groups-p{phase}-r{rank}")]


def relative_error(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all tensors of two gradients."""
    difference = sum(((a[name] - b[name]) ** 2).sum() for name in b).sqrt()
    return float(difference / sum((value**2).sum() for value in b.values()).sqrt())


# ---- the 2-process run itself ------------------------------------------------------------------------


def test_each_rank_rolls_out_its_share_of_whole_groups_and_both_step_alike(ddp_run):
    _, record, _, prompts = ddp_run
    source = PromptFile(str(prompts))
    for phase in range(PHASES):
        drawn = source.draw(SETTINGS["seed"], phase, SETTINGS["prompts_per_phase"])
        for rank in range(RANKS):
            groups = recorded_groups(record, phase, rank)
            assert [group.row for group in groups] == drawn[rank::RANKS]  # rows 0, 2 and 1, 3: whole groups
            assert all(group.sample_ids.shape[0] == SETTINGS["batch_size"] for group in groups)
        first, second = load(record, f"weights-p{phase}-r0"), load(record, f"weights-p{phase}-r1")
        assert all(torch.equal(first[name], second[name]) for name in first), f"phase {phase}"
    for rank in range(RANKS):  # the same number of steps on each rank, every phase
        assert len(list(record.glob(f"grads-s*-r{rank}.pt"))) == PHASES * STEPS_PER_PHASE
    for step in range(PHASES * STEPS_PER_PHASE):
        first, second = load(record, f"grads-s{step}-r0"), load(record, f"grads-s{step}-r1")
        assert first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)


def test_logged_metrics_cover_every_rank_and_the_run_reports_and_exports_once(ddp_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, record, output, _ = ddp_run
    events = EventAccumulator(str(root / "lightning_logs/version_0"), size_guidance={"scalars": 0})
    events.Reload()
    logged = {tag: [event.value for event in events.Scalars(tag)]
              for tag in ("rollout/reward_mean", "rollout/reward_max", "eval/prompts")}  # fmt: skip
    for phase in range(PHASES):
        samples = [group.row["prompt"] + text for rank in range(RANKS)
                   for group in recorded_groups(record, phase, rank) for text in group.completions]  # fmt: skip
        counts = [sample.count("e") for sample in samples]  # the reward, CharCount("e"), by hand
        assert len(samples) == 16
        assert logged["rollout/reward_mean"][phase] == pytest.approx(sum(counts) / 16, abs=1e-6)
        assert logged["rollout/reward_max"][phase] == max(counts)
    # Held-out prompts (the 4 training prompts here) are evaluated once in all, their batches shared by the ranks.
    assert logged["eval/prompts"] == [len(PROMPTS)] * 2  # before training and after phase 2
    assert output.count("Held-out before training") == output.count("Held-out after phase 2/2") == 1
    assert output.count("Phase 001/002") == output.count("Phase 002/002") == 1
    assert output.count("Saved the trained policy") == 1
    assert (root / "lightning_logs/version_0/hf_model/config.json").exists()


# ---- against one process ---------------------------------------------------------------------------


def replay_union(monkeypatch, record: Path, model_dir: str, prompts: Path) -> tuple[list[dict], list[dict]]:
    """One process, fed the ranks' samples in rank order and, at step k, the union of their k-th minibatches
    (each rank's own shuffle, replayed on its part of the memory); returns (gradient per step, weights per phase)."""

    def ranks_groups(grpo, rows):
        return [group for rank in range(RANKS) for group in recorded_groups(record, grpo.current_epoch, rank)]

    monkeypatch.setattr(rollout_phase, "sample_groups", ranks_groups)
    own_minibatches = memory.ReplayMemory.get_minibatches
    phase = {"now": 0}

    def union_minibatches(self, generator=None):
        share = self.args.batch_size // RANKS
        per_rank = []
        for rank in range(RANKS):
            part = slice(rank * share, (rank + 1) * share)
            tensors = {name: None if value is None else value[part] for name, value in vars(self).items()
                       if name not in ("args",)}  # fmt: skip
            rank_memory = memory.ReplayMemory(dataclasses.replace(self.args, batch_size=share), **tensors)
            shuffle = torch.Generator()
            shuffle.set_state(load(record, f"shuffle-p{phase['now']}-r{rank}"))
            per_rank.append(own_minibatches(rank_memory, shuffle))
        return [
            memory.ReplayMinibatch(**{field.name: None if getattr(parts[0], field.name) is None
                                      else torch.cat([getattr(part, field.name) for part in parts])
                                      for field in dataclasses.fields(memory.ReplayMinibatch)})
            for parts in zip(*per_rank)
        ]  # fmt: skip

    monkeypatch.setattr(memory.ReplayMemory, "get_minibatches", union_minibatches)

    class Record(L.Callback):
        def __init__(self):
            self.gradients, self.weights = [], []

        def on_before_optimizer_step(self, trainer, grpo, optimizer):
            self.gradients.append({n: p.grad.clone() for n, p in grpo.policy.named_parameters() if p.grad is not None})

        def on_train_epoch_end(self, trainer, grpo):
            self.weights.append({name: value.clone() for name, value in grpo.policy.state_dict().items()})
            phase["now"] += 1

    recorded = Record()
    grpo = GRPOModule(model_name_or_path=model_dir, prompts=PromptFile(str(prompts)), export_dir=None, **SETTINGS)
    trainer = L.Trainer(max_epochs=PHASES, accelerator="cpu", devices=1, precision="32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[recorded])  # fmt: skip
    trainer.fit(grpo)
    return recorded.gradients, recorded.weights


def test_two_processes_step_as_one_process_over_the_union_of_their_minibatches(ddp_run, tiny_model_dir, monkeypatch):
    root, record, _, prompts = ddp_run
    gradients, weights = replay_union(monkeypatch, record, tiny_model_dir, prompts)
    assert len(gradients) == PHASES * STEPS_PER_PHASE
    assert relative_error(load(record, "grads-s0-r0"), gradients[0]) < 1e-6  # same weights, same samples: rounding
    for step, gradient in enumerate(gradients):
        assert relative_error(load(record, f"grads-s{step}-r0"), gradient) < 1e-3, f"step {step}"
    start = load_causal_lm(tiny_model_dir).state_dict()
    for phase in range(PHASES):
        ddp = load(record, f"weights-p{phase}-r0")
        assert max((ddp[name] - weights[phase][name]).abs().max().item() for name in ddp) < 0.02 * LR, f"phase {phase}"
    moved = max((load(record, "weights-p0-r0")[name] - start[name]).abs().max().item() for name in start)
    assert moved > 2 * LR  # the phase did train: the tolerance is a small fraction of how far it moved


def test_a_ddp_run_cut_after_a_phase_resumes_exactly(ddp_run, tiny_model_dir, tmp_path):
    whole_root, _, _, prompts = ddp_run
    args = fit_args(tiny_model_dir, prompts, tmp_path / "runs")
    run_ddp([*args, "--trainer.max_steps", str(STEPS_PER_PHASE)], tmp_path / "cut")
    output = run_ddp([*args, "--ckpt_path", "last"], tmp_path / "resumed")
    assert output.count("resuming") == 1 and "Phase 001/002" not in output and output.count("Phase 002/002") == 1
    whole = torch.load(find_last_checkpoint(whole_root), weights_only=True)
    resumed = torch.load(find_last_checkpoint(tmp_path / "runs"), weights_only=True)
    assert whole["global_step"] == resumed["global_step"] == PHASES * STEPS_PER_PHASE
    assert whole["state_dict"].keys() == resumed["state_dict"].keys()
    for name, value in whole["state_dict"].items():
        assert torch.equal(resumed["state_dict"][name], value), name
    for name, value in whole["optimizer_states"][0]["state"].items():
        assert all(torch.equal(resumed["optimizer_states"][0]["state"][name][k], v) for k, v in value.items())


# ---- a token mean over ranks ---------------------------------------------------------------------------


def test_a_token_mean_over_ranks_weighs_every_token_of_the_union_alike():
    """DAPO's sum / tokens, with answers that end: two ranks hold 10 and 3 tokens. Each divides by all 13 / 2,
    so that DDP's mean of their gradients weighs every token 1/13, as one process over the union does; each
    dividing by its own count would weigh rank 0's tokens 1/20 and rank 1's 1/6."""
    from types import SimpleNamespace

    from grpo_lightning.distributed import token_mean_denominator
    from grpo_lightning.losses import aggregate

    values = torch.randn(4, 5, generator=torch.Generator().manual_seed(0)).requires_grad_()
    mask = torch.tensor([[1] * 5, [1] * 5, [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    ranks = [slice(0, 2), slice(2, 4)]
    reduced = []

    def reduce(count, reduce_op):  # the sum over both ranks of their token counts: 10 + 3
        reduced.append((float(count), reduce_op))
        return torch.tensor(13.0)

    trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(reduce=reduce))

    def ddp_gradient(denominators) -> torch.Tensor:
        losses = [aggregate(values[r], mask[r], "token_mean", tokens=d) for r, d in zip(ranks, denominators)]
        return torch.autograd.grad(sum(losses) / 2, values)[0]  # DDP: the mean of the ranks' gradients

    shared = ddp_gradient([token_mean_denominator(mask[r], trainer) for r in ranks])
    assert reduced == [(10.0, "sum"), (3.0, "sum")]  # each rank's own count goes into the sum over ranks
    assert torch.allclose(shared, mask / 13.0, rtol=1e-6, atol=0)
    assert torch.allclose(torch.autograd.grad(aggregate(values, mask, "token_mean"), values)[0], mask / 13.0)
    own = ddp_gradient([None, None])
    assert torch.allclose(own[:2], mask[:2] / 20.0) and torch.allclose(own[2:], mask[2:] / 6.0)
    assert token_mean_denominator(mask, SimpleNamespace(world_size=1)) is None  # one process: its own count


# ---- refused in one line -------------------------------------------------------------------------------


def error_line(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, the one stderr line) of a command line that must stop with one ``error:`` line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return exit_info.value.code, err.strip()[len("error: ") :]


@pytest.fixture
def no_weights(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])  # LightningCLI warns about pytest's own arguments

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded although the inputs are invalid")

    monkeypatch.setattr(policy_models, "load_causal_lm", refuse)


def test_a_phase_that_does_not_split_over_the_processes_is_one_line(tiny_model_dir, tmp_path, no_weights, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in PROMPTS))
    code, message = error_line(fit_args(tiny_model_dir, prompts, tmp_path / "runs", prompts_per_phase=3), capsys)
    assert code == 2 and message == (
        "prompts_per_phase (3) must be divisible by the number of processes (2: trainer.devices x "
        "trainer.num_nodes): each process rolls out the same number of whole groups, so that all take the same "
        "number of steps"
    )
    assert not (tmp_path / "runs").exists()  # refused before the trainer, and before any other process started


def test_fsdp_on_a_cpu_is_one_line(tiny_model_dir, tmp_path, no_weights, capsys):
    argv = ["fit", "--model.model_name_or_path", tiny_model_dir, "--trainer.accelerator", "cpu", "--trainer.strategy",
            "fsdp", "--trainer.devices", "2", "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    code, message = error_line(argv, capsys)
    assert code == 2 and message == (
        "trainer.strategy fsdp needs CUDA GPUs: Lightning refuses it on the CPU (The strategy `fsdp` requires a "
        "GPU accelerator, but received `accelerator='cpu'`); on CPUs use --trainer.strategy ddp, on GPUs "
        "--trainer.accelerator gpu"
    )
