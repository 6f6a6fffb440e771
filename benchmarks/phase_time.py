"""Time one GRPO phase of grpo-lightning on the CPU, split into its parts.

Usage:
    python benchmarks/phase_time.py [--workload small|default|both] [--precision 32-true|bf16-mixed|both]
                                    [--finetune full|lora|both] [--phases N] [--model PATH] [--out results.json]

What is measured
----------------
One phase does what ``GRPOModule`` does in one epoch. It calls the same library functions in the same
order, with a policy and a frozen reference model (kl_coef = 0.3), but without the Lightning Trainer:

  generate  get_samples: KV-cached sampling of batch_size completions of gen_len tokens, then decoding
  old-lp    get_logprobs_batched(policy): log pi_old of the generated tokens, minibatch_size sequences a time
  ref-lp    get_logprobs_batched(reference): log pi_ref, chunked the same way
  learn     for each minibatch of ReplayMemory.get_minibatches (num_minibatches x batches_per_learning_phase):
            get_logits + get_logprobs + calc_clipped_surrogate_objective - calc_kl_penalty (the forward pass),
            then zero_grad, backward, clip_grad_norm_(max_norm=1.0) and the AdamW(maximize=True) step
  total     wall time of the whole phase: the parts above, plus scoring (reward_fn_char_count), advantages
            (compute_grpo_advantages), building the ReplayMemory and the once-per-phase LR scheduler step

Not included: Lightning's own per-step work (log_dict, the grad_norm and clip_fraction statistics, loop
bookkeeping). It is small next to the forward and backward passes.

Fine-tuning: "full" trains the whole policy next to a frozen reference copy; "lora" wraps the policy with
LoRA adapters (LoraSettings() defaults) and takes reference log-probabilities from the same model with its
adapters disabled, as the module does with ``lora: true``. "ckpt MiB" is the size of what a checkpoint
holds: the trained weights (all, or the adapters only) and the optimizer state.

Precision: "32-true" runs everything in fp32. "bf16-mixed" puts the rollout (generation and both log-prob
passes) and every learning forward inside torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
which is the context Lightning's bf16-mixed plugin uses. Backward, gradient clipping and the AdamW step run
outside autocast, on the fp32 weights.

Workloads: "default" is the reference's setting (batch 128, gen_len 30, 4 minibatches, 2 passes, prompt
"This is"). "small" is batch 32, gen_len 30, 2 minibatches, 1 pass.

Each (workload, precision) pair runs in a fresh subprocess, so its peak resident memory (ru_maxrss, which is
the maximum over the process's whole life) belongs to that pair alone. Each subprocess first runs one warm-up
phase that is not counted: it allocates the AdamW state and primes the oneDNN kernels. The table shows the
mean of the --phases measured phases, and the JSON (--out) keeps every phase.

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
  generation = prompt forward (n = P, c = 0, L = 1) + (gen_len - 1) one-token steps (n = 1, c = P + t, L = 1)
  log-probs  = one forward of the whole group (n = P + gen_len, c = 0, L = gen_len + 1, from logits_to_keep)
  learning   = 3 x the forward of every minibatch (backward = 2 x forward), summed over all minibatches
For the embedded SmolLM2-135M (N = 106.2M, d_model = 576, V = 49152, 30 layers, d_attn = 576, P = 3 tokens for
"<|endoftext|>This is"), one forward of the default group (128 x 33 tokens) is 1.13 TFLOP (897 GFLOP of layer matmuls,
225 of lm head, 5 of attention), so a default learning phase is 3 x 2 passes x 1.13 = 6.8 TFLOP, and a small one
is 3 x 0.28 = 0.84 TFLOP. Generation costs about one forward of the group (1.09 TFLOP default, 0.27 small).

How to read the output
----------------------
"GFLOP/s" is the matmul throughput achieved under that FLOP model. "% peak" compares it with the peak measured in
the same subprocess: a 2048x2048x2048 torch.matmul in the dtype that the precision computes in (fp32 for
32-true, bf16 for bf16-mixed), best of several runs. Both peaks are reported, and each precision is compared
with its own dtype's peak. The JSON also gives the throughput of a GEMM shaped like the model's MLP up-projection
for one minibatch (tokens x d_model x intermediate). Matmuls this small cannot reach the square GEMM's rate.
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

import psutil
import torch
import transformers

from grpo_lightning import (
    GRPO_Args,
    ReplayMemory,
    calc_clipped_surrogate_objective,
    calc_kl_penalty,
    compute_grpo_advantages,
    get_logits,
    get_logprobs,
    get_logprobs_batched,
    get_optimizer_and_scheduler,
    get_samples,
    load_causal_lm,
    load_tokenizer,
)
from grpo_lightning.lora import LoraSettings, apply_lora
from grpo_lightning.module import phase_seed
from grpo_lightning.sampling import encode_prompt
from rewards import reward_fn_char_count

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
BUSY_LOADAVG = 0.5  # 1-minute load average above which the machine counts as busy
BUSY_PROCESS_CPU = 10.0  # % of one core that another process may use before it is named in the warning


# ---- one phase, as GRPOModule runs it --------------------------------------------------------


@dataclass
class Setup:
    """Everything a phase needs; built once per subprocess, like the module's configure_* hooks."""

    args: GRPO_Args
    precision: str
    tokenizer: object
    policy: torch.nn.Module
    ref_model: torch.nn.Module | None  # None with LoRA
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def make_args(workload: str, phases: int) -> GRPO_Args:
    # total_phases only shapes the LR schedule, which asserts that it is never stepped past its end.
    total_phases = max(GRPO_Args.total_phases, WARMUP_PHASES + phases)
    return GRPO_Args(seed=SEED, total_phases=total_phases, **WORKLOADS[workload])


