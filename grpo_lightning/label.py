"""``grpo-lightning label``: say which of two completions is better, one keypress per pair.

Two completions of a prompt are sampled from a policy (the embedded model by default, a model
directory with ``--model``, or a GRPO checkpoint with ``--ckpt``) and shown side by side. Keys:
``1`` or ``2`` (that one is better), ``=`` (a tie), ``s`` (skip, nothing written), ``q`` (stop).
Each answer is appended to the preference file (``grpo_lightning.preferences``) and flushed to disk
before the next pair is sampled, so Ctrl-C or a crash loses at most the pair on screen; running the
command again continues the same file.

``--auto RULE`` labels without a human, by a rule the reward model is not told (VADER sentiment or
the period count): the way to make a training set, and a test, without anyone at the keyboard.

Errors end in one line ``error: ...``: exit 2 for bad arguments or a bad preference file, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import sys
import textwrap
from pathlib import Path

import torch

from .config import GRPOConfigError, GRPOError
from .preferences import PreferencePair, append_pair, read_preferences
from .sampling import sample_group

KEYS = {"1": "left", "2": "right", "=": "tie", "s": "skip", "q": "quit"}
AUTO_RULES = ("vader-pos", "vader-neg", "periods")
AUTO_BATCH_PAIRS = 16  # pairs sampled per forward batch in --auto mode (32 completions)


class LabelError(GRPOConfigError):
    """A bad argument of ``label``."""


# ---------------------------------------------------------------------------------------------
# Sampling pairs
# ---------------------------------------------------------------------------------------------


def pair_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th pair of a file: a resumed session, starting at the count already in
    the file, samples new pairs instead of repeating the first session's."""
    return (seed * 1_000_003 + index) % (2**63)


def sample_completions(policy, tokenizer, prompt: str, n: int, gen_len: int, temperature: float,
                       start_token: str | None, seed: int) -> list[str]:  # fmt: skip
    """``n`` completions of ``prompt`` (the prompt itself not included), seeded."""
    torch.manual_seed(seed)
    _, samples = sample_group(policy, tokenizer, prompt, n, gen_len, temperature, start_token)
    return [sample[len(prompt) :] for sample in samples]


def distinct_pairs(completions: list[str]) -> list[tuple[str, str]]:
    """Consecutive completions as pairs, dropping pairs of identical texts (nothing to prefer there)."""
    return [(a, b) for a, b in zip(completions[::2], completions[1::2]) if a != b]


# ---------------------------------------------------------------------------------------------
# The terminal
# ---------------------------------------------------------------------------------------------


def printable(text: str) -> str:
    """Control characters (escape sequences a model may write) shown as spaces, so they cannot move the
    cursor or recolour the terminal; newlines are kept as line breaks."""
    return "".join(c if c.isprintable() or c == "\n" else " " for c in text)


