"""Time one GRPO phase of grpo-lightning on the CPU, split into its parts.

Usage:
    python benchmarks/phase_time.py [--workload small|default|both] [--precision 32-true|bf16-mixed|both]
                                    [--finetune full|lora|both] [--phases N] [--model PATH] [--out results.json]

What is measured
----------------
The library itself: a ``GRPOModule`` trained by a Lightning ``Trainer`` (CPU, the given precision, no logger
and no checkpoint callback), with the module's defaults for everything the workload does not set (kl_coef 0.3,
so a reference model is used; reward: the period count). The parts are the module's own per-phase timers, the
ones it logs to TensorBoard under ``perf/``:

  generate  KV-cached sampling of batch_size completions of gen_len tokens, keeping log pi_old of each token
            (and the entropy), then decoding
  old-lp    a separate forward pass for log pi_old: 0 unless --recompute-old-logprobs (the reference's way)
  ref-lp    log pi_ref of the group, minibatch_size sequences at a time (the reference copy, or the policy with
            its adapters disabled under LoRA)
  learn     the training steps of the phase: forward, clipped surrogate - k2 penalty, backward, gradient
            clipping, fused AdamW(maximize=True) step and Lightning's per-step logging
  total     the whole phase: the parts above plus scoring, advantages, the replay memory and the logging of
            the rollout statistics. Checkpoint writing is not included ("ckpt MiB" gives its size).

Fine-tuning: "full" trains the whole policy next to a frozen reference copy; "lora" uses ``lora: true``
(LoraSettings() defaults): adapters only, the reference being the same model with its adapters disabled.
"ckpt MiB" is the size of a Lightning checkpoint of the run (``trainer.save_checkpoint``): trained weights
(all, or the adapters only) and optimizer state.

Precision: the Trainer's precision, "32-true" or "bf16-mixed" (autocast to bf16 around the rollout and every
training_step; weights, gradients, optimizer state and log-softmax stay fp32).

Workloads: "default" is the reference's setting (batch 128, gen_len 30, 4 minibatches, 2 passes, prompt
"This is"). "small" is batch 32, gen_len 30, 2 minibatches, 1 pass.

Each (workload, precision, finetune) runs in a fresh subprocess, so its peak resident memory (ru_maxrss, the
maximum over the process's whole life, read at the end of training) belongs to it alone. Each subprocess first
runs one warm-up phase that is not counted: it allocates the AdamW state and primes the oneDNN kernels. The table shows the
mean of the --phases measured phases, and the JSON (--out) keeps every phase. Like the command line, each
subprocess keeps the memory it frees for reuse (``grpo_lightning.machine.keep_freed_memory_for_reuse``;
GRPO_LIGHTNING_KEEP_FREED_MEMORY=0 measures glibc's default instead), and fp32 decode products go through the
library chosen for this CPU (``grpo_lightning.packed_linear``; GRPO_LIGHTNING_DECODE_MATMUL=mkl|onednn|aten
chooses one), and so do the learning step's fp32 products (``grpo_lightning.training_products``;
GRPO_LIGHTNING_TRAIN_MATMUL=onednn|aten).

FLOP model (matmuls only: elementwise ops, softmax, norms and the optimizer are not counted)
---------------------------------------------------------------------------------------------
A forward pass over b sequences that adds n new positions after c cached ones, with logits at L positions each:
    matmul = 2 * N * b * n                  N = non-embedding matmul parameters: every 2-D weight other than
                                            the input/output embeddings (the 4 attention and 3 MLP projections of
                                            each llama layer)
    head   = 2 * d_model * V * b * L        the unembedding, done only where logits are kept
    attn   = 4 * n_layers * d_attn * b * (sum of p for p = c+1 .. c+n)
                                            QK^T and attention @ V cost 2 * d_attn FLOPs each per (query, key)
                                            pair; a causal query at position p sees p keys; d_attn = heads*head_dim
  generation = prompt forward, once for the group (b = 1, n = P, c = 0, L = 1: every row shares the prompt)
               + (gen_len - 1) one-token steps (n = 1, c = P + t, L = 1)
  log-probs  = one forward of the whole group but its last token (n = P + gen_len - 1, c = 0, L = gen_len: the
               unembedding runs only on the positions that predict generated tokens, and the last token predicts
               none). The workloads' 3-token prompt is too short for the prompt to be run once per group
               (grpo_lightning.shared_prompts: it would save about 9 % of the positions, under its 15 % threshold)
  learning   = 3 x the forward of every minibatch (backward = 2 x forward), summed over all minibatches; these
               are model FLOPs: the forward that --activation-checkpointing repeats is not counted as work
For the embedded SmolLM2-135M (N = 106.2M, d_model = 576, V = 49152, 30 layers, d_attn = 576, P = 3 tokens for
"<|endoftext|>This is"), one forward of the default group (128 x 32 of its 33 tokens) is 1.09 TFLOP (870 GFLOP of
layer matmuls, 217 of lm head, 5 of attention), so a default learning phase is 3 x 2 passes x 1.09 = 6.6 TFLOP, and a
small one is 3 x 0.27 = 0.82 TFLOP. Generation costs about one forward of the group (1.00 TFLOP default, 0.25 small).

How to read the output
----------------------
"GFLOP/s" is the matmul throughput achieved under that FLOP model. "% peak" compares it with the peak measured in
the same subprocess: a 2048x2048x2048 product in the dtype that the precision computes in (fp32 for
32-true, bf16 for bf16-mixed), best of several runs. The fp32 peak is the better of ``torch.matmul`` (MKL) and
oneDNN's product, both kept in the JSON: on AMD CPUs with AVX-512 MKL takes its AVX2 path and reaches half
of what the CPU does (``grpo_lightning.machine.fp32_peak_gflops``). Both dtypes' peaks are reported, and
each precision is compared with its own dtype's peak. The JSON also gives the throughput of a GEMM shaped like
the model's MLP up-projection for one minibatch (tokens x d_model x intermediate). Matmuls this small cannot
reach the square GEMM's rate.
"cpu %" is this process's CPU time divided by (wall time x torch threads) over the measured phases. Well under
100 % means the threads were waiting, often for cores that other processes held. On a 2-core machine one busy
core can slow PyTorch about tenfold, so the script warns when the machine is not idle at the start. On a busy
machine, identical passes (old-lp and ref-lp, or two phases) can differ severalfold. Then read the per-phase
times in the JSON: the fastest phase is the one other work disturbed least.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import lightning as L
import psutil
import torch
import transformers

from grpo_lightning import GRPO_Args, GRPOModule
from grpo_lightning.machine import (
    competing_processes,
    fp32_peak_gflops,
    keep_freed_memory_for_reuse,
    kernel_settings,
    matmul_gflops,
)
from grpo_lightning.packed_linear import cpu_fp32_product_setting, decode_matmul_backend
from grpo_lightning.training_products import training_matmul_backend
from grpo_lightning.precision import cpu_info, precision_warning
from grpo_lightning.sampling import encode_prompt

WORKLOADS = {
    "small": dict(batch_size=32, gen_len=30, num_minibatches=2, batches_per_learning_phase=1, prompt="This is"),
    "default": dict(batch_size=128, gen_len=30, num_minibatches=4, batches_per_learning_phase=2, prompt="This is"),
}
PRECISIONS = ("32-true", "bf16-mixed")
FINETUNES = ("full", "lora")  # lora: LoraSettings() defaults, the reference = the policy with adapters disabled
COMPUTE_DTYPE = {"32-true": "fp32", "bf16-mixed": "bf16"}  # the dtype each precision's matmuls run in
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PARTS = ("generate", "old_lp", "ref_lp", "learn")
WARMUP_PHASES = 1
SEED = 1
PEAK_GEMM_SIZE = 2048
EMULATED_GEMM_SIZE = 256  # the bf16 "peak" on a CPU that emulates bf16 (a 2048^3 product takes minutes there)
BUSY_CORES = 0.5  # cores' worth of CPU that all processes may use in the sample before the machine counts as busy
BUSY_PROCESS_CPU = 10.0  # % of one core that another process may use before it is named in the warning


# ---- phases, as GRPOModule runs them under a Lightning Trainer ---------------------------------


class PhaseRecorder(L.Callback):
    """Copies the module's per-part timer at the end of every phase (epoch), with the CPU use of the phase."""

    def __init__(self) -> None:
        self.phases: list[dict[str, float]] = []

    def on_train_epoch_start(self, trainer, module) -> None:
        self._start = (time.perf_counter(), cpu_seconds())

    def on_train_epoch_end(self, trainer, module) -> None:
        seconds = {**module.timer.seconds, "phase": module.timer.phase_seconds}
        phase = {part: seconds.get(TIMER_PARTS[part], 0.0) for part in (*PARTS, "total")}
        wall, cpu = time.perf_counter() - self._start[0], cpu_seconds() - self._start[1]
        phase["cpu_util"] = cpu / (wall * torch.get_num_threads())
        self.phases.append(phase)


