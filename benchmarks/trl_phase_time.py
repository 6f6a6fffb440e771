"""Time one GRPO phase of Hugging Face TRL's GRPOTrainer on the CPU: the workloads of phase_time.py, for comparison.

Usage:
    bash benchmarks/setup_trl.sh && .venv-trl/bin/python benchmarks/trl_phase_time.py --workload small

    .venv-trl/bin/python benchmarks/trl_phase_time.py [--workload small|default|both] [--phases N] [--model PATH]
                                                      [--lora] [--out results.json]

TRL is not a dependency of grpo-lightning: setup_trl.sh builds a separate venv (.venv-trl) with the project, TRL
1.16.0 and the same torch (2.13.0, CPU), transformers and peft as the project's venv (transformers 5.24.0 and
5.25.0 have been measured). The mapping below was checked against that TRL's source (trl/trainer/grpo_config.py
and grpo_trainer.py).

What is measured
----------------
``trl.GRPOTrainer`` (transformers' Trainer underneath) on the same workload as ``GRPOModule`` in phase_time.py:
fp32 on the CPU (no bf16/fp16, no autocast), full fine-tuning next to a frozen reference copy (or --lora), the
reward = the number of "." characters in the decoded completion, no logging, no checkpoints, no vLLM, torch's
default thread count. One phase = one generation of G completions followed by num_minibatches x passes optimizer
steps. A TrainerCallback closes a phase at every (num_minibatches x passes)-th on_step_end, so a phase's wall time
runs from the end of the previous generation round's last step to the end of its own. One warm-up phase is run
and not counted (AdamW state, oneDNN kernels); the table shows the mean of the --phases measured phases and the
JSON (--out) keeps every phase. Each workload runs in its own subprocess, so its peak RSS is its own.

Parts (TRL's own profiling goes only to wandb/mlflow/trackio, so the trainer's methods are wrapped with timers):
  generate  ``GRPOTrainer._generate``: tokenize the prompts, ``model.generate`` (KV cache), the EOS mask,
            decoding the completions
  old-lp    the no-grad forward of the whole group for log pi_old: TRL recomputes it (see below), ours does not
  ref-lp    the no-grad forward of the group under the reference model (or the policy with adapters disabled)
  learn     the optimizer steps of the phase: forward with log-probs and entropy, loss, backward, gradient
            clipping, AdamW step, scheduler step, zero_grad (transformers' Trainer between on_step_begin and
            on_step_end, less the rollout that TRL runs inside the phase's first training_step)
  other     total - the parts above: rewards, advantages, padding, shuffling and splitting the group, metrics,
            the dataloader (each step fetches a batch of G prompt rows, even when it reuses the buffered group)
  total     the whole phase

Workload mapping (ours -> TRL GRPOConfig, see ``trl_settings``)
--------------------------------------------------------------
  prompt "This is", prepended   dataset column "prompt" = "<|endoftext|>This is" (``default_start_token``),
  with the start token          one row per phase. TRL tokenizes it with add_special_tokens=True; SmolLM2's and
                                the test tokenizer add nothing, so the prompt ids equal ``encode_prompt``'s
                                (checked at run time: "prompt_matches_ours" in the JSON)
  batch_size G                  num_generations = G (one prompt per generation round)
  num_minibatches M             per_device_train_batch_size = G / M, steps_per_generation = M (so
                                generation_batch_size = G), gradient_accumulation_steps = 1: each minibatch
                                is one optimizer step, and old/ref log-probs are computed G/M sequences at a time
  batches_per_learning_phase K  num_iterations = K (GRPO's mu): TRL regenerates every M x K steps
  total phases                  max_steps = (1 warm-up + --phases) x M x K
  gen_len 30, exactly           max_completion_length = gen_len and generation_kwargs min_new_tokens = gen_len
  temperature 1, exact sampling temperature 1.0, top_k 0, top_p 1.0, min_p None, repetition_penalty 1.0
  kl_coef 0.3, reference model  beta 0.3 (TRL loads a second copy of the model as reference; with --lora it
                                disables the adapters instead, as ours does)
  clip_coef 0.2                 epsilon 0.2
  lr 1e-5, fused AdamW          learning_rate 1e-5, optim adamw_torch_fused, weight_decay 0.01 (torch's AdamW
                                default, which ours uses), linear decay without warmup (ours: per phase)
  max_grad_norm 1.0             max_grad_norm 1.0
  fp32, no checkpointing        bf16 False, fp16 False, use_cpu True, activation_checkpointing False (the
                                transformers 5 name of gradient_checkpointing), model dtype float32: TRL's
                                defaults are bf16 True and gradient_checkpointing True
  eval mode (no dropout)        disable_dropout True
  token-mean surrogate          loss_type "bnpo" (the mean over the minibatch's completion tokens: with
                                fixed-length completions this is our mean); scale_rewards "group"
  no logging, no checkpoints    report_to none, logging_strategy no, save_strategy no, disable_tqdm True
  --lora                        peft LoraConfig from ``LoraSettings()``: r 16, alpha 32, dropout 0, targets
                                q/k/v/o/gate/up/down_proj (``default_target_modules``)

What TRL cannot match, and where it does extra work
---------------------------------------------------
* Fixed-length generation: TRL always treats the tokenizer's EOS (and any in generation_config) as the end of a
  completion and masks everything after it, even if generation does not stop there. min_new_tokens = gen_len makes
  every completion exactly gen_len tokens with an all-ones mask, by forbidding the EOS tokens (logit -inf) for
  all gen_len steps; ours samples from the full vocabulary and keeps an EOS as an ordinary token. The
  distributions differ only by SmolLM2's <|im_end|> (the tokenizer's EOS, also its pad token); the work is the same
  (plus one masking op per step).
* log pi_old: TRL recomputes it with an extra no-grad forward of the group whenever
  gradient_accumulation_steps % (steps_per_generation x num_iterations) != 0, i.e. always here (small: 1 % 2,
  default: 1 % 8). Ours keeps the log-probs that sampling computed (phase_time.py's old-lp is 0 by default).
* Generation goes through transformers' ``generate`` (logits processors, stopping criteria, a dynamic KV cache,
  left padding and an attention mask) instead of our KV-cached sampling loop; log-probs are not kept.
* Learning: TRL's fused LM head projects only the gen_len completion positions (as ours does) and also computes
  the entropy of every position (ours: only at sampling); the KL term is k3 =
  exp(ref - lp) - (ref - lp) - 1 (ours: k2), times the importance ratio unless use_bias_correction_kl is False (set
  here). These are elementwise: the matmul work is the same. TRL shuffles the group once per generation round.
* Attention kernel: TRL uses transformers' default (sdpa); ours picks eager for sequences this short. Recorded as
  "attn_implementation" in the JSON.
* TRL collects metrics every step (gathers and .item() calls); they are never written (logging_strategy no).

FLOP model and limit
--------------------
The matmul FLOPs per phase come from phase_time.py's model (``phase_flops``: generate + ref-lp + learn, plus
old-lp because TRL recomputes it, as phase_time.py counts it under --recompute-old-logprobs). "limit s" = FLOPs /
peak (``flop_limit_s``), with the peak the GFLOP/s of a 2048^3 fp32 product measured in the same subprocess, the
better of torch.matmul and oneDNN (``fp32_peak_gflops``, as phase_time.py measures it): the time the phase would
take if every matmul ran at the square-GEMM rate. "x limit" = total s / limit s. TRL's limit includes its extra
old-lp forward (work it chose to do), so it is about one group forward above ours by default: compare the two
implementations by "total s", and each one's efficiency by "x limit".
"cpu %" is as in phase_time.py.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a script: make the repository root importable, for benchmarks.phase_time
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers
from transformers import TrainerCallback

from benchmarks.phase_time import (
    WORKLOADS,
    busy_machine_warning,
    cpu_seconds,
    flop_limit_s,
    format_table,
    make_output_dir,
    model_dims,
    peak_rss_mib,
    phase_flops,
    write_results,
)
from grpo_lightning import GRPO_Args
from grpo_lightning.lora import LoraSettings, default_target_modules
from grpo_lightning.machine import fp32_peak_gflops
from grpo_lightning.models import resolve_model_path
from grpo_lightning.precision import cpu_info
from grpo_lightning.sampling import default_start_token, encode_prompt

PARTS = ("generate", "old_lp", "ref_lp", "learn")
WARMUP_PHASES = 1
SEED = 1
KL_COEF = 0.3  # what phase_time.py passes to GRPOModule (a reference model is used)
PEAK_GEMM_SIZE = 2048


# ---- the mapping: pure, no TRL import (tests/test_trl_mapping.py checks it) ----------------------


def grpo_args(workload: str, phases: int, override: dict | None = None) -> GRPO_Args:
    """Our settings for the workload: phase_time.py's WORKLOADS entry, as GRPOModule would see them."""
    settings = {**WORKLOADS[workload], **(override or {})}
    return GRPO_Args(total_phases=WARMUP_PHASES + phases, warmup_steps=0, seed=SEED, kl_coef=KL_COEF, **settings)