def side_by_side(left: str, right: str, width: int) -> list[str]:
    """The two texts wrapped into two columns of a ``width``-character screen, separated by " │ "."""
    column = max(10, (width - 3) // 2)

    def wrap(text: str) -> list[str]:
        lines = []
        for paragraph in printable(text).split("\n"):
            lines.extend(textwrap.wrap(paragraph, column, drop_whitespace=False, replace_whitespace=True) or [""])
        return lines

    rows = itertools.zip_longest(wrap(left), wrap(right), fillvalue="")
    return [f"{a.ljust(column)} │ {b}".rstrip() for a, b in rows]


def show_pair(prompt: str, left: str, right: str, number: int, out) -> None:
    width = shutil.get_terminal_size((100, 24)).columns
    column = max(10, (width - 3) // 2)
    print(f"\n── pair {number} ── prompt: {printable(prompt)!r}", file=out)
    print(f"{'[1]'.ljust(column)} │ [2]", file=out)
    for line in side_by_side("…" + left, "…" + right, width):
        print(line, file=out)


class KeyReader:
    """One key at a time: without Enter on a terminal (cbreak mode: Ctrl-C still interrupts), else one
    line at a time, its first character (piped input). The end of the input reads as ``q``."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stdin
        self.fd = _fileno(self.stream)
        self.is_tty = self.fd is not None and os.isatty(self.fd)

    @contextlib.contextmanager
    def active(self):
        if not self.is_tty:
            yield self
            return
        import termios
        import tty

        saved = termios.tcgetattr(self.fd)
        try:
            tty.setcbreak(self.fd)
            yield self
        finally:  # whatever happens (Ctrl-C included), the terminal is given back as it was
            termios.tcsetattr(self.fd, termios.TCSADRAIN, saved)

    def read(self) -> str:
        if self.is_tty:
            data = os.read(self.fd, 1)
            return data.decode("utf-8", "replace").lower() if data else "q"
        line = self.stream.readline()
        return (line.strip()[:1] or " ").lower() if line else "q"


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def ask(keys: KeyReader, status: str, out) -> str:
    """Asks until a known key comes; returns its meaning (``left``, ``right``, ``tie``, ``skip``, ``quit``)."""
    while True:
        print(f"{status} · [1]/[2] better · [=] tie · [s] skip · [q] quit > ", end="", file=out, flush=True)
        key = keys.read()
        print(key if key.isprintable() else "", file=out, flush=True)
        if key in KEYS:
            return KEYS[key]


def as_pair(prompt: str, left: str, right: str, answer: str) -> PreferencePair:
    if answer == "right":
        return PreferencePair(prompt, right, left)
    return PreferencePair(prompt, left, right, tie=answer == "tie")


# ---------------------------------------------------------------------------------------------
# Sessions
# ---------------------------------------------------------------------------------------------


class Tally:
    """What is in the file (ties counted apart) and what this session added."""

    def __init__(self, existing: list[PreferencePair]):
        self.pairs = sum(not p.tie for p in existing)
        self.ties = sum(p.tie for p in existing)
        self.added = self.skipped = 0

    def count(self, pair: PreferencePair) -> None:
        self.ties += pair.tie
        self.pairs += not pair.tie
        self.added += 1

    def line(self, path: Path) -> str:
        return f"{self.pairs} pairs + {self.ties} ties in {path}"


def pair_at(args, policy, tokenizer, index: int) -> tuple[str, str, str] | None:
    """The ``index``-th pair a session offers for a file: (prompt, left, right), or None when the two samples
    came out identical (nothing to choose between). A session starts at the number of lines already in the
    file, so a resumed session offers new pairs (a skipped pair, never written, comes back)."""
    prompt = args.prompts[index % len(args.prompts)]
    seed = pair_seed(args.seed, index)
    completions = sample_completions(policy, tokenizer, prompt, 2, args.gen_len, args.temperature, args.start_token, seed)
    pairs = distinct_pairs(completions)
    return (prompt, *pairs[0]) if pairs else None


def label_by_hand(args, policy, tokenizer, tally: Tally, keys: KeyReader, out) -> None:
    first = tally.pairs + tally.ties
    for shown in itertools.count():
        if args.pairs is not None and tally.added >= args.pairs:
            return
        offered = pair_at(args, policy, tokenizer, first + shown)
        if offered is None:
            continue
        prompt, left, right = offered
        show_pair(prompt, left, right, first + shown + 1, out)
        answer = ask(keys, tally.line(args.out), out)
        if answer == "quit":
            return
        if answer == "skip":
            tally.skipped += 1
            continue
        pair = as_pair(prompt, left, right, answer)
        append_pair(args.out, pair)
        tally.count(pair)


def rule_scorer(rule: str):
    """The hidden rule of ``--auto``: a reward callable; the higher-scored completion is chosen."""
    from rewards import CharCount, VaderSentiment

    if rule == "periods":
        return CharCount(".")
    return VaderSentiment(direction=rule.split("-")[1])


def label_by_rule(args, policy, tokenizer, tally: Tally, out) -> None:
    """Samples pairs in batches and labels each by the rule: equal scores are written as ties."""
    rule = rule_scorer(args.auto)
    prompts = itertools.cycle(args.prompts)
    batch = 0
    while tally.added < args.pairs:
        prompt = next(prompts)
        seed = pair_seed(args.seed, tally.pairs + tally.ties + batch)  # resumed: new seeds
        batch += 1
        want = min(AUTO_BATCH_PAIRS, args.pairs - tally.added)
        completions = sample_completions(
            policy, tokenizer, prompt, 2 * want, args.gen_len, args.temperature, args.start_token, seed
        )
        for left, right in distinct_pairs(completions):
            scores = rule([prompt + left, prompt + right]).tolist()
            answer = "tie" if scores[0] == scores[1] else "left" if scores[0] > scores[1] else "right"
            pair = as_pair(prompt, left, right, answer)
            append_pair(args.out, pair)
            tally.count(pair)
        print(f"{tally.line(args.out)} ({tally.added} of {args.pairs} this session, rule {args.auto})", file=out, flush=True)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise LabelError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="grpo-lightning label", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="model directory or hub id (default: the embedded model)")
    source.add_argument("--ckpt", default=None, help="a GRPO checkpoint (.ckpt): label what that trained policy writes")
    parser.add_argument("--prompt", action="append", dest="prompt_list", metavar="PROMPT",
                        help="a prompt to complete; repeat for several, used in turn (default: 'This is', "
                             "or the checkpoint's prompt)")  # fmt: skip
    parser.add_argument("--prompts-file", default=None, help="prompts, one per line, used in turn")
    parser.add_argument("--out", default="preferences.jsonl", help="the preference file, appended to (default: %(default)s)")
    parser.add_argument("--gen-len", type=int, default=30, help="tokens per completion (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0, help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--start-token", default=None, help="prepended to the prompt (default: the tokenizer's)")
    parser.add_argument("--pairs", type=int, default=None, help="stop after this many answers (required with --auto)")
    parser.add_argument("--auto", choices=AUTO_RULES, default=None,
                        help="label by a rule instead of by hand: vader-pos/vader-neg (the more positive/negative "
                             "completion wins) or periods (more periods wins); equal scores are ties")  # fmt: skip
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    _require(args.gen_len >= 1, f"--gen-len ({args.gen_len}) must be at least 1")
    _require(args.temperature > 0, f"--temperature ({args.temperature}) must be > 0")
    _require(args.pairs is None or args.pairs >= 1, f"--pairs ({args.pairs}) must be at least 1")
    _require(args.auto is None or args.pairs is not None, "--auto needs --pairs N: how many pairs to label")
    _require(args.ckpt is None or Path(args.ckpt).is_file(), f"--ckpt: no checkpoint file at '{args.ckpt}'")
    prompts = list(args.prompt_list or [])
    if args.prompts_file is not None:
        try:
            prompts += [line.rstrip("\n") for line in Path(args.prompts_file).read_text(encoding="utf-8").splitlines()]
        except (OSError, UnicodeDecodeError) as error:
            raise LabelError(f"--prompts-file: cannot read '{args.prompts_file}': {error}") from None
        prompts = [p for p in prompts if p.strip()]
        _require(bool(prompts), f"--prompts-file: '{args.prompts_file}' holds no prompt")
    args.prompts = prompts
    args.out = Path(args.out)
    return args


def load_policy(args):
    """The policy and tokenizer to sample from; with ``--ckpt``, the trained GRPO policy (its prompt and
    start token become the defaults)."""
    from .models import load_causal_lm, load_tokenizer

    if args.ckpt is None:
        return load_causal_lm(args.model), load_tokenizer(args.model)
    from .module import GRPOModule

    module = GRPOModule.load_from_checkpoint(args.ckpt, map_location="cpu")
    args.prompts = args.prompts or [module.args.prompt]
    if args.start_token is None:
        args.start_token = module.start_token
    return module.policy.eval(), module.tokenizer


def main(argv: list[str], stdin=None, out=None) -> int:
    """Runs one session; returns the exit code (0; 2 after an ``error: ...`` line; 130 on Ctrl-C)."""
    out = out or sys.stdout
    tally = args = None
    try:
        args = parse_args(argv)
        tally = Tally(read_preferences(args.out) if args.out.exists() else [])  # a bad file: refuse, untouched
        policy, tokenizer = load_policy(args)
        args.prompts = args.prompts or ["This is"]
        print(f"{tally.line(args.out)}; each answer is saved at once", file=out, flush=True)
        with torch.inference_mode():
            if args.auto:
                label_by_rule(args, policy, tokenizer, tally, out)
            else:
                keys = KeyReader(stdin)
                with keys.active():
                    label_by_hand(args, policy, tokenizer, tally, keys, out)
    except SystemExit as stop:  # --help
        return stop.code if isinstance(stop.code, int) else 0
    except GRPOError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nstopped: {_summary(tally, args)}", file=out, flush=True)
        return 130
    print(f"done: {_summary(tally, args)}", file=out, flush=True)
    return 0


def _summary(tally: Tally | None, args) -> str:
    if tally is None:
        return "nothing written"
    return f"{tally.added} answers saved this session ({tally.skipped} skipped); {tally.line(args.out)}"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise LabelError(message)
