"""Shared fixtures: a tiny Llama and its tokenizer, built here and saved to disk, so that tests use the
real loading path (``from_pretrained`` on a local directory) without any download."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

CORPUS = [
    "This is a test. This is only a test.",
    "The cat sat on the mat. It was happy...",
    "Dr. Smith went to Washington, D.C. in 2019.",
    "I thought this movie was great, truly great!",
    "Periods end sentences. Commas pause them, and so on.",
]


def repo_first_on_path() -> str:
    """PYTHONPATH for a subprocess: this checkout first, then whatever the caller's PYTHONPATH held (where
    the dependencies may live, as on a machine that installs them by path)."""
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))


def build_tokenizer():
    """A small byte-level BPE tokenizer with GPT-2's start-of-document token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def build_tiny_llama(vocab_size: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A saved tiny Llama + tokenizer directory, loadable with from_pretrained."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tokenizer()
    build_tiny_llama(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def no_cpu_contention_check(monkeypatch):
    """Fits skip the half-second look at other processes (tests/test_machine.py checks it)."""
    monkeypatch.setattr("grpo_lightning.module.competing_processes", lambda: [])


@pytest.fixture
def plain_argv(monkeypatch):
    """LightningCLI warns when given both ``args`` and a non-empty sys.argv (pytest's own flags)."""
    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fails the test if GRPOModule (grpo_lightning.policy_models) loads a model or tokenizer."""
    from grpo_lightning import policy_models

    refuse_model_loading(monkeypatch, policy_models)


def refuse_model_loading(monkeypatch, namespace) -> None:
    """Makes ``namespace.load_causal_lm`` / ``load_tokenizer`` fail the test: for inputs that must be
    refused before any model loads."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded although the inputs are invalid")

    monkeypatch.setattr(namespace, "load_causal_lm", refuse)
    monkeypatch.setattr(namespace, "load_tokenizer", refuse)


# Short texts of the tiny tokenizer's words; the hidden rule: the text with more periods wins.
RULE_WORDS = (" cat", " dog", " sat", " mat", ".")


def period_rule_pairs(n: int, seed: int = 0, words: int = 8) -> list[dict]:
    """``n`` preference records labelled by the period count (pairs with equal counts are not drawn)."""
    import random

    rng = random.Random(seed)
    records = []
    while len(records) < n:
        a, b = ("".join(rng.choice(RULE_WORDS) for _ in range(words)) for _ in range(2))
        if a.count(".") != b.count("."):
            chosen, rejected = (a, b) if a.count(".") > b.count(".") else (b, a)
            records.append({"prompt": "The", "chosen": chosen, "rejected": rejected})
    return records


def write_jsonl(path, records: list[dict]) -> str:
    import json

    with open(path, "w", encoding="utf-8") as file:
        file.writelines(json.dumps(record) + "\n" for record in records)
    return str(path)


def needs_a_compiler(without: str):
    """Skip a module of fused-kernel tests where no C++ compiler can build the kernels; `without` says what runs then."""
    return pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                              reason=f"no C++ compiler here: {without}")


@pytest.fixture(scope="module")
def kernels():
    """The compiled fused kernels (decode and learning step), built once and cached."""
    from grpo_lightning import fused_decode

    built = fused_decode.compiled_kernels()
    assert built is not None, "a C++ compiler is here, so the fused kernels must build (see the warning above)"
    return built


def bf16_products_only(model: torch.nn.Module):
    """``model`` with every linear layer computing as a bf16 product does (input, weight and bias rounded to bf16,
    the result rounded to bf16) and returning it widened to float32: float32 everywhere else."""
    from torch.nn import functional as F

    def rounded(layer):
        def forward(x):
            bias = None if layer.bias is None else layer.bias.bfloat16()
            return F.linear(x.bfloat16(), layer.weight.bfloat16(), bias).float()

        return forward

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = rounded(module)
    return model
