"""Every bad input ends in one line: what is wrong and how to fix it, exit code 2 for a usage error and
1 for a runtime failure, no traceback, nothing already saved damaged. One test (or test case) per row
of the README's table "Bad input: one line each"; the ids below are the rows' names there.

Each case drives the command line (``grpo_lightning.cli.main``) with real inputs built in tmp_path;
inputs that must be refused before any model loads run with the loaders switched off."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil

import pytest
import torch
from conftest import build_tiny_llama

from grpo_lightning import cli, models, module, policy_models
from rewards import Reward

# Settings that make a fit of the tiny model take a second: one phase of two 2-token completions.
TINY_RUN = [
    "--model.total_phases", "1", "--model.warmup_steps", "0", "--model.batch_size", "2",
    "--model.num_minibatches", "1", "--model.gen_len", "2", "--model.kl_coef", "0",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
]  # fmt: skip


# Every test here runs the command line (conftest.plain_argv).
pytestmark = pytest.mark.usefixtures("plain_argv")


@pytest.fixture
def no_weights(monkeypatch):
    """The tokenizer and config may load (checks read them), the weights may not."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded although the inputs are invalid")

    monkeypatch.setattr(policy_models, "load_causal_lm", refuse)


def error_line(argv: list[str], capsys, code: int) -> str:
    """Runs the command line, which must exit with ``code`` after printing exactly one line on stderr,
    ``error: ...``, and no traceback; returns the message after ``error: ``."""
    capsys.readouterr()  # what building the inputs printed (save_pretrained's progress bar)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert exit_info.value.code == code, lines[0]
    return lines[0][len("error: ") :]


# ---- settings: ranges and combinations, refused before any model loads (exit 2) ---------------

SETTINGS = [
    ("batch_size=1", ["--model.batch_size", "1", "--model.num_minibatches", "1"],
     "batch_size (1) must be at least 2: each completion is scored against the others of its group, so a group "
     "of one has advantage 0 and learns nothing"),
    ("batch_size=0", ["--model.batch_size", "0"],
     "batch_size (0) must be at least 2: each completion is scored against the others of its group, so a group "
     "of one has advantage 0 and learns nothing"),
    ("num_minibatches=0", ["--model.num_minibatches", "0"], "num_minibatches (0) must be at least 1"),
    ("batches_per_learning_phase=0", ["--model.batches_per_learning_phase", "0"],
     "batches_per_learning_phase (0) must be at least 1"),
    ("warmup_steps=-1", ["--model.warmup_steps", "-1"], "warmup_steps (-1) must be >= 0"),
    ("lr=-1e-5", ["--model.lr", "-1e-5"], "lr (-1e-05) must be > 0"),
    ("lr=0", ["--model.lr", "0"], "lr (0.0) must be > 0"),
    ("max_grad_norm=0", ["--model.max_grad_norm", "0"], "max_grad_norm (0.0) must be > 0"),
    ("final_scale=-0.5", ["--model.final_scale", "-0.5"], "final_scale (-0.5) must be >= 0"),
    ("temperature=-1e-3", ["--model.temperature", "-1e-3"], "temperature (-0.001) must be > 0"),
    ("kl_estimator=k4", ["--model.kl_estimator", "k4"], "kl_estimator ('k4') must be one of 'k2', 'k3', 'k1_reward'"),
    ("samples_shown=-1", ["--model.samples_shown", "-1"], "samples_shown (-1) must be >= 0"),
    ("lora.r=0", ["--model.lora.r", "0"], "lora.r (0) must be at least 1 (the rank of each adapter)"),
    ("lora.alpha=0", ["--model.lora.alpha", "0"], "lora.alpha (0) must be > 0 (adapters are scaled by alpha / r)"),
    ("lora.dropout=1", ["--model.lora.dropout", "1.0"], "lora.dropout (1.0) must lie in [0, 1)"),
    ("reward char=ab", ["--model.reward", "rewards.CharCount", "--model.reward.char", "ab"],
     "CharCount: char must be a single character, got 'ab'"),
    ("batch_size=abc", ["--model.batch_size", "abc"], "model.batch_size: expected int, got abc"),
    ("lora=maybe", ["--model.lora", "maybe"], "model.lora: got 'maybe', expected one of: bool, LoraSettings"),
    ("misspelt option", ["--model.batch_szie", "3"],
     "unrecognized arguments: --model.batch_szie 3 (did you mean model.batch_size?)"),
    ("trainer.max_epochs", ["--trainer.max_epochs", "7"],
     "trainer.max_epochs is set by model.total_phases (one epoch is one GRPO phase): pass --model.total_phases 7 instead"),
    ("trainer.gradient_clip_val", ["--trainer.gradient_clip_val=0.5"],
     "trainer.gradient_clip_val is set by model.max_grad_norm (the module clips gradients to max_grad_norm): "
     "pass --model.max_grad_norm 0.5 instead"),
]  # fmt: skip


