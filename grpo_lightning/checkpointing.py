"""Checkpoints that survive a kill, a full disk and a typo.

- ``AtomicCheckpointIO`` writes each checkpoint to a hidden temporary file beside it, flushes it to
  disk and renames it into place: a kill or a full disk mid-write leaves the previous checkpoint
  whole, and the file name only ever points at a complete checkpoint. Loading is always
  ``weights_only=True`` (no pickle code runs), and a missing or damaged file is one line.
- ``PhaseCheckpoint`` is Lightning's ModelCheckpoint with the ``last.ckpt`` link swapped atomically
  and the previous phase's file deleted only after the link points at the new one (Lightning deletes
  it first: a kill in between would leave ``last.ckpt`` dangling).
- The end-of-phase checkpoint is written in the background (``BackgroundWrites``), while the next
  phase's rollout runs: writing it (1.6 GB for SmolLM2-135M with its AdamW state) took 3-5 s a phase,
  a third of the quickstart's time. Where a core is free (a GPU run, or PyTorch on fewer threads than
  cores) the write is hidden; on 2 busy cores it is not, as it is kernel work more than waiting for the
  disk (README, "Nothing lost"), and ``perf/checkpoint_wait_s`` says so. The rollout only reads the weights and the optimizer state, so the
  write takes them as they are, without a copy, and ``PhaseCheckpoint`` waits for it before the first
  learning step changes them. The file, then the link, then the deletion of the previous file are
  done in that order by one thread; a failed write cancels the link and the deletion queued after it,
  and its error stops the run at that wait. A run that stops or fails otherwise waits for the write
  before it reports the last checkpoint; only a SIGKILL (or a power cut) before the write is whole
  loses that phase, whose previous checkpoint is then the one ``last.ckpt`` still points at.
- ``find_last_checkpoint`` resolves ``--ckpt_path last`` to the newest whole checkpoint of any
  earlier run under the run directory.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import glob
import os
import pickle
import threading
import zipfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from .config import GRPOError

TMP_MARK = ".tmp-"  # a temporary file is ".<name>.tmp-<pid>": hidden, and never matches "*.ckpt"


class CheckpointError(GRPOError):
    """A checkpoint could not be written, found or read."""


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk too.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory handles: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(path: Path, write) -> None:
    """Calls ``write(file)`` on a temporary file beside ``path``, then renames it to ``path``.

    On any failure the temporary file is removed and ``path`` (if it existed) is untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def remove_stale_temporaries(directory: Path) -> None:
    """Deletes temporary files left by a process killed mid-write (never a finished checkpoint)."""
    for leftover in directory.glob(f".*{TMP_MARK}*"):
        leftover.unlink(missing_ok=True)


