"""The CPU a run trains on: how many threads PyTorch uses, and whether other processes compete for them.

On a machine with few cores, PyTorch's OpenMP threads wait for each other at every operation, so a single
other busy process can slow training about tenfold. That is invisible from inside the run (it just looks
slow), so a run checks once at the start and says so.
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil
import torch

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
