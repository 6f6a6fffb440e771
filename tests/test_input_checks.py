"""The small functions behind the one-line errors (tests/test_bad_inputs.py drives them through the
command line), and trust_remote_code staying off unless asked for."""

from __future__ import annotations

import socket
import struct
from types import SimpleNamespace

import pytest

from grpo_lightning import model_checks, models
from grpo_lightning.config import GRPOConfigError
from grpo_lightning.input_checks import (
    explain_parser_error,
    is_negative_number,
    join_negative_values,
    prepare_argv,
    run_dir_problem,
)
from grpo_lightning.module import GRPOModule


@pytest.mark.parametrize("token, expected", [("-1e-5", True), ("-0.5", True), ("-3", True), ("-inf", True),
                                             ("--model.lr", False), ("-x", False), ("1e-5", False), ("-", False)])  # fmt: skip
def test_is_negative_number(token, expected):
    assert is_negative_number(token) is expected


def test_join_negative_values():
    argv = ["fit", "--model.lr", "-1e-5", "--model.kl_coef", "0.1", "--model.final_scale=-2", "--model.prompt", "-x"]
    assert join_negative_values(argv) == [
        "fit", "--model.lr=-1e-5", "--model.kl_coef", "0.1", "--model.final_scale=-2", "--model.prompt", "-x",
    ]  # fmt: skip


def test_prepare_argv_leaves_good_arguments_alone(tmp_path):
    config = tmp_path / "ok.yaml"
    config.write_text("model:\n  total_phases: 7\ntrainer:\n  precision: 32-true\n")
    argv = ["fit", "--config", str(config), "--model.max_grad_norm", "0.5"]
    assert prepare_argv(argv) == argv


def test_prepare_argv_finds_linked_settings_in_a_fit_block(tmp_path):
    config = tmp_path / "top.yaml"
    config.write_text("fit:\n  trainer:\n    max_epochs: 3\n")
    with pytest.raises(GRPOConfigError, match=r"^trainer.max_epochs \(in .*top.yaml\) is set by model.total_phases"):
        prepare_argv([f"--config={config}", "fit"])


def test_a_message_that_needs_no_rewording_is_kept():
    assert explain_parser_error("Parser key \"model\": something new") == "Parser key \"model\": something new"


def test_run_dir_problem(tmp_path):
    assert run_dir_problem(tmp_path / "new" / "deeper") is None  # creatable: fine, and nothing is created
    assert not (tmp_path / "new").exists()
    assert run_dir_problem(tmp_path) is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert run_dir_problem(blocker) == f"'{blocker}' is a file, so no directory can be made there"
    assert run_dir_problem(blocker / "a" / "b") == f"'{blocker}' is a file, so no directory can be made there"


# ---- model checks --------------------------------------------------------------------------


def test_context_limit_by_family():
    assert model_checks.context_limit(SimpleNamespace(max_position_embeddings=8192)) == (8192, "max_position_embeddings")
    assert model_checks.context_limit(SimpleNamespace(n_positions=1024)) == (1024, "n_positions")  # GPT-2
    assert model_checks.context_limit(SimpleNamespace()) is None  # unknown: nothing refused


def test_check_context_boundaries():
    model_checks.check_context(3, 125, 128, "max_position_embeddings")  # exactly full
    with pytest.raises(GRPOConfigError, match=r"= 129 tokens exceeds .* at most 125 "):
        model_checks.check_context(3, 126, 128, "max_position_embeddings")
    with pytest.raises(GRPOConfigError, match=r"^prompt is 128 tokens .*already beyond"):
        model_checks.check_context(128, 1, 128, "max_position_embeddings")


def write_safetensors(path, data_bytes: int, keep: int | None = None):
    header = b'{"w":{"dtype":"F32","shape":[%d],"data_offsets":[0,%d]}}' % (data_bytes // 4, data_bytes)
    blob = struct.pack("<Q", len(header)) + header + b"\0" * data_bytes
    path.write_bytes(blob if keep is None else blob[:keep])
    return len(blob)


def test_truncated_safetensors(tmp_path):
    whole = tmp_path / "whole.safetensors"
    size = write_safetensors(whole, 64)
    assert model_checks.truncated_safetensors(whole) is None
    cut = tmp_path / "cut.safetensors"
    write_safetensors(cut, 64, keep=size - 1)
    expected = f"cut.safetensors is {size - 1} of the {size} bytes its header lists (truncated)"
    assert model_checks.truncated_safetensors(cut) == expected
    stub = tmp_path / "stub.safetensors"
    write_safetensors(stub, 64, keep=5)
    assert model_checks.truncated_safetensors(stub) == "stub.safetensors is 5 bytes, too short for a safetensors header"
    assert model_checks.damaged_weights(tmp_path).startswith("cut.safetensors")  # the first, sorted by name


def test_hub_reachable_without_network(monkeypatch):
    import huggingface_hub.constants

    def no_network(*args, **kwargs):
        raise OSError("Network is unreachable")

    model_checks._connects.cache_clear()
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name in model_checks._PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert model_checks.hub_reachable() is False
    model_checks._connects.cache_clear()
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")  # a direct probe says nothing behind a proxy
    assert model_checks.hub_reachable() is True
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # offline by choice: never probed
    assert model_checks.hub_reachable() is False


def test_a_cached_hub_id_loads_from_the_cache_when_the_hub_is_unreachable(monkeypatch):
    monkeypatch.setattr(models, "in_hub_cache", lambda repo: True)
    monkeypatch.setattr(models, "hub_reachable", lambda: False)
    assert models.resolve_model_path("some-org/cached-model") == "some-org/cached-model"
    assert models._hub_options("some-org/cached-model") == {"local_files_only": True}  # no minute of retries
    monkeypatch.setattr(models, "hub_reachable", lambda: True)
    assert models._hub_options("some-org/cached-model") == {}


# ---- trust_remote_code -----------------------------------------------------------------------


@pytest.mark.parametrize("trust", [None, True])
def test_trust_remote_code_is_off_unless_turned_on(trust, tiny_model_dir, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    seen = []
    for auto in (AutoConfig, AutoTokenizer, AutoModelForCausalLM):
        original = auto.from_pretrained

        def recording(*args, _original=original, _name=auto.__name__, **kwargs):
            seen.append((_name, kwargs.get("trust_remote_code", "absent")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", recording)
    options = {} if trust is None else {"trust_remote_code": trust}
    module = GRPOModule(model_name_or_path=tiny_model_dir, batch_size=2, num_minibatches=1, **options)
    assert module.hparams.trust_remote_code is bool(trust)
    module.configure_model()
    expected = bool(trust)
    assert sorted(set(seen)) == [("AutoConfig", expected), ("AutoModelForCausalLM", expected), ("AutoTokenizer", expected)]