@pytest.mark.parametrize("flags, message", [pytest.param(f, m, id=i) for i, f, m in SETTINGS])
def test_bad_setting(flags, message, capsys, no_model_loading, tmp_path):
    assert error_line([*flags, "--trainer.default_root_dir", str(tmp_path)], capsys, 2) == message
    assert list(tmp_path.iterdir()) == []  # no run directory made


def test_a_negative_number_in_scientific_notation_is_a_value(no_model_loading, tmp_path):
    # argparse alone reads "-1e-5" as an option ("expected one argument"); a valid one now gets through.
    argv = cli.prepare_argv(["--model.final_scale", "-0e0", "--trainer.default_root_dir", str(tmp_path)])
    app = cli.make_cli(argv, run=False)
    assert app.model.args.final_scale == 0.0


# ---- YAML ----------------------------------------------------------------------------------

YAML = [
    ("syntax", "model:\n  batch_size: [\n", 2, "config {path}: YAML syntax error at line 3, column 1: expected the node "
     "content, but found '<stream end>'; fix the file"),
    ("unknown key", "model:\n  batch_sise: 4\n", 2,
     "Subcommand 'fit' does not accept option 'model.batch_sise' (did you mean model.batch_size?)"),
    ("class_path not importable", "model:\n  reward:\n    class_path: rewards.Nope\n", 2,
     "model.reward: cannot import 'rewards.Nope' (module 'rewards' has no attribute 'Nope'); class_path must name a "
     "Reward subclass, e.g. rewards.CharCount"),
    ("class_path module missing", "model:\n  reward:\n    class_path: my_rewardz.Exclamations\n", 2,
     "model.reward: cannot import 'my_rewardz.Exclamations' (No module named 'my_rewardz'); class_path must name a "
     "Reward subclass, e.g. rewards.CharCount"),
    ("class_path not a Reward", "model:\n  reward:\n    class_path: torch.nn.Linear\n", 2,
     "model.reward: 'torch.nn.Linear' is not a Reward subclass; class_path must name one (or a reward function), "
     "e.g. rewards.CharCount"),
    ("class_path abstract", "model:\n  reward:\n    class_path: rewards.Reward\n", 2,
     "model.reward: 'rewards.Reward' is abstract; name a subclass that implements it, e.g. rewards.CharCount"),
    ("init_args wrong type", "model:\n  reward:\n    class_path: rewards.CharCount\n    init_args:\n      char: 3\n", 2,
     "model.reward: rewards.CharCount init_args.char: expected str, got 3"),
    ("init_args unknown", "model:\n  reward:\n    class_path: rewards.CharCount\n    init_args:\n      chr: x\n", 2,
     "model.reward: rewards.CharCount has no init_arg 'chr' (it takes: char)"),
    ("nested class_path", "model:\n  reward:\n    class_path: rewards.WeightedSum\n    init_args:\n      rewards:\n"
     "        - class_path: rewards.Nope\n      weights: [1.0]\n", 2,
     "model.reward (rewards.WeightedSum init_args.rewards): cannot import 'rewards.Nope' (module 'rewards' has no "
     "attribute 'Nope'); class_path must name a Reward subclass, e.g. rewards.CharCount"),
    ("trainer max_epochs", "trainer:\n  max_epochs: 7\n", 2,
     "trainer.max_epochs (in {path}) is set by model.total_phases (one epoch is one GRPO phase): write total_phases: 7 "
     "under model: instead"),
    ("trainer gradient_clip_val", "trainer:\n  gradient_clip_val: 0.5\n", 2,
     "trainer.gradient_clip_val (in {path}) is set by model.max_grad_norm (the module clips gradients to "
     "max_grad_norm): write max_grad_norm: 0.5 under model: instead"),
    ("reward __init__ raises", "model:\n  reward:\n    class_path: test_bad_inputs.BadReward\n    init_args:\n"
     "      kind: init\n", 1, "could not build test_bad_inputs.BadReward: its __init__ raised RuntimeError: broken setup"),
]  # fmt: skip


