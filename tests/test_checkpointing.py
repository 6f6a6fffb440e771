"""Checkpoint files: atomic writes, a full disk, the last.ckpt link, ``--ckpt_path last`` and safe loading."""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from grpo_lightning import checkpointing
from grpo_lightning.checkpointing import (
    AtomicCheckpointIO,
    CheckpointError,
    find_last_checkpoint,
    link_atomically,
    load_checkpoint_file,
)


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "epoch=0-step=4.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 4, "w": torch.arange(3.0)}, path)
    io.save_checkpoint({"global_step": 8, "w": torch.arange(4.0)}, path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    loaded = io.load_checkpoint(path)
    assert loaded["global_step"] == 8 and torch.equal(loaded["w"], torch.arange(4.0))


def test_a_full_disk_leaves_the_previous_file_intact_and_says_so_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 4}, path)
    before = path.read_bytes()

    def disk_full(obj, file):
        file.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpointing.torch, "save", disk_full)
    with pytest.raises(CheckpointError) as error:
        io.save_checkpoint({"global_step": 8}, path)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"could not write checkpoint {path}: No space left on device (free some space")
    assert message.endswith(f"the checkpoints already in {tmp_path} are intact")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the partial temporary is gone


def test_leftovers_of_a_killed_write_are_removed_by_the_next_write(tmp_path):
    leftover = tmp_path / ".epoch=1-step=8.ckpt.tmp-12345"
    leftover.write_bytes(b"half a checkpoint")
    AtomicCheckpointIO().save_checkpoint({"global_step": 8}, tmp_path / "epoch=1-step=8.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1-step=8.ckpt"]


def test_the_link_moves_in_one_step(tmp_path):
    for name in ("epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"):
        (tmp_path / name).write_bytes(name.encode())
    link = tmp_path / "last.ckpt"
    link_atomically(tmp_path / "epoch=0-step=4.ckpt", link)
    assert os.readlink(link) == "epoch=0-step=4.ckpt"  # relative: the run directory can be moved
    link_atomically(tmp_path / "epoch=1-step=8.ckpt", link)
    assert os.readlink(link) == "epoch=1-step=8.ckpt" and link.read_bytes() == b"epoch=1-step=8.ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]


def _queue_phase_end(io: AtomicCheckpointIO, checkpoint: dict, new: Path, old: Path, link: Path) -> None:
    """What PhaseCheckpoint does at the end of a phase: the new file, then the link to it, then the old file's
    deletion, all in the background."""
    io.in_background = True
    io.save_checkpoint(checkpoint, new)
    io.after_writes(functools.partial(link_atomically, new, link))
    io.after_writes(old.unlink)
    io.in_background = False


def test_a_background_save_returns_at_once_and_the_link_and_deletion_follow_it(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    old, new, link = tmp_path / "epoch=0-step=4.ckpt", tmp_path / "epoch=1-step=8.ckpt", tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 4}, old)
    link_atomically(old, link)
    release, writers, real_save = threading.Event(), [], torch.save

    def held_save(obj, file, *args, **kwargs):
        writers.append(threading.current_thread().name)
        assert release.wait(30)
        return real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(checkpointing.torch, "save", held_save)
    checkpoint = {"global_step": 8, "w": torch.arange(3.0), "loops": {"epoch": 1}}
    _queue_phase_end(io, checkpoint, new, old, link)
    checkpoint["loops"]["epoch"] = 99  # Lightning's bookkeeping moving on after the save: not in the file
    # The write is held: none of the three has happened, and the previous checkpoint is still the last one.
    assert not new.exists() and old.exists() and os.readlink(link) == old.name
    release.set()
    io.wait_for_writes()
    assert writers == ["checkpoint-writer_0"]
    assert os.readlink(link) == new.name and not old.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [new.name, "last.ckpt"]
    loaded = torch.load(link, weights_only=True)
    assert loaded["global_step"] == 8 and loaded["loops"] == {"epoch": 1} and torch.equal(loaded["w"], torch.arange(3.0))
    io.teardown()


