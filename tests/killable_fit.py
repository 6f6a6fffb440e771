"""``grpo-lightning fit`` that SIGKILLs itself at a chosen moment, for tests/test_kill_resume.py.

    python tests/killable_fit.py POINT:N [fit arguments...]

POINT is where the N-th event of its kind (counted in this process) kills it:
  rollout     the N-th sampled token step of any rollout (mid-rollout), once the checkpoint that the previous
              phase writes in the background is whole (a kill during that write is what "write" does)
  learning    the start of the N-th training step (the earlier steps of the phase are applied in memory)
  write       the N-th checkpoint write, half-way through writing its bytes
  link        the N-th move of last.ckpt, after the new checkpoint is whole and before the link moves
  none        never (runs to the end)
SIGKILL cannot be caught: nothing the process does after it runs.
"""

from __future__ import annotations

import io
import os
import signal
import sys


def kill_now() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def on_nth_call(function, n: int, before=None):
    """``function`` wrapped to call ``before(*args)`` (default: kill) on its n-th call."""
    calls = 0

    def wrapped(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == n:
            (before or (lambda *a: kill_now()))(*args)
        return function(*args, **kwargs)

    return wrapped


def arm(point: str, n: int) -> None:
    from grpo_lightning import checkpointing, module, sampling

    if point == "rollout":
        writers = []  # every AtomicCheckpointIO of the run, to wait for its background writes
        made = checkpointing.AtomicCheckpointIO.__init__

        def recorded(self, *args, **kwargs):
            made(self, *args, **kwargs)
            writers.append(self)

        def wait_then_kill(*args):
            for writer in writers:
                writer.wait_for_writes()
            kill_now()

        checkpointing.AtomicCheckpointIO.__init__ = recorded
        sampling.softmax_parts = on_nth_call(sampling.softmax_parts, n, before=wait_then_kill)
    elif point == "learning":
        module.GRPOModule.training_step = on_nth_call(module.GRPOModule.training_step, n)
    elif point == "write":
        original = checkpointing.write_atomically

        def half_then_kill(path, write):
            buffer = io.BytesIO()
            write(buffer)
            data = buffer.getvalue()

            def write_half(file):
                file.write(data[: len(data) // 2])
                file.flush()
                os.fsync(file.fileno())
                kill_now()

            original(path, write_half)

        checkpointing.write_atomically = on_nth_call(original, n, before=lambda path, write: half_then_kill(path, write))
    elif point == "link":
        checkpointing.link_atomically = on_nth_call(checkpointing.link_atomically, n)
    elif point != "none":
        raise SystemExit(f"unknown kill point {point!r}")


if __name__ == "__main__":
    point, _, count = sys.argv[1].partition(":")
    arm(point, int(count or 0))
    from grpo_lightning.cli import main

    fit_args = sys.argv[2:]
    del sys.argv[1:]  # the arguments go to main(); LightningCLI warns when it sees them twice
    main(["fit", *fit_args])
