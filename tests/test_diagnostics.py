"""``grpo-lightning diagnose top-k | kl-estimators`` on the tiny saved Llama: outputs, exact checks, errors.

The estimators' means are random, so only exact or deterministic facts are asserted: the true KL
against an independent computation, the top-k probabilities against a direct softmax, signs that
hold sample by sample, and identical tables for identical seeds.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import refuse_model_loading
import torch

from grpo_lightning import cli, diagnostics
from grpo_lightning.kl_comparison import compare_kl_estimators, read_text_contexts, split_texts, summarise
from grpo_lightning.models import load_causal_lm, load_tokenizer

TEXTS = [
    "The cat sat on the mat. It was happy, and so was the dog next to it.",
    "This is a test.",
    "Dr. Smith went to Washington, D.C. in 2019.",
]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


def diagnose(*flags: str) -> int:
    return cli.main(["diagnose", *flags])


# ---------------------------------------------------------------------------------------------
# top-k
# ---------------------------------------------------------------------------------------------


def test_top_k_writes_png_and_tensorboard_image(tiny_model_dir, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "diag"
    assert diagnose("top-k", "--model", tiny_model_dir, "--out", str(out), "--k", "6") == 0
    assert (out / "top_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = EventAccumulator(str(out), size_guidance={"images": 0})
    events.Reload()
    assert diagnostics.TOP_K_TAG in events.Tags()["images"]
    printed = capsys.readouterr().out
    assert "top-6 next tokens after 'This is'" in printed and str(out / "top_k.png") in printed


def test_top_k_probabilities_match_a_direct_softmax(tiny):
    model, tokenizer = tiny
    rows = diagnostics.top_k_next_tokens(model, tokenizer, "The cat", k=8)
    ids = tokenizer("<|endoftext|>The cat", add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        probs = model(ids).logits[0, -1].double().softmax(-1)
    expected = probs.sort(descending=True).values[:8]
    assert [row.rank for row in rows] == list(range(1, 9))
    listed = torch.tensor([row.probability for row in rows], dtype=torch.float64)
    torch.testing.assert_close(listed, expected, atol=1e-7, rtol=1e-5)
    assert [probs[row.token_id].item() for row in rows] == pytest.approx([row.probability for row in rows], rel=1e-5)
    running = 0.0
    for row in rows:
        running += row.probability
        assert row.cumulative == pytest.approx(running, rel=1e-12)


def test_top_k_over_the_whole_vocabulary_sums_to_one(tiny):
    model, tokenizer = tiny
    rows = diagnostics.top_k_next_tokens(model, tokenizer, "This is", k=10_000)  # capped at the vocabulary
    assert len(rows) == model.config.vocab_size
    assert rows[-1].cumulative == pytest.approx(1.0, abs=1e-6)


def test_token_label_shows_whitespace_and_partial_characters(tiny):
    _, tokenizer = tiny
    space_is = tokenizer(" is", add_special_tokens=False).input_ids
    assert len(space_is) == 1 and diagnostics.token_label(tokenizer, space_is[0]) == "' is'"
    partial = tokenizer("é", add_special_tokens=False).input_ids  # two byte tokens, each half a character
    if len(partial) == 2:
        assert diagnostics.token_label(tokenizer, partial[0]).endswith("(raw)")


# ---------------------------------------------------------------------------------------------
# kl-estimators
# ---------------------------------------------------------------------------------------------


def independent_true_kl(model, contexts, temperature: float) -> tuple[float, int]:
    """Mean exact KL(pi || pi_ref) over every position but the last, one context at a time (no padding),
    written from probabilities in float64."""
    kls = []
    with torch.no_grad():
        for ids in contexts:
            logits = model(ids[None]).logits[0, :-1].double()
            p, q = (logits / temperature).softmax(-1), logits.softmax(-1)
            kls.append((p * (p.log() - q.log())).sum(-1))
    kls = torch.cat(kls)
    return kls.mean().item(), kls.numel()


def test_text_file_table_has_the_independently_computed_true_kl(tiny_model_dir, tiny, text_file, tmp_path):
    model, tokenizer = tiny
    out = tmp_path / "kl"
    flags = ["--model", tiny_model_dir, "--text-file", str(text_file), "--out", str(out)]
    assert diagnose("kl-estimators", *flags, "--temperature", "0.5", "--batch-size", "2", "--seq-len", "12") == 0
    table = json.loads((out / "kl_estimators.json").read_text())

    contexts = read_text_contexts(tokenizer, text_file, n_seqs=32, seq_len=12)
    assert len(contexts) == 3 and {len(ids) for ids in contexts} != {12}  # padding was exercised
    true_kl, n_tokens = independent_true_kl(model, contexts, 0.5)
    assert table["n_contexts"] == 3 and table["n_tokens"] == n_tokens == sum(len(ids) - 1 for ids in contexts)
    assert table["true_kl"] == pytest.approx(true_kl, rel=1e-4)
    assert table["contexts"] == str(text_file)
    assert [row["name"] for row in table["estimators"]] == ["k1", "k2", "k3"]


def test_sampled_contexts_are_reproducible_and_k2_k3_nonnegative(tiny_model_dir, tmp_path):
    tables = []
    for run, seed in enumerate(["3", "3", "4"]):
        out = tmp_path / f"run{run}"
        flags = ["--model", tiny_model_dir, "--out", str(out), "--seed", seed, "--temperature", "0.7"]
        assert diagnose("kl-estimators", *flags, "--n-seqs", "5", "--seq-len", "10", "--batch-size", "2") == 0
        tables.append((out / "kl_estimators.json").read_text())
    assert tables[0] == tables[1]
    assert tables[0] != tables[2]
    table = json.loads(tables[0])
    assert table["n_tokens"] == 5 * 9 and table["contexts"] == "sampled from the model"
    means = {row["name"]: row["mean"] for row in table["estimators"]}
    assert means["k2"] >= 0 and means["k3"] >= 0 and table["true_kl"] > 0


def test_true_kl_does_not_depend_on_batching(tiny, text_file):
    # The exact KL does not depend on how contexts are batched (padding is invisible to it).
    model, tokenizer = tiny
    contexts = read_text_contexts(tokenizer, text_file, n_seqs=32, seq_len=16)
    one = compare_kl_estimators(model, contexts, temperature=0.6, batch_size=1)
    three = compare_kl_estimators(model, contexts, temperature=0.6, batch_size=3)
    assert one.n_tokens == three.n_tokens
    assert one.true_kl == pytest.approx(three.true_kl, rel=1e-5)


def test_summarise_by_hand():
    # log r = [0, log 2]; true KL per position [0.1, 0.3] -> true 0.2
    # k1 = [0, log 2]; k2 = [0, (log 2)^2 / 2]; k3 = e^-d - 1 + d = [0, log 2 - 1/2]
    result = summarise(torch.tensor([0.1, 0.3]), torch.tensor([0.0, math.log(2)]), 0.9, 0, 2)
    assert result.true_kl == pytest.approx(0.2)
    means = {s.name: s.mean for s in result.estimators}
    assert means["k1"] == pytest.approx(math.log(2) / 2)
    assert means["k2"] == pytest.approx(math.log(2) ** 2 / 4)
    assert means["k3"] == pytest.approx((math.log(2) - 0.5) / 2)
    k1 = result.estimators[0]
    assert k1.relative_bias == pytest.approx((math.log(2) / 2 - 0.2) / 0.2, rel=1e-6)
    assert k1.std_over_true == pytest.approx(math.log(2) / math.sqrt(2) / 0.2, rel=1e-6)  # unbiased stdev of [0, log 2]
    assert k1.bias_standard_error == pytest.approx(k1.std_over_true / math.sqrt(2), rel=1e-12)


def test_zero_true_kl_has_no_relative_columns():
    result = summarise(torch.zeros(3), torch.zeros(3), 1.0, 0, 1)
    assert all(s.relative_bias is s.std_over_true is s.bias_standard_error is None for s in result.estimators)


def test_split_texts_lines_or_paragraphs():
    assert split_texts("one\ntwo\n\n") == ["one", "two"]
    assert split_texts("a first\nparagraph\n\n  \nsecond one\n") == ["a first\nparagraph", "second one"]


# ---------------------------------------------------------------------------------------------
# Errors: one line, exit code 2, before any model loads
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_model_loading(monkeypatch):
    refuse_model_loading(monkeypatch, diagnostics)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["kl-estimators", "--text-file", "no/such/file.txt"], "error: --text-file: no file at 'no/such/file.txt'"),
        (["kl-estimators", "--temperature", "0"], "error: --temperature (0.0) must be > 0"),
        (["top-k", "--k", "0"], "error: --k (0) must be at least 1"),
        (["top-k", "--bogus"], "error: unrecognized arguments: --bogus"),
        (["nonsense"], "error: argument {top-k,kl-estimators}: invalid choice: 'nonsense'"),
    ],
)
def test_bad_input_is_one_line_with_exit_code_2(flags, message, capsys, no_model_loading):
    with pytest.raises(SystemExit) as exit_info:
        diagnose(*flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(message)


def test_empty_text_file_is_an_error(tiny_model_dir, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(SystemExit) as exit_info:
        diagnose("kl-estimators", "--model", tiny_model_dir, "--text-file", str(empty), "--out", str(tmp_path))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --text-file:") and "holds no text" in err[-1]