def trl_settings(args: GRPO_Args) -> dict:
    """GRPOConfig keyword arguments (all but output_dir) that run ``args``'s phases (see the module docstring)."""
    minibatches, passes = args.num_minibatches, args.batches_per_learning_phase
    return dict(
        # one generation round of G completions of one prompt, then M x K optimizer steps on G/M sequences each
        num_generations=args.batch_size,
        per_device_train_batch_size=args.minibatch_size,
        steps_per_generation=minibatches,  # generation_batch_size = G/M * M = G (the two are mutually exclusive)
        gradient_accumulation_steps=1,
        num_iterations=passes,
        max_steps=args.total_phases * minibatches * passes,
        # exactly gen_len tokens: EOS is forbidden until then (TRL masks everything after an EOS)
        max_completion_length=args.gen_len,
        generation_kwargs={"min_new_tokens": args.gen_len},
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        min_p=None,
        repetition_penalty=1.0,
        # objective
        beta=args.kl_coef,
        epsilon=args.clip_coef,
        loss_type="bnpo",
        scale_rewards="group",
        use_bias_correction_kl=False,
        # optimizer
        learning_rate=args.lr,
        optim="adamw_torch_fused",
        weight_decay=0.01,  # torch.optim.AdamW's default, which grpo_lightning.optim uses
        lr_scheduler_type="linear",
        warmup_steps=0,
        max_grad_norm=args.max_grad_norm,
        # fp32 on the CPU, no activation checkpointing: TRL's defaults are bf16=True and gradient_checkpointing=True
        # (transformers 5's deprecated alias of activation_checkpointing, which wins when set)
        bf16=False,
        fp16=False,
        use_cpu=True,
        activation_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        disable_dropout=True,
        use_vllm=False,
        # no logging, no checkpoints
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        seed=args.seed,
    )


