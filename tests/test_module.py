"""GRPOModule end to end on a tiny Llama built and saved by the test (real loading path, no download)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lightning import GRPOModule, RewardError
from grpo_lightning.config import GRPOConfigError
from rewards import CharCount
from rewards.base import RewardModule

PHASE = dict(batch_size=4, num_minibatches=2, batches_per_learning_phase=2, gen_len=4)  # 4 steps per phase


def completion_length(samples: list[str]) -> torch.Tensor:
    """A plain-function reward that varies across the tiny model's samples (which rarely hold a period),
    so that advantages, and hence gradients, are non-zero."""
    return torch.tensor([float(len(s)) for s in samples])


def make_module(model_dir: str, **overrides) -> GRPOModule:
    settings = dict(
        model_name_or_path=model_dir, reward=completion_length, total_phases=2, warmup_steps=0, lr=1e-2, kl_coef=0.3,
        **PHASE,
    )  # fmt: skip
    settings.update(overrides)
    return GRPOModule(**settings)


def make_trainer(root, total_phases: int = 2, **kwargs) -> L.Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return L.Trainer(
        max_epochs=total_phases,
        default_root_dir=str(root),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(
                dirpath=str(root / "ckpt"), save_last="link", save_top_k=1, every_n_epochs=1, save_on_train_epoch_end=True
            )],
        **kwargs,
    )


class StepRecorder(L.Callback):
    """Records global_step at each phase end, and the train/eval mode of both models at each step."""

    def __init__(self):
        self.steps_at_phase_end: list[int] = []
        self.modes: list[tuple[bool, bool]] = []
        self.grad_norms: list[float] = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        grads = [p.grad for p in module.policy.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        ref_training = module.ref_model.training if module.ref_model is not None else False
        self.modes.append((module.policy.training, ref_training))

    def on_train_epoch_end(self, trainer, module):
        self.steps_at_phase_end.append(trainer.global_step)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_two_phase_fit_steps_in_every_phase_and_changes_only_the_policy(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir)
    recorder = StepRecorder()
    trainer = make_trainer(tmp_path)
    trainer.callbacks.append(recorder)
    module.configure_model()
    policy_before, ref_before = snapshot(module.policy), snapshot(module.ref_model)

    trainer.fit(module)

    # Epoch 0 took its 4 steps (2 minibatches x 2 passes), and so did epoch 1.
    assert recorder.steps_at_phase_end == [4, 8]
    # Both models stayed in eval mode (no dropout) at every step.
    assert recorder.modes == [(False, False)] * 8
    # Every step had a real gradient (not only AdamW's weight decay moving the weights) ...
    assert len(recorder.grad_norms) == 8 and min(recorder.grad_norms) > 0
    # ... and every policy tensor moved.
    changed = [k for k, v in module.policy.state_dict().items() if not torch.equal(v, policy_before[k])]
    assert len(changed) == len(policy_before)
    assert all(torch.equal(v, ref_before[k]) for k, v in module.ref_model.state_dict().items())


@pytest.mark.parametrize("recompute, atol", [(True, 1e-6), (False, 1e-5)], ids=["recomputed", "from-sampling"])
def test_first_minibatch_ratio_is_one_in_fp32(tiny_model_dir, tmp_path, recompute, atol):
    """The first step's policy is the one that sampled, so the ratio is 1 up to float32 rounding: of a
    different batch layout when log pi_old is recomputed like the reference does (chunks of the group
    in order, not the shuffled minibatch), and of the KV-cached pass when kept from sampling (default)."""
    ratios = []

    class RatioProbe(GRPOModule):
        def training_step(self, minibatch, batch_idx):
            if self.global_step == 0:
                from grpo_lightning.objectives import get_logits, get_logprobs

                with torch.no_grad():
                    logprobs = get_logprobs(get_logits(self.policy, minibatch.sample_ids, 4), minibatch.sample_ids, 4)
                ratios.append((logprobs - minibatch.logprobs).exp())
            return super().training_step(minibatch, batch_idx)

    module = RatioProbe(model_name_or_path=tiny_model_dir, total_phases=1, warmup_steps=0,
                        recompute_old_logprobs=recompute, **PHASE)  # fmt: skip
    make_trainer(tmp_path, total_phases=1).fit(module)
    assert len(ratios) == 1
    torch.testing.assert_close(ratios[0], torch.ones(2, 4), rtol=0, atol=atol)


def test_reference_model_is_out_of_checkpoint_and_optimizer_and_resume_is_strict(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir, reward=CharCount("."))
    trainer = make_trainer(tmp_path)
    trainer.fit(module)

    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.policy.parameters()}
    assert not any(id(p) in optimized for p in module.ref_model.parameters())

    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    keys = checkpoint["state_dict"].keys()
    assert keys and all(k.startswith("policy.") for k in keys)
    assert checkpoint["global_step"] == 8  # saved at the end of the second phase
    assert checkpoint["hyper_parameters"]["reward"] == {"class_path": "rewards.char_count.CharCount", "init_args": {"char": "."}}

    # Strict loading into a fresh module succeeds (only the reference keys are forgiven) ...
    fresh = make_module(tiny_model_dir)
    fresh.configure_model()
    fresh.load_state_dict(checkpoint["state_dict"], strict=True)
    for key, value in module.policy.state_dict().items():
        torch.testing.assert_close(fresh.policy.state_dict()[key], value, rtol=0, atol=0)
    # ... and a real missing policy key still fails.
    broken = dict(checkpoint["state_dict"])
    broken.pop(next(iter(broken)))
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict(broken, strict=True)


def test_resume_from_last_checkpoint_matches_an_uninterrupted_run(tiny_model_dir, tmp_path):
    straight = make_module(tiny_model_dir, total_phases=3)
    make_trainer(tmp_path / "a", total_phases=3).fit(straight)

    first = make_module(tiny_model_dir, total_phases=3)
    make_trainer(tmp_path / "b", total_phases=3, max_steps=8).fit(first)  # stops after 2 of 3 phases
    resumed = make_module(tiny_model_dir, total_phases=3)
    trainer = make_trainer(tmp_path / "b", total_phases=3)
    trainer.fit(resumed, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))

    assert trainer.global_step == 12
    for key, value in straight.policy.state_dict().items():
        torch.testing.assert_close(resumed.policy.state_dict()[key], value, rtol=1e-6, atol=1e-7)


def test_kl_coef_zero_loads_no_reference_model(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir, kl_coef=0.0, total_phases=1)
    make_trainer(tmp_path, total_phases=1).fit(module)
    assert module.ref_model is None


def test_export_is_a_loadable_hugging_face_model_equal_to_the_policy(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir, total_phases=1)
    trainer = make_trainer(tmp_path, total_phases=1)
    trainer.fit(module)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model", dtype=torch.float32)
    for key, value in module.policy.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[key], value, rtol=0, atol=0)


class FailOnSecondPhase(CharCount):
    def __init__(self):
        super().__init__(".")
        self.calls = 0

    def score(self, samples):
        self.calls += 1
        if self.calls == 2:
            return torch.full((len(samples),), float("nan"))
        return super().score(samples)


def test_a_bad_reward_stops_the_run_and_keeps_the_last_checkpoint(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir, reward=FailOnSecondPhase())
    with pytest.raises(RewardError, match=r"reward FailOnSecondPhase returned NaN or inf for samples \[0, 1, 2, 3\]"):
        make_trainer(tmp_path).fit(module)
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 4  # the end of phase 1, untouched by the failure in phase 2


def test_max_epochs_must_equal_total_phases(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir, total_phases=2)
    with pytest.raises(GRPOConfigError, match=r"trainer.max_epochs \(3\) must equal model.total_phases \(2\)"):
        make_trainer(tmp_path, total_phases=3).fit(module)


def test_unknown_model_directory_fails_before_loading(tmp_path):
    with pytest.raises(GRPOConfigError, match="no model directory at"):
        GRPOModule(model_name_or_path=str(tmp_path / "missing-model"))


class LinearLengthReward(RewardModule):
    """A reward with a network: a 1x1 linear layer applied to each sample's length."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(1, 1)
        with torch.no_grad():
            self.head.weight.fill_(2.0)
            self.head.bias.fill_(-1.0)

    def score(self, samples):
        lengths = torch.tensor([[float(len(s))] for s in samples], device=self.device)
        return self.head(lengths).squeeze(-1)


def test_a_network_reward_is_frozen_and_kept_out_of_optimizer_and_checkpoint(tiny_model_dir, tmp_path):
    reward = LinearLengthReward()
    module = make_module(tiny_model_dir, reward=reward)
    trainer = make_trainer(tmp_path)
    trainer.fit(module)

    assert module.reward is reward and dict(module.named_children())["reward"] is reward  # placed with the policy
    assert not any(p.requires_grad for p in reward.parameters()) and not reward.training
    torch.testing.assert_close(reward.head.weight, torch.tensor([[2.0]]), rtol=0, atol=0)  # untouched by training
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert not any(id(p) in optimized for p in reward.parameters())
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert not [k for k in checkpoint["state_dict"] if k.startswith("reward.")]
    # strict loading forgives exactly the frozen reward keys, and the reward still scores 2 * len - 1
    fresh = make_module(tiny_model_dir, reward=LinearLengthReward())
    fresh.configure_model()
    fresh.load_state_dict(checkpoint["state_dict"], strict=True)
    assert reward(["abc", "hello"]).tolist() == [5.0, 9.0]