def test_a_failed_background_write_moves_no_link_deletes_nothing_and_is_raised_once(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    old, new, link = tmp_path / "epoch=0-step=4.ckpt", tmp_path / "epoch=1-step=8.ckpt", tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 4}, old)
    link_atomically(old, link)

    def disk_full(obj, file, *args, **kwargs):
        file.write(b"the start of a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpointing.torch, "save", disk_full)
    _queue_phase_end(io, {"global_step": 8}, new, old, link)
    with pytest.raises(CheckpointError, match=f"^could not write checkpoint {new}: No space left on device"):
        io.wait_for_writes()
    io.wait_for_writes()  # said once
    assert os.readlink(link) == old.name and torch.load(link, weights_only=True)["global_step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name, "last.ckpt"]  # no partial file, nothing deleted
    monkeypatch.undo()
    io.save_checkpoint({"global_step": 12}, tmp_path / "epoch=2-step=12.ckpt")  # the writer carries on after a failure
    assert torch.load(tmp_path / "epoch=2-step=12.ckpt", weights_only=True)["global_step"] == 12
    io.teardown()


def test_each_phase_checkpoint_is_written_while_the_next_rollout_runs_and_whole_before_it_learns(
    tiny_model_dir, tmp_path, monkeypatch
):
    import sys

    from grpo_lightning import cli
    from grpo_lightning.module import GRPOModule

    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])
    events: list[tuple[str, int, str]] = []  # (what, phase or step, thread), in the order they happened
    real_write, real_rollout, real_step = checkpointing.write_atomically, GRPOModule.on_train_epoch_start, GRPOModule.training_step

    def slow_write(path, write):
        time.sleep(1.0)  # a write that outlasts the start of the next rollout (milliseconds after the save)
        real_write(path, write)
        if path.suffix == ".ckpt":
            events.append(("written", torch.load(path, weights_only=True)["global_step"], threading.current_thread().name))

    def rollout(self):
        events.append(("rollout", self.current_epoch, threading.current_thread().name))
        return real_rollout(self)

    checks = []

    def step(self, minibatch, batch_idx):
        if batch_idx == 0 and self.current_epoch > 0:  # no optimizer step yet in this phase
            saved = torch.load(Path(self.trainer.checkpoint_callback.dirpath) / "last.ckpt", weights_only=True)
            live = self.state_dict()
            checks.append(saved["global_step"] == self.global_step
                          and all(torch.equal(value, live[key]) for key, value in saved["state_dict"].items()))
        return real_step(self, minibatch, batch_idx)

    monkeypatch.setattr(checkpointing, "write_atomically", slow_write)
    monkeypatch.setattr(GRPOModule, "on_train_epoch_start", rollout)
    monkeypatch.setattr(GRPOModule, "training_step", step)
    cli.main([
        "fit", "--model.model_name_or_path", tiny_model_dir, "--model.total_phases", "3", "--model.warmup_steps", "0",
        "--model.batch_size", "4", "--model.num_minibatches", "2", "--model.gen_len", "4", "--model.lr", "0.01",
        "--model.export_dir", "null", "--trainer.default_root_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false", "--trainer.precision", "32-true",
    ])  # fmt: skip
    main = threading.current_thread().name
    assert [what for what, _, _ in events] == ["rollout", "rollout", "written", "rollout", "written", "written"]
    assert [(n, thread) for what, n, thread in events if what == "rollout"] == [(0, main), (1, main), (2, main)]
    assert [(n, thread) for what, n, thread in events if what == "written"] == [
        (4, "checkpoint-writer_0"), (8, "checkpoint-writer_0"), (12, "checkpoint-writer_0")]  # 2 x 2 steps a phase
    assert checks == [True, True]  # the checkpoint on disk held the weights the phase was about to change


