"""Sampling a phase's groups one after another against together, in one decode (``rollout.sample_prompt_groups``).

Usage:
    python benchmarks/group_decoding.py [--groups 4] [--group-size 16] [--gen-len 32] [--runs 4]
                                        [--precision auto|32-true|bf16-mixed|both] [--model PATH] [--out results.json]

The groups are those of ``experiments/arithmetic.yaml``: arithmetic problems (``tasks.ArithmeticProblems``) asked
through the chat template, answers ending at the end-of-turn token. "separately" samples each group in a decode of
its own, as the library did before; "together" samples them all in one decode, prompts left-padded, as it does now.
The two alternate, ``--runs`` times each, in one process, and each run is seeded alike (the two draw different
tokens all the same: the rows share one random stream). Prints each run's seconds and the medians, with the CPU
and its 2048^3 matmul peaks, measured first, as benchmarks/phase_time.py measures them. ``--precision auto`` (the
default) is the one a run would choose on this machine: bf16-mixed only where bf16 is native.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import torch  # noqa: E402

from benchmarks.phase_time import run_meta, square_gemm_peaks  # noqa: E402
from grpo_lightning import load_causal_lm, load_tokenizer  # noqa: E402
from grpo_lightning.machine import keep_freed_memory_for_reuse  # noqa: E402
from grpo_lightning.models import embedded_model_dir  # noqa: E402
from grpo_lightning.precision import choose_precision, cpu_info  # noqa: E402
from grpo_lightning.rollout import sample_prompt_groups  # noqa: E402
from grpo_lightning.sampling import stop_token_ids  # noqa: E402
from grpo_lightning.tasks import ArithmeticProblems  # noqa: E402


def time_sampling(model, tokenizer, rows: list[dict], group_size: int, gen_len: int, together: bool, seed: int) -> float:
    """Seconds to sample ``group_size`` answers to each of ``rows``, in one decode or one decode per row."""
    options = dict(stop_tokens=stop_token_ids(tokenizer), chat_template=bool(getattr(tokenizer, "chat_template", None)))
    torch.manual_seed(seed)
    start = time.perf_counter()
    for batch in [rows] if together else [[row] for row in rows]:
        sample_prompt_groups(model, tokenizer, batch, group_size, gen_len, **options)
    return time.perf_counter() - start


def compare(model, tokenizer, rows, group_size: int, gen_len: int, runs: int, precision: str) -> dict:
    seconds = {"separately": [], "together": []}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        for run in range(runs):
            for way in seconds:
                seconds[way].append(time_sampling(model, tokenizer, rows, group_size, gen_len, way == "together", run))
    return {way: {"seconds": values, "median": statistics.median(values)} for way, values in seconds.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--precision", choices=["auto", "32-true", "bf16-mixed", "both"], default="auto")
    parser.add_argument("--model", default=None, help="a model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    opts = parser.parse_args(argv)
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    peaks = square_gemm_peaks(cpu_info().native_bf16)  # first, in a fresh process
    keep_freed_memory_for_reuse()
    path = opts.model or str(embedded_model_dir())
    model, tokenizer = load_causal_lm(path), load_tokenizer(path)
    rows = ArithmeticProblems(kind="mixed").draw(seed=1, phase=0, count=opts.groups)
    results = {**run_meta(), "peaks_gflops": peaks, "groups": opts.groups, "group_size": opts.group_size,
               "gen_len": opts.gen_len, "runs": {}}  # fmt: skip
    print(f"CPU: {cpu_info().describe()}; 2048^3 matmul peaks: " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()) + " GFLOP/s")
    precisions = {"auto": [choose_precision("cpu")[0]], "both": ["32-true", "bf16-mixed"]}.get(opts.precision, [opts.precision])
    for precision in precisions:
        result = compare(model, tokenizer, rows, opts.group_size, opts.gen_len, opts.runs, precision)
        results["runs"][precision] = result
        for way, values in result.items():
            listed = ", ".join(f"{s:.2f}" for s in values["seconds"])
            print(f"{precision:>10} {opts.groups} groups of {opts.group_size}, {way:>10}: {listed} s (median {values['median']:.2f})")
    if opts.out:
        Path(opts.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
