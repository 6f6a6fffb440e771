"""Exact, fixed-length sampling, and loading models from local directories and hub ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_lightning import get_samples, load_causal_lm, load_tokenizer
from grpo_lightning.models import ModelLoadError, looks_like_local_path
from grpo_lightning.sampling import sample_completions


class FixedDistributionLM(torch.nn.Module):
    """A stand-in causal LM whose next-token logits are always ``logits``, with a KV-cache argument."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.register_buffer("next_logits", logits)
        self.calls: list[int] = []

    def forward(self, input_ids, use_cache=False, logits_to_keep=0, cache=None):
        self.calls.append(input_ids.shape[1])
        batch, length = input_ids.shape
        logits = self.next_logits.expand(batch, length, -1)
        return SimpleNamespace(logits=logits, cache=(cache or 0) + length)


def test_sampling_never_stops_early_even_when_end_of_text_is_almost_certain():
    eos = 0
    logits = torch.full((5,), -30.0)
    logits[eos] = 30.0  # P(eos) ~ 1 - 4e-26
    model = FixedDistributionLM(logits)
    prompt = torch.tensor([[eos, 3, 4]]).repeat(6, 1)
    ids = sample_completions(model, prompt, gen_len=7)
    assert ids.shape == (6, 3 + 7)
    assert torch.equal(ids[:, :3], prompt) and bool((ids[:, 3:] == eos).all())
    # One forward of the 3 prompt tokens, then one token per step, through the KV cache.
    assert model.calls == [3] + [1] * 6


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_follows_the_full_untruncated_distribution(temperature):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])  # a top-k=2 or top-p=0.8 sampler would never emit tokens 2-3
    model = FixedDistributionLM(probs.log())
    torch.manual_seed(0)
    ids = sample_completions(model, torch.zeros(4000, 1, dtype=torch.long), gen_len=5, temperature=temperature)
    counts = torch.bincount(ids[:, 1:].flatten(), minlength=4).double()
    expected = probs.double() ** (1 / temperature)
    expected /= expected.sum()  # softmax(log p / T) = p^(1/T) / sum
    n = counts.sum()
    sigma = (n * expected * (1 - expected)).sqrt()
    assert bool(((counts - n * expected).abs() < 4 * sigma).all()), (counts / n, expected)


def test_get_samples_prepends_the_start_token_and_decodes_prompt_plus_completion(tiny_model_dir):
    model, tokenizer = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    sample_ids, samples = get_samples(model, tokenizer, "This is", batch_size=3, gen_len=6)
    prompt_ids = tokenizer("<|endoftext|>This is", add_special_tokens=False).input_ids
    assert sample_ids.shape == (3, len(prompt_ids) + 6)
    assert sample_ids[:, : len(prompt_ids)].tolist() == [prompt_ids] * 3
    for row, text in zip(sample_ids, samples):
        assert text == "This is" + tokenizer.decode(row[-6:], skip_special_tokens=True)


def test_local_directory_loads_in_fp32_eval_mode(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.generation_config.eos_token_id is None


def test_a_path_object_loads_as_its_directory(tiny_model_dir):
    from pathlib import Path

    model, tokenizer = load_causal_lm(Path(tiny_model_dir)), load_tokenizer(Path(tiny_model_dir))
    assert model.config.vocab_size == len(tokenizer)  # the tiny model saved there, not a hub lookup


@pytest.mark.parametrize(
    "name, is_path",
    [("gpt2", False), ("lvwerra/distilbert-imdb", False), ("./model", True), ("/abs/model", True), ("~/m", True), ("a/b/c", True)],
)
def test_hub_ids_and_paths_are_told_apart(name, is_path):
    assert looks_like_local_path(name) is is_path


def test_unreachable_hub_id_names_the_embedded_default_and_local_directories(monkeypatch):
    # As on a machine without network, minus the ~50 s of connection retries.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as error:
        load_tokenizer("nobody-here/not-a-model")
    message = str(error.value)
    assert "could not load model 'nobody-here/not-a-model' (hub id)" in message
    assert "local directory" in message and "SmolLM2-135M-Instruct" in message


def test_sampling_keeps_the_logprobs_and_entropies_of_a_full_forward(tiny_model_dir):
    from grpo_lightning.objectives import get_logits, get_logprobs
    from grpo_lightning.rollout_stats import token_entropy
    from grpo_lightning.sampling import encode_prompt, sample_completions_with_logprobs

    model, tokenizer = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    sampled = sample_completions_with_logprobs(model, encode_prompt(tokenizer, "This is").repeat(3, 1), gen_len=5)
    with torch.no_grad():
        logits = get_logits(model, sampled.sample_ids, 5)
        torch.testing.assert_close(sampled.logprobs, get_logprobs(logits, sampled.sample_ids, 5), rtol=0, atol=1e-5)
        torch.testing.assert_close(sampled.entropy, token_entropy(logits[:, :-1]), rtol=0, atol=1e-5)
