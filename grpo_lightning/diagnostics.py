"""``grpo-lightning diagnose top-k | kl-estimators``: look at the distributions the KL penalty works on.

* ``top-k`` shows how concentrated a next-token distribution is (a handful of tokens hold almost all
  the mass), which is why the exact full-vocabulary KL is mostly wasted work.
* ``kl-estimators`` measures how well the one-sampled-token estimators k1, k2, k3 recover that exact
  KL (see ``grpo_lightning.kl_comparison``).

Both load a model the way training does (``--model``: local directory, hub id, or the embedded default).
Errors end in one line ``error: ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import GRPOError
from .kl_comparison import DiagnoseError, KLComparison, compare_kl_estimators, read_text_contexts, sample_contexts
from .models import load_causal_lm, load_tokenizer
from .sampling import encode_prompt

TOP_K_TAG = "diagnose/top_k"


# ---------------------------------------------------------------------------------------------
# top-k
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenRow:
    rank: int
    token_id: int
    token: str  # see token_label
    probability: float
    cumulative: float


@torch.no_grad()
def top_k_next_tokens(
    model: torch.nn.Module, tokenizer, prompt: str, k: int, start_token: str | None = None
) -> list[TokenRow]:
    """The ``k`` most likely next tokens after start token + ``prompt`` (k is capped at the vocabulary size)."""
    ids = encode_prompt(tokenizer, prompt, start_token)
    if ids.shape[1] == 0:
        raise DiagnoseError("the prompt and start token encode to no tokens; pass a non-empty --prompt")
    logits = model(input_ids=ids.to(next(model.parameters()).device)).logits[0, -1]
    logprobs = logits.float().log_softmax(-1)
    top = logprobs.topk(min(k, logprobs.numel()))
    probs = top.values.double().exp()
    cumulative = probs.cumsum(0)
    return [
        TokenRow(rank + 1, int(token_id), token_label(tokenizer, int(token_id)), float(p), float(c))
        for rank, (token_id, p, c) in enumerate(zip(top.indices, probs, cumulative))
    ]


def token_label(tokenizer, token_id: int) -> str:
    """repr() of the decoded token, so spaces and newlines stay visible; a token that is only part of a
    UTF-8 character decodes to U+FFFD, so it shows its raw vocabulary string instead, marked ``(raw)``."""
    decoded = tokenizer.decode([token_id])
    if "\ufffd" in decoded:
        return f"{tokenizer.convert_ids_to_tokens(token_id)!r} (raw)"
    return repr(decoded)


def plot_top_k(rows: list[TokenRow], prompt: str):
    """A bar chart of the rows' probabilities, drawn on the Agg canvas (no display, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 0.4 * len(rows) + 2), 3.8), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar(range(len(rows)), [row.probability for row in rows], color="#378ADD")
    labels = [row.token.replace("$", r"\$") for row in rows]  # a '$' pair would switch on mathtext
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=8)
    ax.set(ylabel="probability", title=f"top-{len(rows)} next-token probabilities after {prompt!r}".replace("$", r"\$"))
    fig.tight_layout()
    return fig


def run_top_k(args: argparse.Namespace) -> list[TokenRow]:
    _require(args.k >= 1, f"--k ({args.k}) must be at least 1")
    model, tokenizer = load_causal_lm(args.model), load_tokenizer(args.model)
    rows = top_k_next_tokens(model, tokenizer, args.prompt, args.k, args.start_token)
    print_top_k(rows, args.prompt)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig = plot_top_k(rows, args.prompt)
    png = out / "top_k.png"
    fig.savefig(png)
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(out))
    try:
        writer.add_figure(TOP_K_TAG, fig)
        writer.flush()
    finally:
        writer.close()
    print(f"bar chart: {png}\nTensorBoard: {out} (tag {TOP_K_TAG}; `tensorboard --logdir {out}`)")
    return rows


def print_top_k(rows: list[TokenRow], prompt: str) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"top-{len(rows)} next tokens after {prompt!r}")
    for name in ("rank", "token", "probability", "cumulative"):
        table.add_column(name, justify="left" if name == "token" else "right")
    for row in rows:  # Text(): a token like "[b]" must print as itself, not as rich markup
        table.add_row(str(row.rank), Text(row.token), f"{row.probability:.4f}", f"{row.cumulative:.4f}")
    Console().print(table)


# ---------------------------------------------------------------------------------------------
# kl-estimators
# ---------------------------------------------------------------------------------------------