@pytest.mark.parametrize("text, code, message", [pytest.param(t, c, m, id=i) for i, t, c, m in YAML])
def test_bad_yaml(text, code, message, capsys, no_model_loading, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    line = error_line(["--config", str(config), "--trainer.default_root_dir", str(tmp_path / "runs")], capsys, code)
    assert line == message.format(path=config)
    assert len(line) < 200 + len(str(config))  # short: the real cause, not every member of a union
    assert not (tmp_path / "runs").exists()


def test_missing_config_file(capsys, no_model_loading, tmp_path):
    line = error_line(["--config", str(tmp_path / "nope.yaml")], capsys, 2)
    assert line == f"--config: no file at '{tmp_path / 'nope.yaml'}'; check the path"


# ---- model paths -----------------------------------------------------------------------------


def copy_model(tiny_model_dir, tmp_path, name="model"):
    target = tmp_path / name
    shutil.copytree(tiny_model_dir, target)
    return target


def test_model_path_missing(capsys, no_model_loading, tmp_path):
    argv = ["--model.model_name_or_path", "./no/such/model", "--trainer.default_root_dir", str(tmp_path)]
    line = error_line(argv, capsys, 2)
    assert line == (
        "model_name_or_path: no model directory at './no/such/model'; pass an existing directory holding config.json "
        "and weights, a Hugging Face hub id, or leave it unset for the embedded SmolLM2-135M-Instruct"
    )


def test_model_path_is_a_file(capsys, no_model_loading, tiny_model_dir, tmp_path):
    config = os.path.join(tiny_model_dir, "config.json")
    line = error_line(["--model.model_name_or_path", config, "--trainer.default_root_dir", str(tmp_path)], capsys, 2)
    assert line == (
        f"model_name_or_path: '{config}' is a file, not a directory; pass the directory that holds config.json, the "
        f"weights and the tokenizer files (here perhaps '{tiny_model_dir}')"
    )


def test_model_path_holds_no_model(capsys, no_model_loading, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = error_line(["--model.model_name_or_path", str(empty), "--trainer.default_root_dir", str(tmp_path)], capsys, 2)
    assert line == (
        f"model_name_or_path: '{empty}' holds no model (no config.json, no tokenizer files); pass the directory that "
        "save_pretrained wrote"
    )


def test_truncated_weights(capsys, no_weights, tiny_model_dir, tmp_path):
    model_dir = copy_model(tiny_model_dir, tmp_path)
    weights = model_dir / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as file:
        file.truncate(size // 2)
    line = error_line(["--model.model_name_or_path", str(model_dir), "--trainer.default_root_dir", str(tmp_path / "runs"),
                       *TINY_RUN], capsys, 1)  # fmt: skip
    assert line.startswith(
        f"could not load model '{model_dir}' (local directory): model.safetensors is {size // 2} of the {size} bytes its "
        "header lists (truncated). Its files look damaged or incomplete"
    ), line
    assert not (tmp_path / "runs").exists()


def test_hub_id_offline_fails_at_once(capsys, no_weights, monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    probes = []
    monkeypatch.setattr(models, "hub_reachable", lambda: probes.append(1) or False)  # as on a machine without network

    def no_download(*args, **kwargs):
        raise AssertionError("the hub was tried although it cannot be reached")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", no_download)
    line = error_line(["--model.model_name_or_path", "nobody-here/not-a-model", "--trainer.default_root_dir",
                       str(tmp_path)], capsys, 2)  # fmt: skip
    assert line == (
        "could not load model 'nobody-here/not-a-model' (hub id): not in the local Hugging Face cache, and the hub "
        "cannot be reached. Offline, a hub id cannot be fetched: download the model elsewhere and pass its local "
        "directory as model_name_or_path, or leave model_name_or_path unset to use the embedded SmolLM2-135M-Instruct"
    )
    assert probes == [1]


def test_tokenizer_that_does_not_fit_the_model(capsys, no_weights, tiny_model_dir, tmp_path):
    model_dir = copy_model(tiny_model_dir, tmp_path)
    build_tiny_llama(vocab_size=100).save_pretrained(model_dir)  # the tokenizer has 300 tokens
    line = error_line(["--model.model_name_or_path", str(model_dir), "--trainer.default_root_dir", str(tmp_path / "runs"),
                       *TINY_RUN], capsys, 2)  # fmt: skip
    assert line == (
        f"model_name_or_path '{model_dir}': its tokenizer has 300 tokens but the model only 100 embeddings (config "
        "vocab_size): the tokenizer belongs to another model; put the model's own tokenizer files beside its weights"
    )


def test_model_code_is_not_run_unless_trusted(capsys, no_weights, tiny_model_dir, tmp_path):
    """A model directory that ships Python code (auto_map) for an architecture transformers lacks."""
    model_dir = copy_model(tiny_model_dir, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    auto_map = {"AutoConfig": "custom.Config", "AutoModelForCausalLM": "custom.Model"}
    config.update(model_type="custom_llama", auto_map=auto_map)
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "custom.py").write_text("import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('x')\n")
    line = error_line(["--model.model_name_or_path", str(model_dir), "--trainer.default_root_dir", str(tmp_path / "runs"),
                       *TINY_RUN], capsys, 2)  # fmt: skip
    assert line == (
        f"model '{model_dir}' needs its own Python code (auto_map in its config), which is not run unless you set "
        "model.trust_remote_code to true; do that only for a model whose code you trust"
    )
    assert not (model_dir / "RAN").exists()


def test_unknown_attention_kernel(capsys, tiny_model_dir, tmp_path):
    line = error_line(["--model.model_name_or_path", tiny_model_dir, "--model.attn_implementation", "fast",
                       "--trainer.default_root_dir", str(tmp_path), *TINY_RUN], capsys, 2)  # fmt: skip
    assert line == (
        "attn_implementation ('fast') is not one this model supports; pass eager or sdpa, or leave it unset (null) to "
        "let the module choose"
    )


def test_lora_target_modules_naming_no_layer(capsys, tiny_model_dir, tmp_path):
    # Found once the weights are loaded (their progress bar comes first): the error is the last line.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--model.model_name_or_path", tiny_model_dir, "--model.lora.target_modules", "[nope]",
                  "--trainer.default_root_dir", str(tmp_path), *TINY_RUN])  # fmt: skip
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [err.splitlines()[-1]]
    line = err.splitlines()[-1][len("error: ") :]
    assert line.startswith("lora: Target modules {'nope'} not found in the base model.")
    assert line.endswith("set lora.target_modules to layer names of this model, or null for the default")


# ---- context length: refused before any weights load (exit 2) --------------------------------


@pytest.fixture
def short_context_model(tiny_model_dir, tmp_path):
    """The tiny Llama (128 positions) with a tokenizer that knows its limit, as SmolLM2's (8192) does:
    a longer text makes the tokenizer warn, which must not add a line."""
    model_dir = copy_model(tiny_model_dir, tmp_path)
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 128}))
    return str(model_dir)


