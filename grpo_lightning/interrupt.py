"""A clean stop on Ctrl-C or SIGTERM.

The first signal only raises a flag. The run stops at the next safe point: after the current
training step, after the current token of a rollout (a rollout is abandoned, not waited for), or
between the reference model's minibatches. Nothing of the interrupted phase is kept: the checkpoint
written at the end of the previous phase is the consistent state, and resuming from it replays the
interrupted phase exactly (its sampling is seeded by the phase). A second signal stops at once.

``stop_point()`` is what long loops call; with no signal pending it costs one attribute read.
"""

from __future__ import annotations

import signal
import sys

from lightning.pytorch.utilities import rank_zero_only

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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

    def install(self) -> None:
        self.signum = None
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # the second signal: at once (Lightning turns it into exit code 1)
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


STOP = StopSignals()


def stop_point() -> None:
    """Raises StopRequested if Ctrl-C or SIGTERM arrived; call it where stopping leaves nothing half-done."""
    if STOP.signum is not None:
        STOP.check()
