"""What a person reads each phase: a one-line summary, a table of samples (console and TensorBoard)."""

from __future__ import annotations

import io
from dataclasses import dataclass

from torch import Tensor


@dataclass
class SampleRow:
    reward: float
    ref_logprob: float | None  # summed over the completion; None without a reference model
    text: str
    advantage: float  # the sample's group-normalised advantage


def sample_table_rows(
    samples: list[str],
    rewards: Tensor,
    advantages: Tensor,
    ref_logprobs: Tensor | None,
    indices: list[int],
) -> list[SampleRow]:
    """Rows for the samples at ``indices``, in that order (e.g. from ``rollout_stats.select_sample_indices``).

    ``rewards`` and ``advantages`` are ``(B,)``. ``ref_logprobs`` is the reference model's
    log-probability of each completion: ``(B,)`` already summed, or ``(B, T)`` per token, summed here
    over the completion tokens; ``None`` without a reference model (the cell shows "–").
    """
    count = len(samples)
    if rewards.shape != (count,) or advantages.shape != (count,):
        raise ValueError(
            f"{count} samples need rewards and advantages of shape ({count},), "
            f"got {tuple(rewards.shape)} and {tuple(advantages.shape)}"
        )
    if ref_logprobs is not None:
        if ref_logprobs.dim() not in (1, 2) or ref_logprobs.shape[0] != count:
            raise ValueError(f"ref_logprobs must be ({count},) or ({count}, T), got {tuple(ref_logprobs.shape)}")
        if ref_logprobs.dim() == 2:
            ref_logprobs = ref_logprobs.sum(dim=-1)
    rows = []
    for i in indices:
        if not 0 <= i < count:
            raise IndexError(f"sample index {i} out of range for {count} samples")
        ref = None if ref_logprobs is None else float(ref_logprobs[i])
        rows.append(SampleRow(float(rewards[i]), ref, samples[i], advantage=float(advantages[i])))
    return rows


def phase_line(phase: int, total_phases: int, mean_reward: float, kl: float | None) -> str:
    kl_text = "n/a (no reference model at kl_coef=0)" if kl is None else f"{kl:.4f}"
    return f"Phase {phase:03}/{total_phases:03}, Mean reward: {mean_reward:.4f}, KL: {kl_text}"


_NO_REF = "–"  # the cell for "no reference model"
_NEWLINE = "⏎"


def _fmt_ref(value: float | None) -> str:
    return _NO_REF if value is None else f"{value:.2f}"


def display_text(text: str) -> str:
    """A sample on one line: each line break (``\\r\\n``, ``\\r`` or ``\\n``) becomes "⏎"."""
    return text.replace("\r\n", _NEWLINE).replace("\r", _NEWLINE).replace("\n", _NEWLINE)


# Backslash escapes Python-Markdown (TensorBoard's renderer) honours; "|" is the table extension's.
_MARKDOWN_ESCAPES = str.maketrans({c: "\\" + c for c in "\\`*_[]|"} | {"&": "&amp;", "<": "&lt;", ">": "&gt;"})


def escape_markdown_cell(text: str) -> str:
    """``text`` as one Markdown table cell that TensorBoard shows literally.

    Line breaks become "⏎"; backslash, backtick, ``*``, ``_``, brackets and ``|`` are backslash-escaped
    (no code span, emphasis, link or column split); ``&``, ``<`` and ``>`` become entities (no HTML).
    """
    return display_text(text).translate(_MARKDOWN_ESCAPES)


def render_console_table(rows: list[SampleRow], width: int = 120) -> str:
    """A boxed table (rich) rendered to a string, so it can be printed between progress-bar updates:
    Reward | Advantage | Ref log-prob | Sample, each sample on one line with "⏎" for line breaks.
    Sample text is never read as rich markup."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(show_lines=True)
    for name in ("Reward", "Advantage", "Ref log-prob"):
        table.add_column(name, justify="right")
    table.add_column("Sample", overflow="fold")
    for row in rows:
        table.add_row(f"{row.reward:g}", f"{row.advantage:+.3f}", _fmt_ref(row.ref_logprob), Text(display_text(row.text)))
    buffer = io.StringIO()
    Console(file=buffer, width=width, force_terminal=False, color_system=None).print(table)
    return buffer.getvalue().rstrip("\n")


def render_markdown_table(rows: list[SampleRow]) -> str:
    """The same table in Markdown, which TensorBoard's text tab renders."""
    lines = ["| Reward | Advantage | Ref log-prob | Sample |", "|---:|---:|---:|---|"]
    lines += [
        f"| {row.reward:g} | {row.advantage:+.3f} | {_fmt_ref(row.ref_logprob)} | {escape_markdown_cell(row.text)} |"
        for row in rows
    ]
    return "\n".join(lines)
