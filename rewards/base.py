"""The reward contract: a list of samples (prompt + completion strings) in, a float tensor (B,) out.

Two base classes:

* ``Reward``: subclass it and implement ``score``. Store each ``__init__`` argument in a public
  attribute of the same name and anything else (loaded models, caches) in attributes starting with
  an underscore: the public ones are what ``describe_reward`` records in checkpoints.
* ``RewardModule``: a ``Reward`` that is also a ``torch.nn.Module``, for rewards holding a network
  (a sentiment classifier). Given to ``GRPOModule``, it becomes a child module, so Lightning moves
  it to the training device with the policy. It stays in eval mode, its parameters are frozen, and
  it scores under ``no_grad`` with autocast off, so the trainer's precision does not change rewards.

Any plain function with the reference's ``reward_fn(samples) -> Tensor`` signature works too.

Rewards that read the row. With prompts from data (``model.prompts``), each sample comes from a row:
its prompt and other columns (an ``answer``, a test case). A ``Reward`` that needs them overrides
``score_rows(completions, rows)`` instead of (or besides) ``score(samples)``; a plain function that
takes keyword arguments ``completions`` and ``rows`` gets them too. Everything written for
``score(samples)`` keeps working unchanged: a sample is still the row's prompt + its completion.
"""

from __future__ import annotations

import inspect

from abc import ABC, abstractmethod

import torch
from torch import Tensor


class Reward(ABC):
    """Subclass and implement ``score`` (or ``score_rows``, to read each sample's row); instances are
    callables usable wherever a reward is taken.

    Optionally override ``setup`` to load something heavy (a model) once, before the first score.
    Any plain function with the reference's ``reward_fn(samples) -> Tensor`` signature works too.
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # ``score`` is abstract; a class implementing ``score_rows`` alone is complete (ABCMeta reads
        # the abstract methods after this runs), and its ``score`` says that it needs rows.
        if "score_rows" in cls.__dict__ and getattr(cls.score, "__isabstractmethod__", False):
            cls.score = _score_needs_rows

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def last_components(self) -> dict[str, Tensor]:
        """Named parts of the last scores, each (B,), for logging (``WeightedSum`` fills it); empty
        for a reward made of one part."""
        return self.__dict__.get("_last_components", {})

    @last_components.setter
    def last_components(self, components: dict[str, Tensor]) -> None:
        self.__dict__["_last_components"] = components

    @abstractmethod
    def score(self, samples: list[str]) -> Tensor:
        """Returns one float reward per sample (prompt + completion), shape (len(samples),)."""

    def score_rows(self, completions: list[str], rows: list[dict]) -> Tensor:
        """One float reward per completion, reading its row (``row["prompt"]`` and any other column).
        Defaults to ``score`` on prompt + completion."""
        return self.score([row["prompt"] + completion for completion, row in zip(completions, rows)])

    def reads_rows(self) -> bool:
        return type(self).score_rows is not Reward.score_rows

    def setup(self) -> None:
        """Loads what ``score`` needs (a model, a lexicon). Runs once, through ``prepare``: before
        the first score, or earlier when the trainer prepares its models. Does nothing by default."""

    def prepare(self) -> None:
        """Runs ``setup`` unless it has already run successfully."""
        if not self.__dict__.get("_prepared", False):
            self.setup()
            self.__dict__["_prepared"] = True

    def __call__(self, samples: list[str], completions: list[str] | None = None, rows: list[dict] | None = None) -> Tensor:
        self.prepare()
        return self._dispatch(samples, completions, rows)

    def _dispatch(self, samples, completions, rows) -> Tensor:
        if rows is not None and completions is not None and self.reads_rows():
            return self.score_rows(completions, rows)
        return self.score(samples)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and k != "training")
        return f"{self.name}({args})"


def _score_needs_rows(self, samples: list[str]) -> Tensor:
    raise TypeError(
        f"{self.name} reads each sample's row (score_rows): use it with prompts from data (model.prompts), "
        "whose rows hold the columns it reads"
    )


class RewardModule(Reward, torch.nn.Module):
    """A ``Reward`` holding a network. Call ``super().__init__()`` first in ``__init__``, assign
    networks as attributes (in ``__init__`` or ``setup``), and implement ``score`` with tensors on
    ``self.device``. The networks are frozen and kept in eval mode (no dropout)."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        # An empty buffer that follows .to(device) even before setup has loaded any network, so that
        # networks loaded later join the device the reward was moved to. Not saved in checkpoints.
        self.register_buffer("_device_marker", torch.empty(0), persistent=False)

    @property
    def device(self) -> torch.device:
        """The device the reward was moved to (with its parent module), the CPU by default."""
        return self._device_marker.device

    def train(self, mode: bool = True) -> "RewardModule":
        """Stays in eval mode whatever is asked: a reward must be a deterministic function."""
        return super().train(False)

    def prepare(self) -> None:
        if not self.__dict__.get("_prepared", False):
            super().prepare()
            self.to(self.device)  # networks setup loaded join the device the reward was moved to
        self.requires_grad_(False).train(False)  # every call: a trainer may have switched modes directly

    def __call__(self, samples: list[str], completions: list[str] | None = None, rows: list[dict] | None = None) -> Tensor:
        self.prepare()
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            return self._dispatch(samples, completions, rows)


