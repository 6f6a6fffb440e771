"""A clean stop on Ctrl-C or SIGTERM.

The first signal only raises a flag. The run stops at the next safe point: after the current
training step, after the current token of a rollout (a rollout is abandoned, not waited for), or
between the reference model's minibatches. Nothing of the interrupted phase is kept: the checkpoint
written at the end of the previous phase is the consistent state, and resuming from it replays the
interrupted phase exactly (its sampling is seeded by the phase). A second signal stops at once:
it raises KeyboardInterrupt, so Lightning still closes the loggers, and a watchdog ends the process
if that shutdown has not finished within ``SECOND_SIGNAL_GRACE_S``. The watchdog is needed because
a KeyboardInterrupt can land between any two bytecodes of a library: landing inside
``queue.Queue.put`` of TensorBoard's writer (after the item is counted, before the writer thread is
woken) makes the logger's final flush wait up to the writer's 120 s flush interval.

``stop_point()`` is what long loops call; with no signal pending it costs one attribute read.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from lightning.pytorch.utilities import rank_zero_only

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SECOND_SIGNAL_GRACE_S = 10.0  # closing the loggers takes well under a second when nothing is stuck


class StopRequested(Exception):
    """Raised at a safe point after Ctrl-C or SIGTERM; the process exits with 128 + the signal number."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Handlers for SIGINT and SIGTERM that ask for a stop at the next ``stop_point()``."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._watchdog: threading.Timer | None = None

    def install(self) -> None:
        self.signum = None
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Puts the previous handlers back; a shutdown that got this far is not stuck, so the
        watchdog is called off (a program that runs the CLI in-process goes on living)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # the second signal: at once (Lightning turns it into exit code 1)
            if self._watchdog is None:
                self._watchdog = exit_if_still_running(SECOND_SIGNAL_GRACE_S, 128 + signum)
            raise KeyboardInterrupt
        self.signum = signum
        if rank_zero_only.rank != 0:  # a multi-process run: every rank is stopping, rank 0 says so
            return
        name = signal.Signals(signum).name
        print(
            f"\n{name} received: stopping after the current step (the phase in progress is dropped; "
            "the last phase's checkpoint is kept). Ctrl-C again stops at once.",
            file=sys.stderr,
            flush=True,
        )

    def check(self) -> None:
        if self.signum is not None:
            raise StopRequested(self.signum)


def exit_if_still_running(after_s: float, exit_code: int) -> threading.Timer:
    """Ends the process with ``exit_code`` if it is still running ``after_s`` seconds from now.

    A daemon timer: a process that exits in time takes it down with it. Checkpoints are written
    atomically, so ending here can lose only the log lines still queued and a checkpoint still being
    written in the background; the checkpoints already written stay whole.
    """

    def exit_now() -> None:
        print(
            f"error: the shutdown after the second signal took more than {after_s:g} s; exiting now "
            "(checkpoints are intact; log lines still queued are lost)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(exit_code)

    timer = threading.Timer(after_s, exit_now)
    timer.daemon = True
    timer.start()
    return timer


STOP = StopSignals()


def stop_point() -> None:
    """Raises StopRequested if Ctrl-C or SIGTERM arrived; call it where stopping leaves nothing half-done."""
    if STOP.signum is not None:
        STOP.check()