# benchmark part -> the module's PhaseTimer name (old log-probs are only timed when recomputed)
TIMER_PARTS = {"generate": "generate", "old_lp": "old_logprobs", "ref_lp": "ref_logprobs", "learn": "learn",
               "total": "phase"}  # fmt: skip


def make_module(workload: str, phases: int, model: str | None, finetune: str, opts) -> GRPOModule:
    return GRPOModule(
        model_name_or_path=model, total_phases=WARMUP_PHASES + phases, warmup_steps=0, seed=SEED, kl_coef=0.3,
        lora=finetune == "lora", samples_shown=0, export_dir=None,
        recompute_old_logprobs=opts.recompute_old_logprobs, activation_checkpointing=opts.activation_checkpointing,
        **WORKLOADS[workload],
    )  # fmt: skip


def make_trainer(precision: str, total_phases: int, root: str, recorder: PhaseRecorder) -> L.Trainer:
    return L.Trainer(
        max_epochs=total_phases, precision=precision, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=[recorder],
    )  # fmt: skip


# ---- FLOP model (see the module docstring) ---------------------------------------------------


@dataclass(frozen=True)
class ModelDims:
    matmul_params: int  # N: non-embedding 2-D weights
    d_model: int
    vocab: int
    n_layers: int
    d_attn: int  # heads * head_dim: the width of QK^T and attention @ V
    d_ff: int  # MLP width, only for the model-shaped reference GEMM


