"""The arithmetic of the benchmark scripts: the FLOP model and the learning-curve summary."""

from __future__ import annotations

import argparse
import json
import os
import statistics

import pytest
import torch

from benchmarks.learning_curves import summarise
from benchmarks.phase_time import ModelDims, flop_limit_s, forward_flops, phase_flops
from grpo_lightning import GRPO_Args

DIMS = ModelDims(matmul_params=1000, d_model=10, vocab=50, n_layers=2, d_attn=8, d_ff=40)


def test_forward_flops_by_hand():
    # b=2 sequences, n=3 new positions after c=4 cached, logits at L=1 position:
    # matmul 2*1000*2*3 = 12000; head 2*10*50*2*1 = 2000; keys = 3*4 + 3*4/2 = 18,
    # attention 4*2*8*2*18 = 2304
    assert forward_flops(DIMS, batch=2, new=3, cached=4, logit_positions=1) == 12000 + 2000 + 2304


@pytest.mark.parametrize("recompute", [False, True])
def test_phase_flops_counts_old_logprobs_only_when_recomputed(recompute):
    args = GRPO_Args(batch_size=4, num_minibatches=2, batches_per_learning_phase=2, gen_len=3, total_phases=2,
                     warmup_steps=0)  # fmt: skip
    opts = argparse.Namespace(recompute_old_logprobs=recompute, activation_checkpointing=False)
    flops = phase_flops(DIMS, args, prompt_len=2, finetune="full", opts=opts)
    # 4 of the 5 tokens run (the last predicts nothing scored), logits at the gen_len = 3 positions that predict
    # generated tokens: 2*1000*4*4 + 2*10*50*4*3 + 4*2*8*4*(1+2+3+4) = 32000 + 12000 + 2560
    one_forward = forward_flops(DIMS, batch=4, new=4, cached=0, logit_positions=3)
    assert one_forward == 46560
    assert flops["ref_lp"] == one_forward
    # the prompt once, on one row: 2*1000*1*2 + 2*10*50*1 + 4*2*8*1*(1+2) = 5192; then 2 steps of 4 rows after
    # 2 and 3 cached positions: 8000 + 4000 + 4*2*8*4*3 = 12768 and 8000 + 4000 + 4*2*8*4*4 = 13024
    assert flops["generate"] == 5192 + 12768 + 13024
    assert flops["old_lp"] == (one_forward if recompute else 0)
    assert flops["learn"] == 3 * one_forward * 2  # forward + backward (2x), two passes
    lora = phase_flops(DIMS, args, prompt_len=2, finetune="lora", opts=opts)
    assert lora["learn"] == 2 * one_forward * 2  # no weight gradients for the frozen base


def test_learning_curve_summary_by_hand():
    runs = [
        {"precision": "32-true", "seed": 1, "rewards": [1.0, 2.0, 3.0, 5.0]},
        {"precision": "32-true", "seed": 2, "rewards": [1.0, 2.0, 4.0, 7.0]},
        {"precision": "bf16-mixed", "seed": 1, "rewards": [1.0, 3.0, 4.0, 6.0]},
        {"precision": "bf16-mixed", "seed": 2, "rewards": [1.0, 2.0, 3.0, 6.0]},
    ]
    summary = summarise(runs, ["32-true", "bf16-mixed"])
    fp32, bf16 = summary["32-true"], summary["bf16-mixed"]
    assert fp32["last_phase"]["values"] == [5.0, 7.0] and fp32["last_phase"]["mean"] == 6.0
    assert fp32["last_phase"]["stdev"] == pytest.approx(2**0.5)
    assert fp32["last_quarter"]["phases"] == 1  # 4 phases: the last quarter is the last phase
    assert fp32["mean_curve"] == [1.0, 2.0, 3.5, 6.0]
    assert bf16["last_phase"]["mean"] == 6.0 and bf16["last_phase"]["stdev"] == 0.0
    difference = summary["difference"]
    assert difference["value"] == 0.0
    assert difference["stderr"] == pytest.approx((2 / 2 + 0 / 2) ** 0.5)  # sqrt(s_a^2/n_a + s_b^2/n_b)
    assert difference["within_noise"] is True


def test_flop_limit_is_the_phase_flops_at_the_peak():
    flops = {"generate": 100e9, "old_lp": 0, "ref_lp": 100e9, "learn": 300e9}
    assert flop_limit_s(flops, peak_gflops=250.0) == 2.0  # 500 GFLOP at 250 GFLOP/s