class BackgroundWrites:
    """File operations carried out in the order given by one background thread.

    A failed operation cancels every one queued after it (they depend on it: the link to a checkpoint, the
    deletion of the one it replaces), and its error is raised, once, by the next ``wait()``."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._queued: list[Future] = []
        self._error: BaseException | None = None

    def submit(self, operation: Callable[[], None]) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer", initializer=_yield_to_compute)
        self._queued.append(self._executor.submit(self._run, operation))

    def _run(self, operation: Callable[[], None]) -> None:
        if self._error is not None:  # an earlier operation failed: this one depends on it
            return
        try:
            operation()
        except BaseException as error:  # raised on the main thread by wait()
            self._error = error

    def wait(self) -> None:
        """Returns once every queued operation is done; raises the error of one that failed."""
        for future in self._queued:
            future.result()
        self._queued.clear()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def _yield_to_compute() -> None:
    """Lowers the calling thread's priority (Linux: a nice value per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _containers_copied(obj: Any) -> Any:
    """``obj`` with its dicts, lists and tuples copied, and everything else (the tensors above all) shared:
    a checkpoint written in the background cannot see a later change to Lightning's bookkeeping."""
    if isinstance(obj, dict):
        copied = copy.copy(obj)  # the same type (OrderedDict state dicts keep their metadata)
        for key, value in obj.items():
            copied[key] = _containers_copied(value)
        return copied
    if isinstance(obj, list) or type(obj) is tuple:
        return type(obj)(_containers_copied(value) for value in obj)
    return obj


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer and reader, made atomic on write and safe on read.

    While ``in_background`` is set (``PhaseCheckpoint`` sets it around its end-of-phase save), a save is
    queued on ``background`` and returns at once; otherwise it waits for the queued ones, then writes."""

    def __init__(self) -> None:
        super().__init__()
        self.background = BackgroundWrites()
        self.in_background = False

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if self.in_background:
            # The tensors are the live weights and optimizer state: the caller waits (wait_for_writes) before
            # anything changes them in place.
            self.background.submit(functools.partial(self._write, _containers_copied(checkpoint), Path(path)))
            return
        self.wait_for_writes()
        self._write(checkpoint, Path(path))

    def after_writes(self, operation: Callable[[], None]) -> None:
        """Runs ``operation`` once the checkpoints being written are whole: queued after them in the
        background (skipped if one fails), or, outside a background save, at once after waiting."""
        if self.in_background:
            self.background.submit(operation)
        else:
            self.wait_for_writes()
            operation()

    def wait_for_writes(self) -> None:
        self.background.wait()

    def teardown(self) -> None:
        self.background.close()

    def _write(self, checkpoint: dict[str, Any], path: Path) -> None:
        try:
            write_atomically(path, lambda file: torch.save(checkpoint, file))
        except OSError as error:
            reason = os.strerror(error.errno) if error.errno else str(error)
            hint = " (free some space, or set trainer.default_root_dir elsewhere)" if error.errno == errno.ENOSPC else ""
            raise CheckpointError(
                f"could not write checkpoint {path}: {reason}{hint}; the checkpoints already in "
                f"{path.parent} are intact"
            ) from error
        remove_stale_temporaries(path.parent)

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = None) -> dict[str, Any]:
        # weights_only is always on, whatever the caller asks: a checkpoint holds plain data only.
        return load_checkpoint_file(path, map_location)


def load_checkpoint_file(path, map_location=None, mmap: bool = False) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` with one-line errors for what users run into."""
    path = Path(path)
    if not path.exists():
        dangling = " (a link to a file that is gone)" if path.is_symlink() else ""
        raise CheckpointError(
            f"no checkpoint at {path}{dangling}: pass an existing .ckpt file, or --ckpt_path last for the newest "
            "checkpoint under the run directory"
        )
    if path.is_dir():
        raise CheckpointError(f"ckpt_path {path} is a directory: pass a .ckpt file inside it, or --ckpt_path last")
    try:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"checkpoint {path} holds Python objects that safe loading refuses ({_first_line(error)}); "
            "only checkpoints written by grpo-lightning can be resumed"
        ) from error
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as error:
        raise CheckpointError(
            f"checkpoint {path} is truncated or not a checkpoint ({_first_line(error)}); resume from an earlier "
            "one in the same directory, or from --ckpt_path last"
        ) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:160] if text else type(error).__name__