def model_dims(model: torch.nn.Module) -> ModelDims:
    config = model.config
    output_weight = model.get_output_embeddings().weight
    embeddings = {id(model.get_input_embeddings().weight), id(output_weight)}
    embeddings |= {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}  # e.g. positions
    # model.parameters() yields a tied weight once, so tied embeddings are not counted twice.
    matmul_params = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelDims(
        matmul_params=matmul_params,
        d_model=config.hidden_size,
        vocab=output_weight.shape[0],
        n_layers=config.num_hidden_layers,
        d_attn=heads * head_dim,
        d_ff=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
    )


def forward_flops(dims: ModelDims, batch: int, new: int, cached: int, logit_positions: int) -> int:
    """Matmul FLOPs of a forward over ``batch`` sequences adding ``new`` positions after ``cached`` ones."""
    matmul = 2 * dims.matmul_params * batch * new
    head = 2 * dims.d_model * dims.vocab * batch * logit_positions
    keys = new * cached + new * (new + 1) // 2  # sum of p for p = cached+1 .. cached+new (causal)
    attention = 4 * dims.n_layers * dims.d_attn * batch * keys
    return matmul + head + attention


def phase_flops(dims: ModelDims, args: GRPO_Args, prompt_len: int, finetune: str, opts) -> dict[str, int]:
    batch, gen_len = args.batch_size, args.gen_len
    seq_len = prompt_len + gen_len
    # The group's rows share one prompt: sampling runs its forward on one row (grpo_lightning.fast_decode).
    generate = forward_flops(dims, 1, prompt_len, 0, 1) + sum(
        forward_flops(dims, batch, 1, prompt_len + t, 1) for t in range(gen_len - 1)
    )
    # Chunking into minibatches does not change the count: it is linear in the batch. The last token is not run.
    logprobs = forward_flops(dims, batch, seq_len - 1, 0, gen_len)
    # Every sequence once per pass; backward = 2x forward (activation and weight gradients), or 1x with
    # LoRA, whose frozen base weights need no weight gradients (the adapters' own FLOPs are negligible).
    # Model FLOPs only: activation checkpointing's recomputed forward is not counted as useful work.
    learn = (3 if finetune == "full" else 2) * logprobs * args.batches_per_learning_phase
    old_lp = logprobs if opts.recompute_old_logprobs else 0  # by default log pi_old comes from sampling
    return {"generate": generate, "old_lp": old_lp, "ref_lp": logprobs, "learn": learn}