def _checkpoint(path: Path, step: int, age_s: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step}, path)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_last_is_the_newest_whole_checkpoint_of_any_run(tmp_path):
    runs = tmp_path / "lightning_logs"
    old = _checkpoint(runs / "version_0" / "checkpoints" / "epoch=4-step=20.ckpt", 20, age_s=100)
    os.symlink(old.name, old.parent / "last.ckpt")
    newer = _checkpoint(runs / "version_1" / "checkpoints" / "epoch=6-step=28.ckpt", 28, age_s=10)
    os.symlink(newer.name, newer.parent / "last.ckpt")
    assert find_last_checkpoint(tmp_path) == newer.parent / "last.ckpt"

    # A run killed before moving its link: a dangling last.ckpt does not count, its newest file does.
    newest = _checkpoint(runs / "version_2" / "checkpoints" / "epoch=7-step=32.ckpt", 32, age_s=1)
    os.symlink("epoch=6-step=28.ckpt", newest.parent / "last.ckpt")  # dangling in version_2
    assert find_last_checkpoint(tmp_path) == newest


def test_last_without_any_checkpoint_is_one_line(tmp_path):
    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"^--ckpt_path last: no checkpoint under .*; start without --ckpt_path"):
        find_last_checkpoint(tmp_path)


def test_loading_refuses_what_is_not_a_whole_plain_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"^no checkpoint at .*nope\.ckpt: pass an existing \.ckpt file"):
        load_checkpoint_file(tmp_path / "nope.ckpt")
    with pytest.raises(CheckpointError, match=r"is a directory"):
        load_checkpoint_file(tmp_path)

    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": {"w": torch.randn(64, 64)}}, whole)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"truncated\.ckpt is truncated or not a checkpoint"):
        load_checkpoint_file(truncated)

    pickled = tmp_path / "pickled.ckpt"
    torch.save({"callback": Path("/x")}, pickled)  # an arbitrary Python object: weights_only refuses it
    with pytest.raises(CheckpointError, match=r"holds Python objects that safe loading refuses"):
        load_checkpoint_file(pickled)


def test_the_reader_is_weights_only_whatever_lightning_asks(tmp_path):
    pickled = tmp_path / "pickled.ckpt"
    torch.save({"callback": Path("/x")}, pickled)
    with pytest.raises(CheckpointError):
        AtomicCheckpointIO().load_checkpoint(pickled, weights_only=False)


def test_load_from_checkpoint_is_weights_only_by_default(tmp_path):
    import pickle

    from grpo_lightning.module import GRPOModule

    path = tmp_path / "foreign.ckpt"
    torch.save({"hyper_parameters": {}, "state_dict": {}, "callback": Path("/x")}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        GRPOModule.load_from_checkpoint(path)


def fill_the_disk_from_the_second_save(monkeypatch, write_s: float = 0.0) -> None:
    """From the second checkpoint on, each write takes ``write_s``, writes a few bytes, then finds the disk full."""
    saves, real_save = 0, torch.save

    def full_from_the_second_phase(obj, file, *args, **kwargs):
        nonlocal saves
        saves += 1
        if saves >= 2:
            time.sleep(write_s)
            file.write(b"the start of a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(checkpointing.torch, "save", full_from_the_second_phase)


def fit_three_phases_expecting_an_exit(tiny_model_dir, tmp_path, monkeypatch) -> int:
    """A 3-phase run of the tiny model through the command line, which must exit; returns its exit code."""
    import sys

    from grpo_lightning import cli

    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main([
            "fit", "--model.model_name_or_path", tiny_model_dir, "--model.total_phases", "3", "--model.warmup_steps", "0",
            "--model.batch_size", "4", "--model.num_minibatches", "2", "--model.gen_len", "4",
            "--model.export_dir", "null", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.enable_progress_bar", "false",
        ])  # fmt: skip
    return exit_info.value.code


def test_a_full_disk_mid_run_stops_with_one_line_and_keeps_the_last_checkpoint(tiny_model_dir, tmp_path, monkeypatch, capsys):
    fill_the_disk_from_the_second_save(monkeypatch)
    code = fit_three_phases_expecting_an_exit(tiny_model_dir, tmp_path, monkeypatch)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert code == 1 and errors == [err.splitlines()[-1]] and "Traceback" not in err
    assert errors[0].startswith(f"error: could not write checkpoint {checkpoints / 'epoch=1-step=8.ckpt'}: No space left on device")
    assert errors[0].endswith(f"the last checkpoint, intact, is {checkpoints / 'last.ckpt'} (resume with --ckpt_path {checkpoints / 'last.ckpt'})")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]  # no partial file
    monkeypatch.undo()
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 4


def test_a_stop_while_the_background_write_fails_names_the_checkpoint_before_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import signal

    from grpo_lightning.module import GRPOModule

    real_rollout = GRPOModule.on_train_epoch_start

    def rollout(self):
        if self.current_epoch == 2:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C: the rollout's first safe point stops the run
        return real_rollout(self)

    fill_the_disk_from_the_second_save(monkeypatch, write_s=1.0)  # still being written when phase 3 asks to stop
    monkeypatch.setattr(GRPOModule, "on_train_epoch_start", rollout)
    code = fit_three_phases_expecting_an_exit(tiny_model_dir, tmp_path, monkeypatch)
    err = capsys.readouterr().err
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert code == 128 + signal.SIGINT and "Traceback" not in err
    # The write's failure is said once; the stop then names the checkpoint before it, which last.ckpt still links to.
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1
    assert errors[0].startswith(f"error: could not write checkpoint {checkpoints / 'epoch=1-step=8.ckpt'}: No space left on device")
    assert "stopped by SIGINT during phase 3" in err
    resume_line = next(line for line in err.splitlines() if "resume with: " in line)
    assert resume_line.split("the last checkpoint is ")[1].split(";")[0] == str(checkpoints / "last.ckpt")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]  # no partial file
    monkeypatch.undo()
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 4


