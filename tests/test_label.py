"""``grpo-lightning label``: a human's keys through a real pseudo-terminal, sessions that resume and
survive Ctrl-C, the rule labeller, and a bad preference file refused untouched."""

from __future__ import annotations

import argparse
import io
import json
import os
import pty
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import refuse_model_loading, repo_first_on_path
from grpo_lightning import label
from grpo_lightning.models import load_causal_lm, load_tokenizer
from grpo_lightning.preferences import read_preferences

REPO = Path(__file__).resolve().parents[1]
ASK = "[q] quit > "
GEN_LEN = 5


class Terminal:
    """``grpo-lightning label`` in a pseudo-terminal that is its controlling terminal (so Ctrl-C is a
    real SIGINT from the line discipline, as at a keyboard)."""

    def __init__(self, args: list[str]):
        pid, fd = pty.fork()
        if pid == 0:  # the child: exec at once
            # Ctrl-C must reach label as at a keyboard, even where pytest itself was started in the background
            # of a script (which ignores SIGINT; an ignored signal stays ignored across exec, and Python then
            # installs no KeyboardInterrupt handler).
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            env = dict(os.environ, COLUMNS="120", OMP_NUM_THREADS="1", PYTHONPATH=repo_first_on_path())
            os.chdir(REPO)
            os.execvpe(sys.executable, [sys.executable, "-m", "grpo_lightning", "label", *args], env)
        self.pid, self.fd, self.screen, self.answered = pid, fd, "", 0

    def wait_for(self, text: str, count: int, timeout: float = 120.0) -> None:
        """Reads the screen until ``text`` has appeared ``count`` times."""
        deadline = time.monotonic() + timeout
        while self.screen.count(text) < count:
            assert time.monotonic() < deadline, f"timed out waiting for {text!r}; screen:\n{self.screen[-2000:]}"
            if select.select([self.fd], [], [], 0.5)[0]:
                try:
                    self.screen += os.read(self.fd, 65536).decode("utf-8", "replace")
                except OSError:  # the child closed the terminal
                    break

    def press(self, keys: str) -> None:
        """Each key once its question is on screen: every key, known or not, is answered by one more
        question (the next pair's, or the same one again), except q and Ctrl-C."""
        for key in keys:
            self.answered += 1
            self.wait_for(ASK, self.answered)
            os.write(self.fd, key.encode())

    def finish(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._drain()
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._drain()
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, 9)
        raise AssertionError(f"label did not exit; screen:\n{self.screen[-2000:]}")

    def _drain(self) -> None:
        while select.select([self.fd], [], [], 0.2)[0]:
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                return
            if not data:
                return
            self.screen += data.decode("utf-8", "replace")


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    return load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)


def offered(model_dir: str, policy, index: int) -> tuple[str, str, str]:
    """The pair a session shows at ``index`` (the same seeded sampling as the subprocess)."""
    args = argparse.Namespace(prompts=["The cat"], seed=0, gen_len=GEN_LEN, temperature=1.0, start_token=None)
    pair = label.pair_at(args, *policy, index)
    assert pair is not None
    return pair


def test_keys_in_a_terminal_then_ctrl_c_then_resume(tiny_model_dir, tiny_policy, tmp_path):
    out = tmp_path / "prefs.jsonl"
    args = ["--model", tiny_model_dir, "--out", str(out), "--prompt", "The cat", "--gen-len", str(GEN_LEN), "--seed", "0"]

    # Session 1: left better, right better, an unknown key (asked again), a tie, a skip, quit.
    term = Terminal(args)
    term.press("12x=sq")
    assert term.finish() == 0, term.screen
    assert "3 answers saved this session (1 skipped); 2 pairs + 1 ties" in term.screen
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    expected = [offered(tiny_model_dir, tiny_policy, i) for i in range(4)]
    assert lines[0] == {"prompt": "The cat", "chosen": expected[0][1], "rejected": expected[0][2]}
    assert lines[1] == {"prompt": "The cat", "chosen": expected[1][2], "rejected": expected[1][1]}
    assert lines[2] == {"prompt": "The cat", "chosen": expected[2][1], "rejected": expected[2][2], "tie": True}
    assert len(lines) == 3  # the skip wrote nothing
    assert "prompt: 'The cat'" in term.screen and "│" in term.screen  # side by side

    # Session 2 continues the file (the skipped pair, never written, comes back), then Ctrl-C on screen.
    term = Terminal(args)
    term.wait_for("2 pairs + 1 ties in", 1)
    term.press("2\x03")
    assert term.finish() == 130, term.screen
    assert "stopped: 1 answers saved this session" in term.screen
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 4  # the answer before Ctrl-C is kept, the pair on screen is lost
    assert lines[3] == {"prompt": "The cat", "chosen": expected[3][2], "rejected": expected[3][1]}

    # Session 3 resumes after the interrupted one.
    term = Terminal(args)
    term.press("1q")
    assert term.finish() == 0, term.screen
    pairs = read_preferences(out)
    assert len(pairs) == 5
    fifth = offered(tiny_model_dir, tiny_policy, 4)
    assert (pairs[4].chosen, pairs[4].rejected) == (fifth[1], fifth[2])


