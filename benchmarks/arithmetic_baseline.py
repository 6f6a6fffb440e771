"""How well the embedded model does the arithmetic task before any training: the calibration of
``grpo_lightning.tasks.ArithmeticProblems``.

Usage:
    python benchmarks/arithmetic_baseline.py [--kinds add2,add1,mul1] [--template "What is {a} {op} {b}? ..."]
                                             [--heldout-size 60] [--max-new-tokens 24] [--model PATH] [--out results.json]

For each kind: the held-out set (``split="heldout"``), each prompt rendered through the tokenizer's chat
template (a user turn, then the assistant's start), decoded greedily (``grpo_lightning.evaluation.
greedy_complete``) until the model's end-of-turn token or --max-new-tokens, scored by ``rewards.ExactAnswer``
(the completion's last number against the answer). Prints the accuracy per kind, the seconds it took
(batched, left-padded decoding on the CPU) and a few completions, right and wrong; --out writes it all as JSON.

A task suits GRPO when the model starts neither near 0 (every group scores all zeros: no advantage, no
signal) nor near 1 (nothing left to learn); the task's docstring aims at 10-60 % held-out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import torch  # noqa: E402

from grpo_lightning.evaluation import greedy_rewards  # noqa: E402
from grpo_lightning.models import load_causal_lm, load_tokenizer  # noqa: E402
from grpo_lightning.sampling import stop_token_ids  # noqa: E402
from grpo_lightning.tasks import DEFAULT_TEMPLATE, KINDS, ArithmeticProblems  # noqa: E402
from rewards import ExactAnswer  # noqa: E402


def evaluate_kind(model, tokenizer, kind: str, template: str, heldout_size: int, max_new_tokens: int) -> dict:
    rows = ArithmeticProblems(kind=kind, split="heldout", heldout_size=heldout_size, template=template).all_rows()
    start = time.perf_counter()
    completions, rewards = greedy_rewards(model, tokenizer, rows, ExactAnswer(), max_new_tokens, stop_token_ids(tokenizer))
    seconds = time.perf_counter() - start
    return {
        "kind": kind,
        "template": template,
        "problems": len(rows),
        "correct": int(rewards.sum()),
        "accuracy": float(rewards.mean()),
        "seconds": round(seconds, 2),
        "completions": [
            {"prompt": row["prompt"], "answer": row["answer"], "completion": completion, "reward": float(reward)}
            for row, completion, reward in zip(rows, completions, rewards)
        ],
    }


def machine() -> dict:
    return {
        "processor": platform.processor() or platform.machine(),
        "system": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="add2,add1,mul1", help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--template", default=DEFAULT_TEMPLATE)
    parser.add_argument("--heldout-size", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--model", default=None, help="a model directory or hub id (default: the embedded model)")
    parser.add_argument("--show", type=int, default=3, help="completions shown per kind, right and wrong each")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    opts = parser.parse_args(argv)

    torch.manual_seed(0)
    tokenizer, model = load_tokenizer(opts.model), load_causal_lm(opts.model)
    info = machine()
    print(f"machine: {info['processor']}, {info['cpu_count']} CPUs, {info['torch_threads']} torch threads, "
          f"torch {info['torch']}, {info['system']}")  # fmt: skip
    print(f"template: {opts.template!r}; greedy, chat template, up to {opts.max_new_tokens} new tokens\n")
    results = []
    for kind in opts.kinds.split(","):
        result = evaluate_kind(model, tokenizer, kind, opts.template, opts.heldout_size, opts.max_new_tokens)
        results.append(result)
        print(f"{kind}: {result['accuracy']:.0%} ({result['correct']}/{result['problems']}) in {result['seconds']:.1f} s")
        right = [c for c in result["completions"] if c["reward"] == 1.0][: opts.show]
        wrong = [c for c in result["completions"] if c["reward"] == 0.0][: opts.show]
        for c in right + wrong:
            mark = "right" if c["reward"] == 1.0 else "wrong"
            print(f"   {mark} {c['prompt']!r} (answer {c['answer']}) -> {c['completion']!r}")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"machine": info, "command": sys.argv, "max_new_tokens": opts.max_new_tokens, "results": results}, f, indent=2)
        print(f"\nwrote {opts.out}")


if __name__ == "__main__":
    main()
