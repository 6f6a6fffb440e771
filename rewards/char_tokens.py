"""The number of tokens that contain a character: the reference's hack-resistant period count."""

from __future__ import annotations

from torch import Tensor

from .base import Reward, as_reward_tensor, check_model_dir
from .char_count import _check_char


class CharTokenCount(Reward):
    """How many tokens of a sample contain ``char`` at least once.

    Resists the hack the reference warns about for ``CharCount``: a single token made of 64 periods
    scores 1 here, not 64, so the reward counts the policy's actions (tokens), not characters.
    Samples are re-tokenized with the policy's tokenizer, so pass the same ``model_name_or_path``
    as the policy (unset means the embedded SmolLM2-135M-Instruct, the policy's default). The text
    is re-tokenized, so a token boundary can differ from the sampled one where several
    tokenizations spell the same text; the prompt counts too, the same for the whole group.
    """

    def __init__(self, char: str = ".", model_name_or_path: str | None = None):
        """
        Args:
            char: the character looked for in each token (one character).
            model_name_or_path: hub id or local directory of the tokenizer; the policy's own, so
                unset (null) is the embedded SmolLM2-135M-Instruct.
        """
        _check_char("CharTokenCount", char)
        check_model_dir("CharTokenCount", model_name_or_path)
        self.char = char
        self.model_name_or_path = model_name_or_path
        self._tokenizer = None
        self._has_char: dict[int, bool] = {}  # token id -> whether its text contains char

    def setup(self) -> None:
        from grpo_lightning.models import load_tokenizer

        self._tokenizer = load_tokenizer(self.model_name_or_path)

    def _contains_char(self, token_id: int) -> bool:
        if token_id not in self._has_char:
            self._has_char[token_id] = self.char in self._tokenizer.decode([token_id])
        return self._has_char[token_id]

    def score(self, samples: list[str]) -> Tensor:
        encoded = self._tokenizer(list(samples), add_special_tokens=False)["input_ids"]
        return as_reward_tensor([sum(map(self._contains_char, ids)) for ids in encoded])