def test_comparison_rows_pair_workloads_and_use_the_best_peak_for_both_limits():
    from benchmarks.compare_trl import comparison_rows

    ours = [{"workload": "small", "finetune": "full", "precision": "32-true", "mean_s": {"total": 10.0},
             "gflop_per_phase": {"generate": 300.0, "ref_lp": 200.0}, "matmul_peak_gflops_per_s": {"fp32": 100.0}}]
    trl = [{"workload": "small", "mean_s": {"total": 25.0}, "gflop_per_phase": {"generate": 300.0, "old_lp": 200.0,
            "ref_lp": 200.0}, "matmul_peak_gflops_per_s": {"fp32": 50.0}},  # a run whose peak came out low
           {"workload": "default", "mean_s": {"total": 99.0}, "gflop_per_phase": {}, "matmul_peak_gflops_per_s": {"fp32": 1.0}}]
    # peak 100 GFLOP/s: ours 500 GFLOP -> 5 s, TRL 700 GFLOP -> 7 s; "default" has no run of ours
    assert comparison_rows(ours, trl) == [["small", "full", "32-true", "10.0", "5.0", "2.00", "25.0", "7.0", "3.57", "2.50"]]


@pytest.mark.parametrize("held", ["", "AVX512-BF16 not used: ONEDNN_MAX_CPU_ISA=AVX2"])
def test_a_round_names_the_cpu_and_any_instruction_set_held_back(tmp_path, capsys, held):
    from benchmarks.compare_trl import report_round

    cpu = {"model": "AMD EPYC", "features": ["AVX2", "FMA"], "native_bf16": False, "held": held}
    result = {"workload": "small", "finetune": "full", "precision": "32-true", "mean_s": {"total": 10.0},
              "gflop_per_phase": {"learn": 1000.0}, "matmul_peak_gflops_per_s": {"fp32": 200.0}}
    paths = []
    for side in ("ours", "trl"):
        paths.append(tmp_path / f"{side}.json")
        paths[-1].write_text(json.dumps({"meta": {"cpu": cpu}, "results": [result]}))
    rows = report_round(str(paths[0]), str(paths[1]), "round 1: ")
    assert rows == [["small", "full", "32-true", "10.0", "5.0", "2.00", "10.0", "5.0", "2.00", "1.00"]]
    expected = "round 1: CPU: AMD EPYC (AVX2, FMA; AVX512-BF16 not used: ONEDNN_MAX_CPU_ISA=AVX2)" if held else \
        "round 1: CPU: AMD EPYC (AVX2, FMA); fp32 matmul peak 200 GFLOP/s"
    assert expected in capsys.readouterr().out


