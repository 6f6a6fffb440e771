"""A learned reward: the reward model ``grpo-lightning reward-model fit`` trained on human (or rule)
preferences, used like any other reward. This closes the RLHF loop: label, fit, train against it."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import RewardModule, check_model_dir, reward_config_error

LEARNED_OUTPUTS = ("raw", "sigmoid")


class LearnedReward(RewardModule):
    """The scalar a Bradley-Terry reward model gives each sample (prompt + completion).

    ``model_name_or_path`` is a directory saved by ``grpo-lightning reward-model fit`` (its
    ``hf_model``), or any Hugging Face sequence-classification model with one output (such as a TRL
    reward model). Samples are encoded exactly as in training (``grpo_lightning.reward_model.
    encode_texts``: start-of-document token + text, at most ``max_length`` tokens).

    ``output``: "raw" (default) is the head's value, a logit whose differences are log-odds of
    preference (0 is not neutral: only differences mean anything, and GRPO normalises rewards within
    each group, so a shift or scale does not change training); "sigmoid" maps it into (0, 1), easier to
    read and to mix in a ``WeightedSum``, but it flattens differences among samples the model scores
    far from 0. A frozen network: placed on the policy's device by Lightning, kept out of checkpoints,
    scored in float32 whatever the trainer's precision.
    """

    def __init__(self, model_name_or_path: str, output: str = "raw", batch_size: int = 32, max_length: int = 128):
        """
        Args:
            model_name_or_path: the trained reward model: the ``hf_model`` directory a
                ``grpo-lightning reward-model fit`` run wrote, or a hub id.
            output: "raw" (the head's logit) or "sigmoid" (the logit mapped into (0, 1)).
            batch_size: samples per forward pass of the reward model.
            max_length: tokens kept of each sample (as the reward model was trained: data.max_length).
        """
        super().__init__()
        if output not in LEARNED_OUTPUTS:
            raise reward_config_error(f"LearnedReward: output must be one of {list(LEARNED_OUTPUTS)}, got {output!r}")
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if not isinstance(value, int) or value < 1:
                raise reward_config_error(f"LearnedReward: {name} ({value}) must be at least 1")
        check_model_dir(self.name, model_name_or_path)
        self.model_name_or_path = model_name_or_path
        self.output = output
        self.batch_size = batch_size
        self.max_length = max_length
        self._model = None
        self._tokenizer = None

    def setup(self) -> None:
        from grpo_lightning.models import load_tokenizer
        from grpo_lightning.reward_model import load_reward_backbone, prepare_tokenizer

        model = load_reward_backbone(self.model_name_or_path)
        if model.config.num_labels != 1:
            raise reward_config_error(
                f"LearnedReward: '{self.model_name_or_path}' has {model.config.num_labels} outputs; a reward model "
                "has one (train one with `grpo-lightning reward-model fit`)"
            )
        self._tokenizer = prepare_tokenizer(load_tokenizer(self.model_name_or_path))
        model.config.pad_token_id = self._tokenizer.pad_token_id
        self._model = model.eval().requires_grad_(False)

    def score(self, samples: list[str]) -> Tensor:
        from grpo_lightning.reward_model import score_texts

        values = score_texts(self._model, self._tokenizer, list(samples), self.max_length, self.batch_size)
        return torch.sigmoid(values) if self.output == "sigmoid" else values
