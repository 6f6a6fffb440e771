"""Sentiment by VADER (the ``vaderSentiment`` package), a rule and lexicon based scorer that needs
no network and no model download: the sentiment reward for a machine without hub access."""

from __future__ import annotations

from torch import Tensor

from .base import Reward, as_reward_tensor, reward_config_error

VADER_DIRECTIONS = ("pos", "neg")


class VaderSentiment(Reward):
    """Sentiment by VADER, offline (its lexicon ships in the package), mapped to [0, 1].

    VADER's compound score c lies in [-1, 1] (-1 most negative, 0 neutral or no sentiment words,
    1 most positive); the reward is (1 + c) / 2 for direction "pos" and (1 - c) / 2 for "neg", so
    a sample with no sentiment words scores 0.5. A lexicon scores words, not meaning: stacking
    strongly-scored words ("terrible", "awful") pays whether or not the text reads as a review.
    """

    def __init__(self, direction: str = "pos"):
        """
        Args:
            direction: "pos" rewards positive sentiment, "neg" negative sentiment.
        """
        if direction not in VADER_DIRECTIONS:
            raise reward_config_error(
                f"VaderSentiment: direction must be one of {list(VADER_DIRECTIONS)}, got {direction!r}"
            )
        self.direction = direction
        self._analyzer = None

    def setup(self) -> None:
        try:
            from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        except ImportError as error:
            message = "VaderSentiment needs the package vaderSentiment: pip install vaderSentiment"
            raise reward_config_error(message) from error
        self._analyzer = SentimentIntensityAnalyzer()

    def compound(self, samples: list[str]) -> list[float]:
        """VADER's compound score of each sample, in [-1, 1]."""
        self.prepare()
        return [self._analyzer.polarity_scores(sample)["compound"] for sample in samples]

    def score(self, samples: list[str]) -> Tensor:
        sign = 1.0 if self.direction == "pos" else -1.0
        return as_reward_tensor([(1.0 + sign * c) / 2.0 for c in self.compound(samples)])
