"""Sampling against its matrix products alone: how near the matmul peak sampling could get if everything
between the products cost nothing.

Usage:
    python benchmarks/decode_products.py [--groups 32 128] [--gen-len 30] [--runs 5]
                                         [--precision auto|32-true|bf16-mixed] [--model PATH] [--out results.json]

For each group size G, two things alternate ``--runs`` times in one process:

  whole     ``sampling.sample_completions_with_logprobs`` of G completions of gen_len tokens after the
            workloads' prompt ("<|endoftext|>This is"), as a rollout samples them: the lean decoder's products
            prepared once, then every decode step (norms, rotary, key/value cache, attention, the gated MLP,
            the sampling draw over the whole vocabulary)
  products  the same decoder's prepared products and nothing else, called in the same order with inputs of the
            same shapes: the prompt on one row, then gen_len - 1 steps of G rows through every layer's q/k/v,
            output, gate/up and down products and the unembedding

Both are timed with their weights laid out first and freed after (the layout is part of "whole", as in a
rollout, and of "products" too). "rest" = whole - products: the operations between the products, the sampling
draw and the prompt's copy of its keys and values to the G rows (in fp32, where they could be built, the
fused kernels of ``grpo_lightning/fused_decode.py``; ``GRPO_LIGHTNING_FUSED_DECODE=0`` measures without them). The FLOPs are phase_time.py's generation FLOPs
(matmuls and attention); "products" counts the matmuls only. GFLOP/s are against the fp32 (or, in bf16-mixed,
bf16) peak of a 2048^3 product measured first, as phase_time.py measures it, so "% peak" of the products alone is
the most the sampling part of a phase could reach on this machine with these libraries, and "% peak" of the
whole is what phase_time.py reports for it.

Run it on an idle machine: on 2 cores one busy core slows PyTorch about tenfold.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import torch  # noqa: E402

from benchmarks.phase_time import ModelDims, forward_flops, model_dims, run_meta, square_gemm_peaks  # noqa: E402
from grpo_lightning import load_causal_lm, load_tokenizer  # noqa: E402
from grpo_lightning.fast_decode import LeanDecoder, supports_fast_decode  # noqa: E402
from grpo_lightning.machine import keep_freed_memory_for_reuse  # noqa: E402
from grpo_lightning.models import embedded_model_dir  # noqa: E402
from grpo_lightning.precision import choose_precision, cpu_info  # noqa: E402
from grpo_lightning.sampling import encode_prompt, sample_completions_with_logprobs  # noqa: E402

PROMPT = "This is"  # the workloads' prompt (benchmarks/phase_time.py)


def generation_flops(dims: ModelDims, group: int, prompt_len: int, gen_len: int) -> int:
    """phase_time.py's generation FLOPs: the prompt once on one row, then gen_len - 1 steps of ``group`` rows."""
    return forward_flops(dims, 1, prompt_len, 0, 1) + sum(
        forward_flops(dims, group, 1, prompt_len + t, 1) for t in range(gen_len - 1)
    )


def product_flops(dims: ModelDims, group: int, prompt_len: int, gen_len: int) -> int:
    """The same without attention's QK^T and attention @ V: the FLOPs of the linear layers and the unembedding."""
    return generation_flops(dataclasses.replace(dims, d_attn=0), group, prompt_len, gen_len)


@torch.no_grad()
def run_products(model: torch.nn.Module, group: int, prompt_len: int, gen_len: int) -> None:
    """The lean decoder's products for one sampling of ``group`` rows, in its order, on random inputs."""
    decoder = LeanDecoder(model, group, prompt_len + gen_len)
    config = decoder.config
    width, ff = config.hidden_size, config.intermediate_size
    attended = config.num_attention_heads * decoder.head_dim  # the output product's input width
    fused = decoder.fused is not None and not torch.is_autocast_enabled("cpu")  # its steps pass (B, d) inputs
    for rows, new in [(1, prompt_len)] + [(group, 1)] * (gen_len - 1):
        flat = fused and new == 1
        positions = (rows,) if flat else (rows, new)
        x, mixed, hidden = (torch.randn(*positions, n) for n in (width, attended, ff))
        for products in decoder.products:
            products.qkv(x)
            products.o(mixed)
            (products.joined_gate_up if flat else products.gate_up)(x)
            products.down(hidden)
        decoder.head(x if flat else x[:, -1:])


