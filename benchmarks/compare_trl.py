"""grpo-lightning against Hugging Face TRL's GRPOTrainer: the same workloads, one after the other, one table.

Usage (builds .venv-trl on first use; run on an idle machine, it takes 10-20 minutes on 2 cores):
    .venv/bin/python benchmarks/compare_trl.py [--workload small|default|both] [--lora] [--precision 32-true]
                                               [--out-dir benchmarks/results]

Runs ``benchmarks/phase_time.py`` (this project, in .venv) and ``benchmarks/trl_phase_time.py`` (TRL, in its own
.venv-trl: TRL is not a dependency of grpo-lightning) back to back on the same workloads, writes both JSON files
and prints, per workload: each one's seconds per phase, the FLOP limit (the phase's matmul FLOPs at this machine's
measured fp32 peak; TRL's includes the extra old-log-prob forward it chooses to run), and TRL's time over ours.
TRL runs in fp32: ``--precision bf16-mixed`` sets only ours (where bf16 is native), to compare the fast default
with TRL's fp32 run.
"""

from __future__ import annotations

import argparse
import json
import os
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["small", "default", "both"], default="both")
    parser.add_argument("--lora", action="store_true", help="both train LoRA adapters (r=16) instead of the whole model")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true", help="ours only")
    parser.add_argument("--phases", type=int, default=2)
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    opts = parser.parse_args(argv)

    finetune = "lora" if opts.lora else "full"
    tag = f"{opts.workload}_{finetune}_{opts.precision}"
    ours_json = os.path.join(opts.out_dir, f"compare_ours_{tag}.json")
    trl_json = os.path.join(opts.out_dir, f"compare_trl_{tag}.json")
    os.makedirs(os.path.join(REPO, opts.out_dir), exist_ok=True)  # before the runs, not after them
    python = os.path.join(".venv", "bin", "python")
    trl_python = os.path.join(".venv-trl", "bin", "python")
    if not os.path.exists(os.path.join(REPO, trl_python)):
        run(["bash", "benchmarks/setup_trl.sh"])
    run([python, "benchmarks/phase_time.py", "--workload", opts.workload, "--precision", opts.precision,
         "--finetune", finetune, "--phases", str(opts.phases), "--out", ours_json])  # fmt: skip
    run([trl_python, "benchmarks/trl_phase_time.py", "--workload", opts.workload, "--phases", str(opts.phases),
         "--out", trl_json, *(["--lora"] if opts.lora else [])])  # fmt: skip

    with open(os.path.join(REPO, ours_json)) as f, open(os.path.join(REPO, trl_json)) as g:
        ours, trl = json.load(f), json.load(g)
    print()
    peaks = [r["matmul_peak_gflops_per_s"]["fp32"] for r in (*ours["results"], *trl["results"])]
    print(f"CPU: {ours['meta']['cpu']['model']} ({', '.join(ours['meta']['cpu']['features'])}); fp32 matmul peak "
          f"{max(peaks):.0f} GFLOP/s (best of the runs' measurements: {', '.join(f'{p:.0f}' for p in peaks)}); "
          "seconds per phase; limit s: the phase's matmul FLOPs at that peak")  # fmt: skip
    print(format_table(HEADERS, comparison_rows(ours["results"], trl["results"])))


if __name__ == "__main__":
    main()
