"""``grpo-lightning fit`` that records, rank by rank, what tests/test_distributed.py compares.

    GRPO_RECORD=DIR python tests/ddp_fit.py fit [fit arguments...]

Each rank writes into DIR, per phase P (0-based) and rank R:
  groups-pP-rR.pt   the groups it sampled (row, ids, log-probs, entropies, masks, texts), in order
  shuffle-pP-rR.pt  the state of the generator its replay memory shuffled the minibatches with
  weights-pP-rR.pt  its policy's weights at the end of the phase (every step taken)
and per learning step S (0-based):
  grads-sS-rR.pt    the gradient it steps with (after DDP's all-reduce, before clipping)
Lightning starts the other ranks by running this same command line again (environment included), so
they record too.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch


def arm(record: Path) -> None:
    from grpo_lightning import memory, module, rollout_phase

    sampled: dict[int, list[dict]] = {}

    def where(grpo) -> str:
        return f"p{grpo.current_epoch}-r{grpo.global_rank}"

    sample_groups = rollout_phase.sample_groups

    def recording_sample_groups(grpo, rows):
        groups = sample_groups(grpo, rows)
        phase_groups = sampled.setdefault(grpo.current_epoch, [])
        phase_groups.extend(dataclasses.asdict(group) for group in groups)  # refills append to the phase's list
        torch.save(phase_groups, record / f"groups-{where(grpo)}.pt")
        return groups

    get_minibatches = memory.ReplayMemory.get_minibatches
    current = {}

    def recording_get_minibatches(self, generator=None):
        torch.save(generator.get_state(), record / f"shuffle-{current['where']}.pt")
        return get_minibatches(self, generator)

    on_train_epoch_start = module.GRPOModule.on_train_epoch_start

    def noting_phase(self):
        current["where"] = where(self)
        on_train_epoch_start(self)

    on_train_epoch_end = module.GRPOModule.on_train_epoch_end

    def saving_weights(self):
        on_train_epoch_end(self)
        torch.save(self.policy.state_dict(), record / f"weights-{where(self)}.pt")

    def saving_gradients(self, optimizer):
        grads = {name: p.grad.clone() for name, p in self.policy.named_parameters() if p.grad is not None}
        torch.save(grads, record / f"grads-s{self.global_step}-r{self.global_rank}.pt")

    rollout_phase.sample_groups = recording_sample_groups
    memory.ReplayMemory.get_minibatches = recording_get_minibatches
    module.GRPOModule.on_train_epoch_start = noting_phase
    module.GRPOModule.on_train_epoch_end = saving_weights
    module.GRPOModule.on_before_optimizer_step = saving_gradients


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package, not an installed one
    directory = Path(os.environ["GRPO_RECORD"])
    directory.mkdir(parents=True, exist_ok=True)
    arm(directory)
    from grpo_lightning.cli import main

    main()  # reads sys.argv, which Lightning also passes on to the ranks it starts
