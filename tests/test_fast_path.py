"""The fast path keeps GRPO's semantics: log pi_old from sampling, the on-policy shortcut, bf16, fused
AdamW, activation checkpointing; and the KL estimator choices do what they say."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lightning import GRPOModule, shared_prompts
from grpo_lightning.config import GRPOConfigError
from grpo_lightning.kl import kl_k3
from grpo_lightning.objectives import (
    calc_clipped_surrogate_objective,
    calc_kl_penalty,
    compute_grpo_advantages,
    get_logits,
    get_logprobs,
)
from rewards import CharCount

from test_module import completion_length, make_module


def fit(module: GRPOModule, root, total_phases: int, precision: str = "32-true", callbacks=()) -> L.Trainer:
    trainer = L.Trainer(
        max_epochs=total_phases, precision=precision, default_root_dir=str(root), accelerator="cpu", devices=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=list(callbacks),
    )  # fmt: skip
    trainer.fit(module)
    return trainer


class FirstStepProbe(L.Callback):
    """Keeps the minibatch, the policy gradient (before clipping) and the logged train/ values of one
    step, the first by default."""

    def __init__(self, step: int = 0):
        self.step = step
        self.minibatch = None
        self.grads: dict[str, torch.Tensor] | None = None
        self.metrics: dict[str, float] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.minibatch = batch

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step == self.step:
            self.grads = {n: p.grad.detach().clone() for n, p in module.policy.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step + 1:
            self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}


ON_POLICY = dict(batch_size=4, num_minibatches=1, batches_per_learning_phase=1, gen_len=4, total_phases=1)


def test_on_policy_shortcut_gives_the_gradient_of_the_full_computation(tiny_model_dir, tmp_path):
    probe = FirstStepProbe()
    module = make_module(tiny_model_dir, **ON_POLICY)
    assert module.on_policy
    fit(module, tmp_path, total_phases=1, callbacks=[probe])

    # The full computation, as the reference does it: log pi_old from a separate no-grad forward of the
    # untouched policy, then the clipped surrogate minus the k2 penalty, differentiated.
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    batch = probe.minibatch
    with torch.no_grad():
        old_logprobs = get_logprobs(get_logits(policy, batch.sample_ids, 4), batch.sample_ids, 4)
    logprobs = get_logprobs(get_logits(policy, batch.sample_ids, 4), batch.sample_ids, 4)
    objective = calc_clipped_surrogate_objective(logprobs, old_logprobs, batch.advantages, 0.2) - calc_kl_penalty(
        logprobs, batch.ref_logprobs, 0.3
    )
    objective.backward()
    expected = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    assert probe.grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(probe.grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert probe.metrics["train/ratio_mean"] == 1.0 and probe.metrics["train/ratio_max"] == 1.0
    # The logged gradient norm is the norm before clipping, from the same single pass that clips.
    norm_before_clipping = torch.linalg.vector_norm(torch.stack([g.norm() for g in probe.grads.values()]))
    assert probe.metrics["train/grad_norm"] == pytest.approx(float(norm_before_clipping), rel=1e-5)
    # Sampling's own log pi_old agrees with the recomputed one to fp32 rounding.
    torch.testing.assert_close(batch.logprobs, old_logprobs, rtol=0, atol=1e-5)


def test_first_minibatch_ratio_is_one_within_bf16_rounding(tiny_model_dir, tmp_path):
    ratios = []

    class RatioProbe(GRPOModule):
        def training_step(self, minibatch, batch_idx):
            if self.global_step == 0:  # inside Lightning's bf16 autocast, as the step itself
                with torch.no_grad():
                    logprobs = get_logprobs(get_logits(self.policy, minibatch.sample_ids, 4), minibatch.sample_ids, 4)
                ratios.append((logprobs - minibatch.logprobs).exp())
            return super().training_step(minibatch, batch_idx)

    module = RatioProbe(model_name_or_path=tiny_model_dir, total_phases=1, warmup_steps=0, batch_size=4,
                        num_minibatches=2, batches_per_learning_phase=2, gen_len=4)  # fmt: skip
    fit(module, tmp_path, total_phases=1, precision="bf16-mixed")
    assert module.memory.logprobs.dtype == torch.float32
    # bf16 keeps 8 significant bits: the KV-cached sampling pass and the full forward round differently,
    # by far less than the clipping range (0.2).
    torch.testing.assert_close(ratios[0], torch.ones(2, 4), rtol=0, atol=2e-2)


def test_bf16_fit_of_the_tiny_model_learns(tiny_model_dir, tmp_path):
    means = []
    module = GRPOModule(
        model_name_or_path=tiny_model_dir, reward=CharCount("."), total_phases=10, warmup_steps=0, lr=3e-2,
        kl_coef=0.0, batch_size=32, num_minibatches=2, batches_per_learning_phase=1, gen_len=8, samples_shown=0,
        export_dir=None,
    )  # fmt: skip
    log_rollout = module.log_rollout
    module.log_rollout = lambda record: (means.append(record.rewards.float().mean().item()), log_rollout(record))
    fit(module, tmp_path, total_phases=10, precision="bf16-mixed")
    # Periods per 8-token completion: none at first (the untrained tiny model rarely emits one),
    # several after 10 phases (2.84 in this seeded run; fp32 reaches 2.75).
    assert means[0] < 0.1
    assert means[-1] > 2.0


def test_activation_checkpointing_recomputes_layers_and_gives_the_same_gradients(tiny_model_dir, tmp_path, monkeypatch):
    # Checkpointed layers run every row whole (shared_prompts); so does the run without checkpointing here, so that
    # the two compute alike. Running the prompts once is tested in test_shared_prompts.py.
    monkeypatch.setattr(shared_prompts, "MIN_SAVED_SHARE", float("inf"))
    grads, layer_calls = {}, {}
    for checkpointing in (False, True):
        probe = FirstStepProbe()
        module = make_module(tiny_model_dir, activation_checkpointing=checkpointing, **ON_POLICY)
        module.configure_model()
        calls = []
        first_layer = module.policy.model.layers[0]
        # A pre-hook: the recomputation stops early, once the tensors backward needs are back, so a hook
        # after the MLP's forward would not see it.
        first_layer.mlp.register_forward_pre_hook(lambda *args: calls.append(torch.is_grad_enabled()))
        fit(module, tmp_path / str(checkpointing), total_phases=1, callbacks=[probe])
        grads[checkpointing], layer_calls[checkpointing] = probe.grads, calls.count(True)
        # Dropout stays off: only the decoder layers carry the training flag that checkpointing needs.
        assert not module.policy.training
        flagged = [m for m in module.policy.modules() if m.training]
        assert flagged == (list(module.policy.model.layers) if checkpointing else [])
    # One learning step: the layer runs once with grad, or twice (forward, then recomputed in backward).
    assert layer_calls == {False: 1, True: 2}
    # And the forward keeps far fewer tensors for backward.
    saved = {flag: saved_numel(tiny_model_dir, flag, probe.minibatch.sample_ids) for flag in (False, True)}
    assert saved[True] < 0.5 * saved[False]
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def saved_numel(model_dir: str, checkpointing: bool, sample_ids: torch.Tensor) -> int:
    """Elements autograd keeps for backward during one training forward of the policy."""
    from grpo_lightning.activation_checkpointing import enable_activation_checkpointing

    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if checkpointing:
        enable_activation_checkpointing(policy)
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        get_logprobs(get_logits(policy, sample_ids, 4), sample_ids, 4).sum()
    return total


def test_k1_in_the_reward_moves_the_kl_into_the_advantages(tiny_model_dir, tmp_path):
    records = []
    probe = FirstStepProbe()
    module = make_module(tiny_model_dir, kl_estimator="k1_reward", kl_coef=0.5, **{**ON_POLICY, "total_phases": 2})
    log_rollout = module.log_rollout
    module.log_rollout = lambda record: (records.append(record), log_rollout(record))
    fit(module, tmp_path, total_phases=2, callbacks=[probe])
    record = records[1]  # phase 2: after one update the policy has left the reference
    k1_sums = (record.logprobs - record.ref_logprobs).sum(-1)
    assert k1_sums.abs().min() > 0
    expected = compute_grpo_advantages(record.rewards - 0.5 * k1_sums)
    torch.testing.assert_close(module.memory.advantages, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(expected, compute_grpo_advantages(record.rewards), atol=1e-3)  # the KL changed them
    assert probe.metrics["train/kl_penalty"] == 0.0  # nothing in the loss


def test_k3_estimator_is_the_loss_penalty(tiny_model_dir, tmp_path):
    probe = FirstStepProbe(step=1)  # phase 2, when the policy has left the reference
    module = make_module(tiny_model_dir, kl_estimator="k3", kl_coef=0.5, **{**ON_POLICY, "total_phases": 2})
    fit(module, tmp_path, total_phases=2, callbacks=[probe])
    batch = probe.minibatch  # on-policy: the step's log pi equals log pi_old (fp32 rounding)
    expected = 0.5 * kl_k3(batch.logprobs, batch.ref_logprobs).mean().item()
    assert expected > 1e-6
    assert probe.metrics["train/kl_penalty"] == pytest.approx(expected, rel=1e-3)
    k2 = 0.5 * calc_kl_penalty(batch.logprobs, batch.ref_logprobs, 1.0).item()
    assert probe.metrics["train/kl_penalty"] != pytest.approx(k2, rel=1e-3)  # not the default k2


def test_unknown_kl_estimator_is_refused():
    with pytest.raises(GRPOConfigError, match="kl_estimator \\('k4'\\) must be one of 'k2', 'k3', 'k1_reward'"):
        GRPOModule(reward=completion_length, kl_estimator="k4")


def test_attention_kernel_is_eager_for_short_sequences_only(tiny_model_dir):
    short = make_module(tiny_model_dir, gen_len=4)
    short.configure_model()
    assert short.attention_kernel() == "eager"
    assert short.policy.config._attn_implementation == short.ref_model.config._attn_implementation == "eager"
    long = make_module(tiny_model_dir, gen_len=100)  # 100 + prompt tokens > 64: transformers' default
    long.tokenizer = short.tokenizer
    assert long.attention_kernel() is None
    chosen = make_module(tiny_model_dir, gen_len=4, attn_implementation="sdpa")
    chosen.tokenizer = short.tokenizer
    assert chosen.attention_kernel() == "sdpa"