@torch.no_grad()
def run_whole(model: torch.nn.Module, prompt_ids: torch.Tensor, gen_len: int, seed: int) -> None:
    torch.manual_seed(seed)
    sample_completions_with_logprobs(model, prompt_ids, gen_len)


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def measure(model, prompt_ids: torch.Tensor, group: int, gen_len: int, runs: int, precision: str) -> dict:
    """Seconds of the whole sampling and of its products alone, ``runs`` of each, alternated (one warm-up each)."""
    prompt_len = prompt_ids.shape[1]
    rows = prompt_ids.expand(group, -1).contiguous()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True) if precision == "bf16-mixed" else None
    seconds = {"whole": [], "products": []}
    with autocast or contextlib.nullcontext():
        run_whole(model, rows, gen_len, seed=0)
        run_products(model, group, prompt_len, gen_len)
        for run in range(runs):
            seconds["whole"].append(timed(lambda: run_whole(model, rows, gen_len, seed=run + 1)))
            seconds["products"].append(timed(lambda: run_products(model, group, prompt_len, gen_len)))
    return seconds


def summary(seconds: dict, dims: ModelDims, group: int, prompt_len: int, gen_len: int, peak: float) -> dict:
    whole, products = (statistics.median(seconds[key]) for key in ("whole", "products"))
    whole_gflop = generation_flops(dims, group, prompt_len, gen_len) / 1e9
    products_gflop = product_flops(dims, group, prompt_len, gen_len) / 1e9
    return {
        "seconds": seconds,
        "median_s": {"whole": whole, "products": products, "rest": whole - products},
        "gflop": {"whole": whole_gflop, "products": products_gflop},
        "gflops_per_s": {"whole": whole_gflop / whole, "products": products_gflop / products},
        "fraction_of_peak": {"whole": whole_gflop / whole / peak, "products": products_gflop / products / peak},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--gen-len", type=int, default=30)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--precision", choices=["auto", "32-true", "bf16-mixed"], default="auto")
    parser.add_argument("--model", default=None, help="a model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    opts = parser.parse_args(argv)
    native_bf16 = cpu_info().native_bf16
    peaks = square_gemm_peaks(native_bf16)  # first, in a fresh process
    keep_freed_memory_for_reuse()  # as the command line does
    precision = choose_precision("cpu")[0] if opts.precision == "auto" else opts.precision
    peak = peaks["bf16" if precision == "bf16-mixed" else "fp32"]
    path = opts.model or str(embedded_model_dir())
    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    prompt_ids = encode_prompt(tokenizer, PROMPT)
    if not supports_fast_decode(model, prompt_ids.shape[1] + opts.gen_len):
        parser.error("the model is not Llama-shaped: it samples through its own forward, which has no products to time alone")
    dims = model_dims(model)
    print(f"CPU: {cpu_info().describe()}; 2048^3 matmul peaks: " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items())
          + f" GFLOP/s; {precision}, compared with the {'bf16' if precision == 'bf16-mixed' else 'fp32'} peak")  # fmt: skip
    results = {**run_meta(), "peaks_gflops": peaks, "precision": precision, "gen_len": opts.gen_len, "groups": {}}
    for group in opts.groups:
        seconds = measure(model, prompt_ids, group, opts.gen_len, opts.runs, precision)
        result = summary(seconds, dims, group, prompt_ids.shape[1], opts.gen_len, peak)
        results["groups"][str(group)] = result
        median, rate, share = result["median_s"], result["gflops_per_s"], result["fraction_of_peak"]
        print(f"G = {group:>3}: whole {median['whole']:.2f} s ({rate['whole']:.0f} GFLOP/s, {share['whole']:.0%} of the peak); "
              f"products alone {median['products']:.2f} s ({rate['products']:.0f} GFLOP/s, {share['products']:.0%}); "
              f"rest {median['rest']:.2f} s ({median['rest'] / median['whole']:.0%} of the whole)")  # fmt: skip
        for key in ("whole", "products"):
            print(f"        {key:>8} runs: " + ", ".join(f"{s:.2f}" for s in seconds[key]) + " s")
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
