"""Precision per machine: bf16 only where it is native, said on the run's first line, and a warning when
bf16 is forced on a CPU that would emulate it."""

from __future__ import annotations

import glob
import os
import sys

import pytest
from conftest import refuse_model_loading

from grpo_lightning import cli, policy_models, precision
from grpo_lightning.precision import CpuInfo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = sorted(glob.glob(os.path.join(REPO, "experiments", "*.yaml")))

ZEN3 = CpuInfo(model="AMD EPYC 7B13 64-Core Processor", features=("AVX2", "FMA"))
SAPPHIRE_RAPIDS = CpuInfo(model="Intel(R) Xeon(R) Platinum 8481C", features=("AVX512-BF16", "AMX-BF16", "AVX2", "FMA"))
ZEN4 = CpuInfo(model="AMD EPYC 9B14", features=("AVX512-BF16", "AVX2", "FMA"))  # bf16 without AMX


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])


@pytest.fixture
def on_cpu(monkeypatch):
    """No GPU, whatever the machine has: the CPU's own default applies."""
    monkeypatch.setattr(precision.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision.torch.backends.mps, "is_available", lambda: False)


def test_parse_cpuinfo_reads_the_first_model_and_flags():
    text = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n"
        "flags\t\t: fpu sse2 avx2 fma bmi2\n\nprocessor\t: 1\nmodel name\t: other\nflags\t\t: avx512_bf16\n"
    )
    assert precision.parse_cpuinfo(text) == ("AMD EPYC 7B13 64-Core Processor", {"fpu", "sse2", "avx2", "fma", "bmi2"})
    assert precision.parse_cpuinfo("") == (None, set())
    assert precision.parse_cpu_vendor(text) == "AuthenticAMD"
    assert precision.parse_cpu_vendor("processor\t: 0\nvendor_id\t: GenuineIntel\n") == "GenuineIntel"
    assert precision.parse_cpu_vendor("") == ""  # not Linux, or an Arm CPU (no vendor_id line)


@pytest.mark.parametrize("cpu, native", [(ZEN3, False), (SAPPHIRE_RAPIDS, True), (ZEN4, True)])
def test_native_bf16_means_avx512_bf16_or_amx(cpu, native):
    assert cpu.native_bf16 is native


def cpuinfo_text(model: str, flags: str) -> str:
    return f"processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: {model}\nflags\t\t: fpu sse2 {flags}\n"


ZEN5_TEXT = cpuinfo_text("AMD EPYC 9B45", "avx2 fma avx512f avx512_bf16")
SPR_TEXT = cpuinfo_text("Intel(R) Xeon(R) Platinum 8481C", "avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile")
ZEN3_TEXT = cpuinfo_text("AMD EPYC 7B13 64-Core Processor", "avx2 fma")


@pytest.mark.parametrize(
    "variable, setting, text, features, held",
    [
        (None, None, ZEN5_TEXT, ("AVX512-BF16", "AVX2", "FMA"), ""),
        ("ONEDNN_MAX_CPU_ISA", "AVX2", ZEN5_TEXT, ("AVX2", "FMA"), "AVX512-BF16 not used: ONEDNN_MAX_CPU_ISA=AVX2"),
        ("DNNL_MAX_CPU_ISA", "avx512_core", SPR_TEXT, ("AVX2", "FMA"),
         "AVX512-BF16, AMX-BF16 not used: DNNL_MAX_CPU_ISA=avx512_core"),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", SPR_TEXT, ("AVX512-BF16", "AVX2", "FMA"),
         "AMX-BF16 not used: ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"),
        ("ONEDNN_MAX_CPU_ISA", "ALL", SPR_TEXT, ("AVX512-BF16", "AMX-BF16", "AVX2", "FMA"), ""),
        ("ONEDNN_MAX_CPU_ISA", "AVX2", ZEN3_TEXT, ("AVX2", "FMA"), ""),  # nothing there to hold back
    ],
)  # fmt: skip
def test_bf16_held_back_by_onednn_isa_is_not_native(monkeypatch, on_cpu, variable, setting, text, features, held):
    """oneDNN held below AVX512_CORE_BF16 emulates bf16 on any CPU (0.29 GFLOP/s measured on a Zen 5 held to
    AVX2): such a machine is one without native bf16, and the run's first line says why."""
    monkeypatch.setattr(precision, "_read_cpuinfo", lambda: text)
    for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):  # this machine's own hardware checks
        monkeypatch.setattr(precision.torch.cpu, check, lambda: False, raising=False)
    for name in precision.ONEDNN_ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    if variable:
        monkeypatch.setenv(variable, setting)
    cpu = precision.cpu_info()
    assert (cpu.features, cpu.held) == (features, held)
    chosen, reason = precision.choose_precision("cpu")
    assert chosen == ("bf16-mixed" if "AVX512-BF16" in features else "32-true")
    assert held in reason
    assert cpu.record() == {"model": cpu.model, "vendor": "AuthenticAMD", "features": list(features),
                            "native_bf16": chosen == "bf16-mixed", "held": held}  # what benchmark JSON keeps


