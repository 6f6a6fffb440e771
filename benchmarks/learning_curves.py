"""Learning curves of one experiment config under several precisions and seeds: does the fast setting learn
as well as fp32?

Usage:
    python benchmarks/learning_curves.py --config experiments/smoke_kl0.yaml [--seeds 1 2 3]
                                         [--precisions 32-true bf16-mixed] [--out curves.json]

Each (precision, seed) is a real ``grpo-lightning fit`` of the config, run one after another in a fresh
subprocess (so each has the machine's cores to itself), with ``--model.seed`` and ``--trainer.precision``
overridden and everything else as the config says. The mean reward of every phase is read back from the
run's TensorBoard events (``rollout/reward_mean``).

The report gives each run's curve, then per precision the mean and standard deviation over seeds of the mean
reward of the last phase and of the last quarter of the phases, and the difference between the precisions
together with its standard error (from the seed-to-seed spread). "Within noise" means the difference is
smaller than two standard errors.
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

from grpo_lightning.machine import fp32_peak_gflops, kernel_settings
from grpo_lightning.precision import cpu_info, precision_warning

PRECISIONS = ("32-true", "bf16-mixed")


def timed_fit(fit_args: list[str], what: str) -> float:
    """Runs ``grpo-lightning fit <fit_args>`` (no progress bar) in a subprocess and returns the whole
    command's seconds; a failed run ends the script with the end of its stderr."""
    command = [sys.executable, "-m", "grpo_lightning", "fit", "--trainer.enable_progress_bar", "false", *fit_args]
    start = time.perf_counter()
    completed = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if completed.returncode != 0:
        raise SystemExit(f"error: {what} failed:\n{completed.stderr[-2000:]}")
    return seconds


def run_once(config: str, precision: str, seed: int, extra: list[str], keep_root: str | None = None) -> dict:
    """One fit in a subprocess; returns its per-phase mean rewards and wall time. With ``keep_root`` the run's
    directory (TensorBoard events, checkpoints) is kept under it, as ``<precision>_seed<seed>``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(keep_root, f"{precision}_seed{seed}") if keep_root else tmp
        fit_args = ["--config", config, "--model.seed", str(seed), "--trainer.precision", precision,
                    "--trainer.default_root_dir", root, "--model.export_dir", "null", *extra]  # fmt: skip
        seconds = timed_fit(fit_args, f"{precision} seed {seed}")
        events = EventAccumulator(os.path.join(root, "lightning_logs", "version_0"), size_guidance={"scalars": 0})
        events.Reload()
        rewards = [event.value for event in events.Scalars("rollout/reward_mean")]
        phase_seconds = sum(event.value for event in events.Scalars("perf/phase_s"))
    # seconds: the whole command (loading, checkpoints every phase); phase_seconds: the phases themselves
    return {"precision": precision, "seed": seed, "rewards": rewards, "seconds": seconds, "phase_seconds": phase_seconds}


def summarise(runs: list[dict], precisions: list[str]) -> dict:
    """Per precision: last-phase and last-quarter mean reward, mean and stdev over seeds; and the gap."""
    summary = {}
    for precision in precisions:
        curves = [r["rewards"] for r in runs if r["precision"] == precision]
        quarter = max(1, len(curves[0]) // 4)
        last = [c[-1] for c in curves]
        tail = [statistics.mean(c[-quarter:]) for c in curves]
        summary[precision] = {
            "last_phase": {"mean": statistics.mean(last), "stdev": _stdev(last), "values": last},
            "last_quarter": {"mean": statistics.mean(tail), "stdev": _stdev(tail), "values": tail, "phases": quarter},
            "mean_curve": [statistics.mean(values) for values in zip(*curves)],
        }
    if len(precisions) == 2:
        a, b = (summary[p]["last_quarter"] for p in precisions)
        n_a, n_b = len(a["values"]), len(b["values"])
        stderr = (a["stdev"] ** 2 / n_a + b["stdev"] ** 2 / n_b) ** 0.5
        gap = b["mean"] - a["mean"]
        summary["difference"] = {"of": f"{precisions[1]} - {precisions[0]}, last-quarter mean reward",
                                 "value": gap, "stderr": stderr, "within_noise": abs(gap) <= 2 * stderr}  # fmt: skip
    return summary


def _stdev(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def report(config: str, runs: list[dict], summary: dict, precisions: list[str]) -> str:
    phases = len(runs[0]["rewards"])
    lines = [f"{config}: mean reward per phase (rollout/reward_mean); wall: the whole command, phases: the sum of "
             "perf/phase_s (rollout and learning, without loading and checkpoint writes)", ""]
    header = f"{'precision':<11} {'seed':>4} {'wall':>7} {'phases':>7}  " + " ".join(f"{i + 1:>5}" for i in range(phases))
    lines += [header, "-" * len(header)]
    for r in runs:
        curve = " ".join(f"{v:5.2f}" for v in r["rewards"])
        lines.append(f"{r['precision']:<11} {r['seed']:>4} {r['seconds']:6.0f}s {r['phase_seconds']:6.0f}s  {curve}")
    lines.append("")
    for precision in precisions:
        s = summary[precision]
        quarter = s["last_quarter"]
        lines.append(
            f"{precision:<11} last phase {s['last_phase']['mean']:.2f} ± {s['last_phase']['stdev']:.2f}; "
            f"last {quarter['phases']} phase(s) {quarter['mean']:.2f} ± {quarter['stdev']:.2f} (mean ± stdev over seeds)"
        )
    if "difference" in summary:
        d = summary["difference"]
        verdict = "within noise" if d["within_noise"] else "NOT within noise"
        lines.append(f"difference ({d['of']}): {d['value']:+.2f} ± {d['stderr']:.2f} (standard error): {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--out", default=None, help="also write the runs and summary as JSON")
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep each run's directory under DIR")
    opts, extra = parser.parse_known_args(argv)  # anything else goes to grpo-lightning fit, e.g. --model.lr 1e-4
    if not os.path.isfile(opts.config):
        parser.error(f"no config file at {opts.config}")
    if opts.out:  # the folder first: minutes of runs must not end in a FileNotFoundError
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    cpu = cpu_info()
    if not cpu.native_bf16 and "bf16-mixed" in opts.precisions:
        print(f"warning: {precision_warning('bf16-mixed', 'cpu')}", file=sys.stderr, flush=True)
    machine = {"cpu": cpu.record(),
               "matmul_peak_gflops_per_s": fp32_peak_gflops(2048), "kernel_settings": kernel_settings()}  # fmt: skip
    print(f"CPU: {cpu.describe()}; fp32 matmul peak {machine['matmul_peak_gflops_per_s']['fp32']:.0f} GFLOP/s",
          file=sys.stderr, flush=True)  # fmt: skip
    runs = []
    for precision in opts.precisions:
        for seed in opts.seeds:
            print(f"running {opts.config} / {precision} / seed {seed} ...", file=sys.stderr, flush=True)
            runs.append(run_once(opts.config, precision, seed, extra, opts.keep))
            print(f"  {' '.join(f'{v:.2f}' for v in runs[-1]['rewards'])} ({runs[-1]['seconds']:.0f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip
    summary = summarise(runs, opts.precisions)
    print(report(opts.config, runs, summary, opts.precisions))
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"config": opts.config, "extra_args": extra, "machine": machine, "runs": runs, "summary": summary},
                      f, indent=2)  # fmt: skip
        print(f"\nwrote {opts.out}")


if __name__ == "__main__":
    main()