def setup(workload: str, precision: str, phases: int, model: str | None, finetune: str = "full") -> Setup:
    args = make_args(workload, phases)
    policy = load_causal_lm(model)
    if finetune == "lora":
        policy, ref_model = apply_lora(policy, LoraSettings()), None  # one model in memory
    else:
        ref_model = load_causal_lm(model).requires_grad_(False)  # the module's frozen reference (kl_coef > 0)
    optimizer, scheduler = get_optimizer_and_scheduler(args, policy)
    return Setup(args, precision, load_tokenizer(model), policy, ref_model, optimizer, scheduler)


def forward_context(precision: str):
    """The context Lightning's precision plugin puts around the rollout and each training_step."""
    if precision == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext()


@contextlib.contextmanager
def timed(times: dict[str, float], key: str):
    start = time.perf_counter()
    yield
    times[key] = time.perf_counter() - start


def run_phase(s: Setup, phase: int) -> dict[str, float]:
    """One rollout + learning phase (GRPOModule.on_train_epoch_start + the epoch's training steps);
    returns the seconds of each part and of the whole phase."""
    args, times = s.args, {}
    start = time.perf_counter()
    s.policy.eval()
    seed = phase_seed(args.seed, phase, rank=0)
    torch.manual_seed(seed)
    shuffle = torch.Generator().manual_seed(seed + 1)

    with torch.no_grad(), forward_context(s.precision):
        with timed(times, "generate"):
            sample_ids, samples = get_samples(
                s.policy, s.tokenizer, args.prompt, args.batch_size, args.gen_len, args.temperature
            )
        advantages = compute_grpo_advantages(reward_fn_char_count(samples))
        with timed(times, "old_lp"):
            logprobs = get_logprobs_batched(s.policy, sample_ids, args.gen_len, args.minibatch_size)
        with timed(times, "ref_lp"):
            if s.ref_model is None:  # LoRA: the reference is the policy without its adapters
                with s.policy.disable_adapter():
                    ref_logprobs = get_logprobs_batched(s.policy, sample_ids, args.gen_len, args.minibatch_size)
            else:
                ref_logprobs = get_logprobs_batched(s.ref_model, sample_ids, args.gen_len, args.minibatch_size)
    memory = ReplayMemory(args, sample_ids, logprobs, ref_logprobs, advantages)

    with timed(times, "learn"):
        for minibatch in memory.get_minibatches(shuffle):
            learning_step(s, minibatch)
    s.scheduler.step()  # the module's scheduler interval is "epoch", i.e. once per phase
    times["total"] = time.perf_counter() - start
    return times


