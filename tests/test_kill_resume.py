"""A run SIGKILLed at any moment and resumed with ``--ckpt_path last`` ends bit-identical (fp32, CPU) to a
run never interrupted: the same rewards and losses at every step, the same weights and optimizer state.

Real training subprocesses (tests/killable_fit.py) are killed mid-rollout, mid-learning, half-way through
a checkpoint write, between a checkpoint and the move of its last.ckpt link, and at random moments."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_lightning.checkpointing import find_last_checkpoint

DRIVER = Path(__file__).with_name("killable_fit.py")
REPO = DRIVER.parent.parent
TOTAL_PHASES = 4
STEPS_PER_PHASE = 4  # 2 minibatches x 2 passes
GEN_LEN = 6
COMPARED_TAGS = ("rollout/reward_mean", "rollout/kl_k1", "train/objective", "train/grad_norm", "train/lr")


def fit_args(model_dir: str, root: Path) -> list[str]:
    return [
        "--model.model_name_or_path", model_dir,
        "--model.reward", "rewards.CharCount", "--model.reward.char", "e",
        "--model.total_phases", str(TOTAL_PHASES), "--model.warmup_steps", "1",
        "--model.batch_size", "8", "--model.num_minibatches", "2", "--model.batches_per_learning_phase", "2",
        "--model.gen_len", str(GEN_LEN), "--model.lr", "0.01", "--model.samples_shown", "0",
        "--model.export_dir", "null",
        "--trainer.precision", "32-true", "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    ]  # fmt: skip


def start(kill_at: str, args: list[str]) -> subprocess.Popen:
    command = [sys.executable, str(DRIVER), kill_at, *args]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(kill_at: str, args: list[str]) -> tuple[int, str]:
    process = start(kill_at, args)
    output, _ = process.communicate(timeout=300)
    return process.returncode, output


def resume_args(args: list[str], root: Path) -> list[str]:
    """``--ckpt_path last`` once any phase has finished; before that, the same command from the start."""
    try:
        find_last_checkpoint(root)
    except Exception:
        return args
    return [*args, "--ckpt_path", "last"]


def logged_scalars(root: Path) -> dict[tuple[str, int], float]:
    """Every compared scalar of every run under ``root``, by (tag, step); a later run's value replaces an
    earlier one's (the phase a kill interrupted is logged again by the run that resumed it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    versions = sorted(root.glob("lightning_logs/version_*"), key=lambda p: int(p.name.split("_")[1]))
    for version in versions:
        events = EventAccumulator(str(version), size_guidance={"scalars": 0})
        events.Reload()
        for tag in set(COMPARED_TAGS) & set(events.Tags()["scalars"]):
            for event in events.Scalars(tag):
                scalars[(tag, event.step)] = event.value
    return scalars


def final_state(root: Path) -> dict:
    checkpoint = torch.load(find_last_checkpoint(root), weights_only=True)
    return {key: checkpoint[key] for key in ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "epoch")}


def assert_identical(actual, expected, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_identical(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    code, output = run("none", fit_args(tiny_model_dir, root))
    assert code == 0, output
    scalars = logged_scalars(root)
    steps = {step for tag, step in scalars if tag == "train/objective"}
    assert len(steps) == TOTAL_PHASES * STEPS_PER_PHASE  # every step logged once: the comparison covers them all
    return scalars, final_state(root)


def test_killed_at_each_kind_of_moment_and_resumed_ends_bit_identical(tiny_model_dir, tmp_path, uninterrupted):
    root = tmp_path / "runs"
    args = fit_args(tiny_model_dir, root)
    # Each process resumes where the one before it was killed; the counts are this process's events.
    kills = [
        "rollout:9",  # phase 2's third token (phase 1 ran tokens 1-6): resumes from phase 1's checkpoint
        f"learning:{STEPS_PER_PHASE + 3}",  # runs phase 2, dies at phase 3's third step: resumes from phase 2
        "write:1",  # runs phase 3, dies half-way through writing its checkpoint: resumes from phase 2 again
        "link:1",  # runs phase 3, its checkpoint whole, dies before last.ckpt moves: resumes from phase 3
    ]
    for kill_at in kills:
        code, output = run(kill_at, resume_args(args, root))
        assert code == -9, f"{kill_at} did not die by SIGKILL (exit {code}):\n{output[-3000:]}"
        find_last_checkpoint(root)  # a whole, loadable checkpoint is always there to resume from
        torch.load(find_last_checkpoint(root), weights_only=True)
    for _ in range(3):  # then resume until done
        code, output = run("none", resume_args(args, root))
        if code == 0:
            break
    assert code == 0, output[-3000:]
    assert "resuming" in output

    scalars, state = uninterrupted
    assert logged_scalars(root) == scalars
    assert_identical(final_state(root), state)


def test_a_kill_mid_write_leaves_the_previous_checkpoint_whole(tiny_model_dir, tmp_path):
    root = tmp_path / "runs"
    code, _ = run("write:2", fit_args(tiny_model_dir, root))  # the end of phase 2
    assert code == -9
    checkpoints = root / "lightning_logs" / "version_0" / "checkpoints"
    leftovers = [p.name for p in checkpoints.iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1 and leftovers[0].startswith(".epoch=1-step=8.ckpt.tmp-")  # the half-written file
    assert (checkpoints / "last.ckpt").resolve().name == "epoch=0-step=4.ckpt"
    assert find_last_checkpoint(root) == checkpoints / "last.ckpt"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == STEPS_PER_PHASE


def test_killed_at_random_moments_and_resumed_ends_bit_identical(tiny_model_dir, tmp_path, uninterrupted):
    root = tmp_path / "runs"
    args = fit_args(tiny_model_dir, root)
    chance = random.Random(20261130)
    landed, code = 0, None
    for _ in range(3):
        process = start("none", resume_args(args, root))
        # After a random one of the phase lines still to come (the imports and model loading are over),
        # a random moment of up to about a phase.
        phase_lines_to_wait = chance.randint(1, 2)
        for line in process.stdout:
            phase_lines_to_wait -= line.startswith("Phase ")
            if phase_lines_to_wait == 0:
                break
        time.sleep(chance.uniform(0.0, 0.4))
        if process.poll() is None:
            process.kill()
            landed += 1
        output = process.communicate(timeout=120)[0]
        code = process.returncode
        if code == 0:
            break
    assert landed >= 2, "the random kills all came too late: the test proves nothing"
    finished = "already run 4 of total_phases 4"  # the last kill came after the last checkpoint
    for _ in range(3):
        if code == 0 or finished in output:
            break
        code, output = run("none", resume_args(args, root))
    assert code == 0 or finished in output, output[-3000:]

    scalars, state = uninterrupted
    assert logged_scalars(root) == scalars
    assert_identical(final_state(root), state)