def fit_tiny(tiny_model_dir, root: Path, phases: int, *extra: str) -> None:
    """A run of the tiny model through the command line: 4 learning steps a phase."""
    from grpo_lightning import cli

    cli.main([
        "fit", "--model.model_name_or_path", tiny_model_dir, "--model.total_phases", str(phases), "--model.warmup_steps",
        "0", "--model.batch_size", "4", "--model.num_minibatches", "2", "--model.gen_len", "4", "--model.export_dir",
        "null", "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false", *extra,
    ])  # fmt: skip


def test_checkpoints_every_n_phases_and_after_the_last_also_when_resumed(tiny_model_dir, tmp_path, monkeypatch):
    written = []
    real_save = AtomicCheckpointIO.save_checkpoint

    def recording_save(self, checkpoint, path, *args, **kwargs):
        written.append(Path(path).name)
        return real_save(self, checkpoint, path, *args, **kwargs)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", recording_save)
    fit_tiny(tiny_model_dir, tmp_path, 5, "--checkpoint_every_n_phases", "2")
    assert written == ["epoch=1-step=8.ckpt", "epoch=3-step=16.ckpt", "epoch=4-step=20.ckpt"]  # phases 2, 4, 5 (the last)
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=4-step=20.ckpt", "last.ckpt"]
    assert os.readlink(checkpoints / "last.ckpt") == "epoch=4-step=20.ckpt"
    # Resumed after phase 5, up to phase 8: phases 6 and 8, counted from the run's first phase, not from the resume.
    written.clear()
    fit_tiny(tiny_model_dir, tmp_path, 8, "--checkpoint_every_n_phases", "2", "--ckpt_path", "last")
    assert written == ["epoch=5-step=24.ckpt", "epoch=7-step=32.ckpt"]


def test_a_run_cut_short_by_max_steps_keeps_its_last_phase_whatever_the_count(tiny_model_dir, tmp_path):
    fit_tiny(tiny_model_dir, tmp_path, 5, "--checkpoint_every_n_phases", "2", "--trainer.max_steps", "12")
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert os.readlink(checkpoints / "last.ckpt") == "epoch=2-step=12.ckpt"  # phase 3 of 5, where max_steps cut it


def test_checkpoints_every_zero_phases_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])
    with pytest.raises(SystemExit) as exit_info:
        fit_tiny(tiny_model_dir, tmp_path, 2, "--checkpoint_every_n_phases", "0")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.strip() == "error: checkpoint_every_n_phases (0) must be at least 1"