CONTEXT = [
    ("gen_len=10000", ["--model.gen_len", "10000"],
     "prompt (3 tokens, start token included) + gen_len (10000) = 10003 tokens exceeds the model's context of 128 "
     "tokens (max_position_embeddings): lower model.gen_len to at most 125 or shorten model.prompt"),
    ("one token over", ["--model.gen_len", "126"],
     "prompt (3 tokens, start token included) + gen_len (126) = 129 tokens exceeds the model's context of 128 "
     "tokens (max_position_embeddings): lower model.gen_len to at most 125 or shorten model.prompt"),
    ("9000-word prompt", ["--model.prompt", " ".join(["word"] * 9000)],
     "prompt is 36001 tokens (start token included), already beyond the model's context of 128 tokens "
     "(max_position_embeddings): shorten model.prompt to leave room for gen_len (30)"),
]  # fmt: skip


@pytest.mark.parametrize("flags, message", [pytest.param(f, m, id=i) for i, f, m in CONTEXT])
def test_beyond_the_context(flags, message, capsys, no_weights, short_context_model, tmp_path):
    argv = ["--model.model_name_or_path", short_context_model, *flags, "--trainer.default_root_dir", str(tmp_path / "runs")]
    assert error_line(argv, capsys, 2) == message
    assert not (tmp_path / "runs").exists()


def test_exactly_the_context_is_accepted(short_context_model):
    fits = module.GRPOModule(model_name_or_path=short_context_model, gen_len=125, batch_size=2, num_minibatches=1)
    fits.check_inputs()  # 3 + 125 = 128 tokens: no error
    assert fits.tokenizer is not None and fits.policy is None  # the checks load no weights


# ---- rewards that fail during the run (exit 1), nothing saved damaged -------------------------


class BadReward(Reward):
    """A reward that goes wrong in the way ``kind`` names."""

    def __init__(self, kind: str = "raise"):
        """
        Args:
            kind: raise, init, short, column, text, nan or inf.
        """
        if kind == "init":
            raise RuntimeError("broken setup")
        self.kind = kind

    def score(self, samples: list[str]):
        n = len(samples)
        if self.kind == "raise":
            raise KeyError("no such entry")
        return {
            "short": torch.zeros(n - 1),
            "column": torch.zeros(n, 1),
            "text": "high",
            "nan": torch.tensor([0.0] * (n - 1) + [float("nan")]),
            "inf": torch.tensor([float("inf")] + [0.0] * (n - 1)),
        }[self.kind]


