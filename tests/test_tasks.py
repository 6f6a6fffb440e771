"""The arithmetic task (train stream, held-out set) and greedy evaluation."""

from __future__ import annotations

import random

import pytest
import torch

from grpo_lightning import ArithmeticProblems
from grpo_lightning.config import GRPOConfigError
from grpo_lightning.evaluation import chat_prompt, greedy_complete, greedy_rewards
from grpo_lightning.tasks import KINDS, MIXED, problem_pools
from rewards import ExactAnswer

ALL_KINDS = (*KINDS, "mixed")


def answer_of(row) -> str:
    a, b = row["a"], row["b"]
    return str(a + b if row["op"] == "+" else a * b)


# ---- the train stream ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_train_draws_depend_on_seed_and_phase_only(kind):
    first = ArithmeticProblems(kind).draw(seed=3, phase=5, count=16)
    # another instance, other global random states, other draws before: the same rows
    torch.manual_seed(123)
    random.seed(456)
    other = ArithmeticProblems(kind, heldout_size=7)
    other.draw(seed=9, phase=0, count=50)
    assert other.draw(seed=3, phase=5, count=16) == first
    # a smaller draw is the start of a larger one
    assert ArithmeticProblems(kind).draw(seed=3, phase=5, count=4) == first[:4]
    for row in first:
        assert row["answer"] == answer_of(row) and str(row["a"]) in row["prompt"] and str(row["b"]) in row["prompt"]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_phases_and_seeds_draw_different_problems(kind):
    source = ArithmeticProblems(kind)
    def key(rows):
        return [(r["a"], r["op"], r["b"]) for r in rows]
    assert key(source.draw(0, 0, 32)) != key(source.draw(0, 1, 32))
    assert key(source.draw(0, 0, 32)) != key(source.draw(1, 0, 32))


def test_the_template_changes_the_wording_only():
    plain = ArithmeticProblems("add2").draw(0, 2, 8)
    worded = ArithmeticProblems("add2", template="Compute {a} {op} {b}.").draw(0, 2, 8)
    assert [(r["a"], r["b"], r["answer"]) for r in plain] == [(r["a"], r["b"], r["answer"]) for r in worded]
    assert worded[0]["prompt"] == f"Compute {worded[0]['a']} + {worded[0]['b']}."


def test_mixed_draws_every_kind():
    kinds = {row["kind"] for row in ArithmeticProblems("mixed").draw(0, 0, 60)}
    assert kinds == set(MIXED)


# ---- the held-out set ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_heldout_is_fixed_right_and_never_drawn_for_training(kind):
    heldout = ArithmeticProblems(kind, split="heldout")
    rows = heldout.all_rows()
    assert len(heldout) == 60 and len(rows) == 60
    assert rows == ArithmeticProblems(kind, split="heldout").all_rows()
    assert len({(r["a"], r["op"], r["b"]) for r in rows}) == 60  # distinct problems
    for row in rows:
        assert row["answer"] == answer_of(row)
    # the train stream never draws a problem of the reserved pool (whatever heldout_size)
    reserved = {(base, *p) for base in (MIXED if kind == "mixed" else (kind,)) for p in problem_pools(base)[0]}
    assert {(r["kind"], r["a"], r["op"], r["b"]) for r in rows} <= reserved
    train = ArithmeticProblems(kind)
    drawn = {(r["kind"], r["a"], r["op"], r["b"]) for phase in range(20) for r in train.draw(0, phase, 100)}
    assert not drawn & reserved


def test_pools_split_each_problem_space():
    for kind, (operands, op, reserved) in KINDS.items():
        heldout, train = problem_pools(kind)
        assert len(heldout) == reserved and set(heldout).isdisjoint(train)
        assert set(heldout) | set(train) == {(a, op, b) for a in operands for b in operands}
    assert len(problem_pools("add2")[1]) == 7290


def test_heldout_problems_are_pinned():
    """The held-out set must never change silently: results across versions are compared on it."""
    first = [(r["kind"], r["a"], r["op"], r["b"]) for r in ArithmeticProblems("mixed", split="heldout").all_rows()[:6]]
    assert first == [("add1", 5, "+", 2), ("add2", 33, "+", 75), ("mul1", 4, "*", 2),
                     ("add1", 0, "+", 8), ("add2", 31, "+", 27), ("mul1", 1, "*", 5)]  # fmt: skip
    add2 = ArithmeticProblems("add2", split="heldout")
    assert add2.row(0)["prompt"] == "What is 33 + 75? Answer with just the number." and add2.row(0)["answer"] == "108"
    # a smaller held-out set is the start of a larger one
    assert ArithmeticProblems("add2", split="heldout", heldout_size=10).all_rows() == add2.all_rows()[:10]


def test_mixed_heldout_takes_the_kinds_in_turn():
    rows = ArithmeticProblems("mixed", split="heldout").all_rows()
    assert [r["kind"] for r in rows] == list(MIXED) * 20


