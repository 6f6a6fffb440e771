"""Activation checkpointing of the policy's decoder layers, with the policy kept in eval mode.

Checkpointing keeps only each decoder layer's input during the forward pass and recomputes the layer
in the backward pass: the activations of a minibatch (about 2 GB fp32 for 32 x 33 tokens of
SmolLM2-135M, more than the model itself) shrink to one layer's worth, for about a third more
compute in the learning phase. It pays when memory is what limits the run, e.g. with LoRA, where
the model is the only other large thing in memory.

Hugging Face layers checkpoint only when the layer module is in training mode, but GRPO keeps the
whole policy in eval mode (no dropout: rollout, old, reference and learning log-probabilities must
come from one deterministic function). So only the decoder-layer modules themselves are flagged as
training, not their children: no dropout module ever sees ``training=True``.
"""

from __future__ import annotations

import torch

from .config import GRPOConfigError


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # see through peft


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Turns on non-reentrant activation checkpointing of every decoder layer of ``model``."""
    base = _base_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise GRPOConfigError(
            f"activation_checkpointing: {type(base).__name__} does not support it; set activation_checkpointing: false"
        )
    kwargs = {"use_reentrant": False}  # works when no input requires grad (a frozen LoRA base)
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before the rename
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    flag_checkpointed_layers(model)


def checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers whose forward Hugging Face checkpoints. The model-level module carries the
    same flag but must stay in eval mode: in training mode it would switch off the KV cache."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # transformers >= 4.52

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def flag_checkpointed_layers(model: torch.nn.Module) -> None:
    """Marks the checkpointed layers (only them, not their children) as training, which is the
    condition Hugging Face checks before checkpointing; call again after any ``model.eval()``."""
    for layer in checkpointed_layers(model):
        layer.training = True
