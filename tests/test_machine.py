"""The machine checks: the CPU contention check finds a busy process and a fit warns about it; freed memory is reused."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import time

import pytest

from grpo_lightning.machine import competing_processes, cpu_contention_warning


def test_no_competitors_no_warning():
    assert cpu_contention_warning([]) is None


def test_warning_names_the_competitors_and_the_threads():
    message = cpu_contention_warning(["python (pid 7, 98% CPU)"], threads=2, cores=2)
    assert "python (pid 7, 98% CPU)" in message and "2 PyTorch threads on 2 cores" in message
    assert "OMP_NUM_THREADS" in message


def test_a_busy_process_is_found():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it start spinning
        busy = competing_processes(window_s=0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert any(f"pid {spinner.pid}," in entry for entry in busy), busy


def test_a_fit_warns_when_another_process_competes(tiny_model_dir, tmp_path, monkeypatch):
    from test_fast_path import ON_POLICY, fit
    from test_module import make_module

    monkeypatch.setattr("grpo_lightning.module.competing_processes", lambda: ["spinner (pid 42, 97% CPU)"])
    with pytest.warns(UserWarning, match=r"other processes are using the CPU \(spinner \(pid 42, 97% CPU\)\)"):
        fit(make_module(tiny_model_dir, **ON_POLICY), tmp_path, total_phases=1)


def test_threads_are_lowered_to_the_usable_cpus(monkeypatch):
    import torch

    from grpo_lightning import machine

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(machine, "usable_cpus", lambda: 1)
        assert machine.fit_threads_to_cpus() == "PyTorch was set to 2 threads but this process may use 1 CPUs: using 1 threads"
        assert torch.get_num_threads() == 1
        assert machine.fit_threads_to_cpus() is None  # already within the CPUs
    finally:
        torch.set_num_threads(before)


# Allocates and frees a 200 MB tensor 8 times, writing every page, as a learning step does with its logits;
# prints the page faults of the last 5 times. 200 MB / 4 KiB = 51,200 pages, each faulted in again whenever
# the block went back to the system. (The first times may fault: a small object can land in the freed
# block, and the heap then grows once more; after that the same memory serves every step.)
_REALLOCATE = """
import resource, sys, torch
from grpo_lightning.machine import keep_freed_memory_for_reuse
print(keep_freed_memory_for_reuse())
for _ in range(3):
    torch.empty(50 * 2**20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.empty(50 * 2**20).fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


# A phase frees more than 1 GB at the top of the heap between its rollout and its learning steps. Here a
# 1.25 GB block is allocated, written and freed three times through glibc itself (so that nothing else lands
# in the heap between), and the page faults of the last two times are printed: none where freed memory is
# kept however much of it lies at the top, about 2 x 327,650 where glibc trims the top above some threshold.
_REALLOCATE_MORE_THAN_A_GIGABYTE = """
import ctypes, resource
from grpo_lightning.machine import keep_freed_memory_for_reuse
print(keep_freed_memory_for_reuse())
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 1280 * 2**20
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    libc.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""


def _huge_pages_always() -> bool:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        return "[always]" in f.read()


def _faults_of_later_allocations(keep: str, script: str = _REALLOCATE) -> tuple[str, int]:
    env = {**os.environ, "GRPO_LIGHTNING_KEEP_FREED_MEMORY": keep}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    kept, faults = out.stdout.split()
    return kept, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults():
    kept, faults = _faults_of_later_allocations("1")
    assert kept == "True" and faults < 500  # a few pages of bookkeeping at most, not 5 x 51,200
    kept, faults = _faults_of_later_allocations("0")  # switched off: glibc's own behaviour
    assert kept == "False"
    # with huge pages always on, 2 MB pages: about 5 x 100 faults, not 5 x 51,200
    assert faults > (250 if _huge_pages_always() else 5 * 40_000)


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc's mallopt")
def test_more_than_a_gigabyte_freed_at_once_is_kept_too():
    kept, faults = _faults_of_later_allocations("1", _REALLOCATE_MORE_THAN_A_GIGABYTE)
    assert kept == "True" and faults < 500  # 2 x 327,648 when trimming was held to a 1 GB threshold
    kept, faults = _faults_of_later_allocations("0", _REALLOCATE_MORE_THAN_A_GIGABYTE)
    # with huge pages always on, 2 MB pages: 2 x 640 faults
    assert kept == "False" and faults > (1000 if _huge_pages_always() else 2 * 300_000)


def test_the_fp32_peak_is_the_better_library(monkeypatch):
    """MKL (torch.matmul) can reach half of what oneDNN does on the same CPU (AMD with AVX-512): the peak is
    the better of the two, and both are kept; without oneDNN it is torch.matmul's."""
    from grpo_lightning import machine

    monkeypatch.setattr(machine, "matmul_gflops", lambda m, k, n, dtype, repeats=5: 192.0)
    monkeypatch.setattr(machine, "onednn_fp32_gflops", lambda m, k, n, repeats=5: 418.0)
    assert machine.fp32_peak_gflops(64) == {"fp32": 418.0, "fp32_torch_matmul": 192.0, "fp32_onednn": 418.0}
    monkeypatch.setattr(machine, "onednn_fp32_gflops", lambda m, k, n, repeats=5: None)
    assert machine.fp32_peak_gflops(64) == {"fp32": 192.0, "fp32_torch_matmul": 192.0}


def test_onednn_rate_is_measured_on_a_real_product():
    from grpo_lightning.machine import onednn_fp32_gflops

    rate = onednn_fp32_gflops(64, 64, 64, repeats=2)
    if rate is None:
        pytest.skip("this PyTorch has no oneDNN")
    assert 0 < rate < 1e5


def test_kernel_settings_name_the_dispatch_level_and_the_limits_set(monkeypatch):
    import torch

    from grpo_lightning.machine import KERNEL_SETTINGS_ENV, kernel_settings

    for name in KERNEL_SETTINGS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # not a kernel setting: not recorded
    assert kernel_settings() == {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "ONEDNN_MAX_CPU_ISA": "AVX2"}