def recomputes_old_logprobs(settings: dict) -> bool:
    """Whether TRL runs an extra forward for log pi_old (GRPOTrainer._generate_and_score_completions, without vLLM):
    when the optimizer steps between two generation rounds do not line up with gradient accumulation."""
    generate_every = settings["steps_per_generation"] * settings["num_iterations"]
    return settings["gradient_accumulation_steps"] % generate_every != 0


def steps_per_phase(settings: dict) -> int:
    """Optimizer steps between two generation rounds (TRL's ``generate_every``)."""
    return settings["steps_per_generation"] * settings["num_iterations"]


def period_count(completions: list[str], **kwargs) -> list[float]:
    """The reward: the number of "." characters in each decoded completion (ours: rewards.CharCount)."""
    return [float(text.count(".")) for text in completions]


# ---- timing ------------------------------------------------------------------------------


class PhaseTimer(TrainerCallback):
    """Per-phase wall time (between consecutive generation rounds) and per-part times, from timers wrapped
    around the trainer's methods (``instrument``) and the step callbacks."""

    def __init__(self, steps_per_phase: int, recompute_old: bool) -> None:
        self.steps_per_phase = steps_per_phase
        self.recompute_old = recompute_old
        self.phases: list[dict[str, float]] = []
        self.completion_lengths: set[int] = set()  # over all rounds: {gen_len} when generation has a fixed length

    def instrument(self, trainer) -> None:
        self._wrap(trainer, "_generate", lambda: "generate", after=self._record_lengths)
        self._wrap(trainer, "_generate_and_score_completions", self._start_rollout)
        self._wrap(trainer, "_get_per_token_logps_and_entropies", self._logprob_part)

    def _wrap(self, trainer, name: str, part, after=None) -> None:
        original = getattr(trainer, name)  # a bound method; the instance attribute shadows it

        @functools.wraps(original)
        def timed(*args, **kwargs):
            key = part()
            start = time.perf_counter()
            try:
                result = original(*args, **kwargs)
            finally:
                if key is not None:
                    self.parts[key] += time.perf_counter() - start
            if after is not None:
                after(result)
            return result

        setattr(trainer, name, timed)

    def _record_lengths(self, generated) -> None:
        completion_ids = generated[1]  # _generate returns (prompt_ids, completion_ids, ...)
        self.completion_lengths.update(len(ids) for ids in completion_ids)

    def _start_rollout(self) -> str:
        self._nograd_forwards = 0
        return "rollout"

    def _logprob_part(self) -> str | None:
        if torch.is_grad_enabled():
            return None  # the training forward: part of learn
        # In the rollout TRL computes log pi_old first (when it recomputes it), then log pi_ref.
        index, self._nograd_forwards = self._nograd_forwards, self._nograd_forwards + 1
        return "old_lp" if self.recompute_old and index == 0 else "ref_lp"

    def _new_phase(self, now: float) -> None:
        self.parts = dict.fromkeys((*PARTS, "rollout"), 0.0)
        self._nograd_forwards = 0
        self._phase_start = (now, cpu_seconds())

    def on_train_begin(self, args, state, control, **kwargs):
        self._new_phase(time.perf_counter())

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = (time.perf_counter(), self.parts["rollout"])

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        rollout_in_step = self.parts["rollout"] - self._step_start[1]  # TRL generates inside training_step
        self.parts["learn"] += now - self._step_start[0] - rollout_in_step
        if state.global_step % self.steps_per_phase:
            return
        wall, cpu = now - self._phase_start[0], cpu_seconds() - self._phase_start[1]
        phase = {part: self.parts[part] for part in PARTS}
        phase["other"] = wall - sum(phase.values())
        phase["total"] = wall
        phase["logprob_forwards"] = self._nograd_forwards
        phase["cpu_util"] = cpu / (wall * torch.get_num_threads())
        self.phases.append(phase)
        self._new_phase(time.perf_counter())


