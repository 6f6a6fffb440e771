"""Prompts as data: where a run's prompts come from, and which of them each phase draws.

A prompt source holds rows: dictionaries with a ``prompt`` column (the text every completion of the
group continues) and any other columns (an ``answer``, a test case) that rewards may read. Each phase
draws ``prompts_per_phase`` rows, and ``group_size`` completions of each row's prompt form one GRPO
group. Which rows a phase draws depends only on the run's seed and the phase, so a resumed run
draws exactly what an uninterrupted one would have.

Sources, each usable from YAML as ``model.prompts: {class_path: ..., init_args: {...}}``:
  ``PromptList``   rows given inline (strings, or mappings with a ``prompt`` key)
  ``PromptFile``   a JSONL, JSON, CSV or Parquet file, or a Hugging Face dataset saved with
                   ``save_to_disk`` (Parquet needs ``pyarrow``, a dataset directory needs ``datasets``)
A task may also generate its rows (``grpo_lightning.tasks``): any ``PromptSource`` subclass works.
"""

from __future__ import annotations

import csv
import json
from abc import ABC
from pathlib import Path
from typing import Any

import torch

from .config import GRPOConfigError

Row = dict[str, Any]


class PromptSource(ABC):
    """Rows to draw prompts from. Subclasses implement ``draw``, or ``__len__`` and ``row`` for a fixed set."""

    prompt_column: str = "prompt"

    def draw(self, seed: int, phase: int, count: int) -> list[Row]:
        """``count`` rows for ``phase``: a fixed set is walked through in a fresh shuffled order per pass, so
        every row is drawn once per pass; the order depends on ``seed`` and the pass number only."""
        size = len(self)
        if size == 0:
            raise GRPOConfigError(f"{type(self).__name__} has no rows to draw prompts from")
        rows, orders = [], {}
        for position in range(phase * count, (phase + 1) * count):
            cycle, offset = divmod(position, size)
            if cycle not in orders:
                orders[cycle] = torch.randperm(size, generator=torch.Generator().manual_seed(draw_seed(seed, cycle)))
            rows.append(self.row(int(orders[cycle][offset])))
        return rows

    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no fixed number of rows")

    def row(self, index: int) -> Row:
        raise NotImplementedError(f"{type(self).__name__} has no fixed rows")

    def all_rows(self) -> list[Row]:
        """Every row, in order (a held-out set is evaluated whole)."""
        return [self.row(i) for i in range(len(self))]


def draw_seed(seed: int, cycle: int) -> int:
    """A distinct, reproducible seed per (run seed, pass over the rows)."""
    return (seed * 1_000_003 + cycle * 7_919 + 17) % (2**63)


def normalise_rows(items: list, prompt_column: str, where: str) -> list[Row]:
    """Rows as dictionaries with a non-empty ``prompt`` (renamed from ``prompt_column``); strings are prompts."""
    rows = []
    for number, item in enumerate(items, start=1):
        if isinstance(item, str):
            item = {prompt_column: item}
        if not isinstance(item, dict):
            raise GRPOConfigError(f"{where}: row {number} is {type(item).__name__}; a row is a prompt string or a mapping")
        if prompt_column not in item:
            columns = ", ".join(map(str, item)) or "none"
            raise GRPOConfigError(
                f"{where}: row {number} has no '{prompt_column}' column (its columns: {columns}); "
                "name the prompt column with prompt_column"
            )
        prompt = item[prompt_column]
        if not isinstance(prompt, str) or not prompt.strip():
            raise GRPOConfigError(f"{where}: row {number}'s prompt must be a non-empty string, got {prompt!r}")
        row = dict(item)
        row["prompt"] = row.pop(prompt_column)
        rows.append(row)
    if not rows:
        raise GRPOConfigError(f"{where}: no rows")
    return rows


class PromptList(PromptSource):
    """Prompts given inline: ``rows: ["What is 2 + 2?", ...]`` or ``[{prompt: ..., answer: ...}, ...]``."""

    def __init__(self, rows: list, prompt_column: str = "prompt"):
        self.rows = rows
        self.prompt_column = prompt_column
        self._rows = normalise_rows(list(rows), prompt_column, "PromptList")

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, index: int) -> Row:
        return dict(self._rows[index])


class PromptFile(PromptSource):
    """Rows read from ``path``: ``.jsonl`` (one object per line), ``.json`` (a list), ``.csv`` (a header
    row), ``.parquet``, or a directory written by ``datasets.Dataset.save_to_disk``."""

    def __init__(self, path: str, prompt_column: str = "prompt"):
        self.path = path
        self.prompt_column = prompt_column
        self._rows = normalise_rows(read_rows(Path(path).expanduser()), prompt_column, path)

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, index: int) -> Row:
        return dict(self._rows[index])


def read_rows(path: Path) -> list:
    """The raw rows of a prompt file, or one-line errors naming the file (and line) at fault."""
    if not path.exists():
        raise GRPOConfigError(f"prompts: no file or dataset directory at '{path}'")
    if path.is_dir():
        return _read_dataset_dir(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise GRPOConfigError(f"{path}:{number}: not a JSON object ({error.msg})") from error
        return rows
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise GRPOConfigError(f"{path}:{error.lineno}: not JSON ({error.msg})") from error
        if not isinstance(data, list):
            raise GRPOConfigError(f"{path}: a JSON prompt file holds a list of rows, not a {type(data).__name__}")
        return data
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as file:
            return list(csv.DictReader(file))
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as parquet
        except ImportError as error:
            raise GRPOConfigError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from error
        return parquet.read_table(path).to_pylist()
    raise GRPOConfigError(f"{path}: unknown prompt file type '{suffix}'; use .jsonl, .json, .csv, .parquet or a dataset directory")


def _read_dataset_dir(path: Path) -> list:
    try:
        import datasets
    except ImportError as error:
        raise GRPOConfigError(f"{path}: reading a Hugging Face dataset directory needs datasets: pip install datasets") from error
    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as error:
        raise GRPOConfigError(f"{path}: not a dataset saved with save_to_disk ({error})") from error
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise GRPOConfigError(f"{path}: a DatasetDict without a 'train' split (it has {', '.join(dataset)})")
        dataset = dataset["train"]
    return dataset.to_list()


def describe_source(source: PromptSource) -> dict:
    """A plain-data description (``class_path``/``init_args`` of its public attributes) for hyperparameters
    and checkpoints, which must hold no pickled objects."""
    cls = type(source)
    init_args = {name: value for name, value in vars(source).items() if not name.startswith("_")}
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}
