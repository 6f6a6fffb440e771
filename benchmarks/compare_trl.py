"""grpo-lightning against Hugging Face TRL's GRPOTrainer: the same workloads, one after the other, one table.

Usage (builds .venv-trl on first use; run on an idle machine, it takes 10-20 minutes a round on 2 cores):
    .venv/bin/python benchmarks/compare_trl.py [--workload small|default|both] [--lora] [--precision 32-true]
                                               [--rounds 1] [--out-dir benchmarks/results]

Runs ``benchmarks/phase_time.py`` (this project, in .venv) and ``benchmarks/trl_phase_time.py`` (TRL, in its own
.venv-trl: TRL is not a dependency of grpo-lightning) back to back on the same workloads, writes both JSON files
and prints, per workload: each one's seconds per phase, the FLOP limit (the phase's matmul FLOPs at this machine's
measured fp32 peak; TRL's includes the extra old-log-prob forward it chooses to run), and TRL's time over ours.
TRL runs in fp32: ``--precision bf16-mixed`` sets only ours (where bf16 is native), to compare the fast default
with TRL's fp32 run.

``--rounds N`` measures both N times, alternating which goes first (ours, TRL; then TRL, ours; ...), and adds
the median of the N ratios and their range. On a shared VM whose speed drifts by a quarter within minutes, one
run's ratio moved by ±15 % from one run to the next; alternating spreads the drift over both sides, and the
range says how far one round can be trusted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, REPO)

from benchmarks.phase_time import format_table  # noqa: E402


def run(command: list[str]) -> None:
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, cwd=REPO, check=True)


def comparison_rows(ours: list[dict], trl: list[dict]) -> list[list[str]]:
    """One row per workload present in both: ours s, TRL s, each one's FLOP limit, and TRL / ours.

    Both limits use one peak: the best fp32 rate measured in any of the runs (a run's own measurement can
    come out low, one core briefly busy, and would flatter that run's efficiency)."""
    peak = max(r["matmul_peak_gflops_per_s"]["fp32"] for r in (*ours, *trl))
    trl_by_workload = {r["workload"]: r for r in trl}
    rows = []
    for mine in ours:
        theirs = trl_by_workload.get(mine["workload"])
        if theirs is None:
            continue
        ours_s, trl_s = mine["mean_s"]["total"], theirs["mean_s"]["total"]
        ours_limit, trl_limit = (sum(r["gflop_per_phase"].values()) / peak for r in (mine, theirs))
        rows.append([
            mine["workload"], mine["finetune"], mine["precision"],
            f"{ours_s:.1f}", f"{ours_limit:.1f}", f"{ours_s / ours_limit:.2f}",
            f"{trl_s:.1f}", f"{trl_limit:.1f}", f"{trl_s / trl_limit:.2f}",
            f"{trl_s / ours_s:.2f}",
        ])  # fmt: skip
    return rows


HEADERS = ["workload", "finetune", "ours precision", "ours s", "ours limit s", "ours x limit", "TRL fp32 s",
           "TRL limit s", "TRL x limit", "TRL / ours"]  # fmt: skip


def rounds_summary(rounds: list[list[list[str]]]) -> list[list[str]]:
    """Per workload, over the rounds' ``comparison_rows``: the median of ours s, of TRL s and of the ratios,
    and the ratios' range (the median ratio is that of the rounds, not the ratio of the medians)."""
    by_workload: dict[tuple[str, ...], list[list[str]]] = {}
    for rows in rounds:
        for row in rows:
            by_workload.setdefault(tuple(row[:3]), []).append(row)
    summary = []
    for key, rows in by_workload.items():
        ours, trl, ratios = ([float(row[i]) for row in rows] for i in (3, 6, 9))
        summary.append([*key, str(len(rows)), f"{statistics.median(ours):.1f}", f"{statistics.median(trl):.1f}",
                        f"{statistics.median(ratios):.2f}", f"{min(ratios):.2f}-{max(ratios):.2f}"])  # fmt: skip
    return summary


SUMMARY_HEADERS = ["workload", "finetune", "ours precision", "rounds", "ours s (median)", "TRL fp32 s (median)",
                   "TRL / ours (median)", "TRL / ours (range)"]  # fmt: skip


def round_paths(out_dir: str, tag: str, round_index: int, rounds: int) -> tuple[str, str]:
    """The JSON files of one round: the plain names for a single round, ``..._round<k>`` for several."""
    suffix = "" if rounds == 1 else f"_round{round_index + 1}"
    return (os.path.join(out_dir, f"compare_ours_{tag}{suffix}.json"),
            os.path.join(out_dir, f"compare_trl_{tag}{suffix}.json"))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["small", "default", "both"], default="both")
    parser.add_argument("--lora", action="store_true", help="both train LoRA adapters (r=16) instead of the whole model")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true", help="ours only")
    parser.add_argument("--phases", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="measure both this many times, alternating which goes first")
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    opts = parser.parse_args(argv)

    if opts.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {opts.rounds}")
    finetune = "lora" if opts.lora else "full"
    tag = f"{opts.workload}_{finetune}_{opts.precision}"
    os.makedirs(os.path.join(REPO, opts.out_dir), exist_ok=True)  # before the runs, not after them
    python = os.path.join(".venv", "bin", "python")
    trl_python = os.path.join(".venv-trl", "bin", "python")
    if not os.path.exists(os.path.join(REPO, trl_python)):
        run(["bash", "benchmarks/setup_trl.sh"])
    tables = []
    for index in range(opts.rounds):
        ours_json, trl_json = round_paths(opts.out_dir, tag, index, opts.rounds)
        ours_run = [python, "benchmarks/phase_time.py", "--workload", opts.workload, "--precision", opts.precision,
                    "--finetune", finetune, "--phases", str(opts.phases), "--out", ours_json]  # fmt: skip
        trl_run = [trl_python, "benchmarks/trl_phase_time.py", "--workload", opts.workload, "--phases",
                   str(opts.phases), "--out", trl_json, *(["--lora"] if opts.lora else [])]  # fmt: skip
        for command in (ours_run, trl_run) if index % 2 == 0 else (trl_run, ours_run):
            run(command)
        tables.append(report_round(ours_json, trl_json, f"round {index + 1} of {opts.rounds}: " if opts.rounds > 1 else ""))
    if opts.rounds > 1:
        print()
        print(format_table(SUMMARY_HEADERS, rounds_summary(tables)))


def report_round(ours_json: str, trl_json: str, title: str) -> list[list[str]]:
    with open(os.path.join(REPO, ours_json)) as f, open(os.path.join(REPO, trl_json)) as g:
        ours, trl = json.load(f), json.load(g)
    print()
    peaks = [r["matmul_peak_gflops_per_s"]["fp32"] for r in (*ours["results"], *trl["results"])]
    cpu = ours["meta"]["cpu"]
    held = f"; {cpu['held']}" if cpu.get("held") else ""  # e.g. "AVX512-BF16 not used: ONEDNN_MAX_CPU_ISA=AVX2"
    print(f"{title}CPU: {cpu['model']} ({', '.join(cpu['features'])}{held}); fp32 matmul "
          f"peak {max(peaks):.0f} GFLOP/s (best of the runs' measurements: {', '.join(f'{p:.0f}' for p in peaks)}); "
          "seconds per phase; limit s: the phase's matmul FLOPs at that peak")  # fmt: skip
    rows = comparison_rows(ours["results"], trl["results"])
    print(format_table(HEADERS, rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