def test_piped_input_reads_lines(tiny_model_dir, tmp_path):
    out = tmp_path / "prefs.jsonl"
    screen = io.StringIO()
    argv = ["--model", tiny_model_dir, "--out", str(out), "--prompt", "The cat", "--gen-len", "4"]
    assert label.main(argv, stdin=io.StringIO("2\n\n=\n"), out=screen) == 0  # blank: asked again; EOF: quit
    pairs = read_preferences(out)
    assert [p.tie for p in pairs] == [False, True]
    assert "done: 2 answers saved this session" in screen.getvalue()


def test_auto_rule_labels_by_the_hidden_rule(tiny_model_dir, tmp_path):
    out = tmp_path / "prefs.jsonl"
    argv = ["--model", tiny_model_dir, "--out", str(out), "--prompt", "Dr.", "--gen-len", "8", "--auto", "periods",
            "--pairs", "20"]  # fmt: skip
    assert label.main(argv, out=io.StringIO()) == 0
    pairs = read_preferences(out)
    assert len(pairs) >= 20  # a batch of distinct pairs is written whole
    for pair in pairs:
        if pair.tie:
            assert pair.chosen.count(".") == pair.rejected.count(".")
        else:
            assert pair.chosen.count(".") > pair.rejected.count(".")
    assert label.main(argv, out=io.StringIO()) == 0  # a second session appends new pairs
    more = read_preferences(out)
    assert len(more) >= 40 and more[: len(pairs)] == pairs and more[len(pairs)] != pairs[0]


def test_side_by_side_wraps_into_two_columns():
    rows = label.side_by_side("a" * 25, "b\x1b[31mred", width=43)
    assert rows == ["a" * 20 + " │ b [31mred", "aaaaa".ljust(20) + " │"]  # the escape character is shown as a space


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"\n', "prefs.jsonl:2: not valid JSON"),
        ('{"prompt": "a", "chosen": "b"}\n', "prefs.jsonl:1: missing column 'rejected'"),
    ],
)
def test_a_bad_file_is_refused_untouched(monkeypatch, capsys, tmp_path, content, message):
    refuse_model_loading(monkeypatch, sys.modules["grpo_lightning.models"])
    out = tmp_path / "prefs.jsonl"
    out.write_text(content)
    assert label.main(["--out", str(out)], stdin=io.StringIO("1\n")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert out.read_text() == content


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--auto", "periods"], "--auto needs --pairs N"),
        (["--gen-len", "0"], "--gen-len (0) must be at least 1"),
        (["--ckpt", "missing.ckpt"], "--ckpt: no checkpoint file at 'missing.ckpt'"),
        (["--model", "x", "--ckpt", "y"], "not allowed with argument"),
        (["--auto", "smiles", "--pairs", "3"], "invalid choice: 'smiles'"),
    ],
)
def test_bad_arguments_are_one_line(monkeypatch, capsys, tmp_path, argv, message):
    refuse_model_loading(monkeypatch, sys.modules["grpo_lightning.models"])
    assert label.main([*argv, "--out", str(tmp_path / "p.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "p.jsonl").exists()