def learning_step(s: Setup, minibatch) -> None:
    """GRPOModule.training_step plus what Lightning's automatic optimization does around it, in its order."""
    args = s.args
    with forward_context(s.precision):
        logits = get_logits(s.policy, minibatch.sample_ids, args.gen_len)
        logprobs = get_logprobs(logits, minibatch.sample_ids, args.gen_len)
        surrogate = calc_clipped_surrogate_objective(logprobs, minibatch.logprobs, minibatch.advantages, args.clip_coef)
        objective = surrogate - calc_kl_penalty(logprobs, minibatch.ref_logprobs, args.kl_coef)
    s.optimizer.zero_grad()
    objective.backward()  # not negated: AdamW(maximize=True) climbs the objective
    params = [p for group in s.optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
    s.optimizer.step()


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


def phase_flops(dims: ModelDims, args: GRPO_Args, prompt_len: int, finetune: str = "full") -> dict[str, int]:
    batch, gen_len = args.batch_size, args.gen_len
    seq_len = prompt_len + gen_len
    generate = forward_flops(dims, batch, prompt_len, 0, 1) + sum(
        forward_flops(dims, batch, 1, prompt_len + t, 1) for t in range(gen_len - 1)
    )
    # Chunking into minibatches does not change the count: it is linear in the batch.
    logprobs = forward_flops(dims, batch, seq_len, 0, gen_len + 1)
    # Every sequence once per pass; backward = 2x forward (activation and weight gradients), or 1x with
    # LoRA, whose frozen base weights need no weight gradients (the adapters' own FLOPs are negligible).
    learn = (3 if finetune == "full" else 2) * logprobs * args.batches_per_learning_phase
    return {"generate": generate, "old_lp": logprobs, "ref_lp": logprobs, "learn": learn}


# ---- machine: matmul peak, memory, CPU use -----------------------------------------------------


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """Best-of-``repeats`` GFLOP/s of an (m, k) @ (k, n) torch.matmul into a preallocated output."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    torch.matmul(a, b, out=out)  # the first call picks and primes the kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9


def measure_peaks(dims: ModelDims, args: GRPO_Args, prompt_len: int) -> dict[str, float]:
    """Square-GEMM peak per dtype, and the rate of one minibatch's MLP up-projection (for context)."""
    tokens = args.minibatch_size * (prompt_len + args.gen_len)
    peaks = {}
    for name, dtype in DTYPES.items():
        peaks[name] = matmul_gflops(PEAK_GEMM_SIZE, PEAK_GEMM_SIZE, PEAK_GEMM_SIZE, dtype)
        peaks[f"model_shape_{name}"] = matmul_gflops(tokens, dims.d_model, dims.d_ff, dtype)
    return peaks


def peak_rss_mib() -> float:
    """ru_maxrss: the peak resident set size of this process so far (KiB on Linux, bytes on macOS)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 2**10


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # summed over all threads of this process
    return usage.ru_utime + usage.ru_stime


def busy_machine_warning(sample_s: float = 1.0) -> str | None:
    """A warning when other work is using the CPU, or None when the machine looks idle."""
    load1 = os.getloadavg()[0]
    others = [p for p in psutil.process_iter(["name"]) if p.pid != os.getpid()]
    for p in others:  # the first cpu_percent call only starts each process's measurement window
        with contextlib.suppress(psutil.Error):
            p.cpu_percent(None)
    time.sleep(sample_s)
    busy = []
    for p in others:
        with contextlib.suppress(psutil.Error):
            percent = p.cpu_percent(None)
            if percent >= BUSY_PROCESS_CPU:
                busy.append(f"{p.info['name']} (pid {p.pid}, {percent:.0f}% CPU)")
    if load1 <= BUSY_LOADAVG and not busy:
        return None
    who = f"; busy: {', '.join(busy)}" if busy else ""
    return (
        f"WARNING: the machine is not idle (1-min load average {load1:.2f}, {psutil.cpu_count()} CPUs{who}). "
        "PyTorch on a few cores slows down sharply when other processes hold one; the times below are pessimistic."
    )


# ---- one (workload, precision) measurement: runs in its own subprocess ----------------------------


def checkpoint_mib(s: Setup) -> float:
    """Size of what a Lightning checkpoint of this run holds: the trained weights (all of the policy, or
    only the adapters with LoRA, whose frozen base the module keeps out) and the optimizer state."""
    weights = {name: p for name, p in s.policy.named_parameters() if p.requires_grad}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        torch.save({"state_dict": weights, "optimizer": s.optimizer.state_dict()}, path)
        return os.path.getsize(path) / 2**20


def measure(workload: str, precision: str, phases: int, model: str | None, finetune: str = "full") -> dict:
    loadavg_start = os.getloadavg()[0]
    transformers.utils.logging.disable_progress_bar()  # one "Loading weights" bar per model would clutter the report
    s = setup(workload, precision, phases, model, finetune)
    rss_after_load = peak_rss_mib()  # a baseline only: weights read lazily from disk count once they are touched
    base = s.policy.get_base_model() if finetune == "lora" else s.policy
    dims = model_dims(base)
    prompt_len = encode_prompt(s.tokenizer, s.args.prompt).shape[1]
    flops = phase_flops(dims, s.args, prompt_len, finetune)

    for phase in range(WARMUP_PHASES):
        run_phase(s, phase)
    wall_start, cpu_start = time.perf_counter(), cpu_seconds()
    per_phase = [run_phase(s, WARMUP_PHASES + i) for i in range(phases)]
    cpu_util = (cpu_seconds() - cpu_start) / ((time.perf_counter() - wall_start) * torch.get_num_threads())
    peak_rss = peak_rss_mib()  # read before the peak GEMMs allocate their own buffers
    checkpoint_size = checkpoint_mib(s)

    peaks = measure_peaks(dims, s.args, prompt_len)
    peak = peaks[COMPUTE_DTYPE[precision]]
    mean_s = {key: statistics.mean(t[key] for t in per_phase) for key in (*PARTS, "total")}
    gflops = {part: flops[part] / mean_s[part] / 1e9 for part in PARTS}
    return {
        "workload": workload,
        "precision": precision,
        "finetune": finetune,
        "compute_dtype": COMPUTE_DTYPE[precision],
        "settings": WORKLOADS[workload],
        "prompt_tokens": prompt_len,
        "model": model or "SmolLM2-135M-Instruct (embedded)",
        "model_dims": asdict(dims),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": loadavg_start,
        "warmup_phases": WARMUP_PHASES,
        "phases_s": per_phase,
        "mean_s": mean_s,
        "generated_tokens_per_s": s.args.batch_size * s.args.gen_len / mean_s["generate"],
        "gflop_per_phase": {part: f / 1e9 for part, f in flops.items()},
        "gflops_per_s": gflops,
        "fraction_of_peak": {part: g / peak for part, g in gflops.items()},
        "matmul_peak_gflops_per_s": peaks,
        "peak_rss_mib": peak_rss,
        "checkpoint_mib": checkpoint_size,
        "rss_after_load_mib": rss_after_load,
        "cpu_util": cpu_util,
    }


def measure_in_subprocess(workload: str, precision: str, finetune: str, opts: argparse.Namespace) -> dict:
    """Re-runs this script on one (workload, precision, finetune), so that ru_maxrss is that run's alone."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--workload", workload, "--precision", precision,
                   "--finetune", finetune, "--phases", str(opts.phases), "--child-result", result_path]  # fmt: skip
        if opts.model is not None:
            command += ["--model", opts.model]
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
               "gen tok/s", "learn GFLOP/s", "% peak", "peak RSS MiB", "ckpt MiB", "cpu %"]  # fmt: skip
    rows = []
    for r in results:
        t = r["mean_s"]
        rows.append([
            r["workload"], r["precision"], r["finetune"],
            *(f"{t[key]:.2f}" for key in (*PARTS, "total")),
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


def report(results: list[dict], phases: int, warning: str | None) -> str:
    first = results[0]
    dims = first["model_dims"]
    lines = [
        f"GRPO phase time: mean of {phases} measured phase(s) after {WARMUP_PHASES} warm-up, "
        f"model {first['model']} ({dims['matmul_params'] / 1e6:.1f}M non-embedding matmul params, "
        f"{dims['n_layers']} layers, d_model {dims['d_model']}, vocab {dims['vocab']}), "
        f"torch {torch.__version__}, {first['torch_threads']} threads",
        "",
        timing_table(results),
        "",
        "Achieved matmul GFLOP/s per part (% of the peak of the dtype the precision computes in); peaks are the "
        f"GFLOP/s of a {PEAK_GEMM_SIZE}^3 torch.matmul, measured in each run:",
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
            + f"bf16 {r['matmul_peak_gflops_per_s']['model_shape_bf16']:.0f}"
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
        result = measure(opts.workload, opts.precision, opts.phases, opts.model, opts.finetune)
        with open(opts.child_result, "w") as f:
            json.dump(result, f)
        return

    warning = busy_machine_warning()
    if warning:
        print(warning, file=sys.stderr, flush=True)
    workloads = list(WORKLOADS) if opts.workload == "both" else [opts.workload]
    precisions = list(PRECISIONS) if opts.precision == "both" else [opts.precision]
    finetunes = list(FINETUNES) if opts.finetune == "both" else [opts.finetune]
    results = []
    for workload in workloads:
        for precision in precisions:
            for finetune in finetunes:
                print(f"measuring {workload} / {precision} / {finetune} ...", file=sys.stderr, flush=True)
                results.append(measure_in_subprocess(workload, precision, finetune, opts))

    print(report(results, opts.phases, warning))
    if opts.out:
        meta = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": sys.argv,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": psutil.cpu_count(),
            "phases": opts.phases,
            "warmup_phases": WARMUP_PHASES,
            "busy_warning": warning,
        }
        with open(opts.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
        print(f"\nwrote {opts.out}")


if __name__ == "__main__":
    main()
