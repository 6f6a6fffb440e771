"""Replay memory of one rollout phase, and the IterableDataset that feeds it to Lightning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor
from torch.utils.data import IterableDataset


@dataclass
class ReplayMinibatch:
    """What one training step needs; b = minibatch size, T = gen_len."""

    sample_ids: Tensor  # (b, P + T) prompt + completion ids
    logprobs: Tensor  # (b, T) log pi_old of the generated tokens (rollout time)
    ref_logprobs: Tensor  # (b, T) log pi_ref of the generated tokens
    advantages: Tensor  # (b,) one per sequence
    completion_mask: Tensor | None = None  # (b, T) bool, True for generated tokens; None: all are
    attention_mask: Tensor | None = None  # (b, P + T) 0 on prompt left-padding; None: no padding


class ReplayMemory:
    """Everything a rollout phase produced, split into shuffled minibatches for the learning phase.

    ``args`` needs ``batch_size``, ``gen_len``, ``num_minibatches`` and ``batches_per_learning_phase``
    (a ``GRPO_Args`` has them).
    """

    def __init__(
        self, args, sample_ids: Tensor, logprobs: Tensor, ref_logprobs: Tensor, advantages: Tensor,
        completion_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ):  # fmt: skip
        assert sample_ids.shape[0] == args.batch_size
        assert logprobs.shape == ref_logprobs.shape == (args.batch_size, args.gen_len)
        assert advantages.shape == (args.batch_size,)
        assert completion_mask is None or completion_mask.shape == logprobs.shape
        assert attention_mask is None or attention_mask.shape == sample_ids.shape
        self.completion_mask = completion_mask
        self.attention_mask = attention_mask
        self.args = args
        self.sample_ids = sample_ids
        self.logprobs = logprobs
        self.ref_logprobs = ref_logprobs
        self.advantages = advantages

    def __len__(self) -> int:
        """Number of minibatches ``get_minibatches`` yields."""
        return self.args.batches_per_learning_phase * self.args.num_minibatches

    def get_minibatches(self, generator: torch.Generator | None = None) -> list[ReplayMinibatch]:
        """``batches_per_learning_phase`` shuffled passes of ``num_minibatches`` minibatches each, so
        every sequence appears exactly ``batches_per_learning_phase`` times."""
        minibatches = []
        for _ in range(self.args.batches_per_learning_phase):
            permutation = torch.randperm(self.args.batch_size, generator=generator)
            for indices in permutation.reshape(self.args.num_minibatches, -1):
                indices = indices.to(self.sample_ids.device)
                minibatches.append(
                    ReplayMinibatch(
                        sample_ids=self.sample_ids[indices],
                        logprobs=self.logprobs[indices],
                        ref_logprobs=self.ref_logprobs[indices],
                        advantages=self.advantages[indices],
                        completion_mask=None if self.completion_mask is None else self.completion_mask[indices],
                        attention_mask=None if self.attention_mask is None else self.attention_mask[indices],
                    )
                )
        return minibatches


class ReplayDataset(IterableDataset):
    """Yields the current phase's minibatches.

    The memory is read lazily, at the first ``next()``: Lightning creates the iterator before
    ``on_train_epoch_start`` has run the rollout. ``__len__`` is the fixed count from the config,
    not ``len(memory)``, because Lightning reads it before the first rollout too (and without a
    length it would prefetch a batch from the empty memory and epoch 0 would train on nothing).
    """

    def __init__(self, get_memory: Callable[[], ReplayMemory | None], num_batches: int, get_generator=None):
        self.get_memory = get_memory
        self.num_batches = num_batches
        self.get_generator = get_generator or (lambda: None)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[ReplayMinibatch]:
        memory = self.get_memory()
        if memory is None:
            raise RuntimeError("ReplayDataset was iterated before a rollout filled the replay memory")
        minibatches = memory.get_minibatches(self.get_generator())
        if len(minibatches) != self.num_batches:
            raise RuntimeError(
                f"the replay memory yields {len(minibatches)} minibatches but the dataset promised {self.num_batches}"
            )
        yield from minibatches