def call_reward(reward, samples: list[str], completions: list[str] | None = None, rows: list[dict] | None = None):
    """Calls any reward: a ``Reward`` with the rows when it reads them; a plain function with keyword
    arguments ``completions`` and ``rows`` when its signature takes them, else with the samples only."""
    if isinstance(reward, Reward) or rows is None:
        return reward(samples, completions=completions, rows=rows) if isinstance(reward, Reward) else reward(samples)
    try:
        parameters = inspect.signature(reward).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return reward(samples)
    if "rows" in parameters and "completions" in parameters:
        return reward(samples, completions=completions, rows=rows)
    return reward(samples)


def reward_name(reward) -> str:
    """A readable name for any reward callable, for messages and logs."""
    if isinstance(reward, Reward):
        return reward.name
    return getattr(reward, "__qualname__", None) or getattr(reward, "__name__", None) or type(reward).__name__


def prepare_reward(reward) -> None:
    """Runs a ``Reward``'s ``setup`` once (loads its models); a no-op for plain functions."""
    if isinstance(reward, Reward):
        reward.prepare()


def as_reward_tensor(values: list[float]) -> Tensor:
    return torch.tensor(values, dtype=torch.float32)


def reward_config_error(message: str) -> Exception:
    """A settings error naming a reward: a ``GRPOConfigError`` (a ``ValueError``), which the command
    line prints as one line. Imported here, not at the top, to keep ``rewards`` importable first."""
    from grpo_lightning.config import GRPOConfigError

    return GRPOConfigError(message)


def check_model_dir(reward: str, name_or_path: str | None) -> None:
    """Fails fast, naming the reward, on a local model directory that does not exist (a hub id is
    only fetched at setup)."""
    from pathlib import Path

    from grpo_lightning.models import looks_like_local_path

    if name_or_path is not None and looks_like_local_path(name_or_path):
        if not Path(name_or_path).expanduser().is_dir():
            raise reward_config_error(
                f"{reward}: model_name_or_path: no model directory at '{name_or_path}'; pass an existing "
                "directory (config.json and weights, or the tokenizer files) or a Hugging Face hub id"
            )


_PLAIN = (str, int, float, bool, type(None))


def _init_args(reward: Reward) -> dict | None:
    """The public attributes of a reward as plain data (nested rewards described in turn), or None
    if one of them is not plain data."""
    args = {}
    for key, value in vars(reward).items():
        if key.startswith("_") or (key == "training" and isinstance(reward, torch.nn.Module)):
            continue
        plain = _plain(value)
        if plain is _NOT_PLAIN:
            return None
        args[key] = plain
    return args


_NOT_PLAIN = object()


def _plain(value):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in items) else items
    if isinstance(value, Reward):
        described = describe_reward(value)
        return described if isinstance(described, dict) else _NOT_PLAIN
    return _NOT_PLAIN


def describe_reward(reward) -> dict | str:
    """A plain-data description of a reward for hyperparameters and checkpoints (which must hold no
    pickled objects to stay loadable with ``weights_only``): ``class_path``/``init_args`` for a
    ``Reward`` whose public attributes are plain values (or rewards, or lists of them), the import
    path for a function, else its repr."""
    cls = type(reward)
    if isinstance(reward, Reward):
        init_args = _init_args(reward)
        if init_args is not None:
            return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}
    if callable(reward) and hasattr(reward, "__module__") and hasattr(reward, "__qualname__"):
        return f"{reward.__module__}.{reward.__qualname__}"
    return repr(reward)
