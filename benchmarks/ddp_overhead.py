"""The same GRPO phase as 1 process x 2 threads and as 2 processes x 1 thread (Lightning's DDP, gloo).

Usage:
    python benchmarks/ddp_overhead.py [--model PATH | --tiny] [--phases N] [--batch-size G] [--gen-len T]
                                      [--num-minibatches M] [--precision 32-true|bf16-mixed] [--out results.json]

What is measured
----------------
``grpo-lightning fit`` itself, in a fresh subprocess per layout, on a phase of 2 prompts (groups of G
completions, of "This is" and "The weather today"; default G = 16, so 32 completions of 30 tokens in 2 steps,
the README's small workload), so that both layouts do the same work:

  1 x 2   one process with 2 PyTorch threads (OMP_NUM_THREADS=2) rolls out both groups and takes M steps over
          minibatches of 2G/M sequences
  2 x 1   two processes with 1 thread each (--trainer.strategy ddp --trainer.devices 2), one group each, M steps
          over minibatches of G/M sequences, the gradients all-reduced over gloo after every backward

The seconds are the module's own per-phase timers (TensorBoard ``perf/``: under DDP the slowest rank's), the
mean over the phases after the first (a warm-up: kernels, allocator, AdamW state). "wall" is the whole
command: start-up (imports, model loading, process launch) and the checkpoint written after every phase
included. On a 2-core CPU the 2 x 1 layout is expected to be slower: two processes compute what one
process's two threads computed, plus the all-reduces, two copies of the model and the optimizer, and the
rollout record gathered every phase. The point is the overhead figure. Run it on an idle machine: a busy
core slows either layout severalfold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["This is", "The weather today"]
PARTS = ("generate", "ref_logprobs", "learn", "phase")
LAYOUTS = {  # name: (processes, threads per process)
    "1 x 2": (1, 2),
    "2 x 1": (2, 1),
}


def fit_command(opts, layout: str, prompts: Path, root: Path) -> list[str]:
    processes, _ = LAYOUTS[layout]
    command = [
        sys.executable, "-m", "grpo_lightning.cli", "fit",
        "--model.prompts", "grpo_lightning.prompts.PromptFile", "--model.prompts.path", str(prompts),
        "--model.prompts_per_phase", str(len(PROMPTS)), "--model.batch_size", str(opts.batch_size),
        "--model.num_minibatches", str(opts.num_minibatches), "--model.batches_per_learning_phase", "1",
        "--model.gen_len", str(opts.gen_len), "--model.total_phases", str(opts.phases + 1), "--model.warmup_steps", "0",
        "--model.lr", "1e-5", "--model.samples_shown", "0", "--model.export_dir", "null",
        "--trainer.precision", opts.precision, "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    ]  # fmt: skip
    if opts.model:
        command += ["--model.model_name_or_path", opts.model]
    if processes > 1:
        command += ["--trainer.strategy", "ddp", "--trainer.devices", str(processes)]
    return command


def phase_seconds(root: Path) -> dict[str, list[float]]:
    """The perf/<part>_s scalars of every phase, in order, from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "lightning_logs" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    return {part: [e.value for e in sorted(events.Scalars(f"perf/{part}_s"), key=lambda e: e.step)] for part in PARTS}


def summarise(per_phase: dict[str, list[float]], warmup: int = 1) -> dict[str, float]:
    """The mean of each part over the phases after the first ``warmup``."""
    return {part: statistics.mean(values[warmup:]) for part, values in per_phase.items()}


def run_layout(opts, layout: str, prompts: Path, work: Path) -> dict:
    _, threads = LAYOUTS[layout]
    root = work / layout.replace(" ", "")
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # the checkout first, then the caller's
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
    start = time.perf_counter()
    done = subprocess.run(fit_command(opts, layout, prompts, root), cwd=REPO, env=environment, capture_output=True,
                          text=True)  # fmt: skip
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"error: the {layout} run failed:\n{(done.stdout + done.stderr)[-3000:]}")
    per_phase = phase_seconds(root)
    return {"layout": layout, "wall_s": wall, "per_phase": per_phase, "mean": summarise(per_phase)}


def tiny_model(directory: Path) -> str:
    """The tests' tiny Llama (tests/conftest.py), saved to ``directory``."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import build_tiny_llama, build_tokenizer

    tokenizer = build_tokenizer()
    build_tiny_llama(len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory or hub id (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny Llama (a check that the script runs)")
    parser.add_argument("--phases", type=int, default=2, help="measured phases, after one warm-up phase")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="completions per group, 2 groups per phase (16: the README's small workload, 32 in all)")
    parser.add_argument("--gen-len", type=int, default=30)
    parser.add_argument("--num-minibatches", type=int, default=2, help="steps per phase")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--out", help="write the results as JSON here")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        if opts.tiny:
            opts.model = tiny_model(work / "tiny")
        prompts = work / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in PROMPTS))
        results = [run_layout(opts, layout, prompts, work) for layout in LAYOUTS]
    print(f"one phase: {len(PROMPTS)} groups of {opts.batch_size} x {opts.gen_len} tokens, {opts.num_minibatches} "
          f"steps, {opts.precision}; mean of {opts.phases} phases after a warm-up; seconds")  # fmt: skip
    print(f"{'layout':<8}" + "".join(f"{part:>14}" for part in PARTS) + f"{'wall':>10}")
    for result in results:
        print(f"{result['layout']:<8}" + "".join(f"{result['mean'][part]:>14.3f}" for part in PARTS)
              + f"{result['wall_s']:>10.1f}")  # fmt: skip
    one, two = (result["mean"]["phase"] for result in results)
    print(f"2 processes x 1 thread / 1 process x 2 threads, phase: {two / one:.2f}")
    if opts.out:
        Path(opts.out).write_text(json.dumps({"settings": vars(opts), "results": results}, indent=2))


if __name__ == "__main__":
    main()
