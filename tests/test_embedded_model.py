"""The embedded SmolLM2-135M-Instruct, for real: GGUF conversion, and the reference's kl_coef=0
smoke run, shortened, on it. These are the slow tests (a few minutes on 2 CPU cores)."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from grpo_lightning import cli, models
from grpo_lightning.sampling import default_start_token

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def converted_cache(tmp_path_factory):
    """A fresh cache directory holding the converted embedded model (conversion runs here, once)."""
    cache = tmp_path_factory.mktemp("grpo-cache")
    previous = os.environ.get("GRPO_LIGHTNING_CACHE")
    os.environ["GRPO_LIGHTNING_CACHE"] = str(cache)
    models.embedded_model_dir()
    yield cache
    if previous is None:
        del os.environ["GRPO_LIGHTNING_CACHE"]
    else:
        os.environ["GRPO_LIGHTNING_CACHE"] = previous


def read_scalars(run_dir, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def test_converted_checkpoint_matches_the_gguf_model(converted_cache):
    from transformers import AutoModelForCausalLM

    model_dir = converted_cache / models.EMBEDDED_MODEL_NAME
    assert (model_dir / "config.json").is_file()
    tokenizer = models.load_tokenizer(None)
    assert default_start_token(tokenizer) == "<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 0

    converted = models.load_causal_lm(None)
    gguf = models._gguf_path()
    original = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = tokenizer("<|endoftext|>The cat sat on the", return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, original(ids).logits, rtol=0, atol=0)
    assert converted.dtype == torch.float32 and not converted.training


def test_kl0_smoke_run_collapses_onto_periods(converted_cache, tmp_path, monkeypatch, capsys):
    """The reference's smoke test (batch 64, lr 1e-3, kl_coef 0), 4 phases instead of 6: the mean
    number of periods per sample must rise several-fold as the policy collapses onto periods."""
    monkeypatch.setattr(sys, "argv", ["grpo-lightning"])
    started = time.time()
    cli.main([
        "fit", "--config", os.path.join(REPO, "experiments", "smoke_kl0.yaml"), "--model.total_phases", "4",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
    ])  # fmt: skip
    run_dir = tmp_path / "lightning_logs" / "version_0"
    rewards = read_scalars(run_dir, "rollout/reward_mean")
    with capsys.disabled():
        print(f"\nsmoke run mean reward per phase: {[round(r, 3) for r in rewards]} ({time.time() - started:.0f} s)")
    assert len(rewards) == 4
    assert rewards[0] < 3  # the pretrained model writes about one period per sample
    assert rewards[-1] >= 4 * rewards[0]
    assert (run_dir / "hf_model" / "model.safetensors").is_file()
