"""sample_categorical: exact inverse-CDF sampling, checked with chosen uniforms and by frequency."""

from __future__ import annotations

import torch

from grpo_lightning import sampling
from grpo_lightning.sampling import SAMPLING_BLOCK, sample_categorical


def with_uniforms(monkeypatch, values: list[float]) -> None:
    """Makes the draw inside sample_categorical return ``values`` (one per row)."""

    def fake_rand(*shape, dtype=None, device=None, generator=None):
        assert tuple(shape) == (len(values), 1)
        return torch.tensor(values, dtype=dtype).view(-1, 1)

    monkeypatch.setattr(sampling.torch, "rand", fake_rand)


def test_one_block_by_hand(monkeypatch):
    # cumulative: 0.125, 0.125, 0.75, 1.0 (dyadic: exact in float). Index 1 has no mass: never drawn,
    # so a uniform at exactly 0.125 lands on index 2.
    probs = torch.tensor([0.125, 0.0, 0.625, 0.25]).repeat(6, 1)
    with_uniforms(monkeypatch, [0.0, 0.124, 0.125, 0.7499, 0.75, 0.99999])
    assert sample_categorical(probs).squeeze(1).tolist() == [0, 0, 2, 2, 3, 3]


def test_across_blocks_by_hand(monkeypatch):
    vocab = 2 * SAMPLING_BLOCK + 88  # three blocks, the last padded
    probs = torch.zeros(6, vocab)
    probs[:, 0], probs[:, SAMPLING_BLOCK + 44], probs[:, vocab - 2] = 0.25, 0.5, 0.25  # the last token: no mass
    with_uniforms(monkeypatch, [0.2, 0.25, 0.74, 0.75, 0.999999, 0.5])
    expected = [0, SAMPLING_BLOCK + 44, SAMPLING_BLOCK + 44, vocab - 2, vocab - 2, SAMPLING_BLOCK + 44]
    assert sample_categorical(probs).squeeze(1).tolist() == expected


def test_unnormalised_rows_are_normalised(monkeypatch):
    probs = torch.tensor([[2.0, 6.0], [1.0, 3.0]])  # both mean (0.25, 0.75)
    with_uniforms(monkeypatch, [0.2499, 0.25])
    assert sample_categorical(probs).squeeze(1).tolist() == [0, 1]


def test_frequencies_match_the_distribution():
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 700, 10_000
    probs = torch.rand(vocab, generator=generator) ** 4
    probs[[5, 300, 699]] = 0.0  # never drawn
    probs /= probs.sum()
    counts = torch.zeros(vocab)
    for _ in range(4):
        drawn = sample_categorical(probs.repeat(rows, 1), generator=generator).squeeze(1)
        counts += torch.bincount(drawn, minlength=vocab).float()
    n = 4 * rows
    assert counts[[5, 300, 699]].tolist() == [0.0, 0.0, 0.0]
    # each count is binomial(n, p): within 5 standard deviations everywhere
    sigma = (n * probs * (1 - probs)).sqrt()
    assert torch.all((counts - n * probs).abs() <= 5 * sigma + 1), (counts - n * probs).abs().max()


def test_seeded_draws_repeat():
    probs = torch.softmax(torch.randn(8, 1000, generator=torch.Generator().manual_seed(1)), -1)
    first = sample_categorical(probs, generator=torch.Generator().manual_seed(3))
    again = sample_categorical(probs, generator=torch.Generator().manual_seed(3))
    assert torch.equal(first, again) and first.shape == (8, 1) and first.dtype == torch.int64
