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


def sample_rows(samples: list[str], rewards: Tensor, ref_logprobs: Tensor | None, count: int) -> list[SampleRow]:
    """The first ``count`` samples of the group, as the reference prints them."""
    rows = []
    for i in range(min(count, len(samples))):
        ref = None if ref_logprobs is None else float(ref_logprobs[i].sum())
        rows.append(SampleRow(float(rewards[i]), ref, samples[i]))
    return rows


def phase_line(phase: int, total_phases: int, mean_reward: float, kl: float | None) -> str:
    kl_text = "n/a (no reference model at kl_coef=0)" if kl is None else f"{kl:.4f}"
    return f"Phase {phase:03}/{total_phases:03}, Mean reward: {mean_reward:.4f}, KL: {kl_text}"


def _fmt_ref(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def render_console_table(rows: list[SampleRow], width: int = 120) -> str:
    """A boxed table (rich) rendered to a string, so it can be printed between progress-bar updates."""
    from rich.console import Console
    from rich.table import Table

    table = Table(show_lines=True)
    table.add_column("Reward", justify="right")
    table.add_column("Ref logprobs", justify="right")
    table.add_column("Sample", overflow="fold")
    for row in rows:
        table.add_row(f"{row.reward:g}", _fmt_ref(row.ref_logprob), repr(row.text))
    buffer = io.StringIO()
    Console(file=buffer, width=width, force_terminal=False, color_system=None).print(table)
    return buffer.getvalue().rstrip("\n")


def render_markdown_table(rows: list[SampleRow]) -> str:
    """The same table in Markdown, which TensorBoard's text tab renders."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "\\n")

    lines = ["| Reward | Ref logprobs | Sample |", "|---:|---:|---|"]
    lines += [f"| {row.reward:g} | {_fmt_ref(row.ref_logprob)} | {cell(repr(row.text))} |" for row in rows]
    return "\n".join(lines)
