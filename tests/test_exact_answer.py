"""ExactAnswer: the last number of the completion against the row's answer."""

from __future__ import annotations

from decimal import Decimal

import pytest
import torch

from grpo_lightning.config import GRPOConfigError
from grpo_lightning.reward_checks import RewardError, score_samples
from rewards import ExactAnswer
from rewards.base import call_reward, describe_reward
from rewards.exact_answer import final_number, parse_numbers


@pytest.mark.parametrize(
    "text, number",
    [
        ("12", 12),
        ("12.", 12),
        ("The answer is 12.", 12),
        ("-3", -3),
        ("The answer is -3.", -3),
        ("\u22127", -7),  # a Unicode minus sign
        ("1,024", 1024),
        ("1,024,576.25", Decimal("1024576.25")),
        ("12.0", 12),
        ("16 + 47 = 63", 63),  # the last number, not the question's operand
        ("5-3", 3),  # a minus right after a digit is an operator
        ("5 - 3 = 2", 2),
        ("1, 2, 3", 3),
        ("3,4,5", 5),  # not a thousands group
        ("1,2345", 2345),
        ("x = 7\n\nThat is all.", 7),
        ("v2 is nine", None),  # a digit inside a word is not a number; words are not numbers
        ("no number here", None),
        ("", None),
    ],
)
def test_final_number(text, number):
    assert final_number(text) == (None if number is None else Decimal(number))


def test_parse_numbers_in_order():
    assert parse_numbers("3 + 4 = 7, not -1.5 or 1,000.") == [3, 4, 7, Decimal("-1.5"), 1000]


ROWS = [{"prompt": "What is 7 + 5?", "answer": "12"}] * 6 + [{"prompt": "What is 2 - 5?", "answer": "-3"}]
COMPLETIONS = ["12", "12.", "The answer is 12.", "7 + 5 = 12", "12 is wrong, it is 13", "12.5", "2 - 5 = -3"]
EXPECTED = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def samples_of(completions, rows):
    return [row["prompt"] + completion for completion, row in zip(completions, rows)]


def test_score_rows_by_hand():
    rewards = ExactAnswer().score_rows(COMPLETIONS, ROWS)
    assert rewards.dtype == torch.float32 and rewards.tolist() == EXPECTED


def test_through_call_reward_and_score_samples():
    reward, samples = ExactAnswer(), samples_of(COMPLETIONS, ROWS)
    assert call_reward(reward, samples, COMPLETIONS, ROWS).tolist() == EXPECTED
    assert score_samples(reward, samples, COMPLETIONS, ROWS).tolist() == EXPECTED


def test_answers_as_numbers_or_text_ending_in_one():
    rows = [{"prompt": "q", "answer": 82}, {"prompt": "q", "answer": "#### 1,024"}, {"prompt": "q", "solution": "7.0"}]
    assert ExactAnswer().score_rows(["82", "1024", "7"], rows[:2] + [{"prompt": "q", "answer": "7.0"}]).tolist() == [1, 1, 1]
    assert ExactAnswer(answer_column="solution").score_rows(["7"], rows[2:]).tolist() == [1.0]


def test_a_row_without_the_answer_column_is_one_line():
    rows = [{"prompt": "What is 7 + 5?", "target": "12"}]
    with pytest.raises(GRPOConfigError, match=r"no 'answer' column \(its columns: prompt, target\); set answer_column"):
        ExactAnswer().score_rows(["12"], rows)
    with pytest.raises(RewardError, match="reward ExactAnswer raised GRPOConfigError: .*no 'answer' column") as caught:
        score_samples(ExactAnswer(), samples_of(["12"], rows), ["12"], rows)
    assert "\n" not in str(caught.value)


def test_an_answer_without_a_number_is_refused():
    with pytest.raises(GRPOConfigError, match="holds no number"):
        ExactAnswer().score_rows(["12"], [{"prompt": "q", "answer": "twelve"}])


def test_without_rows_it_says_it_needs_them():
    with pytest.raises(RewardError, match="reads each sample's row"):
        score_samples(ExactAnswer(), ["What is 7 + 5? 12"])


def test_bad_answer_column_and_description():
    with pytest.raises(GRPOConfigError, match="answer_column must be a non-empty string"):
        ExactAnswer(answer_column="")
    assert describe_reward(ExactAnswer()) == {
        "class_path": "rewards.exact_answer.ExactAnswer", "init_args": {"answer_column": "answer"}
    }  # fmt: skip
