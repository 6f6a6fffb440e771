"""Fused CPU kernels for the operations between the matrix products, float32: of a decode step (here) and of a
learning step (``fused_training``). This module builds and loads them.

At one new token per row, a decoder layer's products are the work, and the rest (two RMS norms with their
residual adds, rotary embedding of q and k, the cache writes, the attention scores, softmax and weighted
values, the gated activation) is a dozen small operations on (B, d) tensors, each a separate PyTorch
dispatch, allocation and pass over memory. Measured on 2 Zen 4 cores (SmolLM2-135M, one decode step, fp32):
at G = 32 the step took 69-75 ms through ``LeanDecoder``'s PyTorch operations and about 60 ms with these
kernels (the products ~52 ms); at G = 128, ~220 ms against ~193 ms.

``csrc/decode_step.cpp`` holds three kernels for sampling, each one pass over its data (tests/test_fused_decode.py
checks each against the PyTorch formulas):

- ``add_rms_norm(hidden, delta, weight, eps)``: the residual add in place, then the model's RMS norm;
- ``decode_attention(qkv, keys, values, cos, signed_sin, pads, position, kv_heads, groups, scaling)``: rotates
  this token's query and key heads, writes its key and value into the caches, and attends over the row's
  visible positions, the query heads of one key/value head together (each cached key and value read once);
- ``silu_mul(gate_up, width)``: ``silu(gate) * up`` of the joined gate/up product's output.

Their ``exp`` is a polynomial within 2 ulp of ``std::exp`` (PyTorch's vectorized one is also approximate,
within 1 ulp), so logits agree with the PyTorch path to float rounding, as any two kernels do; what is
sampled from them is unchanged (the exact-distribution tests run either way).

``csrc/train_step.cpp`` holds the learning step's norms, gated activations, log-softmax and transposes
(``fused_training``) and ``csrc/train_attention.cpp`` its attention (``fused_attention``); ``csrc/bindings.cpp``
makes them one Python module.

The extension is compiled once per machine, with ``-march=native`` (less AVX-512, or AVX2 too, where
``$ATEN_CPU_CAPABILITY`` holds PyTorch to avx2 or default), by PyTorch's ``cpp_extension`` (a C++
compiler and ninja, which the package depends on), the first time a CPU run
needs it (about a minute; ``scripts/setup.sh`` builds it as part of the setup), and cached in PyTorch's extension directory
(``$TORCH_EXTENSIONS_DIR``) under a name that includes the CPU's features. Where it cannot be built the
decoder says so in one line and runs its PyTorch operations; ``GRPO_LIGHTNING_FUSED_DECODE=0`` turns the
decode kernels off (``GRPO_LIGHTNING_FUSED_TRAINING=0`` the learning step's, ``GRPO_LIGHTNING_FUSED_ATTENTION=0``
its attention alone).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from .precision import _read_cpuinfo, parse_cpuinfo

log = logging.getLogger(__name__)

FUSED_DECODE_ENV = "GRPO_LIGHTNING_FUSED_DECODE"
FUSED_TRAINING_ENV = "GRPO_LIGHTNING_FUSED_TRAINING"
CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "decode_step.cpp", CSRC / "train_step.cpp", CSRC / "train_attention.cpp", CSRC / "bindings.cpp"]
HEADERS = [CSRC / "kernels.h"]
# -fno-trapping-math: lets GCC vectorize floor() (in exp); -fno-math-errno: sqrt without the errno branch.
# -fopenmp at compile time only, for the `omp simd` loops: threads come from PyTorch's own pool (at::parallel_for).
COMPILE_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
# $ATEN_CPU_CAPABILITY holds PyTorch's own kernels to an older instruction set than the CPU has (to reproduce a
# CPU without AVX-512 on one with it); these kernels are held alike, so that such a run is that CPU's code.
HELD_ISA_FLAGS = {"avx2": ["-mno-avx512f"], "default": ["-mno-avx512f", "-mno-avx2", "-mno-fma"]}


def compile_flags() -> list[str]:
    """COMPILE_FLAGS, less the instruction sets that ``$ATEN_CPU_CAPABILITY`` keeps PyTorch from using."""
    held = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return COMPILE_FLAGS + HELD_ISA_FLAGS.get(held, [])


def switched_on(variable: str) -> bool:
    """False where the environment variable is 0 (or false, no, off); True where it is unset or anything else."""
    return os.environ.get(variable, "1").strip().lower() not in ("0", "false", "no", "off")


def fused_decode_enabled() -> bool:
    """False where ``$GRPO_LIGHTNING_FUSED_DECODE`` is 0 (or false, no, off)."""
    return switched_on(FUSED_DECODE_ENV)


def extension_name() -> str:
    """The cached build's name: one per source text, compile flags, CPU features and PyTorch version, since
    ``-march=native`` code may not run on another CPU that shares the cache directory."""
    model, flags = parse_cpuinfo(_read_cpuinfo())  # every flag: -march=native compiles for all of them
    texts = [path.read_text() for path in SOURCES + HEADERS]
    key = "\n".join([*texts, " ".join(compile_flags()), model or "", " ".join(sorted(flags)), torch.__version__])
    return "grpo_lightning_kernels_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def fused_kernels() -> ModuleType | None:
    """The compiled kernels for sampling (built on first use, then loaded from the cache), or None where they are
    turned off or cannot be built here (said once, in one line)."""
    return compiled_kernels() if fused_decode_enabled() else None


@functools.cache
def compiled_kernels() -> ModuleType | None:
    """The compiled extension, built on first use and then loaded from the cache; None where it cannot be built
    here (said once, in one line)."""
    try:
        from torch.utils import cpp_extension

        name = extension_name()
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        if not any(build_dir.glob(f"{name}*.so")):
            print(f"grpo-lightning: building the fused CPU kernels once for this CPU (~1 min; cached in {build_dir})", flush=True)
        # ninja from the package's own environment, where it was installed with it, even if that is not on PATH;
        # the user's PATH is given back afterwards
        path = os.environ.get("PATH")
        os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), path or ""])
        try:
            return cpp_extension.load(name, sources=[str(path) for path in SOURCES], extra_cflags=compile_flags(),
                                      extra_include_paths=[str(CSRC)], verbose=False)
        finally:
            if path is None:
                os.environ.pop("PATH", None)
            else:
                os.environ["PATH"] = path
    except Exception as error:  # no compiler or ninja, a read-only cache, ...: the PyTorch path does the same work
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        log.warning("grpo-lightning: fused CPU kernels unavailable (%s); sampling and learning run PyTorch's "
                    "operations (slower). Set %s=0 and %s=0 to skip trying.", first_line[:200], FUSED_DECODE_ENV,
                    FUSED_TRAINING_ENV)
        return None
