"""The preference file: JSON Lines, one labelled pair per line, in the columns the Hugging Face hub's
preference datasets and TRL's reward trainer use.

    {"prompt": "This is", "chosen": " a fine day.", "rejected": " bad."}

* **Explicit prompt** (what ``grpo-lightning label`` writes): ``chosen``/``rejected`` are the two
  completions without the prompt; the text a reward model scores is ``prompt + chosen``.
* **Implicit prompt** (no ``prompt`` column): ``chosen``/``rejected`` are whole texts.
* **Ties** are written with ``"tie": true`` (the human's answer is kept, and ``label`` counts it) and
  skipped when training: Bradley-Terry has no tie outcome. Other tools ignore the flag and would read
  a tie as a preference, so drop those lines before handing the file elsewhere
  (``grep -v '"tie": true'``). Skipped pairs are not written.

Every line is appended with one ``write`` and flushed to disk before the next pair is shown, so a
Ctrl-C, a kill or a power cut loses at most the pair on screen. Reading checks every line and
stops at the first bad one with one message naming ``file:line``; it never modifies the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .config import GRPOConfigError

COLUMNS = ("prompt", "chosen", "rejected")


class PreferenceError(GRPOConfigError):
    """The preference file cannot be read as labelled pairs; the message names the file and line."""


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    tie: bool = False

    @property
    def chosen_text(self) -> str:
        """What a reward model scores for the preferred side: the prompt followed by the completion."""
        return self.prompt + self.chosen

    @property
    def rejected_text(self) -> str:
        return self.prompt + self.rejected

    def to_json(self) -> str:
        record = {"prompt": self.prompt, "chosen": self.chosen, "rejected": self.rejected}
        if self.tie:
            record["tie"] = True
        return json.dumps(record, ensure_ascii=False)


def parse_line(text: str, where: str) -> PreferencePair:
    """One JSON line as a pair; ``where`` (``file:line``) starts every error message."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        incomplete = "" if text.endswith("\n") else " (the last line is incomplete: was the writer killed mid-line?)"
        raise PreferenceError(f"{where}: not valid JSON ({error.msg} at column {error.colno}){incomplete}") from None
    if not isinstance(record, dict):
        raise PreferenceError(f"{where}: expected a JSON object with {_columns()}, got {type(record).__name__}")
    missing = [name for name in ("chosen", "rejected") if name not in record]
    if missing:
        raise PreferenceError(f"{where}: missing column {' and '.join(map(repr, missing))}; each line needs {_columns()}")
    prompt = record.get("prompt", "")  # the implicit-prompt format: chosen and rejected are whole texts
    for name, value in (("prompt", prompt), ("chosen", record["chosen"]), ("rejected", record["rejected"])):
        if not isinstance(value, str):
            conversational = " (conversational, message-list data is not supported: join the messages into text)"
            hint = conversational if isinstance(value, list) else ""
            raise PreferenceError(f"{where}: column {name!r} must be a string, got {type(value).__name__}{hint}")
    tie = record.get("tie", False)
    if not isinstance(tie, bool):
        raise PreferenceError(f"{where}: column 'tie' must be true or false, got {tie!r}")
    pair = PreferencePair(prompt, record["chosen"], record["rejected"], tie)
    if pair.chosen == pair.rejected and not tie:
        raise PreferenceError(f"{where}: 'chosen' and 'rejected' are the same text, so neither is preferred")
    return pair


def read_preferences(path: str | Path) -> list[PreferencePair]:
    """Every pair in the file, ties included, in file order. Blank lines are allowed (and skipped).
    Raises ``PreferenceError`` naming ``file:line`` at the first bad line, or for a missing file."""
    path = Path(path)
    if not path.is_file():
        raise PreferenceError(f"{path}: no such preference file (label pairs with `grpo-lightning label --out {path}`)")
    pairs = []
    with open(path, encoding="utf-8") as file:
        try:
            for number, text in enumerate(file, start=1):
                if text.strip():
                    pairs.append(parse_line(text, f"{path}:{number}"))
        except UnicodeDecodeError as error:
            raise PreferenceError(f"{path}:{len(pairs) + 1}: not UTF-8 text ({error.reason})") from None
    return pairs


def training_pairs(path: str | Path) -> list[PreferencePair]:
    """The pairs a reward model learns from: ties dropped. Raises if none is left."""
    pairs = read_preferences(path)
    kept = [pair for pair in pairs if not pair.tie]
    if not kept:
        what = f"only ties ({len(pairs)})" if pairs else "no pairs (the file is empty)"
        raise PreferenceError(f"{path}: {what}; label some pairs first (`grpo-lightning label --out {path}`)")
    return kept


def append_pair(path: str | Path, pair: PreferencePair) -> None:
    """Appends one line and flushes it to disk before returning: once this returns, the answer survives a
    crash. One ``os.write`` on an ``O_APPEND`` descriptor, so a line is never interleaved with another."""
    data = (pair.to_json() + "\n").encode("utf-8")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a file written by hand without a final newline
            data = b"\n" + data
        written = os.write(fd, data)
        if written != len(data):  # a full disk: say so rather than leave half a line unexplained
            raise OSError(f"only {written} of {len(data)} bytes written to {path}")
        os.fsync(fd)
    finally:
        os.close(fd)


def _columns() -> str:
    return "'chosen' and 'rejected' (and usually 'prompt')"
