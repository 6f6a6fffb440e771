"""GRPO_Args defaults and validation, and default_start_token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_lightning.config import GRPO_Args, GRPOConfigError, GRPOError
from grpo_lightning.sampling import default_start_token


def test_defaults_match_the_reference():
    args = GRPO_Args()
    assert args.seed == 1
    assert args.total_phases == 100
    assert args.prompt == "This is"
    assert args.batch_size == 128
    assert args.num_minibatches == 4
    assert args.batches_per_learning_phase == 2
    assert args.lr == 1e-5
    assert args.max_grad_norm == 1.0
    assert args.warmup_steps == 10
    assert args.final_scale == 0.1
    assert args.clip_coef == 0.2
    assert args.kl_coef == 0.3
    assert args.gen_len == 30
    assert args.temperature == 1.0
    assert args.minibatch_size == 32  # 128 / 4


def test_default_reward_is_zero_per_sample():
    out = GRPO_Args().reward_fn(["a", "b", "c"])
    assert torch.equal(out, torch.zeros(3))


def test_minibatch_size_is_derived():
    assert GRPO_Args(batch_size=12, num_minibatches=3).minibatch_size == 4


def test_config_error_types():
    assert issubclass(GRPOConfigError, GRPOError)
    assert issubclass(GRPOConfigError, ValueError)


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        (dict(batch_size=10, num_minibatches=4), "batch_size"),
        (dict(batch_size=128, num_minibatches=3), "num_minibatches"),
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=1, num_minibatches=1), "batch_size"),
        (dict(num_minibatches=-2), "num_minibatches"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(batches_per_learning_phase=0), "batches_per_learning_phase"),
        (dict(total_phases=10, warmup_steps=10), "total_phases"),
        (dict(total_phases=5, warmup_steps=10), "warmup_steps"),
        (dict(gen_len=0), "gen_len"),
        (dict(gen_len=-3), "gen_len"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(clip_coef=0.0), "clip_coef"),
        (dict(clip_coef=1.0), "clip_coef"),
        (dict(clip_coef=-0.1), "clip_coef"),
        (dict(clip_coef=1.5), "clip_coef"),
        (dict(kl_coef=-0.1), "kl_coef"),
        (dict(lr=0.0), "lr"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(final_scale=-0.5), "final_scale"),
        (dict(prompt=""), "prompt"),
        (dict(prompt="   "), "prompt"),
        (dict(prompt="\n\t "), "prompt"),
    ],
)
def test_bad_settings_raise_naming_the_setting(kwargs, setting):
    with pytest.raises(GRPOConfigError) as excinfo:
        GRPO_Args(**kwargs)
    assert setting in str(excinfo.value), str(excinfo.value)


def test_zero_num_minibatches_raises_config_error():
    # num_minibatches = 0 must be refused as a GRPOConfigError naming num_minibatches, like -2 is.
    try:
        GRPO_Args(num_minibatches=0)
    except GRPOConfigError as error:
        assert "num_minibatches" in str(error), str(error)
    except Exception as error:  # noqa: BLE001 - the bug under test is precisely the wrong exception type
        raise AssertionError(
            f"LIBRARY BUG: GRPO_Args(num_minibatches=0) raised {type(error).__name__}: {error} instead of "
            "GRPOConfigError: validate_args builds its whole list of (condition, message) pairs eagerly, so "
            "`batch_size % num_minibatches` is evaluated (and divides by zero) before the "
            "`num_minibatches >= 1` check gets to raise"
        ) from error
    else:
        raise AssertionError("GRPO_Args(num_minibatches=0) was accepted")


def test_divisibility_message_names_both_values():
    with pytest.raises(GRPOConfigError) as excinfo:
        GRPO_Args(batch_size=10, num_minibatches=4)
    message = str(excinfo.value)
    assert "batch_size (10)" in message and "num_minibatches (4)" in message, message


def test_a_group_of_one_is_refused_saying_why():
    # Its advantage, reward minus the group's mean, is 0 on every phase: nothing would be learnt.
    with pytest.raises(GRPOConfigError) as excinfo:
        GRPO_Args(batch_size=1, num_minibatches=1)
    assert str(excinfo.value) == (
        "batch_size (1) must be at least 2: each completion is scored against the others of its group, "
        "so a group of one has advantage 0 and learns nothing"
    )


def test_total_phases_message_names_both_values():
    with pytest.raises(GRPOConfigError) as excinfo:
        GRPO_Args(total_phases=10, warmup_steps=10)
    message = str(excinfo.value)
    assert "total_phases (10)" in message and "warmup_steps (10)" in message, message


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(clip_coef=0.01),
        dict(clip_coef=0.99),
        dict(kl_coef=0.0),
        dict(gen_len=1),
        dict(total_phases=11, warmup_steps=10),
        dict(warmup_steps=0, total_phases=1),
        dict(batch_size=2, num_minibatches=2),  # the smallest group, in minibatches of one
        dict(temperature=0.01),
        dict(prompt=" x "),
        dict(final_scale=0.0),
    ],
)
def test_edge_settings_are_accepted(kwargs):
    args = GRPO_Args(**kwargs)
    for key, value in kwargs.items():
        assert getattr(args, key) == value


# ---------------------------------------------------------------------------------------------
# default_start_token
# ---------------------------------------------------------------------------------------------


def _tok(vocab, bos=None, eos=None):
    # As Hugging Face tokenizers do: a token that is not in the vocabulary maps to the unknown token's id.
    ids = {token: index for index, token in enumerate(["<unk>", *vocab])}
    return SimpleNamespace(convert_tokens_to_ids=lambda token: ids.get(token, 0),
                           convert_ids_to_tokens=lambda index: list(ids)[index], bos_token=bos, eos_token=eos)


def test_start_token_gpt2_like():
    assert default_start_token(_tok(["a", "<|endoftext|>"], bos="<|endoftext|>", eos="<|endoftext|>")) == "<|endoftext|>"


def test_start_token_smollm_prefers_endoftext_over_chat_bos():
    # SmolLM2: bos_token is the chat token <|im_start|>, but <|endoftext|> is in the vocabulary
    tok = _tok(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "x"], bos="<|im_start|>", eos="<|im_end|>")
    assert default_start_token(tok) == "<|endoftext|>"


def test_start_token_llama_like():
    assert default_start_token(_tok(["<s>", "</s>", "x"], bos="<s>", eos="</s>")) == "<s>"
    tok = _tok(["<|begin_of_text|>", "<|end_of_text|>"], bos="<|begin_of_text|>", eos="<|end_of_text|>")
    assert default_start_token(tok) == "<|begin_of_text|>"
    assert default_start_token(_tok(["<bos>", "<eos>"], bos="<bos>", eos="<eos>")) == "<bos>"


def test_start_token_candidate_order():
    # several candidates present: <|endoftext|> comes first, then <s>, <|begin_of_text|>, <bos>
    assert default_start_token(_tok(["<bos>", "<s>", "<|endoftext|>"])) == "<|endoftext|>"
    assert default_start_token(_tok(["<bos>", "<|begin_of_text|>", "<s>"])) == "<s>"
    assert default_start_token(_tok(["<bos>", "<|begin_of_text|>"])) == "<|begin_of_text|>"


def test_start_token_falls_back_to_bos_then_eos_then_empty():
    assert default_start_token(_tok(["x"], bos="[BOS]", eos="[EOS]")) == "[BOS]"
    assert default_start_token(_tok(["x"], bos=None, eos="[EOS]")) == "[EOS]"
    assert default_start_token(_tok(["x"], bos="", eos="[EOS]")) == "[EOS]"
    assert default_start_token(_tok(["x"], bos=None, eos=None)) == ""


def test_in_vocabulary_agrees_with_the_whole_vocabulary_on_a_real_tokenizer():
    # Hugging Face's fast tokenizer: a token outside the vocabulary maps to None (no unknown token) or to
    # the unknown token's id; an added token counts as in it.
    from conftest import build_tokenizer

    from grpo_lightning.sampling import in_vocabulary

    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<|im_end|>"])
    vocab = tokenizer.get_vocab()
    candidates = ["<|endoftext|>", "<|im_end|>", "<s>", "<bos>", "<|begin_of_text|>", "Periods", "zzzzzz"]
    assert [in_vocabulary(tokenizer, token) for token in candidates] == [token in vocab for token in candidates]
    assert [token in vocab for token in candidates][:4] == [True, True, False, False]
    tokenizer.add_special_tokens({"unk_token": "<unk>"})  # now a missing token maps to <unk>'s id
    assert in_vocabulary(tokenizer, "<unk>") and not in_vocabulary(tokenizer, "<s>")
    assert default_start_token(tokenizer) == "<|endoftext|>"
