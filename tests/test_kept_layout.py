"""KeptLayout: the reference's products laid out once and used again while its weights stay as they were, laid
out again when any of them changes, and never kept for a weight computed per pass (a merged LoRA weight)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import build_tiny_llama

from grpo_lightning import packed_linear
from grpo_lightning.lora import LoraSettings, apply_lora
from grpo_lightning.packed_linear import KeptLayout

pytestmark = pytest.mark.skipif(not packed_linear._onednn_available(), reason="this PyTorch has no oneDNN")


@pytest.fixture
def layouts(monkeypatch):
    """oneDNN's products (the reference's library: its layout serves any row count), every layer prepared, and
    a count of the weights laid out."""
    monkeypatch.setenv(packed_linear.DECODE_MATMUL_ENV, "onednn")
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHT", 1)
    made = []
    lay_out = packed_linear._product

    def counted(weight, *args, **kwargs):
        made.append(tuple(weight.shape))
        return lay_out(weight, *args, **kwargs)

    monkeypatch.setattr(packed_linear, "_product", counted)
    return made


def reference_pass(model, ids):
    return model(input_ids=ids).logits


@torch.no_grad()
def test_the_layout_is_made_once_and_gives_the_models_own_results(layouts):
    model = build_tiny_llama(vocab_size=300, seed=3).requires_grad_(False)
    linear_layers = sum(isinstance(m, torch.nn.Linear) for m in model.modules())  # 7 per layer + the head
    ids = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(0))
    expected = reference_pass(model, ids)
    kept = KeptLayout()
    for _ in range(3):
        with kept.prepared(model):
            assert "forward" in vars(model.lm_head)
            torch.testing.assert_close(reference_pass(model, ids), expected, rtol=0, atol=1e-5)
        assert not any("forward" in vars(m) for m in model.modules())  # the class's forward between passes
    assert len(layouts) == linear_layers == 2 * 7 + 1  # laid out at the first pass only


@torch.no_grad()
@pytest.mark.parametrize("change", ["in_place", "new_tensor", "loaded"])
def test_a_weight_that_changes_is_laid_out_again(layouts, change):
    model = build_tiny_llama(vocab_size=300, seed=3).requires_grad_(False)
    ids = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(1))
    kept = KeptLayout()
    with kept.prepared(model):
        before = reference_pass(model, ids)
    first = len(layouts)
    down = model.model.layers[1].mlp.down_proj
    if change == "in_place":  # what an optimizer step does
        down.weight.mul_(-3.0)
    elif change == "new_tensor":
        down.weight.data = down.weight.data * -3.0
    else:  # a checkpoint loaded into the model
        state = {name: t.clone() for name, t in model.state_dict().items()}
        state["model.layers.1.mlp.down_proj.weight"] *= -3.0
        model.load_state_dict(state)
    expected = reference_pass(model, ids)
    assert (expected - before).abs().max() > 1e-3  # the change shows in the logits
    with kept.prepared(model):
        torch.testing.assert_close(reference_pass(model, ids), expected, rtol=0, atol=1e-5)
    assert len(layouts) == 2 * first  # the whole model laid out again, once


@torch.no_grad()
def test_another_row_count_or_library_is_laid_out_again_and_aten_prepares_nothing(layouts, monkeypatch):
    model = build_tiny_llama(vocab_size=300, seed=3).requires_grad_(False)
    kept = KeptLayout()
    with kept.prepared(model):
        pass
    first = len(layouts)
    with kept.prepared(model, rows=6):
        pass
    assert len(layouts) == 2 * first and kept.holds_layout
    monkeypatch.setenv(packed_linear.DECODE_MATMUL_ENV, "aten")
    with kept.prepared(model):
        assert "forward" not in vars(model.lm_head)  # F.linear itself: nothing to prepare
    assert len(layouts) == 2 * first and not kept.holds_layout
    monkeypatch.setenv(packed_linear.DECODE_MATMUL_ENV, "onednn")
    with kept.prepared(model):  # the kept layout was let go under "aten": laid out again
        pass
    assert len(layouts) == 3 * first


@torch.no_grad()
def test_lora_base_layers_are_kept_and_merged_weights_are_not(layouts):
    lora = apply_lora(build_tiny_llama(vocab_size=300, seed=4), LoraSettings(), seed=0)
    for name, param in lora.named_parameters():  # adapters start as a no-op (B = 0): make them count
        if "lora_B" in name:
            param.copy_(torch.randn_like(param) * 0.5)
    ids = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(2))
    with lora.disable_adapter():
        without = reference_pass(lora, ids)
    with_adapters = reference_pass(lora, ids)
    kept = KeptLayout()
    for _ in range(2):  # the reference under LoRA: the policy with its adapters off, base weights frozen
        with lora.disable_adapter(), kept.prepared(lora):
            torch.testing.assert_close(reference_pass(lora, ids), without, rtol=0, atol=1e-5)
    base_layers = len(layouts)
    assert base_layers == 2 * 7 + 1
    for _ in range(2):  # adapters on: each LoRA layer is one merged weight, made for this pass: laid out every time
        with kept.prepared(lora):
            torch.testing.assert_close(reference_pass(lora, ids), with_adapters, rtol=0, atol=1e-5)
        assert not kept.holds_layout  # nor is its memory held after the pass
    assert len(layouts) == 3 * base_layers
    with lora.disable_adapter(), kept.prepared(lora):  # the base layers' layout was let go: laid out again
        torch.testing.assert_close(reference_pass(lora, ids), without, rtol=0, atol=1e-5)
    assert len(layouts) == 4 * base_layers


@pytest.mark.parametrize(
    "environment, activation_checkpointing, kept",
    [(None, False, True), ("0", False, False), (None, True, False), ("1", True, True)],
    ids=["default", "turned-off", "checkpointing-saves-memory", "checkpointing-but-asked"],
)
def test_a_run_lays_the_reference_out_once_and_its_log_probs_stay_the_references(
    layouts, tiny_model_dir, tmp_path, monkeypatch, environment, activation_checkpointing, kept
):
    from test_module import make_module, make_trainer

    from grpo_lightning.objectives import generated_logprobs

    if environment is not None:
        monkeypatch.setenv(packed_linear.KEEP_REFERENCE_LAYOUT_ENV, environment)
    module = make_module(tiny_model_dir, total_phases=3, activation_checkpointing=activation_checkpointing)
    assert module.keeps_reference_layout() is kept
    module.configure_model()
    reference_weights = {p.data_ptr() for p in module.ref_model.parameters()}
    laid_out = []  # per phase: the reference's weights laid out in it
    plain_log_probs = []

    class Recorder(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            laid_out.append(0)

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 0:  # the rollout is done: what the reference gives without prepared products
                memory = module.memory
                with torch.no_grad():
                    plain_log_probs.append((memory.ref_logprobs.clone(), generated_logprobs(
                        module.ref_model, memory.sample_ids, module.args.gen_len, memory.attention_mask)))

    counting = packed_linear._product

    def by_phase(weight, *args, **kwargs):
        if weight.data_ptr() in reference_weights and laid_out:
            laid_out[-1] += 1
        return counting(weight, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed_linear, "_product", by_phase)
        trainer = make_trainer(tmp_path, total_phases=3)
        trainer.callbacks.append(Recorder())
        trainer.fit(module)
    # Kept: laid out in the first phase only (the reference's weights do not change); else in every phase.
    assert laid_out == ([2 * 7 + 1, 0, 0] if kept else [2 * 7 + 1] * 3)
    assert module.reference_layout.holds_layout is kept
    for in_memory, plain in plain_log_probs:
        torch.testing.assert_close(in_memory, plain, rtol=0, atol=1e-5)


@torch.no_grad()
def test_a_pickled_or_copied_layout_holds_nothing_and_lays_out_anew(layouts):
    import copy
    import pickle

    model = build_tiny_llama(vocab_size=300, seed=3).requires_grad_(False)
    ids = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(3))
    kept = KeptLayout()
    with kept.prepared(model):
        expected = reference_pass(model, ids)
    assert kept.holds_layout
    for other in (pickle.loads(pickle.dumps(kept)), copy.deepcopy(kept)):
        assert not other.holds_layout
        with other.prepared(model):
            torch.testing.assert_close(reference_pass(model, ids), expected, rtol=0, atol=0)
    assert kept.holds_layout and len(layouts) == 3 * (2 * 7 + 1)


@pytest.mark.parametrize(
    "value, activation_checkpointing, kept",
    [("false", False, False), ("off", False, False), ("no", False, False), ("true", True, True), ("", True, False),
     ("", False, True)],
)
def test_the_switch_reads_as_the_other_switches_do(tiny_model_dir, monkeypatch, value, activation_checkpointing, kept):
    from test_module import make_module

    monkeypatch.setenv(packed_linear.KEEP_REFERENCE_LAYOUT_ENV, value)
    assert make_module(tiny_model_dir, activation_checkpointing=activation_checkpointing).keeps_reference_layout() is kept