def link_atomically(target: Path, link: Path) -> None:
    """Points ``link`` at ``target`` (relative symlink) in one rename: ``link`` is never missing."""
    tmp = link.with_name(f".{link.name}{TMP_MARK}{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(os.path.relpath(target, link.parent), tmp)
    except OSError:  # no symlinks (e.g. Windows without the privilege): a whole copy, renamed into place
        write_atomically(link, lambda file: file.write(Path(target).read_bytes()))
        return
    os.replace(tmp, link)
    _fsync_directory(link.parent)


def atomic_io(trainer) -> AtomicCheckpointIO | None:
    """The run's ``AtomicCheckpointIO``, if it writes through one (every command-line run does)."""
    io = trainer.strategy.checkpoint_io
    return io if isinstance(io, AtomicCheckpointIO) else None


def wait_for_checkpoint_writes(trainer) -> None:
    """Returns once the checkpoints written in the background are whole (or raises why one is not)."""
    io = atomic_io(trainer)
    if io is not None:
        io.wait_for_writes()


def _after_writes(trainer, operation: Callable[[], None]) -> None:
    io = atomic_io(trainer)
    if io is None:
        operation()
    else:
        io.after_writes(operation)


def _run_ends_after_this_phase(trainer) -> bool:
    """Whether the phase ending now is the run's last: its last phase, ``trainer.max_steps`` reached (a run cut
    short on purpose, to be resumed), or a stop a callback asked for."""
    if trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1:
        return True
    if trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step:
        return True
    return bool(trainer.should_stop)


class PhaseCheckpoint(ModelCheckpoint):
    """A checkpoint per phase, written in the background while the next rollout runs, ``last.ckpt``
    linking to the newest: safe against a kill at any moment."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deferred_removals: list[str] | None = None

    @staticmethod
    def _link_checkpoint(trainer, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            _after_writes(trainer, functools.partial(link_atomically, Path(filepath), Path(linkpath)))
        trainer.strategy.barrier()

    @property
    def every_n_phases(self) -> int:
        """A checkpoint after every this many phases (counted from the first, so a resumed run keeps the same
        ones), and after the last phase whatever the count."""
        return self._every_n_epochs

    @every_n_phases.setter
    def every_n_phases(self, phases: int) -> None:
        self._every_n_epochs = phases

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        write_phase_logs(trainer)
        # Lightning deletes the previous phase's file before it moves the last.ckpt link: collect the
        # deletions and run them once the link points at the new file.
        self._deferred_removals = []
        io = atomic_io(trainer)
        if io is not None:
            io.in_background = True
        every = self._every_n_epochs
        if _run_ends_after_this_phase(trainer):
            self._every_n_epochs = 1  # the last phase is always kept
        try:
            super().on_train_epoch_end(trainer, pl_module)
            for filepath in self._deferred_removals:
                _after_writes(trainer, functools.partial(super()._remove_checkpoint, trainer, filepath))
        finally:
            self._every_n_epochs = every
            self._deferred_removals = None
            if io is not None:
                io.in_background = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        # The rollout only read the weights and the optimizer state; the first optimizer step of the phase
        # changes them in place, so the previous phase's checkpoint must be whole by now. The wait is the
        # part of the write the rollout did not hide: perf/checkpoint_wait_s.
        timer = getattr(pl_module, "timer", None)
        with timer.measure("checkpoint_wait") if timer is not None else contextlib.nullcontext():
            wait_for_checkpoint_writes(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        wait_for_checkpoint_writes(trainer)  # the last phase's, before the export (a LoRA merge) runs

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        if self._deferred_removals is not None:
            self._deferred_removals.append(filepath)
        else:
            super()._remove_checkpoint(trainer, filepath)


def write_phase_logs(trainer) -> None:
    """Writes the phase's logs to disk before its checkpoint, so that a kill right after the checkpoint
    loses none of them (the resumed run starts with the next phase and will not log this one again).

    Lightning logs epoch-level metrics only after the checkpoint callbacks have run. They are logged
    here instead, the way Lightning would (same step, same "epoch" entry), and Lightning's own call
    that follows skips what was already written, so each point is written once."""
    connector, loop = trainer._logger_connector, trainer.fit_loop.epoch_loop
    metrics = connector.metrics["log"]  # this phase's epoch-level metrics: the epoch's batches are done
    if metrics:
        loop._batches_that_stepped -= 1  # the step Lightning logs epoch-level metrics at
        try:
            connector.log_metrics(metrics)
        finally:
            loop._batches_that_stepped += 1
        written, log_metrics = set(metrics), connector.log_metrics

        def log_the_rest(metrics, step=None):  # Lightning's next call: the epoch metrics again
            del connector.log_metrics  # back to the class's method
            log_metrics({k: v for k, v in metrics.items() if k not in written}, step)

        connector.log_metrics = log_the_rest
    for logger in trainer.loggers:
        flush = getattr(getattr(logger, "experiment", None), "flush", None)  # TensorBoard's event writer
        if callable(flush):
            flush()


def find_last_checkpoint(root_dir: str | os.PathLike) -> Path:
    """The newest whole checkpoint of any run under ``root_dir`` (what ``--ckpt_path last`` means).

    Each run's ``last.ckpt`` is considered, through its link; a dangling link, or a run without one,
    falls back on that run's newest ``*.ckpt`` file. Newest means most recently written."""
    root = Path(root_dir)
    candidates: list[Path] = []
    for checkpoint_dir in {Path(p).parent for p in glob.glob(str(root / "**" / "*.ckpt"), recursive=True)}:
        last = checkpoint_dir / "last.ckpt"
        if last.exists():  # follows the link: a dangling one does not count
            candidates.append(last)
        else:
            files = [p for p in checkpoint_dir.glob("*.ckpt") if p.is_file()]
            candidates.extend(files)
    if not candidates:
        raise CheckpointError(
            f"--ckpt_path last: no checkpoint under {root}/ (a checkpoint is written at the end of each phase); "
            "start without --ckpt_path, or pass a .ckpt file"
        )
    return max(candidates, key=lambda p: p.resolve().stat().st_mtime_ns)