def test_the_stream_has_no_length_and_the_heldout_set_can_be_drawn():
    with pytest.raises(NotImplementedError, match="endless stream"):
        len(ArithmeticProblems("add2"))
    with pytest.raises(NotImplementedError, match="endless stream"):
        ArithmeticProblems("add2").row(0)
    heldout = ArithmeticProblems("add1", split="heldout", heldout_size=5)
    assert sorted(r["prompt"] for r in heldout.draw(0, 0, 5)) == sorted(r["prompt"] for r in heldout.all_rows())
    with pytest.raises(IndexError):
        heldout.row(5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kind": "sub1"}, "kind must be one of add1, add2, mul1 or mixed"),
        ({"split": "test"}, "split must be 'train' or 'heldout'"),
        ({"kind": "add1", "heldout_size": 61}, "heldout_size must be an integer from 1 to 60 for kind add1"),
        ({"kind": "add2", "heldout_size": 0}, "from 1 to 810"),
        ({"kind": "mixed", "heldout_size": 181}, "from 1 to 180"),
        ({"template": "What is {a}?"}, r"template must be a string holding \{a\} and \{b\}"),
        ({"kind": "mixed", "template": "What is {a} plus {b}?"}, r"must hold \{op\}"),
        ({"template": "{a} {op} {b} {c}"}, "not a format string"),
    ],
)
def test_bad_settings_are_one_line(kwargs, message):
    with pytest.raises(GRPOConfigError, match=message):
        ArithmeticProblems(**kwargs)


def test_init_args_are_plain_values():
    source = ArithmeticProblems("add2", split="heldout", heldout_size=30)
    assert {k: v for k, v in vars(source).items() if not k.startswith("_")} == {
        "kind": "add2", "split": "heldout", "heldout_size": 30, "template": "What is {a} {op} {b}? Answer with just the number."
    }  # fmt: skip


# ---- greedy evaluation (tiny model) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The tiny Llama with larger random weights: at its own initialisation it repeats the last token
    forever, which would make every decoding look alike."""
    from grpo_lightning.models import load_causal_lm, load_tokenizer

    model = load_causal_lm(tiny_model_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model, load_tokenizer(tiny_model_dir)


def argmax_without_cache(model, tokenizer, text: str, steps: int) -> list[int]:
    """Greedy decoding the slow, obvious way: the whole sequence through the model at every step."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    new = []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(input_ids=ids, use_cache=False).logits[0, -1].argmax())
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return new


PROMPTS = ["This is", "The cat sat on the mat. It", "Dr. Smith went", "I thought"]


def test_greedy_equals_argmax_step_by_step(tiny):
    model, tokenizer = tiny
    expected = argmax_without_cache(model, tokenizer, PROMPTS[1], 10)
    assert greedy_complete(model, tokenizer, [PROMPTS[1]], 10) == [tokenizer.decode(expected, skip_special_tokens=True)]


def test_left_padded_batch_equals_one_at_a_time(tiny):
    model, tokenizer = tiny
    lengths = {len(tokenizer(p, add_special_tokens=False).input_ids) for p in PROMPTS}
    assert len(lengths) > 1  # the batch really is padded
    one_at_a_time = [greedy_complete(model, tokenizer, [p], 12)[0] for p in PROMPTS]
    assert len(set(one_at_a_time)) == len(PROMPTS)
    assert greedy_complete(model, tokenizer, PROMPTS, 12) == one_at_a_time
    assert greedy_complete(model, tokenizer, PROMPTS, 12, batch_size=3) == one_at_a_time


def test_greedy_stops_at_a_stop_token(tiny):
    model, tokenizer = tiny
    tokens = argmax_without_cache(model, tokenizer, PROMPTS[0], 10)
    stop = tokens[3]
    end = tokens.index(stop)
    assert end > 0  # something is decoded before the stop
    completion = greedy_complete(model, tokenizer, [PROMPTS[0], PROMPTS[2]], 10, stop_tokens=[stop])[0]
    assert completion == tokenizer.decode(tokens[:end], skip_special_tokens=True)


def test_chat_prompt_and_greedy_rewards(tiny):
    model, tokenizer = tiny
    assert chat_prompt(tokenizer, "What is 2 + 2?") == "What is 2 + 2?"  # no chat template: unchanged
    rows = ArithmeticProblems("add1", split="heldout", heldout_size=3).all_rows()
    completions, rewards = greedy_rewards(model, tokenizer, rows, ExactAnswer(), max_new_tokens=4)
    assert completions == greedy_complete(model, tokenizer, [r["prompt"] for r in rows], 4)
    assert rewards.shape == (3,) and rewards.dtype == torch.float32
    # scoring is the reward's own: a completion that gives the answer scores 1
    assert ExactAnswer().score_rows([rows[0]["answer"]], rows[:1]).tolist() == [1.0]


def test_chat_prompt_with_a_template():
    class ChatTokenizer:
        chat_template = "unused"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and not tokenize
            return f"<user>{messages[0]['content']}<assistant>"

    assert chat_prompt(ChatTokenizer(), "What is 2 + 2?") == "<user>What is 2 + 2?<assistant>"
