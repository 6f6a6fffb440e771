"""A verifiable task that ships with the library: arithmetic problems, generated from a seed.

``ArithmeticProblems`` is a prompt source (``grpo_lightning.prompts``) whose rows are
``{"prompt": "What is 37 + 45? Answer with just the number.", "answer": "82", "a": 37, "b": 45, "op": "+",
"kind": "add2"}``;
the reward ``rewards.ExactAnswer`` gives 1 where the completion's last number is the row's answer.

Kinds (the problem space each draws from, uniformly):
  ``add2``  two-digit addition, a, b in 10..99 (8,100 problems)
  ``add1``  one-digit addition, a, b in 0..9 (100 problems)
  ``mul1``  one-digit multiplication, a, b in 0..9 (100 problems), written with ``*``
  ``mixed`` the default: each problem one of the three; train draws pick the kind uniformly, the
            held-out set takes them in turn (add1, add2, mul1, add1, ...): 60 problems are 20 of each

Splits:
  ``train``    an endless stream: ``draw(seed, phase, count)`` gives ``count`` problems that depend on
               (kind, seed, phase) only, and the first k of a larger draw are the draw of k
  ``heldout``  a fixed list of ``heldout_size`` problems (60 by default), the same for every seed and
               run, read with ``len``/``row``/``all_rows``

Held-out problems never appear in the train stream. Each kind reserves a fixed pool of its problems
(the ones with the smallest SHA-256 of "kind:a op b"; nothing depends on a library's random number
generator, so the sets are the same on every version of Python and PyTorch); the held-out set is the
first ``heldout_size`` of that pool and the train stream draws from the rest. The pool is 810 problems
(10 %) for ``add2``, so the train stream keeps 7,290. One-digit kinds have only 100 problems, so their
pool is 60 and training sees only the other 40 (a held-out 5 + 3 may have its 3 + 5 in training):
there the held-out accuracy measures generalisation to unseen facts of a tiny table, not what ``add2``
measures. ``add2`` is the kind where the held-out set means most, but the model starts too low on it
(below); ``mixed`` holds 1/3 of it.

Calibration (``benchmarks/arithmetic_baseline.py``, results in benchmarks/results/arithmetic_baseline.json):
the embedded SmolLM2-135M-Instruct, greedy, the prompt rendered through its chat template, up to 24 new
tokens or its end-of-turn token, scored by ``ExactAnswer`` (the completion's last number), on each kind's
held-out set of 60, with the default wording "What is {a} {op} {b}? Answer with just the number.", about
14 s per kind on one CPU thread:
  mixed  35 % (21/60: add1 9/20, add2 1/20, mul1 11/20)   <- the default: inside the 10-60 % aimed at
  add2    5 % (3/60; 11 %, 45/400, on its first 400 held-out problems: near the floor)
  add1   63 % (38/60)
  mul1   60 % (36/60)
experiments/arithmetic.yaml (mixed, up to 32 tokens, bf16-mixed) starts at 41.7 % (25/60); the 35 % above
were up to 24 tokens in fp32 (which of the two differences counts was not measured).
A GRPO group learns only where some of its samples are right and some wrong, so a task starting near 0 %
gives mostly all-zero groups, and one near 100 % nothing to learn. The model seldom gives the bare number
it is asked for: it restates the sum ("16 + 47 = 63", "33 + 75 = 20."), says "The answer is 0." to
"0 + 8", or starts an explanation that 24 tokens cut off. Other wordings did no better on two-digit
addition (the same 120 random problems each, greedy_complete in a throwaway script): the default 17 %,
"Compute {a} + {b}. Reply with only the result, a single number." 18 %, "... Answer with just the number, for example:
42." 3 %, "Add {a} and {b}. Give only the sum." 4 %, "What is the sum of {a} and {b}?" 2 %. The first
number instead of the last would score far worse (add2 0 %): it is the question's operand in "16 + 47 = 63".
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

from .config import GRPOConfigError
from .prompts import PromptSource, Row

DEFAULT_TEMPLATE = "What is {a} {op} {b}? Answer with just the number."

# kind -> (operand range, operator, size of the reserved held-out pool)
KINDS = {
    "add1": (range(0, 10), "+", 60),
    "add2": (range(10, 100), "+", 810),
    "mul1": (range(0, 10), "*", 60),
}
MIXED = ("add1", "add2", "mul1")  # kind "mixed": each problem one of these, in turn (held-out) or by hash (train)
SPLITS = ("train", "heldout")


def heldout_capacity(kind: str) -> int:
    """The most problems the held-out set of ``kind`` can hold: its reserved pool."""
    if kind == "mixed":
        return len(MIXED) * min(KINDS[k][2] for k in MIXED)
    return KINDS[kind][2]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _evaluate(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a * b


@lru_cache(maxsize=None)
def problem_pools(kind: str) -> tuple[tuple, tuple]:
    """(held-out pool, train pool) of ``kind``: its problems (a, op, b) split once and for all, the
    held-out pool in its fixed order (by hash), the train pool in (a, b) order."""
    operands, op, reserved = KINDS[kind]
    problems = [(a, op, b) for a in operands for b in operands]
    by_hash = sorted(problems, key=lambda p: _hash(f"{kind}:{p[0]} {p[1]} {p[2]}"))
    heldout = tuple(by_hash[:reserved])
    held = set(heldout)
    return heldout, tuple(p for p in problems if p not in held)


class ArithmeticProblems(PromptSource):
    """Arithmetic problems as prompt rows with their answers (see the module docstring).

    Usable from YAML as ``model.prompts: {class_path: grpo_lightning.tasks.ArithmeticProblems,
    init_args: {kind: mixed}}`` with ``reward: {class_path: rewards.ExactAnswer}``."""

    def __init__(self, kind: str = "mixed", split: str = "train", heldout_size: int = 60, template: str = DEFAULT_TEMPLATE):
        """
        Args:
            kind: "mixed" (the three below, in turn), "add2" (two-digit addition), "add1" (one-digit
                addition) or "mul1" (one-digit multiplication).
            split: "train" (an endless stream drawn by seed and phase) or "heldout" (a fixed set).
            heldout_size: how many problems the held-out set holds (at most the kind's reserved pool:
                810 for add2, 60 for add1 and mul1, 180 for mixed); unused by the train split.
            template: the prompt, a format string with {a}, {b} and optionally {op}.
        """
        if kind not in (*KINDS, "mixed"):
            raise GRPOConfigError(f"ArithmeticProblems: kind must be one of {', '.join(KINDS)} or mixed, got {kind!r}")
        if split not in SPLITS:
            raise GRPOConfigError(f"ArithmeticProblems: split must be 'train' or 'heldout', got {split!r}")
        reserved = heldout_capacity(kind)
        if isinstance(heldout_size, bool) or not isinstance(heldout_size, int) or not 1 <= heldout_size <= reserved:
            raise GRPOConfigError(
                f"ArithmeticProblems: heldout_size must be an integer from 1 to {reserved} for kind {kind}, got {heldout_size!r}"
            )
        if not isinstance(template, str) or "{a}" not in template or "{b}" not in template:
            raise GRPOConfigError(f"ArithmeticProblems: template must be a string holding {{a}} and {{b}}, got {template!r}")
        if "{op}" not in template and kind != "add1" and kind != "add2":
            raise GRPOConfigError(f"ArithmeticProblems: kind {kind} has several operators, so template must hold {{op}}, got {template!r}")
        try:
            template.format(a=1, b=2, op="+")
        except (KeyError, IndexError, ValueError) as error:
            raise GRPOConfigError(
                f"ArithmeticProblems: template {template!r} is not a format string with only {{a}}, {{b}} and {{op}} ({error})"
            ) from error
        self.kind = kind
        self.split = split
        self.heldout_size = heldout_size
        self.template = template

    def make_row(self, kind: str, a: int, op: str, b: int) -> Row:
        prompt = self.template.format(a=a, b=b, op=op)
        return {"prompt": prompt, "answer": str(_evaluate(a, op, b)), "a": a, "b": b, "op": op, "kind": kind}

    def draw(self, seed: int, phase: int, count: int) -> list[Row]:
        """``count`` problems for ``phase``. Train: drawn uniformly (with replacement) from the kind's
        train pool, the i-th from a hash of (seed, phase, i) alone. Held-out: the fixed set, walked
        through in shuffled passes (``PromptSource.draw``)."""
        if self.split == "heldout":
            return super().draw(seed, phase, count)
        rows = []
        for i in range(count):
            number = _hash(f"{seed}:{phase}:{i}")
            kind = self.kind
            if kind == "mixed":
                kind, number = MIXED[number % len(MIXED)], number // len(MIXED)
            pool = problem_pools(kind)[1]
            rows.append(self.make_row(kind, *pool[number % len(pool)]))
        return rows

    def __len__(self) -> int:
        if self.split == "train":
            raise NotImplementedError("ArithmeticProblems(split='train') is an endless stream: it has no length; use split='heldout'")
        return self.heldout_size

    def row(self, index: int) -> Row:
        if self.split == "train":
            raise NotImplementedError("ArithmeticProblems(split='train') is an endless stream: draw from it; use split='heldout'")
        if not 0 <= index < self.heldout_size:
            raise IndexError(f"held-out problem {index} of {self.heldout_size}")
        kind = self.kind
        if kind == "mixed":
            kind, index = MIXED[index % len(MIXED)], index // len(MIXED)
        return self.make_row(kind, *problem_pools(kind)[0][index])
