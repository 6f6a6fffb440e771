"""Answers that end: a completion stops at its first stop token, and what follows is masked padding."""

from __future__ import annotations

import torch
from conftest import build_tiny_llama, build_tokenizer
from test_sampling_and_loading import FixedDistributionLM

from grpo_lightning.sampling import sample_completions_with_logprobs, sample_group, stop_token_ids


def test_rows_end_at_their_first_stop_token_and_match_unstopped_sampling_up_to_it():
    model = build_tiny_llama(vocab_size=300, seed=3)
    prompt = torch.tensor([[0, 5, 6]]).repeat(16, 1)
    stops = list(range(10, 60))  # a sixth of the vocabulary: most rows end within 10 tokens
    torch.manual_seed(7)
    free = sample_completions_with_logprobs(model, prompt, gen_len=10)
    torch.manual_seed(7)
    ended = sample_completions_with_logprobs(model, prompt, gen_len=10, stop_tokens=stops)
    assert free.completion_mask is None and ended.completion_mask.shape == (16, 10)
    free_ids, ended_ids = free.sample_ids[:, 3:], ended.sample_ids[:, 3:]
    lengths = []
    for row in range(16):
        is_stop = torch.isin(free_ids[row], torch.tensor(stops))
        length = int(is_stop.int().argmax()) + 1 if is_stop.any() else 10  # the stop token itself counts
        lengths.append(length)
        assert ended.completion_mask[row].tolist() == [True] * length + [False] * (10 - length)
        assert torch.equal(ended_ids[row, :length], free_ids[row, :length])
        assert bool((ended_ids[row, length:] == stops[0]).all())  # padding: the first stop token
        assert torch.equal(ended.logprobs[row, :length], free.logprobs[row, :length])
        assert bool((ended.logprobs[row, length:] == 0).all() and (ended.entropy[row, length:] == 0).all())
    assert min(lengths) < 10 and len(set(lengths)) > 2  # the test saw ragged rows


def test_sampling_stops_once_every_row_has_ended():
    logits = torch.full((5,), -30.0)
    logits[4] = 30.0  # token 4 is all but certain
    model = FixedDistributionLM(logits)
    ended = sample_completions_with_logprobs(model, torch.tensor([[1, 2]]).repeat(3, 1), gen_len=6, stop_tokens=[4])
    assert model.calls == [2]  # the prompt's forward only: every row ended at its first token
    assert ended.sample_ids.tolist() == [[1, 2, 4, 4, 4, 4, 4, 4]] * 3
    assert ended.completion_mask.tolist() == [[True] + [False] * 5] * 3


def test_stop_tokens_are_eos_then_the_known_end_tokens_in_the_vocabulary():
    tokenizer = build_tokenizer()  # eos = <|endoftext|>, the only end token it has
    assert stop_token_ids(tokenizer) == [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_samples_hold_only_the_text_before_padding(tiny_model_dir):
    from grpo_lightning import load_causal_lm, load_tokenizer

    tokenizer, model = load_tokenizer(tiny_model_dir), load_causal_lm(tiny_model_dir)
    torch.manual_seed(0)
    stops = list(range(20, 120))
    sampled, samples = sample_group(model, tokenizer, "This is", 8, 6, stop_tokens=stops)
    for ids, mask, sample in zip(sampled.sample_ids[:, -6:], sampled.completion_mask, samples):
        assert sample == "This is" + tokenizer.decode(ids[mask], skip_special_tokens=True)