def test_arithmetic_baseline_runs_end_to_end(tiny_model_dir, tmp_path, capsys):
    import json

    from benchmarks.arithmetic_baseline import main

    out = tmp_path / "baseline.json"
    main(["--model", tiny_model_dir, "--kinds", "add1,mixed", "--heldout-size", "6", "--max-new-tokens", "3", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [r["kind"] for r in results] == ["add1", "mixed"] and all(r["problems"] == 6 for r in results)
    for result in results:
        assert result["correct"] == sum(c["reward"] for c in result["completions"])
        assert result["accuracy"] == result["correct"] / 6
    assert "add1: " in capsys.readouterr().out


def test_arithmetic_runs_reads_each_evaluation_with_its_phase_and_minutes(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from benchmarks.arithmetic_runs import read_evaluations, report

    writer = SummaryWriter(str(tmp_path))
    start = 1_000_000.0
    # Two phases of 2 steps: Lightning logs a phase's epoch metrics at its last step (1, 3)
    for step, epoch in ((0, 0), (1, 0), (2, 1), (3, 1)):
        writer.add_scalar("epoch", epoch, step, walltime=start + 30 * step)
    for step, accuracy, minutes in ((0, 0.25, 0.5), (3, 0.5, 31.0)):
        writer.add_scalar("eval/accuracy", accuracy, step, walltime=start + 60 * minutes)
        writer.add_scalar("eval/mean_reward", accuracy, step, walltime=start + 60 * minutes)
        writer.add_scalar("eval/prompts", 48, step, walltime=start + 60 * minutes)
    writer.close()
    evaluations = read_evaluations(str(tmp_path))
    assert [(e["step"], e["phase"], e["accuracy"], e["problems"]) for e in evaluations] == [(0, 0, 0.25, 48), (3, 2, 0.5, 48)]
    assert [e["minutes"] for e in evaluations] == pytest.approx([0.5, 31.0])
    text = report([{"seed": 7, "evaluations": evaluations}])
    assert "seed 7: 0@0.5m 25.0%  2@31.0m 50.0%" in text
    # noise: sqrt(0.25 * 0.75 / 48) = 0.0625; the last evaluation within 30 minutes is the start (+0.0 SE)
    assert "start 25.0% (n=48, standard error 6.2 points); last within 30 min: phase 0 25.0% (+0.0 SE)" in text
    assert "end: phase 2 50.0% at 31.0 min" in text and "mean over 1 seed(s): +25.0 points" in text


def test_the_output_folder_is_made_before_any_measuring(tmp_path, monkeypatch):
    from benchmarks import compare_trl, phase_time

    out = tmp_path / "new" / "deeper" / "result.json"
    phase_time.make_output_dir(str(out))
    assert out.parent.is_dir()
    phase_time.make_output_dir(None)  # no --out: nothing to make

    commands = []

    def stop_at_the_first_run(command):
        commands.append(command)
        raise SystemExit(3)

    monkeypatch.setattr(compare_trl, "run", stop_at_the_first_run)
    out_dir = tmp_path / "not" / "yet"
    with pytest.raises(SystemExit):
        compare_trl.main(["--workload", "small", "--out-dir", str(out_dir)])
    assert out_dir.is_dir() and commands  # made before the first run started


def test_rounds_summary_gives_the_median_ratio_of_the_rounds_and_their_range():
    from benchmarks.compare_trl import rounds_summary

    def row(workload, ours, trl):
        return [workload, "full", "32-true", f"{ours:.1f}", "5.0", "x", f"{trl:.1f}", "7.0", "x", f"{trl / ours:.2f}"]

    rounds = [[row("small", 10.0, 20.0), row("default", 60.0, 108.0)],
              [row("small", 12.0, 18.0), row("default", 50.0, 110.0)],
              [row("small", 11.0, 22.0)]]  # fmt: skip
    # small: ratios 2.00, 1.50, 2.00 -> median 2.00 (not 20 / 11 = 1.82, the ratio of the medians); default: 1.80, 2.20
    assert rounds_summary(rounds) == [
        ["small", "full", "32-true", "3", "11.0", "20.0", "2.00", "1.50-2.00"],
        ["default", "full", "32-true", "2", "55.0", "109.0", "2.00", "1.80-2.20"],
    ]


def test_rounds_alternate_which_side_runs_first_and_keep_each_rounds_files(monkeypatch, tmp_path):
    from benchmarks import compare_trl

    commands = []
    monkeypatch.setattr(compare_trl, "run", commands.append)
    row = ["small", "full", "32-true", "10.0", "5.0", "2.00", "20.0", "7.0", "2.86", "2.00"]
    monkeypatch.setattr(compare_trl, "report_round", lambda ours, trl, title: [row])
    compare_trl.main(["--workload", "small", "--rounds", "3", "--out-dir", str(tmp_path)])
    commands = [command for command in commands if "benchmarks/setup_trl.sh" not in command]  # a first use builds .venv-trl
    scripts = [os.path.basename(command[1]) for command in commands]
    assert scripts == ["phase_time.py", "trl_phase_time.py", "trl_phase_time.py", "phase_time.py",
                       "phase_time.py", "trl_phase_time.py"]  # fmt: skip
    outputs = [command[command.index("--out") + 1] for command in commands]
    assert len(set(outputs)) == 6 and outputs[3].endswith("compare_ours_small_full_32-true_round2.json")
    assert compare_trl.round_paths("d", "t", 0, 1) == (os.path.join("d", "compare_ours_t.json"),
                                                       os.path.join("d", "compare_trl_t.json"))  # fmt: skip
    with pytest.raises(SystemExit):
        compare_trl.main(["--rounds", "0"])


def test_group_decoding_times_both_ways_and_records_the_machine(tiny_model_dir, tmp_path, capsys):
    from benchmarks import group_decoding

    out = tmp_path / "results" / "groups.json"
    args = ["--model", tiny_model_dir, "--groups", "3", "--group-size", "2", "--gen-len", "3", "--runs", "2"]
    group_decoding.main([*args, "--precision", "32-true", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["groups"] == 3 and saved["group_size"] == 2 and set(saved["peaks_gflops"]) >= {"fp32", "fp32_torch_matmul", "bf16"}
    runs = saved["runs"]["32-true"]
    assert set(runs) == {"separately", "together"} and all(len(way["seconds"]) == 2 for way in runs.values())
    assert runs["together"]["median"] == statistics.median(runs["together"]["seconds"])
    printed = capsys.readouterr().out
    assert "32-true 3 groups of 2,   together:" in printed and saved["cpu"]["model"] in printed


def test_decode_products_flops_by_hand():
    from benchmarks.decode_products import generation_flops, product_flops

    # As phase_flops's generation above: the prompt once on one row, then 2 steps of 4 rows
    assert generation_flops(DIMS, group=4, prompt_len=2, gen_len=3) == 5192 + 12768 + 13024
    # Without attention: 2*1000*1*2 + 2*10*50*1 = 5000 for the prompt, 2*1000*4 + 2*10*50*4 = 12000 a step
    assert product_flops(DIMS, group=4, prompt_len=2, gen_len=3) == 5000 + 2 * 12000


@pytest.mark.parametrize("fused", [True, False], ids=["fused-steps", "pytorch-steps"])
def test_decode_products_replays_the_products_of_a_whole_decode(tiny_model_dir, monkeypatch, fused):
    """The products-only run calls the very products a sampling run calls, with inputs of the same shapes, in
    the same order: the prompt's forward on one row, then every step's layers and unembedding (with the fused
    kernels, the steps' inputs are (B, d))."""
    import grpo_lightning.packed_linear as packed_linear
    from benchmarks.decode_products import run_products, run_whole
    from grpo_lightning import fast_decode, load_causal_lm, load_tokenizer
    from grpo_lightning.fused_decode import fused_kernels
    from grpo_lightning.sampling import encode_prompt

    if fused and fused_kernels() is None:
        pytest.skip("the fused decode kernels cannot be built here (no C++ compiler)")
    if not fused:
        monkeypatch.setattr(fast_decode, "fused_kernels", lambda: None)

    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHT", 1)  # prepare the tiny model's products too
    monkeypatch.setenv("GRPO_LIGHTNING_DECODE_MATMUL", "onednn")
    calls: list[tuple] = []
    prepare = packed_linear._product

    def recording(weight, bias, rows, backend, dtype=torch.float32):
        product = prepare(weight, bias, rows, backend, dtype)

        def record(x):
            calls.append((tuple(weight.shape), tuple(x.shape)))
            return product(x)

        return record

    monkeypatch.setattr(packed_linear, "_product", recording)
    model = load_causal_lm(tiny_model_dir).eval()
    prompt_ids = encode_prompt(load_tokenizer(tiny_model_dir), "This is")
    group, gen_len = 3, 4
    run_whole(model, prompt_ids.expand(group, -1).contiguous(), gen_len, seed=0)
    whole, calls[:] = list(calls), []
    run_products(model, group, prompt_ids.shape[1], gen_len)
    # 2 layers x 4 products + the head, for the prompt and for each of the gen_len - 1 steps
    assert len(whole) == gen_len * (2 * 4 + 1)
    assert whole[0][1] == (1, prompt_ids.shape[1], 32) and whole[-1][1] == ((group, 32) if fused else (group, 1, 32))
    assert calls == whole


@pytest.mark.parametrize(
    ("cpu_percent", "competing", "expected"),
    [
        (10.0, [], None),  # 0.2 of 2 CPUs: idle, whatever the 1-minute load average still counts
        (40.0, [], "0.8 of 2 CPUs in use over 1 s"),
        (10.0, ["python (pid 7, 30% CPU)"], "0.2 of 2 CPUs in use over 1 s; busy: python (pid 7, 30% CPU)"),
    ],
)
def test_busy_machine_warning_samples_the_cpu_now(monkeypatch, cpu_percent, competing, expected):
    import benchmarks.phase_time as phase_time

    monkeypatch.setattr(phase_time.os, "getloadavg", lambda: (1.9, 1.5, 1.0))  # just after a previous round
    monkeypatch.setattr(phase_time.psutil, "cpu_count", lambda: 2)
    monkeypatch.setattr(phase_time.psutil, "cpu_percent", lambda interval: cpu_percent)
    monkeypatch.setattr(phase_time, "competing_processes", lambda window_s, busy_percent: competing)
    warning = phase_time.busy_machine_warning(sample_s=1.0)
    if expected is None:
        assert warning is None
    else:
        assert warning.startswith(f"WARNING: the machine is not idle ({expected}).")