# ---- one workload: runs in its own subprocess ------------------------------------------------


def lora_config(model_path: str):
    from peft import LoraConfig

    settings = LoraSettings()
    config = transformers.AutoConfig.from_pretrained(model_path)
    targets = settings.target_modules or default_target_modules(SimpleNamespace(config=config))
    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=targets, task_type="CAUSAL_LM")  # fmt: skip


def measure(workload: str, phases: int, model: str | None, lora: bool, override: dict) -> dict:
    import datasets
    import trl
    from trl import GRPOConfig, GRPOTrainer

    loadavg_start = os.getloadavg()[0]
    # First thing in the fresh process, as phase_time.py does: measured after training it can come out far lower.
    peak = fp32_peak_gflops(PEAK_GEMM_SIZE)["fp32"]
    # TRL calls model.is_gradient_checkpointing, deprecated in transformers 5: one harmless warning per model
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    args = grpo_args(workload, phases, override)
    settings = trl_settings(args)
    recompute_old = recomputes_old_logprobs(settings)
    model_path = resolve_model_path(model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    prompt = default_start_token(tokenizer) + args.prompt
    trl_prompt_ids = tokenizer(text=[prompt])["input_ids"][0]  # as GRPOTrainer._tokenize_prompts does
    prompt_matches_ours = trl_prompt_ids == encode_prompt(tokenizer, args.prompt)[0].tolist()
    if not prompt_matches_ours:
        print(f"WARNING: TRL's prompt ids {trl_prompt_ids} differ from ours", file=sys.stderr)
    dataset = datasets.Dataset.from_dict({"prompt": [prompt] * args.total_phases})  # one prompt per round

    timer = PhaseTimer(steps_per_phase(settings), recompute_old)
    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stdout(io.StringIO()):
        trainer = GRPOTrainer(
            model=model_path, reward_funcs=period_count, args=GRPOConfig(output_dir=root, **settings),
            train_dataset=dataset, processing_class=tokenizer, callbacks=[timer],
            peft_config=lora_config(model_path) if lora else None,
        )  # fmt: skip
        timer.instrument(trainer)
        trainer.train()
        peak_rss = peak_rss_mib()  # read before the peak GEMM allocates its buffers

    completion_lengths = [min(timer.completion_lengths), max(timer.completion_lengths)]
    if completion_lengths != [args.gen_len] * 2:
        print(f"WARNING: completion lengths {completion_lengths}, not exactly gen_len {args.gen_len}", file=sys.stderr)
    expected_forwards = 1 + recompute_old
    if any(p["logprob_forwards"] != expected_forwards for p in timer.phases):
        print(f"WARNING: expected {expected_forwards} no-grad log-prob forward(s) per phase, got "
              f"{[p['logprob_forwards'] for p in timer.phases]}: old-lp/ref-lp are misattributed", file=sys.stderr)  # fmt: skip
    per_phase = timer.phases[WARMUP_PHASES:]
    policy = trainer.model.get_base_model() if lora else trainer.model
    dims = model_dims(policy)
    finetune = "lora" if lora else "full"
    flops = phase_flops(dims, args, len(trl_prompt_ids), finetune, SimpleNamespace(recompute_old_logprobs=recompute_old))
    mean_s = {key: statistics.mean(p[key] for p in per_phase) for key in (*PARTS, "other", "total")}
    gflops = {part: flops[part] / mean_s[part] / 1e9 if mean_s[part] > 0 else 0.0 for part in PARTS}
    return {
        "workload": workload,
        "precision": "32-true",
        "finetune": finetune,
        "compute_dtype": "fp32",
        "settings": {**WORKLOADS[workload], **override},
        "trl_settings": settings,
        "recomputes_old_logprobs": recompute_old,
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "attn_implementation": policy.config._attn_implementation,
        "prompt_tokens": len(trl_prompt_ids),
        "completion_length_min_max": completion_lengths,
        "prompt_matches_ours": prompt_matches_ours,
        "model": model or "SmolLM2-135M-Instruct (embedded)",
        "model_dims": asdict(dims),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": loadavg_start,
        "warmup_phases": WARMUP_PHASES,
        "phases_s": per_phase,
        "mean_s": mean_s,
        "generated_tokens_per_s": args.batch_size * args.gen_len / mean_s["generate"],
        "gflop_per_phase": {part: f / 1e9 for part, f in flops.items()},
        "gflops_per_s": gflops,
        "fraction_of_peak": {part: g / peak for part, g in gflops.items()},
        "matmul_peak_gflops_per_s": {"fp32": peak},
        "flop_limit_s": flop_limit_s(flops, peak),
        "total_over_flop_limit": mean_s["total"] / flop_limit_s(flops, peak),
        "peak_rss_mib": peak_rss,
        "cpu_util": statistics.mean(p["cpu_util"] for p in per_phase),
    }


def measure_in_subprocess(workload: str, opts: argparse.Namespace) -> dict:
    """Re-runs this script on one workload, so that ru_maxrss is that run's alone."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--workload", workload, "--phases", str(opts.phases),
                   "--child-result", result_path]  # fmt: skip
        command += ["--model", opts.model] if opts.model is not None else []
        command += ["--lora"] * opts.lora
        command += ["--override", opts.override] if opts.override else []
        completed = subprocess.run(command)
        if completed.returncode != 0:
            raise SystemExit(f"error: the {workload} measurement failed (exit code {completed.returncode})")
        with open(result_path) as f:
            return json.load(f)


# ---- report --------------------------------------------------------------------------------


def report(results: list[dict], phases: int, warning: str | None) -> str:
    first = results[0]
    dims = first["model_dims"]
    headers = ["workload", "finetune", "generate s", "old-lp s", "ref-lp s", "learn s", "other s", "total s",
               "limit s", "x limit", "gen tok/s", "learn GFLOP/s", "% peak", "peak RSS MiB", "cpu %"]  # fmt: skip
    rows = []
    for r in results:
        t = r["mean_s"]
        rows.append([
            r["workload"], r["finetune"],
            *(f"{t[key]:.2f}" for key in (*PARTS, "other", "total")),
            f"{r['flop_limit_s']:.2f}",
            f"{r['total_over_flop_limit']:.2f}",
            f"{r['generated_tokens_per_s']:.0f}",
            f"{r['gflops_per_s']['learn']:.1f}",
            f"{100 * r['fraction_of_peak']['learn']:.1f}",
            f"{r['peak_rss_mib']:.0f}",
            f"{100 * r['cpu_util']:.0f}",
        ])  # fmt: skip
    lines = [
        f"CPU: {cpu_info().describe()}; fp32 matmul peak {first['matmul_peak_gflops_per_s']['fp32']:.0f} GFLOP/s",
        f"TRL {first['trl']} GRPOTrainer phase time: mean of {phases} measured phase(s) after {WARMUP_PHASES} "
        f"warm-up, fp32, model {first['model']} ({dims['matmul_params'] / 1e6:.1f}M non-embedding matmul params), "
        f"transformers {first['transformers']}, torch {torch.__version__}, {first['torch_threads']} threads, "
        f"attention {first['attn_implementation']}",
        "",
        format_table(headers, rows),
        "",
        "limit s = phase matmul FLOPs / fp32 peak (GFLOP/s of a "
        f"{PEAK_GEMM_SIZE}^3 product, the better of torch.matmul and oneDNN, measured in each run): "
        + "; ".join(
            f"{r['workload']}/{r['finetune']}: {sum(r['gflop_per_phase'].values()):.0f} GFLOP ("
            + ", ".join(f"{p.replace('_', '-')} {r['gflop_per_phase'][p]:.0f}" for p in PARTS)
            + f") / {r['matmul_peak_gflops_per_s']['fp32']:.0f} GFLOP/s = {r['flop_limit_s']:.2f} s"
            for r in results
        ),
        "TRL recomputes log pi_old with an extra forward: "
        + ", ".join(f"{r['workload']} {'yes' if r['recomputes_old_logprobs'] else 'no'}" for r in results),
    ]
    if not all(r["prompt_matches_ours"] for r in results):
        lines.append("WARNING: TRL tokenized the prompt differently from grpo-lightning (see prompt_tokens)")
    if warning:
        lines += ["", warning]
    return "\n".join(lines)


# ---- command line --------------------------------------------------------------------------


def parse_override(text: str | None) -> dict:
    """``key=value,...`` over a workload's settings (integers, or the prompt), for smoke tests on tiny models."""
    override = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        override[key.strip()] = int(value) if value.strip().isdigit() else value
    return override


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument("--phases", type=int, default=2, help="measured phases per run, after one warm-up (default 2)")
    parser.add_argument("--model", default=None, help="model directory or hub id (default: the embedded SmolLM2-135M)")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (LoraSettings() defaults) instead")
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
    # Hidden: overrides the workload's settings, e.g. batch_size=4,gen_len=4 for a smoke test on a tiny model.
    parser.add_argument("--override", default=None, help=argparse.SUPPRESS)
    # Internal: set when the script re-runs itself to measure one workload.
    parser.add_argument("--child-result", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.phases < 1:
        parser.error("--phases must be at least 1")
    if opts.child_result and opts.workload == "both":
        parser.error("--child-result measures exactly one workload")
    for workload in WORKLOADS if opts.workload == "both" else [opts.workload]:
        try:  # fail before any model loads on an unknown key or a setting GRPO_Args refuses
            grpo_args(workload, opts.phases, parse_override(opts.override))
        except (TypeError, ValueError) as error:
            parser.error(f"--override: {error}")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    if opts.child_result:
        result = measure(opts.workload, opts.phases, opts.model, opts.lora, parse_override(opts.override))
        with open(opts.child_result, "w") as f:
            json.dump(result, f)
        return

    make_output_dir(opts.out)
    warning = busy_machine_warning()
    if warning:
        print(warning, file=sys.stderr, flush=True)
    workloads = list(WORKLOADS) if opts.workload == "both" else [opts.workload]
    results = []
    for workload in workloads:
        print(f"measuring TRL {workload} / {'lora' if opts.lora else 'full'} ...", file=sys.stderr, flush=True)
        results.append(measure_in_subprocess(workload, opts))

    print(report(results, opts.phases, warning))
    if opts.out:
        write_results(opts.out, results, opts.phases, warning, trl=results[0]["trl"])


if __name__ == "__main__":
    main()
