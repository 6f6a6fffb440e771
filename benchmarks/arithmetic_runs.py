"""Does GRPO teach the embedded model arithmetic? Held-out accuracy over a training run, for several seeds.

Usage:
    python benchmarks/arithmetic_runs.py [--config experiments/arithmetic.yaml] [--seeds 1 2 3]
                                         [--keep DIR] [--existing SEED=RUN_DIR ...] [--out results.json]
                                         [extra grpo-lightning fit flags, e.g. --model.total_phases 30]

Each seed is a real ``grpo-lightning fit`` of the config in a fresh subprocess, one after another (so each
has the machine's cores to itself), with ``--model.seed`` overridden and everything else as the config
says (the precision too: the machine's default). ``--existing 1=runs/lightning_logs/version_0`` reads a run
already made with that seed instead of running it.

Read back from each run's TensorBoard events: ``eval/accuracy`` and ``eval/mean_reward`` at every held-out
evaluation (greedy answers to the fixed held-out set: before training and every ``eval_every_n_phases``
phases), with the minutes since the run's first event (the start of training: loading the model comes
before it) and the phase it followed. The report gives each run's curve, the rise of each from its
starting accuracy, and the noise of a held-out accuracy: the binomial standard error sqrt(p (1 - p) / n)
of the starting accuracy over the n held-out problems.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.learning_curves import timed_fit  # noqa: E402  (needs the line above as a script)


def read_evaluations(run_dir: str) -> list[dict]:
    """The held-out evaluations of a run: step, phase, minutes since its first event, accuracy, mean reward,
    problems. The phase is read from Lightning's ``epoch`` scalar at the same step (0 before training)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    if "eval/accuracy" not in tags:
        raise SystemExit(f"error: {run_dir} has no eval/accuracy: was model.eval_prompts set?")
    start = min(min(e.wall_time for e in events.Scalars(tag)) for tag in tags)
    epochs = {e.step: int(e.value) for e in events.Scalars("epoch")} if "epoch" in tags else {}
    rewards = {e.step: e.value for e in events.Scalars("eval/mean_reward")}
    problems = {e.step: e.value for e in events.Scalars("eval/prompts")}
    evaluations = []
    for event in events.Scalars("eval/accuracy"):
        phase = 0 if event.step == 0 else epochs.get(event.step, -1) + 1
        evaluations.append({
            "step": event.step, "phase": phase, "minutes": (event.wall_time - start) / 60,
            "accuracy": event.value, "mean_reward": rewards.get(event.step), "problems": int(problems.get(event.step, 0)),
        })  # fmt: skip
    return evaluations


def run_seed(config: str, seed: int, root: str, extra: list[str]) -> tuple[str, float]:
    """One fit in a subprocess; returns its run directory and the whole command's seconds."""
    seconds = timed_fit(["--config", config, "--model.seed", str(seed), "--trainer.default_root_dir", root, *extra],
                        f"seed {seed}")  # fmt: skip
    versions = sorted(Path(root, "lightning_logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    return str(versions[-1]), seconds


def standard_error(accuracy: float, problems: int) -> float:
    return math.sqrt(accuracy * (1 - accuracy) / problems) if problems else float("nan")


def report(runs: list[dict]) -> str:
    lines = ["held-out accuracy (greedy) at each evaluation: phase @ minutes since the start of training", ""]
    for run in runs:
        curve = "  ".join(f"{e['phase']}@{e['minutes']:.1f}m {100 * e['accuracy']:.1f}%" for e in run["evaluations"])
        lines.append(f"seed {run['seed']}: {curve}")
    lines.append("")
    for run in runs:
        first, evaluations = run["evaluations"][0], run["evaluations"]
        best = max(evaluations[1:], key=lambda e: e["accuracy"], default=first)
        last = evaluations[-1]
        within = [e for e in evaluations if e["minutes"] <= 30.0]
        at_30 = within[-1] if within else first
        se = standard_error(first["accuracy"], first["problems"])
        lines.append(
            f"seed {run['seed']}: start {100 * first['accuracy']:.1f}% (n={first['problems']}, standard error "
            f"{100 * se:.1f} points); last within 30 min: phase {at_30['phase']} {100 * at_30['accuracy']:.1f}% "
            f"({(at_30['accuracy'] - first['accuracy']) / se:+.1f} SE); end: phase {last['phase']} "
            f"{100 * last['accuracy']:.1f}% at {last['minutes']:.1f} min; best: phase {best['phase']} {100 * best['accuracy']:.1f}%"
        )
    rises = [run["evaluations"][-1]["accuracy"] - run["evaluations"][0]["accuracy"] for run in runs]
    spread = f" ± {100 * statistics.stdev(rises):.1f}" if len(rises) > 1 else ""
    lines.append(f"rise start -> end, mean over {len(runs)} seed(s): {100 * statistics.mean(rises):+.1f}{spread} points")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/arithmetic.yaml")
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument("--keep", default="runs/arithmetic_seeds", metavar="DIR", help="the runs' directories go under DIR")
    parser.add_argument("--existing", nargs="*", default=[], metavar="SEED=RUN_DIR", help="runs already made")
    parser.add_argument("--out", default=None, help="also write the evaluations as JSON")
    opts, extra = parser.parse_known_args(argv)
    if not os.path.isfile(opts.config):
        parser.error(f"no config file at {opts.config}")
    from grpo_lightning.precision import cpu_info

    runs = []
    for item in opts.existing:
        seed, _, run_dir = item.partition("=")
        if not seed.isdigit() or not os.path.isdir(run_dir):
            parser.error(f"--existing takes SEED=RUN_DIR with an existing directory, got {item!r}")
        runs.append({"seed": int(seed), "run_dir": run_dir, "seconds": None, "evaluations": read_evaluations(run_dir)})
    for seed in opts.seeds:
        print(f"running {opts.config} with seed {seed} ...", file=sys.stderr, flush=True)
        run_dir, seconds = run_seed(opts.config, seed, os.path.join(opts.keep, f"seed{seed}"), extra)
        runs.append({"seed": seed, "run_dir": run_dir, "seconds": seconds, "evaluations": read_evaluations(run_dir)})
        print(f"  done in {seconds / 60:.1f} min", file=sys.stderr, flush=True)
    if not runs:
        parser.error("nothing to report: give --seeds or --existing")
    runs.sort(key=lambda run: run["seed"])
    print(f"CPU: {cpu_info().describe()}; torch threads {__import__('torch').get_num_threads()}")
    print(report(runs))
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"config": opts.config, "extra_args": extra, "cpu": cpu_info().describe(), "runs": runs}, f, indent=2)
        print(f"\nwrote {opts.out}")


if __name__ == "__main__":
    main()
