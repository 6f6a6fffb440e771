"""grpo-lightning: GRPO fine-tuning of causal language models as a PyTorch Lightning module.

The functions of the reference chapter are importable from here under their chapter names.
"""

from .config import GRPO_Args, GRPOConfigError, GRPOError
from .memory import ReplayDataset, ReplayMemory, ReplayMinibatch
from .models import ModelLoadError, load_causal_lm, load_tokenizer
from .module import GRPOModule
from .objectives import (
    calc_clipped_surrogate_objective,
    calc_kl_penalty,
    calc_kl_penalty_naive,
    compute_grpo_advantages,
    get_logits,
    get_logprobs,
    get_logprobs_batched,
)
from .optim import get_optimizer_and_scheduler
from .reward_checks import RewardError
from .sampling import get_samples
from .tasks import ArithmeticProblems

__all__ = [
    "GRPOModule", "GRPO_Args", "GRPOError", "GRPOConfigError", "ModelLoadError", "RewardError",
    "ReplayMinibatch", "ReplayMemory", "ReplayDataset", "get_samples", "compute_grpo_advantages",
    "get_logprobs", "get_logits", "get_logprobs_batched", "calc_kl_penalty_naive", "calc_kl_penalty",
    "calc_clipped_surrogate_objective", "get_optimizer_and_scheduler", "load_causal_lm", "load_tokenizer",
    "ArithmeticProblems",
]  # fmt: skip