def run_meta() -> dict:
    """What a benchmark's JSON records about the run and the machine it ran on."""
    cpu = cpu_info()
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": sys.argv,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu.record(),
        "cpu_count": psutil.cpu_count(),
        "kernel_settings": kernel_settings(),
    }


def make_output_dir(path: str | None) -> None:
    """Creates the folder ``--out`` writes into before any measuring, so a long run never ends in a
    FileNotFoundError that throws its numbers away."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def write_results(path: str, results: list[dict], phases: int, warning: str | None, **meta) -> None:
    """The JSON of a benchmark run: the machine and the run (``run_meta``, plus ``meta``), and every result."""
    meta = {**run_meta(), **meta, "phases": phases, "warmup_phases": WARMUP_PHASES, "busy_warning": warning}
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    print(f"\nwrote {path}")


def flop_limit_s(flops: dict[str, float], peak_gflops: float) -> float:
    """Seconds the phase's matmul FLOPs (all parts) take at ``peak_gflops``: no real phase can be faster."""
    return sum(flops.values()) / 1e9 / peak_gflops


# ---- machine: matmul peak, memory, CPU use -----------------------------------------------------


def square_gemm_peaks(native_bf16: bool) -> dict[str, float]:
    """GFLOP/s of a 2048^3 product per dtype (fp32: the better of torch.matmul and oneDNN), measured first thing in a fresh process (measured after
    training, with gigabytes allocated and freed, it came out up to half as high on the same machine).

    Without native bf16 a 2048^3 bf16 product is emulated and takes minutes: its rate is then measured on
    a 256^3 product (a fraction of a second), which is enough to show how slow it is."""
    peaks = fp32_peak_gflops(PEAK_GEMM_SIZE)  # "fp32": the better of MKL's and oneDNN's, both kept
    size = PEAK_GEMM_SIZE if native_bf16 else EMULATED_GEMM_SIZE
    peaks["bf16"] = matmul_gflops(size, size, size, DTYPES["bf16"], repeats=5 if size == PEAK_GEMM_SIZE else 2)
    return peaks


def model_shape_rates(dims: ModelDims, args: GRPO_Args, prompt_len: int, native_bf16: bool) -> dict[str, float]:
    """The rate of one minibatch's MLP up-projection (tokens x d_model x d_ff) per dtype, for context."""
    tokens = args.minibatch_size * (prompt_len + args.gen_len)
    names = [name for name in DTYPES if name == "fp32" or native_bf16]
    return {f"model_shape_{name}": matmul_gflops(tokens, dims.d_model, dims.d_ff, DTYPES[name]) for name in names}


def peak_rss_mib() -> float:
    """ru_maxrss: the peak resident set size of this process so far (KiB on Linux, bytes on macOS)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 2**10


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # summed over all threads of this process
    return usage.ru_utime + usage.ru_stime


def busy_machine_warning(sample_s: float = 1.0) -> str | None:
    """A warning when other work is using the CPU, or None when the machine looks idle.

    It samples the CPU now, for ``sample_s``: the 1-minute load average is no guide here, as it still counts
    the previous measurement of a series (compare_trl.py runs them back to back) for a minute after it ended.
    """
    psutil.cpu_percent(None)  # starts the system-wide window
    busy = competing_processes(window_s=sample_s, busy_percent=BUSY_PROCESS_CPU)
    cpus = psutil.cpu_count()
    cores_used = psutil.cpu_percent(None) / 100 * cpus
    if cores_used <= BUSY_CORES and not busy:
        return None
    who = f"; busy: {', '.join(busy)}" if busy else ""
    return (
        f"WARNING: the machine is not idle ({cores_used:.1f} of {cpus} CPUs in use over {sample_s:g} s{who}). "
        "PyTorch on a few cores slows down sharply when other processes hold one; the times below are pessimistic."
    )


def decode_products(precision: str) -> str:
    """How sampling's linear layers multiply at this precision (grpo_lightning.packed_linear)."""
    if precision == "32-true":
        return decode_matmul_backend()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prepared = cpu_fp32_product_setting() is not None
    return "onednn (bf16, laid out once)" if prepared else "autocast (oneDNN bf16, as is)"


