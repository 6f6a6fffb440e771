"""A verifiable reward: 1 when the completion's final number is the row's answer, else 0.

Which number: the LAST one in the completion. A small chat model restates the question before answering
("16 + 44 = 60"), so the first number is usually the question's own operand; the last one is what it
concluded. Measured on the embedded SmolLM2-135M-Instruct (grpo_lightning/tasks.py): two-digit addition
scores 0 % held-out with the first number and about 20 % with the last. A completion cut off mid-
explanation ("The answer is 7 because 3 + 4") scores by its last number too, so rambling past the answer
costs reward.

What counts as a number: an integer or a decimal, with an optional sign ("-3"; a minus right after a digit,
a letter or a closing bracket is an operator: "5-3" is 5 and 3) and optional thousands commas ("1,024").
A trailing period ends a sentence ("12." is 12); "12.0" equals 12; numbers written in words do not count.
The answer column is read the same way (its last number), so an answer "82", 82 or "#### 82" all work.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from torch import Tensor

from .base import Reward, as_reward_tensor, reward_config_error

_NUMBER = re.compile(
    r"(?<![\w.])"  # not the tail of a word or of a decimal
    r"(?:(?<![\w)\]])([-\u2212]))?"  # a sign, unless right after an operand (then it is a minus operator)
    r"(\d{1,3}(?:,\d{3})+(?!\d)|\d+)"  # digits, maybe grouped by commas in threes ("1,2345" is 1 and 2345)
    r"(\.\d+)?"  # decimals (a period not followed by a digit ends a sentence)
)


def parse_numbers(text: str) -> list[Decimal]:
    """Every number in ``text``, in order, as exact decimals."""
    numbers = []
    for match in _NUMBER.finditer(text):
        sign, digits, decimals = match.groups()
        try:
            value = Decimal(digits.replace(",", "") + (decimals or ""))
        except InvalidOperation:  # cannot happen for what the pattern matches; skipped to stay total
            continue
        numbers.append(-value if sign else value)
    return numbers


def final_number(text: str) -> Decimal | None:
    """The last number in ``text``, or None if it has none."""
    numbers = parse_numbers(text)
    return numbers[-1] if numbers else None


class ExactAnswer(Reward):
    """1.0 where the last number of the completion equals the row's ``answer_column``, else 0.0.

    Reads each sample's row (``score_rows``), so it needs prompts from data (``model.prompts``), for
    instance ``grpo_lightning.tasks.ArithmeticProblems``."""

    def __init__(self, answer_column: str = "answer"):
        """
        Args:
            answer_column: the row column holding the right answer (a number, or text ending in one).
        """
        if not isinstance(answer_column, str) or not answer_column:
            raise reward_config_error(f"ExactAnswer: answer_column must be a non-empty string, got {answer_column!r}")
        self.answer_column = answer_column

    def score_rows(self, completions: list[str], rows: list[dict]) -> Tensor:
        return as_reward_tensor([float(self._correct(completion, row)) for completion, row in zip(completions, rows)])

    def _correct(self, completion: str, row: dict) -> bool:
        if self.answer_column not in row:
            columns = ", ".join(map(str, row)) or "none"
            raise reward_config_error(
                f"ExactAnswer: the row has no '{self.answer_column}' column (its columns: {columns}); "
                "set answer_column to the column holding the answers"
            )
        answer = final_number(str(row[self.answer_column]))
        if answer is None:
            raise reward_config_error(
                f"ExactAnswer: the answer {row[self.answer_column]!r} (column '{self.answer_column}') holds no number"
            )
        return final_number(completion) == answer
