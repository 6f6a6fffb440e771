"""What a run keeps: checkpoints without the frozen weights, and the trained policy exported at the end."""

from __future__ import annotations

import copy
import os

import torch

# Submodules of GRPOModule that never train: kept out of checkpoints (and forgiven when loading), together
# with every other parameter that does not require grad (the frozen base weights under LoRA).
FROZEN_PREFIXES = ("ref_model.", "reward.")


def _is_frozen_key(key: str, frozen_parameters: set[str]) -> bool:
    return key.startswith(FROZEN_PREFIXES) or key in frozen_parameters


def _frozen_parameter_names(module: torch.nn.Module) -> set[str]:
    # remove_duplicate=False: a tied weight (lm_head = embeddings) has a state-dict key under each name.
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def drop_frozen_keys(module, state_dict, prefix, local_metadata) -> None:
    """State-dict post-hook: removes the frozen reference, reward and base weights from a checkpoint."""
    frozen = _frozen_parameter_names(module)
    for key in [k for k in state_dict if _is_frozen_key(k[len(prefix) :], frozen)]:
        del state_dict[key]


def forgive_missing_frozen_keys(module, incompatible_keys) -> None:
    """Load-state-dict post-hook: exactly the frozen keys may be missing, so loading stays strict for the rest."""
    frozen = _frozen_parameter_names(module)
    missing = incompatible_keys.missing_keys
    missing[:] = [k for k in missing if not _is_frozen_key(k, frozen)]


def export_policy(policy: torch.nn.Module, tokenizer, out: str, lora=None) -> None:
    """Saves the trained policy and tokenizer to ``out`` in Hugging Face format.

    With LoRA (``lora`` = the run's LoraSettings) the adapter goes to ``out/adapter`` in peft's format, and
    the merged full model to ``out`` only if ``lora.merge_on_export``.
    """
    if lora is not None:
        policy.save_pretrained(os.path.join(out, "adapter"))  # adapter weights only, peft format
        tokenizer.save_pretrained(os.path.join(out, "adapter"))
        print(f"Saved the LoRA adapter (peft format) to {out}/adapter", flush=True)
        if not lora.merge_on_export:
            return
        copy.deepcopy(policy).merge_and_unload().save_pretrained(out)
    else:
        policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"Saved the trained policy and tokenizer (Hugging Face format) to {out}", flush=True)
