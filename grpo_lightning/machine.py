"""The CPU a run trains on: how many threads PyTorch uses, whether other processes compete for them, and
how its memory allocator treats the large tensors freed at every step.

On a machine with few cores, PyTorch's OpenMP threads wait for each other at every operation, so a single
other busy process can slow training about tenfold. That is invisible from inside the run (it just looks
slow), so a run checks once at the start and says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import time

import psutil
import torch

from .precision import ONEDNN_ISA_ENV

BUSY_PERCENT = 25.0  # % of one core another process may use before it counts as competing


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def fit_threads_to_cpus() -> str | None:
    """Lowers PyTorch's intra-op thread count to the usable CPUs when it exceeds them (more OpenMP threads
    than cores only makes them wait for each other); returns a note saying so, or None."""
    threads, cpus = torch.get_num_threads(), usable_cpus()
    if threads <= cpus:
        return None
    torch.set_num_threads(cpus)
    return f"PyTorch was set to {threads} threads but this process may use {cpus} CPUs: using {cpus} threads"


def competing_processes(window_s: float = 0.5, busy_percent: float = BUSY_PERCENT) -> list[str]:
    """Other processes that used more than ``busy_percent`` of a core during a ``window_s`` sample,
    described as ``name (pid N, P% CPU)``, busiest first."""
    me = os.getpid()
    others = []
    for process in psutil.process_iter(["name"]):
        if process.pid == me:
            continue
        with contextlib.suppress(psutil.Error):
            process.cpu_percent(None)  # starts this process's measurement window
            others.append(process)
    time.sleep(window_s)
    busy = []
    for process in others:
        with contextlib.suppress(psutil.Error):
            percent = process.cpu_percent(None)
            if percent >= busy_percent:
                busy.append((percent, f"{process.info['name']} (pid {process.pid}, {percent:.0f}% CPU)"))
    return [description for _, description in sorted(busy, reverse=True)]


def cpu_contention_warning(busy: list[str], threads: int | None = None, cores: int | None = None) -> str | None:
    """The message for a CPU run when other processes compete, or None when they do not."""
    if not busy:
        return None
    threads = threads or torch.get_num_threads()
    cores = cores or psutil.cpu_count(logical=True)
    return (
        f"other processes are using the CPU ({', '.join(busy[:3])}); this run uses {threads} PyTorch threads on "
        f"{cores} cores, and competing for them can slow it down several-fold. Stop them, or give the run fewer "
        "threads (OMP_NUM_THREADS) for a steadier speed."
    )


def _best_gflops(product, flops: float, repeats: int) -> float:
    """Best-of-``repeats`` GFLOP/s of ``product()``, after one call that picks and primes the kernel."""
    product()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """Best-of-``repeats`` GFLOP/s of an (m, k) @ (k, n) torch.matmul into a preallocated output."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    return _best_gflops(lambda: torch.matmul(a, b, out=out), 2 * m * k * n, repeats)


# Environment variables that change which kernels the products run, recorded with every benchmark.
KERNEL_SETTINGS_ENV = ("ATEN_CPU_CAPABILITY", *ONEDNN_ISA_ENV, "MKL_ENABLE_INSTRUCTIONS",
                       "GRPO_LIGHTNING_DECODE_MATMUL", "GRPO_LIGHTNING_TRAIN_MATMUL", "GRPO_LIGHTNING_FUSED_DECODE",
                       "GRPO_LIGHTNING_FUSED_TRAINING")  # fmt: skip


def kernel_settings() -> dict[str, str]:
    """The instruction set PyTorch dispatches its CPU kernels at here (``"cpu_capability"``), and those of
    ``KERNEL_SETTINGS_ENV`` that are set: a run held to AVX2 on an AVX-512 CPU says so in its JSON."""
    settings = {"cpu_capability": torch.backends.cpu.get_cpu_capability()}
    return settings | {name: os.environ[name] for name in KERNEL_SETTINGS_ENV if name in os.environ}


def onednn_fp32_gflops(m: int, k: int, n: int, repeats: int = 5) -> float | None:
    """Best-of-``repeats`` GFLOP/s of the same (m, k) @ (k, n) fp32 product through oneDNN's inner product
    (the library of this package's decode and reference products, and of its learning products on some
    CPUs); None where this PyTorch has no oneDNN."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return None
    a, weight = torch.randn(m, k), torch.randn(n, k)  # x @ weight^T
    product = torch.ops.mkldnn._linear_pointwise
    return _best_gflops(lambda: product(a, weight, None, "none", [], ""), 2 * m * k * n, repeats)


def fp32_peak_gflops(size: int, repeats: int = 5) -> dict[str, float]:
    """The CPU's fp32 matmul peak: a size^3 product through ``torch.matmul`` (MKL on x86) and through oneDNN,
    and the better of the two as ``"fp32"``. One library alone can understate it severalfold: on an AMD
    EPYC with AVX-512 (Zen 5 class) MKL takes its AVX2 path, 192 GFLOP/s against oneDNN's 418 on 2 cores."""
    peaks = {"fp32_torch_matmul": matmul_gflops(size, size, size, torch.float32, repeats)}
    onednn = onednn_fp32_gflops(size, size, size, repeats)
    if onednn is not None:
        peaks["fp32_onednn"] = onednn
    return {"fp32": max(peaks.values()), **peaks}


# glibc's mallopt parameters (malloc.h) and what the run sets them to.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
# mallopt(3): "Setting M_TRIM_THRESHOLD to -1 disables trimming completely" (no free memory at the top of the
# heap is returned to the system before exit).
NEVER_TRIM = -1
KEEP_FREED_MEMORY_ENV = "GRPO_LIGHTNING_KEEP_FREED_MEMORY"


def keep_freed_memory_for_reuse() -> bool:
    """Makes glibc's malloc reuse freed memory instead of returning it to the system; True if it did.

    Every learning step allocates and frees the same large tensors (the (b * T, V) logits and their
    gradient: 190 MB each for SmolLM2 at 32 x 30 tokens). glibc serves any allocation above 32 MB with
    fresh pages from the kernel and unmaps them at free, so each step faults about 200,000 pages (0.8 GB)
    in again, and the kernel zeroes each one: a tenth of a learning step's time on the machines measured
    (README, "Performance"). With no mmap'd blocks and no free heap returned (trimming off), the same
    tensors land in the same memory every step, and the peak memory is unchanged (a run reuses what it
    freed; it only gives it back to the system at exit).

    Trimming is off, not merely held to a threshold: with glibc trimming the top of the heap above 1 GB,
    the second phase of the default workload gave back about 650 MB between its rollout and its learning
    steps and faulted 394,000 pages in again (its learning took 41.1 s on 2 Zen 4 cores, the third phase's
    38.0 s); with trimming off, 17,500 pages and 39.4 s (README, "Performance").

    Process-wide, so only the command line calls it (a library import should not change the allocator);
    ``GRPO_LIGHTNING_KEEP_FREED_MEMORY=0`` turns it off. Not glibc (macOS, musl): nothing to do."""
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1").strip() == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, NEVER_TRIM))