def run_kl_estimators(args: argparse.Namespace) -> KLComparison:
    _require(args.temperature > 0, f"--temperature ({args.temperature}) must be > 0")
    _require(args.n_seqs >= 1, f"--n-seqs ({args.n_seqs}) must be at least 1")
    _require(args.seq_len >= 2, f"--seq-len ({args.seq_len}) must be at least 2")
    _require(args.batch_size >= 1, f"--batch-size ({args.batch_size}) must be at least 1")
    if args.text_file is not None and not Path(args.text_file).is_file():  # before the slow model load
        raise DiagnoseError(f"--text-file: no file at '{args.text_file}'")

    began = time.perf_counter()
    model, tokenizer = load_causal_lm(args.model), load_tokenizer(args.model)
    progress = _progress_line
    if args.text_file is not None:
        contexts = read_text_contexts(tokenizer, args.text_file, args.n_seqs, args.seq_len, args.start_token)
    else:
        contexts = sample_contexts(
            model, tokenizer, args.n_seqs, args.seq_len, args.batch_size, args.seed, args.start_token, progress
        )
    result = compare_kl_estimators(model, contexts, args.temperature, args.batch_size, args.seed, progress)
    print_kl_table(result)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kl_estimators.json"
    source = str(args.text_file) if args.text_file is not None else "sampled from the model"
    record = {"model": args.model or "embedded default", "contexts": source, **result.to_dict()}
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"table: {path} ({time.perf_counter() - began:.1f} s in all)")
    return result


def print_kl_table(result: KLComparison) -> None:
    from rich.console import Console
    from rich.table import Table

    def percent(x: float | None) -> str:
        return "n/a" if x is None else f"{x:+.1%}"

    def ratio(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    table = Table(
        title=f"KL(pi || pi_ref), pi = temperature {result.temperature:g}, pi_ref = temperature 1",
        caption=f"{result.n_tokens} tokens in {result.n_contexts} contexts, seed {result.seed}; r = pi / pi_ref "
        "on one token drawn from pi; s.e. = standard error of the bias from sampling alone",
    )
    for name in ("estimator", "mean", "bias", "± s.e.", "stdev/true"):
        table.add_column(name, justify="left" if name == "estimator" else "right")
    table.add_row("true KL (exact)", f"{result.true_kl:.4f}", "", "", "")
    for stats in result.estimators:
        se = "n/a" if stats.bias_standard_error is None else f"{stats.bias_standard_error:.1%}"
        table.add_row(
            f"{stats.name} = {stats.formula}", f"{stats.mean:.4f}", percent(stats.relative_bias), se,
            ratio(stats.std_over_true),
        )
    Console().print(table)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so errors end in one line."""

    def error(self, message: str):
        raise DiagnoseError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="grpo-lightning diagnose", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="{top-k,kl-estimators}")

    def command(name: str, help: str, run) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.set_defaults(run=run)
        sub.add_argument("--model", default=None, help="local model directory or hub id (default: the embedded model)")
        sub.add_argument("--start-token", default=None, help="prepended to the text (default: the tokenizer's)")
        sub.add_argument("--out", default="runs/diagnose", help="output directory (default: %(default)s)")
        return sub

    top_k = command("top-k", "table and bar chart of the most likely next tokens after a prompt", run_top_k)
    top_k.add_argument("--prompt", default="This is", help="default: %(default)r")
    top_k.add_argument("--k", type=int, default=10, help="how many tokens (default: %(default)s)")

    kl_help = "bias and spread of the k1/k2/k3 KL estimators against the exact KL"
    kl = command("kl-estimators", kl_help, run_kl_estimators)
    kl.add_argument("--temperature", type=float, default=0.9, help="policy temperature (default: %(default)s)")
    kl.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    kl.add_argument("--n-seqs", type=int, default=32, help="number of contexts (default: %(default)s)")
    kl.add_argument("--seq-len", type=int, default=64, help="tokens per context (default: %(default)s)")
    kl.add_argument("--batch-size", type=int, default=8, help="default: %(default)s")
    kl.add_argument("--text-file", default=None, help="contexts from this file, one text per line or paragraph "
                    "(default: sample them from the model)")  # fmt: skip
    return parser


def main(argv: list[str]) -> int:
    """Runs one diagnose command; returns its exit code (0, or 2 after an ``error: ...`` line on stderr)."""
    try:
        args = build_parser().parse_args(argv)
        args.run(args)
    except SystemExit as stop:  # --help
        return stop.code if isinstance(stop.code, int) else 0
    except GRPOError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    return 0


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise DiagnoseError(message)


def _progress_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
