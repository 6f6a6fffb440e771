"""Ctrl-C and SIGTERM: the run stops at the next safe point, keeps its last checkpoint, flushes its logs,
prints the exact command that resumes it and exits 128 + the signal; a second signal stops it at once."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_lightning.cli import resume_command
from grpo_lightning.interrupt import StopRequested, StopSignals

REPO = Path(__file__).resolve().parent.parent


def fit_command(model_dir: str, root: Path, phases: int = 6) -> list[str]:
    return [
        sys.executable, "-m", "grpo_lightning", "fit", "--model.model_name_or_path", model_dir,
        "--model.total_phases", str(phases), "--model.warmup_steps", "0", "--model.batch_size", "16",
        "--model.num_minibatches", "2", "--model.gen_len", "24", "--model.samples_shown", "0",
        "--model.export_dir", "null", "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    ]  # fmt: skip


def start_and_wait_for_phase(command: list[str], phase: int) -> subprocess.Popen:
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if line.startswith(f"Phase {phase:03d}/"):
            return process
    raise AssertionError(f"the run ended before phase {phase}: {process.stderr.read()[-3000:]}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_cleanly_and_says_how_to_resume(signum, tiny_model_dir, tmp_path):
    root = tmp_path / "runs"
    process = start_and_wait_for_phase(fit_command(tiny_model_dir, root), phase=2)
    sent = time.monotonic()
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    stopped_in = time.monotonic() - sent
    assert process.returncode == 128 + signum, err[-3000:]
    assert stopped_in < 30  # one training step of the tiny model, then teardown
    assert "Traceback" not in err
    name = signal.Signals(signum).name
    assert f"{name} received: stopping after the current step" in err
    assert f"stopped by {name} during phase " in err and "; logs flushed" in err

    resume_line = next(line for line in err.splitlines() if "resume with: " in line)
    checkpoint = resume_line.split("the last checkpoint is ")[1].split(";")[0]
    assert checkpoint.endswith("checkpoints/last.ckpt") and Path(checkpoint).resolve().is_file()
    command = shlex.split(resume_line.split("resume with: ")[1])
    assert command[0] == "grpo-lightning" and command[-2:] == ["--ckpt_path", checkpoint]
    assert command[1:-2] == fit_command(tiny_model_dir, root)[3:]  # the same arguments, as typed

    # The logs of the finished phases are on disk.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "lightning_logs" / "version_0"))
    events.Reload()
    assert len(events.Scalars("rollout/reward_mean")) >= 1

    # And the printed command resumes it (run here through python -m, the same entry point).
    resumed = subprocess.run([sys.executable, "-m", "grpo_lightning", *command[1:]], cwd=REPO, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming {checkpoint}: " in resumed.stdout and "Phase 006/006" in resumed.stdout


def test_a_second_signal_stops_at_once(tiny_model_dir, tmp_path):
    process = start_and_wait_for_phase(fit_command(tiny_model_dir, tmp_path / "runs", phases=50), phase=2)
    process.send_signal(signal.SIGINT)
    for line in process.stderr:  # the first one was seen (two at once would be one for Python)
        if "SIGINT received" in line:
            break
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    process.communicate(timeout=120)
    # Lightning's immediate exit (1), or ours (130) if the clean stop was already under way; never a success.
    assert process.returncode in (1, 130) and time.monotonic() - sent < 30


def test_the_first_signal_only_asks_and_the_check_raises(monkeypatch):
    stop = StopSignals()
    stop.install()
    try:
        stop.check()  # nothing pending
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(StopRequested) as raised:
            stop.check()
        assert raised.value.exit_code == 143 and str(raised.value) == "stopped by SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # the second signal
        assert stop._watchdog is not None and stop._watchdog.is_alive()
        watchdog = stop._watchdog
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    watchdog.join(timeout=5)  # called off by restore(): this process (pytest) goes on
    assert not watchdog.is_alive() and stop._watchdog is None


def test_the_resume_command_replaces_an_earlier_ckpt_path(monkeypatch):
    monkeypatch.setattr(sys, "argv", [".venv/bin/grpo-lightning"])
    argv = ["fit", "--config", "my run.yaml", "--ckpt_path", "old.ckpt", "--ckpt_path=older.ckpt", "--model.lr", "1e-4"]
    assert resume_command(argv, "runs/v1/last.ckpt") == (
        ".venv/bin/grpo-lightning fit --config 'my run.yaml' --model.lr 1e-4 --ckpt_path runs/v1/last.ckpt"
    )


STUCK_SHUTDOWN = """
import signal, time
import grpo_lightning.interrupt as interrupt
interrupt.SECOND_SIGNAL_GRACE_S = 1.0
interrupt.STOP.install()
signal.raise_signal(signal.SIGINT)  # the first: a flag only
print("asked", flush=True)
try:
    signal.raise_signal(signal.SIGINT)  # the second: KeyboardInterrupt, and the watchdog starts
except KeyboardInterrupt:
    print("interrupted", flush=True)
    time.sleep(60)  # a shutdown that hangs, as a logger's flush can
print("never reached", flush=True)
"""


def test_a_stuck_shutdown_after_the_second_signal_is_ended_by_the_watchdog():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", STUCK_SHUTDOWN], cwd=REPO, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert done.stdout.split() == ["asked", "interrupted"], done.stderr[-2000:]
    assert done.returncode == 130 and took < 30  # 1 s of grace, not the 60 s sleep
    assert "the shutdown after the second signal took more than 1 s; exiting now" in done.stderr


def test_the_watchdog_leaves_a_process_that_exits_in_time_alone():
    code = "import grpo_lightning.interrupt as i; i.exit_if_still_running(30, 130); print('done')"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "done\n", "")
