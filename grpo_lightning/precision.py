"""Which precision a run trains in, chosen for the machine it runs on.

bf16 is only fast where the hardware multiplies bf16 natively: on a CPU that means AVX512-BF16 or AMX
(Intel Sapphire Rapids and later, AMD Zen 4 and later), where bf16 matrix products run 2-4x faster than
fp32. Elsewhere (AMD Zen 3, most laptops) PyTorch emulates them, about 300x slower than fp32: a config
that pins bf16 turns a ten-minute run into hours. So no config pins a precision; when none is given, the
run picks one here and says why, and a bf16 request on a CPU that cannot run it fast gets a warning.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

# cpuinfo flag -> what users know it as. The first two make bf16 native; the last two are what fp32 uses.
CPU_FEATURES = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16", "avx2": "AVX2", "fma": "FMA"}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# oneDNN runs PyTorch's bf16 matrix products on x86, and can be held to an older instruction set than the CPU
# has (to reproduce another CPU's speed, say). Held below AVX512_CORE_BF16 it emulates bf16 whatever the CPU
# has: 0.29 GFLOP/s against 222 in fp32 on an AMD Zen 5 held to AVX2, as on a Zen 3. oneDNN's names, in its
# order; an unknown value (ALL, DEFAULT) holds nothing back.
ONEDNN_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
ONEDNN_ISAS_WITHOUT_AMX = (*ONEDNN_ISAS_WITHOUT_BF16, "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    features: tuple[str, ...]  # names from CPU_FEATURES that this CPU has
    vendor: str = ""  # "GenuineIntel", "AuthenticAMD", ... ("" where /proc/cpuinfo does not say)
    held: str = ""  # features the CPU has that a setting keeps its kernels from using, and the setting

    @property
    def native_bf16(self) -> bool:
        return any(CPU_FEATURES[flag] in self.features for flag in NATIVE_BF16_FLAGS)

    def describe(self) -> str:
        features = ", ".join(self.features) or "none of " + "/".join(CPU_FEATURES.values())
        return f"{self.model} ({features}{'; ' + self.held if self.held else ''})"

    def record(self) -> dict:
        """What a benchmark's JSON keeps of the CPU."""
        return {"model": self.model, "vendor": self.vendor, "features": list(self.features),
                "native_bf16": self.native_bf16, "held": self.held}  # fmt: skip


def _first_values(text: str) -> dict[str, str]:
    """Each key of the text of /proc/cpuinfo with its first value (the first processor's, for per-CPU keys)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        values.setdefault(key.strip(), value.strip())
    return values


def parse_cpuinfo(text: str) -> tuple[str | None, set[str]]:
    """The first processor's model name and flags in the text of /proc/cpuinfo (x86 "flags", Arm "Features")."""
    values = _first_values(text)
    flags = values.get("flags") or values.get("Features") or ""
    return values.get("model name"), set(flags.split())


def parse_cpu_vendor(text: str) -> str:
    """The first processor's vendor_id in the text of /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), or ""."""
    return _first_values(text).get("vendor_id", "")


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:  # not Linux
        return ""


def cpu_info() -> CpuInfo:
    """This CPU's model and the features that decide its speed in fp32 and bf16.

    Linux reports them in /proc/cpuinfo; elsewhere PyTorch's own checks say whether bf16 is native."""
    text = _read_cpuinfo()
    model, flags = parse_cpuinfo(text)
    torch_cpu = getattr(torch, "cpu", None)
    if getattr(torch_cpu, "_is_avx512_bf16_supported", lambda: False)():
        flags.add("avx512_bf16")
    if getattr(torch_cpu, "_is_amx_tile_supported", lambda: False)():
        flags.add("amx_bf16")
    flags, held = without_held_bf16(flags)
    features = tuple(name for flag, name in CPU_FEATURES.items() if flag in flags)
    name = model or platform.processor() or platform.machine() or "unknown CPU"
    return CpuInfo(model=name, features=features, vendor=parse_cpu_vendor(text), held=held)


def without_held_bf16(flags: set[str]) -> tuple[set[str], str]:
    """``flags`` less the bf16 ones that ``$ONEDNN_MAX_CPU_ISA`` keeps oneDNN from using, and a note naming
    them and the setting ("" where nothing is held back)."""
    settings = [(name, os.environ[name].strip()) for name in ONEDNN_ISA_ENV if os.environ.get(name, "").strip()]
    if not settings:
        return flags, ""
    variable, value = settings[0]  # oneDNN reads ONEDNN_ first, then the older DNNL_ name
    isa = value.upper()
    if isa in ONEDNN_ISAS_WITHOUT_BF16:
        unused = flags & {"avx512_bf16", "amx_bf16"}
    elif isa in ONEDNN_ISAS_WITHOUT_AMX:
        unused = flags & {"amx_bf16"}
    else:
        unused = set()
    if not unused:
        return flags, ""
    names = ", ".join(CPU_FEATURES[flag] for flag in CPU_FEATURES if flag in unused)
    return flags - unused, f"{names} not used: {variable}={value}"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX)."""
    return cpu_info().native_bf16


def resolve_accelerator(accelerator: str | None) -> str:
    """"cpu", "cuda" or "mps" for a Trainer ``accelerator`` setting ("auto" picks as Lightning does)."""
    name = str(accelerator or "auto").lower()
    if name in ("gpu", "auto"):
        if torch.cuda.is_available():
            return "cuda"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu" if name == "auto" else "cuda"
    return name


def choose_precision(accelerator: str) -> tuple[str, str]:
    """The default precision for ``accelerator`` ("cpu", "cuda", ...) and why, as (precision, reason)."""
    if accelerator == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", "this GPU computes in bf16 natively"
        return "32-true", "this GPU has no bf16 support"
    if accelerator == "cpu":
        cpu = cpu_info()
        if cpu.native_bf16:
            return "bf16-mixed", f"this CPU has native bf16 ({cpu.describe()})"
        return "32-true", (
            f"this CPU has no native bf16 ({cpu.describe()}), so bf16 matrix products would be emulated "
            "and far slower than fp32"
        )
    return "32-true", f"the default on {accelerator}"


def precision_warning(precision: str | int | None, accelerator: str) -> str | None:
    """A warning for a bf16 precision asked for on a CPU without native bf16; None when it is fine."""
    if accelerator != "cpu" or not str(precision).startswith("bf16"):
        return None
    cpu = cpu_info()
    if cpu.native_bf16:
        return None
    return (
        f"precision {precision} on a CPU without native bf16 ({cpu.describe()}): bf16 matrix products are "
        "emulated here, typically 100-300x slower than fp32, so a run of minutes can take hours. Leave "
        "trainer.precision unset (the default picks 32-true on this CPU) or pass --trainer.precision 32-true."
    )