# ---- one (workload, precision) measurement: runs in its own subprocess ----------------------------


def measure(workload: str, precision: str, phases: int, model: str | None, finetune: str, opts) -> dict:
    keeps_freed_memory = keep_freed_memory_for_reuse()  # as the command line does
    loadavg_start = os.getloadavg()[0]
    native_bf16 = cpu_info().native_bf16
    peaks = square_gemm_peaks(native_bf16)
    transformers.utils.logging.disable_progress_bar()  # one "Loading weights" bar per model would clutter the report
    module = make_module(workload, phases, model, finetune, opts)
    recorder = PhaseRecorder()
    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stdout(io.StringIO()):
        trainer = make_trainer(precision, WARMUP_PHASES + phases, root, recorder)
        trainer.fit(module)
        peak_rss = peak_rss_mib()  # read before the checkpoint and the peak GEMMs allocate their own buffers
        checkpoint_path = os.path.join(root, "phase.ckpt")
        trainer.save_checkpoint(checkpoint_path, weights_only=False)  # the full checkpoint ModelCheckpoint writes every phase
        checkpoint_size = os.path.getsize(checkpoint_path) / 2**20

    per_phase = recorder.phases[WARMUP_PHASES:]
    base = module.policy.get_base_model() if finetune == "lora" else module.policy
    dims = model_dims(base)
    prompt_len = encode_prompt(module.tokenizer, module.args.prompt).shape[1]
    flops = phase_flops(dims, module.args, prompt_len, finetune, opts)
    peaks.update(model_shape_rates(dims, module.args, prompt_len, native_bf16))
    peak = peaks[COMPUTE_DTYPE[precision]]
    mean_s = {key: statistics.mean(t[key] for t in per_phase) for key in (*PARTS, "total")}
    gflops = {part: flops[part] / mean_s[part] / 1e9 if mean_s[part] > 0 else 0.0 for part in PARTS}
    cpu_util = statistics.mean(t["cpu_util"] for t in per_phase)
    return {
        "workload": workload,
        "precision": precision,
        "finetune": finetune,
        "compute_dtype": COMPUTE_DTYPE[precision],
        "settings": WORKLOADS[workload],
        "options": {"recompute_old_logprobs": opts.recompute_old_logprobs,
                    "activation_checkpointing": opts.activation_checkpointing},  # fmt: skip
        "prompt_tokens": prompt_len,
        "model": model or "SmolLM2-135M-Instruct (embedded)",
        "model_dims": asdict(dims),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": loadavg_start,
        "warmup_phases": WARMUP_PHASES,
        "phases_s": per_phase,
        "mean_s": mean_s,
        "generated_tokens_per_s": module.args.batch_size * module.args.gen_len / mean_s["generate"],
        "gflop_per_phase": {part: f / 1e9 for part, f in flops.items()},
        "gflops_per_s": gflops,
        "fraction_of_peak": {part: g / peak for part, g in gflops.items()},
        # The honest yardstick across machines: the phase's matmul FLOPs at this machine's measured peak.
        "flop_limit_s": flop_limit_s(flops, peak),
        "total_over_flop_limit": mean_s["total"] / flop_limit_s(flops, peak),
        "matmul_peak_gflops_per_s": peaks,
        "peak_rss_mib": peak_rss,
        "checkpoint_mib": checkpoint_size,
        "cpu_util": cpu_util,
        "decode_matmul": decode_products(precision),
        "learning_matmul": training_matmul_backend() if precision == "32-true" else "autocast (oneDNN bf16)",
        "keeps_freed_memory": keeps_freed_memory,
    }