REWARD_FAILURES = [
    ("raise", "reward BadReward raised KeyError: 'no such entry'"),
    ("short", "reward BadReward returned shape (1,) for 2 samples; it must return one value per sample, shape (2,)"),
    ("column", "reward BadReward returned shape (2, 1) for 2 samples; it must return one value per sample, shape (2,)"),
    ("text", "reward BadReward returned str; it must return a float tensor of shape (2,)"),
    ("nan", "reward BadReward returned NaN or inf for samples [1] (1 of 2)"),
    ("inf", "reward BadReward returned NaN or inf for samples [0] (1 of 2)"),
]


@pytest.mark.parametrize("kind, message", [pytest.param(k, m, id=k) for k, m in REWARD_FAILURES])
def test_reward_failing_during_the_run(kind, message, capsys, tiny_model_dir, tmp_path):
    earlier = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"  # an earlier run's checkpoint
    earlier.parent.mkdir(parents=True)
    earlier.write_bytes(b"an earlier run's checkpoint")
    argv = ["--model.model_name_or_path", tiny_model_dir, "--model.reward", "test_bad_inputs.BadReward",
            "--model.reward.kind", kind, "--trainer.default_root_dir", str(tmp_path), *TINY_RUN]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", *argv])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 1
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [f"error: {message}"]
    assert err.splitlines()[-1] == f"error: {message}"
    assert earlier.read_bytes() == b"an earlier run's checkpoint"
    assert not list(tmp_path.glob("lightning_logs/version_1/checkpoints/*"))  # the failed phase saved nothing


# ---- the run directory -----------------------------------------------------------------------


def test_run_dir_under_a_regular_file(capsys, no_model_loading, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    line = error_line(["--trainer.default_root_dir", str(blocker / "runs")], capsys, 2)
    assert line == (
        f"trainer.default_root_dir: cannot write the run directory '{blocker / 'runs'}': '{blocker}' is a file, so no "
        "directory can be made there; pass --trainer.default_root_dir a directory you can write to"
    )
    assert blocker.read_text() == "not a directory"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes through permissions")
def test_run_dir_not_writable(capsys, no_model_loading, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        line = error_line(["--trainer.default_root_dir", str(locked / "runs")], capsys, 2)
    finally:
        locked.chmod(0o755)
    assert line == (
        f"trainer.default_root_dir: cannot write the run directory '{locked / 'runs'}': '{locked}' is not writable; "
        "pass --trainer.default_root_dir a directory you can write to"
    )


def test_a_path_refused_during_the_run_is_one_line(capsys, monkeypatch):
    """A directory that turns unwritable mid-run (after the checks): the file system's error, one line."""

    def fit_that_cannot_write(args=None, run=True):
        raise PermissionError(13, "Permission denied", "/runs/lightning_logs/version_3")

    monkeypatch.setattr(cli, "make_cli", fit_that_cannot_write)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == (
        "error: cannot use '/runs/lightning_logs/version_3': Permission denied; check the path and its permissions\n"
    )


# ---- the README's table ------------------------------------------------------------------------


def test_every_row_of_the_readme_table_names_a_test_that_exists():
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    section = readme.split("## Bad input: one line each", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| area")]
    assert len(rows) >= 40
    ids = {name: {row[0] for row in rows_} for name, rows_ in [
        ("test_bad_setting", SETTINGS), ("test_bad_yaml", YAML), ("test_beyond_the_context", CONTEXT),
        ("test_reward_failing_during_the_run", REWARD_FAILURES),
    ]}  # fmt: skip
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert len(cells) == 5 and cells[3] in ("1", "2"), row
        named = re.findall(r"`(?:tests/(test_\w+)\.py::)?(test_\w+)(?:\[([^\]]+)\])?`", cells[4])
        assert named, f"no test named (README row: {row})"
        for file, name, case in named:
            if file:  # a test in another file: tests/test_x.py::test_name
                assert callable(getattr(importlib.import_module(file), name, None)), f"{file}::{name} (README row: {row})"
                continue
            if name == "test_cli":
                continue  # tests/test_cli.py's own table of settings
            assert callable(globals().get(name)), f"{name} (README row: {row})"
            assert not case or case in ids[name], f"{name}[{case}] (README row: {row})"
