"""The learning step's fused kernels (grpo_lightning/csrc/train_step.cpp) and layers (grpo_lightning.fused_training):
each kernel against float64 formulas written out by hand, the fused layers of whole models (Llama, Qwen2 with
biases, LoRA) against their eager layers, forward and backward, and where they must not apply."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_tiny_llama, needs_a_compiler
from test_fast_decode import build_tiny_qwen2

from grpo_lightning import fused_decode, fused_training, objectives, training_products
from grpo_lightning.fused_attention import FusedCausalAttention, use_fused_attention
from grpo_lightning.fused_training import FusedRMSNorm, FusedSiLUMul, use_fused_layers
from grpo_lightning.lora import LoraSettings, apply_lora
from grpo_lightning.models import load_causal_lm
from grpo_lightning.objectives import generated_logprobs, selective_log_softmax

pytestmark = needs_a_compiler(without="the learning step runs PyTorch's operations")


def norm_and_grads_float64(x, weight, grad_out, eps):
    """The RMS norm by its formula, weight * x / sqrt(mean(x^2) + eps), and its gradients, in float64 autograd."""
    x = x.double().requires_grad_(True)
    weight = weight.double().requires_grad_(True)
    out = weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    out.backward(grad_out.double())
    return out.detach(), x.grad, weight.grad


def test_rms_norm_forward_and_backward_follow_the_formula(kernels):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=generator) * 3  # 37 rows: uneven chunks over the threads
    weight = torch.rand(96, generator=generator) + 0.5
    grad_out = torch.randn(37, 96, generator=generator)
    out, inverse_rms = kernels.rms_norm_forward(x, weight, 1e-5)
    grad_x, grad_weight = kernels.rms_norm_backward(grad_out, x, weight, inverse_rms, True)
    expected, expected_grad_x, expected_grad_weight = norm_and_grads_float64(x, weight, grad_out, 1e-5)
    torch.testing.assert_close(inverse_rms.double(), 1 / torch.sqrt(x.double().pow(2).mean(-1) + 1e-5), rtol=1e-6, atol=0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_x.double(), expected_grad_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_weight.double(), expected_grad_weight, rtol=1e-5, atol=1e-5)
    grad_x_only, no_weight_grad = kernels.rms_norm_backward(grad_out, x, weight, inverse_rms, False)
    assert torch.equal(grad_x_only, grad_x) and no_weight_grad.numel() == 0


def test_rms_norm_of_a_zero_row_keeps_eps(kernels):
    """0 / sqrt(0 + eps): no NaN. The gradient there is dy * weight / sqrt(eps) (the mean term vanishes with x)."""
    x, weight, grad_out = torch.zeros(1, 8), torch.full((8,), 2.0), torch.arange(8.0)[None]
    out, inverse_rms = kernels.rms_norm_forward(x, weight, 1e-4)
    grad_x, grad_weight = kernels.rms_norm_backward(grad_out, x, weight, inverse_rms, True)
    assert torch.equal(out, torch.zeros(1, 8)) and torch.equal(grad_weight, torch.zeros(8))
    torch.testing.assert_close(grad_x, grad_out * 2.0 / 1e-2, rtol=1e-6, atol=0)


def silu_mul_and_grads_float64(gate, up, grad_out):
    gate = gate.double().requires_grad_(True)
    up = up.double().requires_grad_(True)
    out = gate / (1 + torch.exp(-gate)) * up
    out.backward(grad_out.double())
    return out.detach(), gate.grad, up.grad


def test_silu_mul_forward_and_backward_follow_the_formula(kernels):
    generator = torch.Generator().manual_seed(1)
    gate = torch.randn(9, 160, generator=generator) * 4
    gate[0, :6] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 30.0, 100.0])  # where exp and the sigmoid saturate
    up = torch.randn(9, 160, generator=generator)
    grad_out = torch.randn(9, 160, generator=generator)
    out = kernels.silu_mul_forward(gate, up)
    grad_gate, grad_up = kernels.silu_mul_backward(grad_out, gate, up)
    expected, expected_grad_gate, expected_grad_up = silu_mul_and_grads_float64(gate, up, grad_out)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_gate.double(), expected_grad_gate, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_up.double(), expected_grad_up, rtol=1e-5, atol=1e-6)


def test_silu_mul_reads_strided_rows_and_passes_nan_on(kernels):
    both = torch.randn(4, 2, 24)  # gate and up as the two halves of one buffer: rows of stride 48
    gate, up = both[:, 0], both[:, 1]
    gate[2, 5] = float("nan")
    out = kernels.silu_mul_forward(gate, up)
    grad_gate, grad_up = kernels.silu_mul_backward(torch.ones(4, 24), gate, up)
    expected, expected_grad_gate, expected_grad_up = silu_mul_and_grads_float64(gate, up, torch.ones(4, 24))
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(grad_gate.double(), expected_grad_gate, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert out[2, 5].isnan() and grad_gate[2, 5].isnan() and grad_up[2, 5].isnan()


def test_silu_mul_is_the_formula_in_every_lane_and_past_the_last_vector(kernels):
    """Width 45: five vectors of 8 entries (AVX2's loop) or two of 16 (AVX-512's), and the entries after them (the
    element loop); saturating values and NaN in both parts."""
    generator = torch.Generator().manual_seed(3)
    gate = torch.randn(5, 45, generator=generator) * 6
    gate[0, :8] = torch.tensor([-100.0, -87.5, -30.0, -1e-3, 0.0, 30.0, 88.5, 100.0])  # one vector: exp's clamps
    gate[1, 40:] = torch.tensor([-100.0, -30.0, 0.0, 30.0, 100.0])  # the same past the last vector
    gate[2, 17], gate[3, 43] = float("nan"), float("nan")
    up = torch.randn(5, 45, generator=generator)
    grad_out = torch.randn(5, 45, generator=generator)
    out = kernels.silu_mul_forward(gate, up)
    grad_gate, grad_up = kernels.silu_mul_backward(grad_out, gate, up)
    expected, expected_grad_gate, expected_grad_up = silu_mul_and_grads_float64(gate, up, grad_out)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(grad_gate.double(), expected_grad_gate, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(grad_up.double(), expected_grad_up, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert out[2, 17].isnan() and out[3, 43].isnan() and out.isnan().sum() == 2


# Shapes around the register blocks (8 or 16) and the 64 x 64 tiles, so that every edge case of the blocked path
# (columns past the last block, rows past it, both, a single partial tile) is read.
@pytest.mark.parametrize(
    "shape", [(5, 7), (64, 96), (1, 33), (33, 1), (0, 4), (70, 45), (63, 65), (129, 127), (17, 300), (300, 17), (16, 8)]
)
def test_transpose_copy_is_the_transpose_exactly(kernels, shape):
    x = torch.randn(shape)
    assert torch.equal(kernels.transpose_copy(x), x.t().contiguous())
    assert kernels.transpose_copy(x).is_contiguous()


def test_transpose_copy_reads_any_strides(kernels):
    base = torch.randn(100, 70)
    for view in (base[:, 3:50], base[1:, 5:], base[7:90, 2:69], base.t(), base[::3, ::2]):
        assert torch.equal(kernels.transpose_copy(view), view.t().contiguous())


def test_the_kernels_follow_pytorchs_instruction_set_hold(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert fused_decode.compile_flags() == fused_decode.COMPILE_FLAGS
    native = fused_decode.extension_name()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "AVX2")
    assert fused_decode.compile_flags() == [*fused_decode.COMPILE_FLAGS, "-mno-avx512f"]
    assert fused_decode.extension_name() != native  # a held build is cached apart from the native one
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert fused_decode.compile_flags()[-3:] == ["-mno-avx512f", "-mno-avx2", "-mno-fma"]
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")  # no hold below what -march=native gives
    assert fused_decode.compile_flags() == fused_decode.COMPILE_FLAGS


def test_kernels_held_to_avx2_transpose_exactly(kernels, monkeypatch):
    """On an AVX-512 CPU the native build transposes in 16 x 16 blocks and takes exp 16 lanes at a time; held to
    AVX2 (as on a CPU without AVX-512) it takes the 8 x 8 blocks and 8 lanes, which this reads on the same shapes."""
    flags = fused_decode.parse_cpuinfo(fused_decode._read_cpuinfo())[1]
    if not {"avx512f", "avx2"} <= flags:
        pytest.skip("the native build is already the AVX2 (or element-loop) one here")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    fused_decode.compiled_kernels.cache_clear()
    try:
        held = fused_decode.compiled_kernels()
    finally:
        fused_decode.compiled_kernels.cache_clear()  # the next user gets the native build again
    assert held is not None
    assert held.vector_exp_lanes == 8
    if kernels.vector_exp_lanes == 16:  # the native build, not held itself: 16 lanes, the same SiLU x up bit for bit
        gate, up = torch.randn(7, 45) * 6, torch.randn(7, 45)
        assert torch.equal(held.silu_mul_forward(gate, up), kernels.silu_mul_forward(gate, up))
    for shape in [(16, 8), (63, 65), (129, 127), (17, 300), (8, 8), (7, 9)]:
        x = torch.randn(shape)
        assert torch.equal(held.transpose_copy(x), x.t().contiguous()), shape
    base = torch.randn(100, 70)
    assert torch.equal(held.transpose_copy(base[1:, 5:]), base[1:, 5:].t().contiguous())


def test_pick_log_softmax_gives_the_log_probabilities_and_their_gradient(kernels):
    generator = torch.Generator().manual_seed(8)
    buffer = torch.randn(6, 1030, generator=generator) * 8
    logits = buffer[:, :1000]  # rows of stride 1030, as a slice of the model's logits
    targets = torch.randint(0, 1000, (6,), generator=generator)
    grad_out = torch.randn(6, generator=generator)
    picked, logsumexp = kernels.pick_log_softmax_forward(logits, targets)
    grad = kernels.pick_log_softmax_backward(grad_out, logits, targets, logsumexp)
    exact = logits.double().requires_grad_(True)
    expected = exact.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    expected.backward(grad_out.double())
    torch.testing.assert_close(logsumexp.double(), exact.detach().logsumexp(-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(picked.double(), expected.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad.double(), exact.grad, rtol=1e-5, atol=1e-7)


# Columns inside the vector loops (AVX2: the maximum in blocks of 32, the sum of exp in blocks of 16), and past them.
@pytest.mark.parametrize("columns", [(3, 7, 11), (49, 48, 49)])
def test_pick_log_softmax_follows_torch_at_infinities_and_nan(kernels, columns):
    infinite, impossible, nan = columns
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(9))
    logits[0, :] = float("-inf")  # an impossible row
    logits[1, infinite] = float("inf")  # an infinite logit
    logits[2, impossible] = float("-inf")  # one impossible token, picked
    logits[3, nan] = float("nan")
    targets = torch.tensor([0, 4, impossible, 2])
    picked, logsumexp = kernels.pick_log_softmax_forward(logits, targets)
    # as selective_log_softmax's PyTorch path: the target's logit minus torch.logsumexp
    expected = logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)
    assert torch.equal(logsumexp[:2], logits[:2].logsumexp(-1)) and logsumexp[3].isnan()
    assert picked[0].isnan() and picked[1] == float("-inf") and picked[2] == float("-inf") and picked[3].isnan()
    torch.testing.assert_close(picked, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bad", [50, -1])
def test_a_target_outside_the_vocabulary_is_refused_before_the_kernel_reads_it(kernels, monkeypatch, bad):
    # Refused in Python: an error thrown inside the extension crashed the process on a GPU host (torch 2.11).
    calls = []
    monkeypatch.setattr(objectives, "_fused_kernels_for", lambda logits: calls.append(1) or kernels)
    monkeypatch.setattr(kernels, "pick_log_softmax_forward", lambda *args: pytest.fail("the kernel ran"), raising=False)
    with pytest.raises(RuntimeError, match=f"target {bad} outside the vocabulary of 50"):
        selective_log_softmax(torch.zeros(2, 50), torch.tensor([3, bad]))
    assert calls == [1]  # the fused path was the one taken


def test_the_autograd_functions_match_the_eager_formulas(kernels):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 48, generator=generator, requires_grad=True)
    weight = (torch.rand(48, generator=generator) + 0.5).requires_grad_(True)
    normed = FusedRMSNorm.apply(x, weight, 1e-6, kernels)
    normed.backward(torch.ones_like(normed))
    expected, expected_grad_x, expected_grad_weight = norm_and_grads_float64(x.detach(), weight.detach(), torch.ones(2, 5, 48), 1e-6)
    torch.testing.assert_close(normed.detach().double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), expected_grad_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), expected_grad_weight, rtol=1e-5, atol=1e-5)
    frozen = weight.detach()  # a LoRA model's norm: only the input's gradient
    x.grad = None
    FusedRMSNorm.apply(x, frozen, 1e-6, kernels).sum().backward()
    torch.testing.assert_close(x.grad.double(), expected_grad_x, rtol=1e-5, atol=1e-6)
    gate = torch.randn(3, 4, 40, generator=generator, requires_grad=True)
    up = torch.randn(3, 4, 40, generator=generator, requires_grad=True)
    FusedSiLUMul.apply(gate, up, kernels).backward(torch.ones(3, 4, 40))
    _, expected_grad_gate, expected_grad_up = silu_mul_and_grads_float64(gate.detach(), up.detach(), torch.ones(3, 4, 40))
    torch.testing.assert_close(gate.grad.double(), expected_grad_gate, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(up.grad.double(), expected_grad_up, rtol=1e-5, atol=1e-6)


def loss_and_grads(model, ids, attention_mask=None):
    """The learning step's forward (log-probabilities of the last 5 tokens) and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    logprobs = generated_logprobs(model, ids, 5, attention_mask)
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(3))
    (logprobs * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), grads


