"""ReplayMemory minibatching and the lazy ReplayDataset (grpo_lightning.memory)."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.config import GRPO_Args
from grpo_lightning.memory import ReplayDataset, ReplayMemory, ReplayMinibatch

B, P, T = 12, 3, 4  # batch_size, prompt length, gen_len


def _args(batch_size=B, num_minibatches=3, batches_per_learning_phase=2, gen_len=T):
    return GRPO_Args(
        batch_size=batch_size,
        num_minibatches=num_minibatches,
        batches_per_learning_phase=batches_per_learning_phase,
        gen_len=gen_len,
    )


def _memory(args) -> ReplayMemory:
    """Every tensor encodes its row index i, so alignment can be read back from any minibatch:
    sample_ids[i, j] = 100 i + j, logprobs[i, t] = -(i + t / 10), ref_logprobs[i, t] = -(1000 i + t),
    advantages[i] = i / 2."""
    n, gen_len = args.batch_size, args.gen_len
    rows = torch.arange(n)
    sample_ids = rows[:, None] * 100 + torch.arange(P + gen_len)[None, :]
    logprobs = -(rows[:, None].float() + torch.arange(gen_len)[None, :].float() / 10)
    ref_logprobs = -(rows[:, None].float() * 1000 + torch.arange(gen_len)[None, :].float())
    advantages = rows.float() / 2
    return ReplayMemory(args, sample_ids, logprobs, ref_logprobs, advantages)


def _row_ids(mb: ReplayMinibatch) -> list[int]:
    return (mb.sample_ids[:, 0] // 100).tolist()


def test_len_and_count():
    args = _args(num_minibatches=3, batches_per_learning_phase=2)
    memory = _memory(args)
    mbs = memory.get_minibatches(torch.Generator().manual_seed(0))
    assert len(memory) == 6
    assert len(mbs) == 6  # batches_per_learning_phase * num_minibatches
    for mb in mbs:
        assert isinstance(mb, ReplayMinibatch)
        assert mb.sample_ids.shape == (4, P + T)  # minibatch_size = 12 / 3
        assert mb.logprobs.shape == (4, T)
        assert mb.ref_logprobs.shape == (4, T)
        assert mb.advantages.shape == (4,)


@pytest.mark.parametrize("passes, num_minibatches", [(1, 1), (2, 3), (3, 4), (2, 12)])
def test_each_sequence_once_per_pass(passes, num_minibatches):
    args = _args(num_minibatches=num_minibatches, batches_per_learning_phase=passes)
    mbs = _memory(args).get_minibatches(torch.Generator().manual_seed(3))
    assert len(mbs) == passes * num_minibatches
    overall = []
    for p in range(passes):
        this_pass = [i for mb in mbs[p * num_minibatches : (p + 1) * num_minibatches] for i in _row_ids(mb)]
        assert sorted(this_pass) == list(range(B)), f"pass {p} is not a permutation of the group: {this_pass}"
        overall += this_pass
    for i in range(B):
        assert overall.count(i) == passes


def test_rows_stay_aligned():
    args = _args(num_minibatches=4, batches_per_learning_phase=3)
    mbs = _memory(args).get_minibatches(torch.Generator().manual_seed(7))
    t = torch.arange(T).float()
    for mb in mbs:
        rows = torch.tensor(_row_ids(mb))
        assert torch.equal(mb.sample_ids, rows[:, None] * 100 + torch.arange(P + T)[None, :])
        assert torch.equal(mb.logprobs, -(rows[:, None].float() + t[None, :] / 10))
        assert torch.equal(mb.ref_logprobs, -(rows[:, None].float() * 1000 + t[None, :]))
        assert torch.equal(mb.advantages, rows.float() / 2)


def test_reproducible_with_seeded_generator():
    args = _args(num_minibatches=3, batches_per_learning_phase=2)
    memory = _memory(args)
    a = memory.get_minibatches(torch.Generator().manual_seed(42))
    b = memory.get_minibatches(torch.Generator().manual_seed(42))
    c = memory.get_minibatches(torch.Generator().manual_seed(43))
    assert [_row_ids(m) for m in a] == [_row_ids(m) for m in b]
    for x, y in zip(a, b):
        assert torch.equal(x.sample_ids, y.sample_ids)
        assert torch.equal(x.logprobs, y.logprobs)
        assert torch.equal(x.ref_logprobs, y.ref_logprobs)
        assert torch.equal(x.advantages, y.advantages)
    assert [_row_ids(m) for m in a] != [_row_ids(m) for m in c]


def test_order_is_the_seeded_permutation():
    # The minibatches are the seeded generator's randperm, pass after pass, split in order.
    args = _args(num_minibatches=3, batches_per_learning_phase=2)
    mbs = _memory(args).get_minibatches(torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    expected = torch.cat([torch.randperm(B, generator=g) for _ in range(2)]).reshape(6, 4).tolist()
    assert [_row_ids(m) for m in mbs] == expected
    # and it is shuffled, not the identity
    assert expected[:3] != [list(range(0, 4)), list(range(4, 8)), list(range(8, 12))]


def test_passes_are_shuffled_independently():
    args = _args(num_minibatches=1, batches_per_learning_phase=2)
    mbs = _memory(args).get_minibatches(torch.Generator().manual_seed(0))
    assert _row_ids(mbs[0]) != _row_ids(mbs[1])


# ---------------------------------------------------------------------------------------------
# ReplayDataset
# ---------------------------------------------------------------------------------------------


class Holder:
    def __init__(self, memory=None):
        self.memory = memory
        self.reads = 0

    def get(self):
        self.reads += 1
        return self.memory


def test_dataset_is_lazy():
    holder = Holder()
    dataset = ReplayDataset(holder.get, num_batches=6)
    it = iter(dataset)  # Lightning creates the iterator before the rollout: must not fail
    assert holder.reads == 0
    holder.memory = _memory(_args())  # the rollout fills the memory afterwards
    first = next(it)
    assert holder.reads == 1
    assert isinstance(first, ReplayMinibatch)
    rest = list(it)
    assert holder.reads == 1
    assert len(rest) == 5


def test_dataset_len_is_fixed_before_any_memory():
    holder = Holder()
    dataset = ReplayDataset(holder.get, num_batches=6)
    assert len(dataset) == 6
    assert holder.reads == 0


def test_dataset_next_without_memory_raises():
    dataset = ReplayDataset(Holder().get, num_batches=6)
    it = iter(dataset)
    with pytest.raises(RuntimeError, match="rollout"):
        next(it)


def test_dataset_yields_the_memory_minibatches_with_its_generator():
    memory = _memory(_args(num_minibatches=3, batches_per_learning_phase=2))
    dataset = ReplayDataset(lambda: memory, num_batches=6, get_generator=lambda: torch.Generator().manual_seed(9))
    got = list(dataset)
    expected = memory.get_minibatches(torch.Generator().manual_seed(9))
    assert [_row_ids(m) for m in got] == [_row_ids(m) for m in expected]
    # a fresh iteration re-reads the memory (a new phase) and reshuffles with a fresh generator
    assert [_row_ids(m) for m in list(dataset)] == [_row_ids(m) for m in expected]


def test_dataset_reads_the_current_memory_each_epoch():
    holder = Holder(_memory(_args(num_minibatches=3, batches_per_learning_phase=2)))
    dataset = ReplayDataset(holder.get, num_batches=6)
    assert len(list(dataset)) == 6
    new_memory = _memory(_args(num_minibatches=3, batches_per_learning_phase=2))
    new_memory.advantages = torch.full((B,), 9.0)
    holder.memory = new_memory
    second = list(dataset)
    assert holder.reads == 2
    assert all(torch.equal(mb.advantages, torch.full((4,), 9.0)) for mb in second)


@pytest.mark.parametrize("promised", [5, 7])
def test_dataset_count_mismatch_raises(promised):
    memory = _memory(_args(num_minibatches=3, batches_per_learning_phase=2))  # yields 6
    it = iter(ReplayDataset(lambda: memory, num_batches=promised))
    with pytest.raises(RuntimeError) as excinfo:
        next(it)
    message = str(excinfo.value)
    assert "6" in message and str(promised) in message, message