def measure_in_subprocess(workload: str, precision: str, finetune: str, opts: argparse.Namespace) -> dict:
    """Re-runs this script on one (workload, precision, finetune), so that ru_maxrss is that run's alone."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--workload", workload, "--precision", precision,
                   "--finetune", finetune, "--phases", str(opts.phases), "--child-result", result_path]  # fmt: skip
        if opts.model is not None:
            command += ["--model", opts.model]
        command += ["--recompute-old-logprobs"] * opts.recompute_old_logprobs
        command += ["--activation-checkpointing"] * opts.activation_checkpointing
        completed = subprocess.run(command)
        if completed.returncode != 0:
            raise SystemExit(
                f"error: the {workload}/{precision}/{finetune} measurement failed (exit code {completed.returncode})"
            )
        with open(result_path) as f:
            return json.load(f)


# ---- report --------------------------------------------------------------------------------


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned first two columns (names), right-aligned numbers."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def timing_table(results: list[dict]) -> str:
    headers = ["workload", "precision", "finetune", "generate s", "old-lp s", "ref-lp s", "learn s", "total s",
               "limit s", "x limit", "gen tok/s", "learn GFLOP/s", "% peak", "peak RSS MiB", "ckpt MiB",
               "cpu %"]  # fmt: skip
    rows = []
    for r in results:
        t = r["mean_s"]
        rows.append([
            r["workload"], r["precision"], r["finetune"],
            *(f"{t[key]:.2f}" for key in (*PARTS, "total")),
            f"{r['flop_limit_s']:.2f}",
            f"{r['total_over_flop_limit']:.2f}",
            f"{r['generated_tokens_per_s']:.0f}",
            f"{r['gflops_per_s']['learn']:.1f}",
            f"{100 * r['fraction_of_peak']['learn']:.1f}",
            f"{r['peak_rss_mib']:.0f}",
            f"{r['checkpoint_mib']:.1f}",
            f"{100 * r['cpu_util']:.0f}",
        ])  # fmt: skip
    return format_table(headers, rows)


def throughput_table(results: list[dict]) -> str:
    headers = ["workload", "precision", "finetune", "dtype", *(p.replace("_", "-") for p in PARTS), "peak fp32", "peak bf16"]
    rows = []
    for r in results:
        peaks = r["matmul_peak_gflops_per_s"]
        rows.append([
            r["workload"], r["precision"], r["finetune"], r["compute_dtype"],
            *(f"{r['gflops_per_s'][p]:.1f} ({100 * r['fraction_of_peak'][p]:.1f}%)" for p in PARTS),
            f"{peaks['fp32']:.0f}", f"{peaks['bf16']:.0f}",
        ])  # fmt: skip
    return format_table(headers, rows)


def machine_line(results: list[dict]) -> str:
    """The CPU, the features that decide its fp32 and bf16 speed, and the peaks measured on it."""
    cpu = cpu_info()
    peaks = results[0]["matmul_peak_gflops_per_s"]
    bf16 = f"bf16 {peaks['bf16']:.0f}" + ("" if cpu.native_bf16 else f" (emulated; {EMULATED_GEMM_SIZE}^3)")
    kind = "native bf16" if cpu.native_bf16 else "no native bf16"
    return (
        f"CPU: {cpu.describe()}, {kind}; matmul peak GFLOP/s: fp32 {peaks['fp32']:.0f}, {bf16}; "
        f"decode products: fp32 {decode_products('32-true')}, bf16 {decode_products('bf16-mixed')}; "
        f"fp32 learning products: {training_matmul_backend()}"
    )


def report(results: list[dict], phases: int, warning: str | None) -> str:
    first = results[0]
    dims = first["model_dims"]
    lines = [
        machine_line(results),
        f"GRPO phase time: mean of {phases} measured phase(s) after {WARMUP_PHASES} warm-up, "
        f"model {first['model']} ({dims['matmul_params'] / 1e6:.1f}M non-embedding matmul params, "
        f"{dims['n_layers']} layers, d_model {dims['d_model']}, vocab {dims['vocab']}), "
        f"torch {torch.__version__}, {first['torch_threads']} threads",
        "",
        timing_table(results),
        "limit s: the phase's matmul FLOPs at the measured peak of its dtype; x limit: total s / limit s.",
        "",
        "Achieved matmul GFLOP/s per part (% of the peak of the dtype the precision computes in); peaks are the "
        f"GFLOP/s of a {PEAK_GEMM_SIZE}^3 product (fp32: the better of torch.matmul and oneDNN), measured in each run:",
        "",
        throughput_table(results),
        "",
        "GFLOP per phase: "
        + "; ".join(
            f"{r['workload']}: " + ", ".join(f"{p.replace('_', '-')} {r['gflop_per_phase'][p]:.0f}" for p in PARTS)
            for r in {r["workload"]: r for r in results}.values()
        ),
        "Model-shaped GEMM (one minibatch's tokens x d_model x d_ff), GFLOP/s: "
        + "; ".join(
            f"{r['workload']}/{r['precision']}: "
            + f"fp32 {r['matmul_peak_gflops_per_s']['model_shape_fp32']:.0f}, "
            + f"bf16 {r['matmul_peak_gflops_per_s'].get('model_shape_bf16', float('nan')):.0f}"
            for r in results
        ),
    ]
    if warning:
        lines += ["", warning]
    return "\n".join(lines)


# ---- command line --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument("--precision", choices=[*PRECISIONS, "both"], default="both")
    parser.add_argument("--finetune", choices=[*FINETUNES, "both"], default="full", help="full, lora, or both (default full)")
    parser.add_argument("--phases", type=int, default=2, help="measured phases per run, after one warm-up (default 2)")
    parser.add_argument("--model", default=None, help="model directory or hub id (default: the embedded SmolLM2-135M)")
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
    parser.add_argument("--recompute-old-logprobs", action="store_true",
                        help="recompute log pi_old with a forward pass, as the reference does (model option)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute layer activations in backward to save memory (model option)")
    # Internal: set when the script re-runs itself to measure one (workload, precision) pair.
    parser.add_argument("--child-result", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.phases < 1:
        parser.error("--phases must be at least 1")
    if opts.child_result and "both" in (opts.workload, opts.precision, opts.finetune):
        parser.error("--child-result measures exactly one workload, one precision and one finetune mode")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    if opts.child_result:
        result = measure(opts.workload, opts.precision, opts.phases, opts.model, opts.finetune, opts)
        with open(opts.child_result, "w") as f:
            json.dump(result, f)
        return

    make_output_dir(opts.out)
    warning = busy_machine_warning()
    if warning:
        print(warning, file=sys.stderr, flush=True)
    workloads = list(WORKLOADS) if opts.workload == "both" else [opts.workload]
    precisions = list(PRECISIONS) if opts.precision == "both" else [opts.precision]
    cpu = cpu_info()
    if not cpu.native_bf16 and "bf16-mixed" in precisions:
        if opts.precision == "both":  # hours of emulated bf16 would measure nothing a user should run
            precisions.remove("bf16-mixed")
            print(f"skipping bf16-mixed: this CPU has no native bf16 ({cpu.describe()})", file=sys.stderr, flush=True)
        else:
            print(f"warning: {precision_warning('bf16-mixed', 'cpu')}", file=sys.stderr, flush=True)
    finetunes = list(FINETUNES) if opts.finetune == "both" else [opts.finetune]
    results = []
    for workload in workloads:
        for precision in precisions:
            for finetune in finetunes:
                print(f"measuring {workload} / {precision} / {finetune} ...", file=sys.stderr, flush=True)
                results.append(measure_in_subprocess(workload, precision, finetune, opts))

    print(report(results, opts.phases, warning))
    if opts.out:
        peaks = results[0]["matmul_peak_gflops_per_s"]
        write_results(opts.out, results, opts.phases, warning, matmul_peak_gflops_per_s=peaks)


if __name__ == "__main__":
    main()