def assert_same_model_results(fused, eager, results, expected) -> None:
    """``loss_and_grads`` of a fused model and of its eager original agree to float rounding, parameter by parameter."""
    (logprobs, grads), (expected_logprobs, expected_grads) = results, expected
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert fused.state_dict().keys() == eager.state_dict().keys()


def count_fused_calls(monkeypatch) -> list[str]:
    calls = []
    for function in (FusedRMSNorm, FusedSiLUMul):
        original = function.apply
        monkeypatch.setattr(function, "apply", lambda *args, _f=original, _n=function.__name__: calls.append(_n) or _f(*args))
    return calls


@pytest.mark.parametrize("build", [build_tiny_llama, build_tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("oneDNN_products", [False, True], ids=["aten", "onednn"])
def test_a_models_fused_layers_give_its_log_probs_and_gradients(kernels, monkeypatch, build, oneDNN_products):
    eager = build(300).train()
    fused = copy.deepcopy(eager)
    if oneDNN_products:  # the transposes of the weight gradients' products go through the kernels too
        monkeypatch.setattr(training_products, "training_matmul_backend", lambda: "onednn")
        assert training_products.use_training_products(fused, min_weight=1) > 0
    layers = len(eager.model.layers)
    assert use_fused_layers(fused) == 2 * layers + 1 + layers  # two norms a layer, the final norm, an MLP a layer
    calls = count_fused_calls(monkeypatch)
    ids = torch.randint(1, 300, (3, 12), generator=torch.Generator().manual_seed(4))
    logprobs, grads = loss_and_grads(fused, ids)
    expected_logprobs, expected_grads = loss_and_grads(eager, ids)
    assert calls.count("FusedRMSNorm") == 2 * layers + 1 and calls.count("FusedSiLUMul") == layers
    assert_same_model_results(fused, eager, (logprobs, grads), (expected_logprobs, expected_grads))


def test_lora_models_train_their_adapters_through_the_fused_layers(kernels, monkeypatch):
    settings = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    eager = apply_lora(build_tiny_llama(300), settings, seed=0).train()
    with torch.no_grad():  # LoRA's B starts at zero: give the adapters something to pass on
        for name, param in eager.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
    fused = copy.deepcopy(eager)
    assert use_fused_layers(fused) == 2 * 2 + 1 + 2
    ids = torch.randint(1, 300, (2, 10), generator=torch.Generator().manual_seed(5))
    logprobs, grads = loss_and_grads(fused, ids)
    expected_logprobs, expected_grads = loss_and_grads(eager, ids)
    assert grads and all("lora_" in name for name in grads)
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def tiny_llama_pair(monkeypatch):
    """(eager, fused, fused calls, ids): a tiny Llama, a copy with the fused layers, their calls counted."""
    eager = build_tiny_llama(300)
    fused = copy.deepcopy(eager)
    use_fused_layers(fused)
    return eager, fused, count_fused_calls(monkeypatch), torch.randint(1, 300, (2, 8), generator=torch.Generator().manual_seed(6))


def test_under_bf16_autocast_only_the_norms_of_float32_activations_are_fused(kernels, monkeypatch):
    eager, fused, calls, ids = tiny_llama_pair(monkeypatch)
    x = torch.randn(2, 8, eager.config.hidden_size, generator=torch.Generator().manual_seed(7))
    norm, eager_norm = fused.model.layers[0].input_layernorm, eager.model.layers[0].input_layernorm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # Llama's norm computes in float32 and returns its input's dtype, autocast or not: the kernel's result
        torch.testing.assert_close(norm(x), eager_norm(x), rtol=0, atol=1e-6)
        assert norm(x).dtype == torch.float32 and calls == ["FusedRMSNorm"] * 2
        assert torch.equal(norm(x.bfloat16()), eager_norm(x.bfloat16())) and len(calls) == 2  # bf16: its own
        del calls[:]
        logits, expected = fused(ids).logits, eager(ids).logits
    # 2 layers' 2 norms and the last one; the MLP's gate and up are bf16 products there: its own forward
    assert calls == ["FusedRMSNorm"] * 5
    # The same sums to float rounding before each bf16 rounding of a product's input: a rounding may tip
    torch.testing.assert_close(logits.float(), expected.float(), rtol=2**-7, atol=2**-8)


def test_the_layers_own_forward_runs_when_turned_off(kernels, monkeypatch):
    eager, fused, calls, ids = tiny_llama_pair(monkeypatch)
    monkeypatch.setenv(fused_decode.FUSED_TRAINING_ENV, "0")
    assert torch.equal(fused(ids).logits, eager(ids).logits)
    assert calls == []
    monkeypatch.setattr(fused_training, "compiled_kernels", lambda: None)  # not buildable here
    monkeypatch.delenv(fused_decode.FUSED_TRAINING_ENV)
    assert torch.equal(fused(ids).logits, eager(ids).logits) and calls == []


def test_only_layers_with_llamas_forward_are_changed():
    class ScaledNorm(torch.nn.Module):  # a norm of another formula (Gemma's is weight + 1)
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.zeros(8)), 1e-6

        def forward(self, x):
            return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    model = build_tiny_llama(300)
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()  # not SiLU: left as it is
    model.add_module("other_norm", ScaledNorm())
    assert use_fused_layers(model) == 2 * 2 + 1 + 1
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert type(model.model.layers[1].mlp).__name__ == "FusedLlamaMLP"
    assert type(model.other_norm) is ScaledNorm
    assert use_fused_layers(model) == 0  # once is enough


def test_the_module_fuses_the_policy_and_the_reference(tiny_model_dir):
    """Norms, MLPs and attention layers (grpo_lightning.fused_attention) get the fused forward, in both models."""
    from grpo_lightning import GRPOModule

    module = GRPOModule(model_name_or_path=tiny_model_dir, reward=lambda samples: torch.zeros(len(samples)),
                        batch_size=4, gen_len=4, num_minibatches=1, kl_coef=0.1)  # fmt: skip
    module.configure_model()
    for model in (module.policy, module.ref_model):
        for kind in ("RMSNorm", "MLP", "Attention"):  # of a subclass whose forward is the fused one
            layers = [m for m in model.modules() if type(m).__name__.endswith(kind)]
            assert layers and all(type(layer).__name__ == f"FusedLlama{kind}" for layer in layers), kind


def test_the_fused_layers_outlast_train_and_eval_switches(kernels, monkeypatch, tmp_path):
    """transformers' kernel hub, at each train()/eval() switch of a model loaded by from_pretrained, puts back the
    class forward of the layers it knows (LlamaRMSNorm among them), dropping any forward set on the instance;
    Lightning calls model.train() when fit starts. The fused norms, MLPs and attention (each a subclass of its
    layer's class) must still run after such switches."""
    from test_fused_attention import build_llama_with_wide_heads  # here: that module imports this one

    build_llama_with_wide_heads().save_pretrained(tmp_path)  # heads 16 wide: the attention kernel applies too
    model = load_causal_lm(str(tmp_path), "eager")
    layers = len(model.model.layers)
    assert use_fused_layers(model) == 2 * layers + 1 + layers
    assert use_fused_attention(model) == layers
    model.train()
    model.eval()
    model.train()
    calls = count_fused_calls(monkeypatch)
    original = FusedCausalAttention.apply
    monkeypatch.setattr(FusedCausalAttention, "apply", lambda *args: calls.append("FusedCausalAttention") or original(*args))
    ids = torch.randint(1, 300, (2, 9), generator=torch.Generator().manual_seed(7))
    generated_logprobs(model, ids, 4).sum().backward()
    assert calls.count("FusedRMSNorm") == 2 * layers + 1 and calls.count("FusedSiLUMul") == layers
    assert calls.count("FusedCausalAttention") == layers
