"""A run with answers that end (stop_at_eos) and each loss variant: padding never counts anywhere."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from test_module import make_module

from grpo_lightning import policy_models

STOPS = list(range(20, 120))  # a third of the tiny vocabulary ends an answer: most end within a few tokens


class RolloutWatcher(L.Callback):
    def __init__(self):
        self.masks, self.memories, self.metrics = [], [], []

    def on_train_epoch_end(self, trainer, pl_module):
        self.memories.append(pl_module.memory)
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rollout/")})


@pytest.fixture
def ending_answers(monkeypatch):
    monkeypatch.setattr(policy_models, "stop_token_ids", lambda tokenizer: STOPS)


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_a_run_with_ending_answers_trains_on_generated_tokens_only(variant, ending_answers, tiny_model_dir, tmp_path):
    watcher = RolloutWatcher()
    grpo = make_module(tiny_model_dir, stop_at_eos=True, loss_variant=variant, gen_len=8,
                       clip_coef_high=0.28 if variant == "dapo" else None)  # fmt: skip
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[watcher])  # fmt: skip
    trainer.fit(grpo)
    for memory, metrics in zip(watcher.memories, watcher.metrics):
        mask = memory.completion_mask
        lengths = mask.sum(dim=1)
        assert mask.shape == (grpo.args.batch_size, 8) and bool((lengths >= 1).all())
        # every row: generated tokens first, then padding; the stored log pi_old and log pi_ref are 0 there
        assert torch.equal(mask, torch.arange(8)[None, :] < lengths[:, None])
        assert bool((memory.logprobs[~mask] == 0).all() and (memory.ref_logprobs[~mask] == 0).all())
        assert metrics["rollout/completion_tokens"] == pytest.approx(lengths.float().mean().item())
        assert metrics["rollout/ended_fraction"] == pytest.approx((lengths < 8).float().mean().item())
        assert 0 < metrics["rollout/ended_fraction"]
    if variant == "dr_grpo":  # centred rewards, not divided by their std: standardised scores of 4 values
        # never exceed (n - 1) / sqrt(n) = 1.5 in size, centred character counts do
        advantages = watcher.memories[-1].advantages
        assert advantages.sum().abs().item() < 1e-3 and advantages.abs().max().item() > 1.5


def test_the_chapters_default_path_is_kept_without_a_mask(tiny_model_dir):
    grpo = make_module(tiny_model_dir)
    assert grpo.stop_at_eos is False and grpo.variant.name == "grpo" and grpo.clip_coef_high is None


@pytest.mark.parametrize("kwargs, message", [
    ({"loss_variant": "ppo"}, r"loss_variant \('ppo'\) must be one of 'grpo', 'dapo', 'dr_grpo', 'gspo'"),
    ({"clip_coef_high": 0.0}, r"clip_coef_high \(0.0\) must be > 0"),
])  # fmt: skip
def test_bad_variant_settings_are_refused(kwargs, message, tiny_model_dir):
    with pytest.raises(ValueError, match=message):
        make_module(tiny_model_dir, **kwargs)
