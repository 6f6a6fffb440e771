"""The hack-resistant variants of the period count: tokens that contain the character, and the
character's frequency. Hand-computed values on a tokenizer with known multi-period tokens."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from grpo_lightning.config import GRPOConfigError
from rewards import CharCount, CharFrequency, CharTokenCount, Reward, describe_reward, reward_fn_char_count


@pytest.fixture(scope="module")
def periods_tokenizer_dir(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer whose only merges make ".." and "....": like GPT-2's tokens made of
    runs of periods, so "........" is two tokens and " ..." is "Ġ", "..", "."."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab[".."] = len(vocab)
    vocab["...."] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[(".", "."), ("..", "..")]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    path = tmp_path_factory.mktemp("periods-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=core).save_pretrained(path)
    return str(path)


SAMPLES = [
    "Wait........ ok.",  # W a i t | .... .... | Ġ o k | .   -> 3 tokens with a period, 9 periods
    "U.S.A. ...",  # U . S . A . | Ġ .. .                -> 5 tokens with a period, 6 periods
    "No periods",  # -> 0, 0
    "",  # -> 0, 0
    "." * 64,  # sixteen "...." tokens                   -> 16, 64
]


def test_char_token_count_counts_tokens_not_characters(periods_tokenizer_dir):
    reward = CharTokenCount(".", model_name_or_path=periods_tokenizer_dir)
    assert isinstance(reward, Reward)
    out = reward(SAMPLES)
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor([3.0, 5.0, 0.0, 0.0, 16.0]), atol=0, rtol=0)
    assert_close(reward_fn_char_count(SAMPLES), torch.tensor([9.0, 6.0, 0.0, 0.0, 64.0]), atol=0, rtol=0)


def test_char_token_count_other_characters(periods_tokenizer_dir):
    # no merges for "S": one token per "S"; " " belongs to the "Ġ..." / "Ġok" pieces, decoded as " "
    assert_close(
        CharTokenCount("S", periods_tokenizer_dir)(["U.S.A. SS", "s"]), torch.tensor([3.0, 0.0]), atol=0, rtol=0
    )
    assert_close(CharTokenCount(" ", periods_tokenizer_dir)(SAMPLES[:3]), torch.tensor([1.0, 1.0, 1.0]), atol=0, rtol=0)


def test_char_token_count_on_a_trained_tokenizer_is_bounded_by_the_character_count(tiny_model_dir):
    samples = ["This is a test.", "It was happy...", "Dr. Smith went to Washington, D.C. in 2019.", "none"]
    tokens = CharTokenCount(".", tiny_model_dir)(samples)
    chars = reward_fn_char_count(samples)
    assert ((tokens <= chars) & ((tokens > 0) == (chars > 0))).all(), (tokens, chars)


def test_char_token_count_is_described_and_loads_lazily(periods_tokenizer_dir):
    reward = CharTokenCount(",", periods_tokenizer_dir)
    assert reward._tokenizer is None  # nothing loaded before the first score (or prepare)
    assert describe_reward(reward) == {
        "class_path": "rewards.char_tokens.CharTokenCount",
        "init_args": {"char": ",", "model_name_or_path": periods_tokenizer_dir},
    }


def test_char_frequency_hand_computed():
    out = CharFrequency(".")(["This is a test.", "......", "Whatever", "", "a.b."])
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor([1 / 15, 1.0, 0.0, 0.0, 0.5]), atol=1e-7, rtol=0)
    assert_close(CharFrequency(" ")(["a b c"]), torch.tensor([2 / 5]), atol=1e-7, rtol=0)


def test_char_frequency_does_not_pay_for_packing_characters():
    # 20 periods inside long words vs 2 periods in a short text: the count prefers the first, the
    # frequency the second
    padded, short = "Extraordinarily. " * 20, "Yes. No."
    assert CharCount()([padded, short]).argmax() == 0
    assert CharFrequency()([padded, short]).argmax() == 1


@pytest.mark.parametrize("cls", [CharCount, CharFrequency, CharTokenCount])
@pytest.mark.parametrize("bad", ["", "..", 1])
def test_char_rewards_reject_non_single_characters(cls, bad):
    with pytest.raises(GRPOConfigError, match=rf"^{cls.__name__}: char must be a single character"):
        cls(bad)


def test_char_token_count_missing_tokenizer_directory():
    message = r"^CharTokenCount: model_name_or_path: no model directory at './no/such/tokenizer'"
    with pytest.raises(GRPOConfigError, match=message):
        CharTokenCount(".", "./no/such/tokenizer")
