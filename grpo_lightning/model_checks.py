"""Checks on a model before its weights load: does it fit the tokenizer and the context asked of it,
are its weight files whole, can a hub id be had at all. Small functions; ``models.check_model_fits``
puts them together.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import struct
from pathlib import Path
from urllib.parse import urlparse

from .config import GRPOConfigError

# Config attributes that hold a model's context length, by family (Llama & most: the first; GPT-2: n_positions).
_CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_limit(config) -> tuple[int, str] | None:
    """The most tokens (prompt + completion) the model takes, and the config attribute saying so;
    None when the config does not say."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _CONTEXT_ATTRIBUTES:
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value, name
    return None


def check_context(prompt_tokens: int, gen_len: int, limit: int, attribute: str) -> None:
    """Refuses a prompt + completion longer than the model's context: beyond it, a model with learnt
    positions fails and one with rotary positions produces nonsense (and, at 10,000 tokens, takes
    hours to say so)."""
    total = prompt_tokens + gen_len
    if total <= limit:
        return
    context = f"the model's context of {limit} tokens ({attribute})"
    if prompt_tokens >= limit:
        raise GRPOConfigError(
            f"prompt is {prompt_tokens} tokens (start token included), already beyond {context}: "
            f"shorten model.prompt to leave room for gen_len ({gen_len})"
        )
    raise GRPOConfigError(
        f"prompt ({prompt_tokens} tokens, start token included) + gen_len ({gen_len}) = {total} tokens "
        f"exceeds {context}: lower model.gen_len to at most {limit - prompt_tokens} or shorten model.prompt"
    )


def check_vocab_fits(tokenizer_size: int, embedding_rows: int, name: str) -> None:
    """A tokenizer with ids the model has no embedding for belongs to another model: its prompt and
    samples would index past the embedding ("index out of range" deep inside the first forward)."""
    if tokenizer_size > embedding_rows:
        raise GRPOConfigError(
            f"model_name_or_path '{name}': its tokenizer has {tokenizer_size} tokens but the model only "
            f"{embedding_rows} embeddings (config vocab_size): the tokenizer belongs to another model; "
            "put the model's own tokenizer files beside its weights"
        )


def truncated_safetensors(path: Path) -> str | None:
    """Why a ``.safetensors`` file is incomplete (a copy or download cut short), or None if its size is
    what its header promises. Reads only the header: 8 bytes of length, then JSON."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as file:
            head = file.read(8)
            if len(head) < 8:
                return f"{path.name} is {size} bytes, too short for a safetensors header"
            (header_len,) = struct.unpack("<Q", head)
            if 8 + header_len > size:
                return f"{path.name} is {size} bytes, shorter than its own header ({8 + header_len} bytes)"
            header = json.loads(file.read(header_len))
    except (OSError, ValueError, UnicodeDecodeError) as error:
        return f"{path.name} has an unreadable header ({error})"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return f"{path.name} is {size} of the {expected} bytes its header lists (truncated)"
    return None


def damaged_weights(directory: Path) -> str | None:
    """The first truncated ``.safetensors`` file of a local model directory, said why; else None."""
    for path in sorted(directory.glob("*.safetensors")):
        problem = truncated_safetensors(path)
        if problem:
            return problem
    return None


# ---- the hub -------------------------------------------------------------------------------

_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether a TCP connection to the hub opens within ``timeout`` seconds. Behind a proxy a direct
    probe says nothing, so the hub counts as reachable and huggingface_hub finds out itself."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return True
    url = urlparse(constants.ENDPOINT)
    return _connects(url.hostname, url.port or (443 if url.scheme == "https" else 80), timeout)


@functools.lru_cache(maxsize=8)
def _connects(host: str, port: int, timeout: float) -> bool:
    """Once per process: a model loads its config, tokenizer and weights, each asking."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds this hub id (its config or tokenizer files)."""
    from huggingface_hub import try_to_load_from_cache

    for filename in ("config.json", "tokenizer_config.json"):
        try:
            if isinstance(try_to_load_from_cache(repo_id, filename), str):
                return True
        except ValueError:  # not a valid repo id
            return False
    return False
