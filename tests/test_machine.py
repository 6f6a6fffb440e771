"""The CPU contention check: finds a busy process, and a fit warns about it."""

from __future__ import annotations

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
