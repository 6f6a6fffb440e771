"""LoRA with one flag: only adapters train, the reference is the adapter-free policy, small checkpoints."""

from __future__ import annotations

import warnings

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from grpo_lightning.lora import LoraSettings, default_target_modules
from grpo_lightning.objectives import get_logprobs_batched
from test_module import make_module, make_trainer


def lora_module(model_dir, **overrides):
    return make_module(model_dir, lora=LoraSettings(r=4, alpha=8), lr=1e-2, **overrides)


def test_only_adapters_train_and_the_base_stays_bit_identical(tiny_model_dir, tmp_path):
    module = lora_module(tiny_model_dir)
    module.configure_model()
    before = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
    trainer = make_trainer(tmp_path)
    trainer.fit(module)

    assert module.ref_model is None  # no second copy of the model
    trainable = {name for name, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.policy.parameters() if p.requires_grad}

    after = module.policy.state_dict()
    lora_keys = [k for k in after if "lora_" in k]
    base_keys = [k for k in after if "lora_" not in k]
    assert all(torch.equal(after[k], before[k]) for k in base_keys)
    # lora_B starts at zero and every adapter moves with lr 1e-2
    assert all(not torch.equal(after[k], before[k]) for k in lora_keys)


def test_reference_logprobs_are_those_of_the_untouched_base_model(tiny_model_dir, tmp_path):
    module = lora_module(tiny_model_dir)
    make_trainer(tmp_path).fit(module)  # adapters are now non-zero
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(0))

    expected = get_logprobs_batched(base, ids, gen_len=4, chunk_size=2)  # the module's gen_len
    torch.testing.assert_close(module.get_ref_logprobs(ids), expected, rtol=0, atol=1e-6)
    with_adapters = get_logprobs_batched(module.policy, ids, gen_len=4, chunk_size=2)
    assert (with_adapters - expected).abs().max() > 1e-3  # the adapters do change the policy


def test_checkpoint_holds_adapters_and_optimizer_state_only_and_resumes(tiny_model_dir, tmp_path):
    first = lora_module(tiny_model_dir, total_phases=3)
    make_trainer(tmp_path, total_phases=3, max_steps=4).fit(first)  # 1 of 3 phases
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    keys = list(checkpoint["state_dict"])
    assert keys and all("lora_" in k for k in keys)
    adapter_count = sum(checkpoint["state_dict"][k].numel() for k in keys)
    assert adapter_count == sum(p.numel() for p in first.policy.parameters() if p.requires_grad)
    saved_moments = checkpoint["optimizer_states"][0]["state"]
    assert len(saved_moments) == len(keys)

    resumed = lora_module(tiny_model_dir, total_phases=3)
    trainer = make_trainer(tmp_path, total_phases=3, max_steps=4)
    trainer.fit(resumed, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))  # restores, then stops at once
    for key in keys:
        name = key[len("policy.") :]
        torch.testing.assert_close(resumed.policy.state_dict()[name], first.policy.state_dict()[name], rtol=0, atol=0)
    restored = trainer.optimizers[0].state_dict()["state"]
    for index, moments in saved_moments.items():
        torch.testing.assert_close(restored[index]["exp_avg"], moments["exp_avg"], rtol=0, atol=0)


def test_exported_adapter_reloads_with_the_same_logprobs(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir, lora=LoraSettings(r=4, alpha=8, merge_on_export=True), lr=1e-2, total_phases=1)
    make_trainer(tmp_path, total_phases=1).fit(module)
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(1))
    trained = get_logprobs_batched(module.policy, ids, gen_len=4, chunk_size=2)

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "hf_model" / "adapter").eval()
    torch.testing.assert_close(get_logprobs_batched(reloaded, ids, 4, 2), trained, rtol=0, atol=1e-6)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model", dtype=torch.float32).eval()
    torch.testing.assert_close(get_logprobs_batched(merged, ids, 4, 2), trained, rtol=0, atol=1e-5)


def test_default_targets_cover_attention_and_mlp_for_llama_and_gpt2(tiny_model_dir):
    llama = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert default_target_modules(llama) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10))
    assert default_target_modules(gpt2) == ["c_attn", "c_proj", "c_fc"]


def test_lora_flag_true_means_default_settings(tiny_model_dir):
    module = make_module(tiny_model_dir, lora=True)
    assert module.lora == LoraSettings()


def test_adapter_initialisation_is_seeded(tiny_model_dir):
    first, second, other = (lora_module(tiny_model_dir, seed=s) for s in (7, 7, 8))
    for module in (first, second, other):
        module.configure_model()
    key = next(k for k in first.policy.state_dict() if "lora_A" in k)
    assert torch.equal(first.policy.state_dict()[key], second.policy.state_dict()[key])
    assert not torch.equal(first.policy.state_dict()[key], other.policy.state_dict()[key])


def test_activation_checkpointing_under_lora_gives_the_same_adapter_gradients(tiny_model_dir, tmp_path):
    from test_fast_path import ON_POLICY, FirstStepProbe, fit

    grads = {}
    for checkpointing in (False, True):
        probe = FirstStepProbe()
        module = lora_module(tiny_model_dir, activation_checkpointing=checkpointing, **ON_POLICY)
        fit(module, tmp_path / str(checkpointing), total_phases=1, callbacks=[probe])
        grads[checkpointing] = probe.grads
    assert grads[True].keys() == grads[False].keys() and all("lora_" in name for name in grads[True])
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_wrapping_prints_no_deprecation_warning_from_peft(tiny_model_dir):
    """peft reads transformers' deprecated ``is_gradient_checkpointing`` while wrapping: that FutureWarning is not
    shown, and the filter does not outlive the wrapping."""
    from grpo_lightning.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(model, LoraSettings())
        assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
        model.is_gradient_checkpointing  # read directly, after the wrapping: transformers' warning shows as before
    assert [w.category for w in caught if "is_gradient_checkpointing" in str(w.message)] == [FutureWarning]
