"""LoRA adapters on the policy (peft), so that only a few million parameters train.

With adapters, the reference policy is the same network with its adapters switched off, so no
second copy of the model is loaded (see ``GRPOModule.get_ref_logprobs``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

# Every projection of attention and MLP: more capacity than peft's own defaults (q and v only),
# at a still tiny parameter count.
_LLAMA_STYLE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_TARGETS_BY_MODEL_TYPE = {
    "llama": _LLAMA_STYLE,
    "mistral": _LLAMA_STYLE,
    "qwen2": _LLAMA_STYLE,
    "gpt2": ["c_attn", "c_proj", "c_fc"],
}


@dataclass
class LoraSettings:
    """LoRA adapters on the policy.

    Args:
        r: rank of each adapter.
        alpha: scaling numerator; the adapter's output is scaled by alpha / r.
        dropout: dropout on the adapter input. The policy runs in eval mode (so that log-probabilities
            are deterministic), which switches dropout off; kept for completeness.
        target_modules: names of the linear layers to adapt; null picks a default for Llama-style
            and GPT-2-style models, else every linear layer but the output head.
        merge_on_export: also save the base model with the adapters merged in, in Hugging Face format.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] | None = None
    merge_on_export: bool = False

    def validate(self) -> None:
        """Raises GRPOConfigError for a setting peft would refuse deep in model loading. Called by
        GRPOModule, not on construction: the parser builds these inside a union, where an error raised
        here would be reported as a mismatch of every member of the union."""
        from .config import GRPOConfigError

        if not (isinstance(self.r, int) and self.r >= 1):
            raise GRPOConfigError(f"lora.r ({self.r}) must be at least 1 (the rank of each adapter)")
        if not self.alpha > 0:
            raise GRPOConfigError(f"lora.alpha ({self.alpha}) must be > 0 (adapters are scaled by alpha / r)")
        if not 0 <= self.dropout < 1:
            raise GRPOConfigError(f"lora.dropout ({self.dropout}) must lie in [0, 1)")


def default_target_modules(model: torch.nn.Module) -> list[str] | str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    targets = _TARGETS_BY_MODEL_TYPE.get(model_type, "all-linear")
    return list(targets) if isinstance(targets, list) else targets  # a copy: peft may keep and alter it


def apply_lora(model: torch.nn.Module, settings: LoraSettings, seed: int = 0) -> torch.nn.Module:
    """Wraps ``model`` with fresh LoRA adapters; only the adapter weights require grad afterwards.
    The adapters' random initialisation is drawn from ``seed``, so runs repeat exactly."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules or default_target_modules(model),
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():  # leave the caller's global RNG as it was
        # peft reads model.is_gradient_checkpointing, which transformers 5 deprecates with a FutureWarning on every
        # LoRA run; the attribute is peft's to stop reading, nothing a user can act on.
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, config).eval()
        except ValueError as error:  # peft's word for target_modules naming no layer of this model
            from .config import GRPOConfigError

            raise GRPOConfigError(
                f"lora: {str(error).splitlines()[0]}; set lora.target_modules to layer names of this model, "
                "or null for the default"
            ) from error
