"""Sentiment by a Hugging Face sequence classifier, such as the reference's lvwerra/distilbert-imdb.
(``VaderSentiment``, in ``vader.py``, is the offline alternative.)"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import RewardModule, check_model_dir, reward_config_error


def pick_label(reward: str, direction: str, id2label: dict[int, str], source: str) -> int:
    """The index of the label ``direction`` names, matched case-insensitively against the label
    names: an exact name wins, else the one name it begins ("pos" finds "POSITIVE", "neg" finds
    "negative"). Raises a settings error naming the labels present when none or several match."""
    wanted = direction.strip().lower() if isinstance(direction, str) else ""
    labels = {int(i): str(name) for i, name in id2label.items()}
    names = [labels[i] for i in sorted(labels)]
    if not wanted:
        raise reward_config_error(f"{reward}: direction must be a label name such as 'pos' or 'neg', got {direction!r}")
    matches = [i for i, name in labels.items() if name.lower() == wanted]
    matches = matches or [i for i, name in labels.items() if name.lower().startswith(wanted)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise reward_config_error(
            f"{reward}: {source} has no label for direction '{direction}'; its labels are {names}. "
            "Pass one of these names (or its beginning) as direction, "
            "or use a classifier whose labels name the sentiment"
        )
    raise reward_config_error(
        f"{reward}: direction '{direction}' matches several labels of {source}: "
        f"{[labels[i] for i in sorted(matches)]}; pass a full label name"
    )


class SentimentClassifier(RewardModule):
    """The probability a Hugging Face sequence classifier gives to one label (e.g. NEGATIVE).

    The reference uses the IMDB review classifier ``lvwerra/distilbert-imdb``. ``direction`` picks
    the label by the classifier's own label names (``config.id2label``), not by index: "pos" finds
    POSITIVE/positive/pos, "neg" finds NEGATIVE/negative/neg, and any other label name works too
    (e.g. "joy" for an emotion classifier). The reward is that label's softmax probability, in
    [0, 1]; advantages are normalised per group, so probabilities near 0 or 1 still give a signal.

    Samples (prompt included) are scored in batches of ``batch_size``, truncated to the
    classifier's maximum length, in float32 on the CPU and float16 on a GPU, whatever the trainer's
    precision. A local directory is checked for the label at construction; a hub id is fetched,
    and checked, at setup (before the first phase). The classifier is frozen, stays in eval mode
    and moves to the training device with the policy.
    """

    def __init__(
        self, model_name_or_path: str = "lvwerra/distilbert-imdb", direction: str = "pos", batch_size: int = 64
    ):
        """
        Args:
            model_name_or_path: hub id or local directory of a sequence-classification model.
            direction: the label rewarded, matched against the classifier's label names: "pos"
                or "neg" for a positive/negative classifier, or any full label name.
            batch_size: samples per forward pass of the classifier.
        """
        super().__init__()
        from grpo_lightning.models import looks_like_local_path

        if not isinstance(batch_size, int) or batch_size < 1:
            raise reward_config_error(f"SentimentClassifier: batch_size ({batch_size}) must be at least 1")
        check_model_dir(self.name, model_name_or_path)
        self.model_name_or_path = model_name_or_path
        self.direction = direction
        self.batch_size = batch_size
        self._classifier = None
        self._tokenizer = None
        self._max_length: int | None = None
        self._label_index: int | None = None
        if looks_like_local_path(model_name_or_path):  # cheap: reads config.json only
            self._label_index = pick_label(self.name, direction, self._load(_auto("AutoConfig")).id2label, self._source)

    @property
    def _source(self) -> str:
        return f"the classifier '{self.model_name_or_path}'"

    def _load(self, auto_class, **kwargs):
        from grpo_lightning.models import ModelLoadError, looks_like_local_path, resolve_model_path

        path = self.model_name_or_path
        try:
            return auto_class.from_pretrained(resolve_model_path(path), **kwargs)
        except (OSError, ValueError) as error:
            where = "local directory" if looks_like_local_path(path) else "hub id"
            # A hub id that is neither cached nor reachable fails at once in resolve_model_path, with its reason.
            reason = getattr(error, "reason", None)
            cause = reason or f"{type(error).__name__}: " + (str(error).splitlines() or [""])[0].rstrip(".")
            raise ModelLoadError(
                f"{self.name}: could not load the classifier '{path}' ({where}): "
                f"{cause}. Offline, a hub id cannot be fetched: download it "
                f"elsewhere (hf download {path} --local-dir DIR) and pass DIR as model_name_or_path, or use "
                "rewards.VaderSentiment, which needs no download (HF_HUB_OFFLINE=1 skips the connection retries)"
            ) from error

    def setup(self) -> None:
        tokenizer = self._load(_auto("AutoTokenizer"))
        classifier = self._load(_auto("AutoModelForSequenceClassification"), dtype=torch.float32)
        self._label_index = pick_label(self.name, self.direction, classifier.config.id2label, self._source)
        if tokenizer.pad_token is None:  # GPT-2-style classifiers: pad with EOS, which the model then skips
            tokenizer.pad_token = tokenizer.eos_token
            classifier.config.pad_token_id = tokenizer.pad_token_id
        limits = [tokenizer.model_max_length, getattr(classifier.config, "max_position_embeddings", None)]
        limits = [n for n in limits if isinstance(n, int) and 0 < n < 1_000_000]  # unset means a huge sentinel
        self._max_length = min(limits) if limits else None
        self._tokenizer = tokenizer
        self._classifier = classifier.eval().requires_grad_(False)

    def score(self, samples: list[str]) -> Tensor:
        device = self.device
        if device.type == "cuda" and self._classifier.dtype == torch.float32:
            self._classifier.half()
        chunks = []
        for start in range(0, len(samples), self.batch_size):
            batch = self._tokenizer(
                list(samples[start : start + self.batch_size]), padding=True, return_tensors="pt",
                truncation=self._max_length is not None, max_length=self._max_length,
            )  # fmt: skip
            logits = self._classifier(
                input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
            ).logits
            chunks.append(logits.float().softmax(dim=-1)[:, self._label_index].cpu())
        return torch.cat(chunks) if chunks else torch.zeros(0)


def _auto(name: str):
    import transformers

    return getattr(transformers, name)