@pytest.mark.parametrize(
    "cpu, expected",
    [(ZEN3, "32-true"), (SAPPHIRE_RAPIDS, "bf16-mixed"), (ZEN4, "bf16-mixed")],
)
def test_cpu_default_is_bf16_only_where_native(monkeypatch, on_cpu, cpu, expected):
    monkeypatch.setattr(precision, "cpu_info", lambda: cpu)
    chosen, reason = precision.choose_precision(precision.resolve_accelerator("auto"))
    assert chosen == expected
    assert cpu.model in reason
    assert ("has no native bf16" in reason) is (expected == "32-true")


@pytest.mark.parametrize("bf16_supported, expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_cuda_default_is_bf16_mixed_where_the_gpu_supports_it(monkeypatch, bf16_supported, expected):
    monkeypatch.setattr(precision.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(precision.torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
    monkeypatch.setattr(precision, "cpu_info", lambda: ZEN3)  # the host CPU does not matter on a GPU
    assert precision.resolve_accelerator("auto") == "cuda"
    assert precision.resolve_accelerator("gpu") == "cuda"
    assert precision.resolve_accelerator("cpu") == "cpu"  # an explicit CPU run on a GPU machine
    assert precision.choose_precision("cuda")[0] == expected


@pytest.mark.parametrize("requested", ["bf16-mixed", "bf16-true"])
def test_forced_bf16_warns_only_on_a_cpu_without_native_bf16(monkeypatch, requested):
    monkeypatch.setattr(precision, "cpu_info", lambda: ZEN3)
    warning = precision.precision_warning(requested, "cpu")
    assert f"precision {requested} on a CPU without native bf16" in warning
    assert "AMD EPYC 7B13" in warning and "--trainer.precision 32-true" in warning
    assert precision.precision_warning("32-true", "cpu") is None
    assert precision.precision_warning(requested, "cuda") is None
    monkeypatch.setattr(precision, "cpu_info", lambda: SAPPHIRE_RAPIDS)
    assert precision.precision_warning(requested, "cpu") is None


def make_cli(args, tmp_path):
    return cli.make_cli([*args, "--trainer.default_root_dir", str(tmp_path)], run=False)


def experiment_cli(config: str, tmp_path):
    """The CLI a config belongs to, parsed: reward_model.yaml is `reward-model fit`'s (given a preference file);
    rlhf_policy.yaml names a reward model directory, which only a `reward-model fit` run makes (any directory here)."""
    name = os.path.basename(config)
    if name == "reward_model.yaml":
        from conftest import period_rule_pairs, write_jsonl
        from grpo_lightning.reward_model import make_reward_model_cli

        data = write_jsonl(tmp_path / "prefs.jsonl", period_rule_pairs(4))
        return make_reward_model_cli(["--config", config, "--data.path", data, "--trainer.default_root_dir",
                                      str(tmp_path)], run=False)  # fmt: skip
    learned = ["--model.reward.init_args.model_name_or_path", str(tmp_path)] if name.startswith("rlhf") else []
    return make_cli(["--config", config, *learned], tmp_path)


@pytest.fixture
def no_model_loading(monkeypatch):
    refuse_model_loading(monkeypatch, policy_models)


@pytest.mark.parametrize("cpu, expected", [(ZEN3, "32-true"), (SAPPHIRE_RAPIDS, "bf16-mixed")])
def test_the_cli_says_which_precision_it_chose_and_why(monkeypatch, on_cpu, no_model_loading, tmp_path, capsys, cpu, expected):
    monkeypatch.setattr(precision, "cpu_info", lambda: cpu)
    assert make_cli([], tmp_path).trainer.precision == expected
    out, err = capsys.readouterr()
    assert out.startswith(f"precision {expected}: this CPU has") and cpu.model in out
    assert err == ""


def test_the_cli_keeps_a_forced_bf16_with_one_warning_line(monkeypatch, on_cpu, no_model_loading, tmp_path, capsys):
    monkeypatch.setattr(precision, "cpu_info", lambda: ZEN3)
    assert make_cli(["--trainer.precision", "bf16-mixed"], tmp_path).trainer.precision == "bf16-mixed"
    out, err = capsys.readouterr()
    assert "precision" not in out  # nothing was chosen for the user
    assert err.count("\n") == 1 and err.startswith("warning: precision bf16-mixed on a CPU without native bf16")


def test_an_explicit_precision_is_kept_silently_where_it_is_fast(monkeypatch, on_cpu, no_model_loading, tmp_path, capsys):
    monkeypatch.setattr(precision, "cpu_info", lambda: SAPPHIRE_RAPIDS)
    assert make_cli(["--trainer.precision", "32-true"], tmp_path).trainer.precision == "32-true"
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("config", EXPERIMENTS, ids=os.path.basename)
def test_every_config_resolves_to_the_fast_precision_of_this_machine(no_model_loading, tmp_path, capsys, config):
    """No config pins a precision: each gets this machine's default, never bf16 on a CPU that would emulate it."""
    chosen = experiment_cli(config, tmp_path).trainer.precision
    device = precision.resolve_accelerator("auto")
    assert chosen == precision.choose_precision(device)[0]
    assert precision.precision_warning(chosen, device) is None
    if device == "cpu" and not precision.cpu_info().native_bf16:
        assert chosen == "32-true"
    assert capsys.readouterr().out.startswith(f"precision {chosen}: ")
