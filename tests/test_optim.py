"""The AdamW (maximize) optimizer and the warmup / linear-decay schedule (grpo_lightning.optim)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from grpo_lightning.config import GRPO_Args
from grpo_lightning.optim import get_optimizer_and_scheduler, warmup_linear_decay


def test_warmup_linear_decay_by_hand():
    f = warmup_linear_decay(total_phases=10, warmup_steps=4, final_scale=0.1)
    # warmup: (step + 1) / (warmup + 1) = 1/5, 2/5, 3/5, 4/5
    for step, expected in enumerate([0.2, 0.4, 0.6, 0.8]):
        assert f(step) == pytest.approx(expected, abs=1e-12)
    # decay: 1 - (1 - 0.1) * (step - 4) / (10 - 4)
    assert f(4) == pytest.approx(1.0, abs=1e-12)
    assert f(5) == pytest.approx(1 - 0.9 * 1 / 6, abs=1e-12)  # 0.85
    assert f(7) == pytest.approx(0.55, abs=1e-12)  # 1 - 0.9 * 3/6
    assert f(10) == pytest.approx(0.1, abs=1e-12)


def test_warmup_linear_decay_without_warmup():
    # warmup 0: starts at 1, decays to final_scale 0.5 at step 4: 1 - 0.5 * step / 4
    f = warmup_linear_decay(total_phases=4, warmup_steps=0, final_scale=0.5)
    assert [f(s) for s in range(5)] == pytest.approx([1.0, 0.875, 0.75, 0.625, 0.5], abs=1e-12)


def test_warmup_linear_decay_rejects_steps_past_the_end():
    f = warmup_linear_decay(total_phases=10, warmup_steps=4, final_scale=0.1)
    with pytest.raises(AssertionError):
        f(11)


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    model[0].weight.requires_grad_(False)  # a frozen parameter, like a LoRA base
    return model


def _args(**kw):
    base = dict(lr=0.1, total_phases=10, warmup_steps=4, final_scale=0.1)
    base.update(kw)
    return GRPO_Args(**base)


def test_optimizer_is_maximizing_adamw_over_trainable_params_only():
    model = _model()
    optimizer, scheduler = get_optimizer_and_scheduler(_args(), model)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert len(optimizer.param_groups) == 1
    group = optimizer.param_groups[0]
    assert group["maximize"] is True
    assert group["initial_lr"] == 0.1
    params = group["params"]
    expected = [model[0].bias, model[1].weight, model[1].bias]
    assert len(params) == 3
    assert all(p is q for p, q in zip(params, expected))
    assert not any(p is model[0].weight for p in params)
    assert group["fused"] is True  # the fused kernel, on CPU as on GPU


def test_fused_update_matches_the_reference_adamw():
    # Same arithmetic as the plain per-parameter AdamW(maximize=True): 5 steps on fixed gradients.
    torch.manual_seed(0)
    fused_model, plain_model = _model(), _model()
    plain_model.load_state_dict(fused_model.state_dict())
    fused_opt, _ = get_optimizer_and_scheduler(_args(), fused_model)
    params = [p for p in plain_model.parameters() if p.requires_grad]
    plain_opt = torch.optim.AdamW(params, lr=0.1 / 5, maximize=True, foreach=False)
    for step in range(5):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        for model, opt in ((fused_model, fused_opt), (plain_model, plain_opt)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    for p, q in zip(fused_model.parameters(), plain_model.parameters()):
        assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-6)


def test_lr_follows_the_schedule():
    model = _model()
    optimizer, scheduler = get_optimizer_and_scheduler(_args(), model)
    lam = warmup_linear_decay(10, 4, 0.1)
    # before any scheduler step: lr * lambda(0) = 0.1 / 5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02, abs=1e-12)
    lrs = {}
    for k in range(1, 11):
        optimizer.step()  # no grads: no-op, keeps the scheduler's step order check happy
        scheduler.step()
        lrs[k] = optimizer.param_groups[0]["lr"]
        assert lrs[k] == pytest.approx(0.1 * lam(k), abs=1e-12), k
    # hand values: step 3 -> 0.1 * 4/5, step 4 -> 0.1, step 7 -> 0.1 * 0.55, step 10 -> 0.1 * 0.1
    assert lrs[3] == pytest.approx(0.08, abs=1e-12)
    assert lrs[4] == pytest.approx(0.1, abs=1e-12)
    assert lrs[7] == pytest.approx(0.055, abs=1e-12)
    assert lrs[10] == pytest.approx(0.01, abs=1e-12)


def test_one_step_increases_the_objective():
    # objective J(p) = -(p - 3)^2 at p = 0.5: dJ/dp = 5 > 0, so maximising must increase p.
    # AdamW step 1 (lr_t = 0.1 * lambda(0) = 0.02, weight_decay 0.01, eps 1e-8):
    #   decay: p <- 0.5 * (1 - 0.02 * 0.01) = 0.4999
    #   m_hat = g, v_hat = g^2 -> update = lr_t * g / (|g| + eps) ~ 0.02 (ascent, maximize=True)
    #   p = 0.4999 + 0.02 = 0.5199
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.5)
    optimizer, _ = get_optimizer_and_scheduler(_args(), model)
    objective = -((model.weight - 3.0) ** 2).sum()
    before = objective.item()
    optimizer.zero_grad()
    objective.backward()
    optimizer.step()
    assert_close(model.weight.detach(), torch.tensor([[0.5199]]), atol=1e-6, rtol=1e-6)
    after = -((model.weight.detach() - 3.0) ** 2).sum().item()
    assert after > before


def test_frozen_parameter_does_not_move():
    model = _model()
    frozen = model[0].weight.detach().clone()
    trainable = model[1].weight.detach().clone()
    optimizer, _ = get_optimizer_and_scheduler(_args(), model)
    out = model(torch.ones(1, 3)).sum()
    out.backward()
    optimizer.step()
    assert torch.equal(model[0].weight.detach(), frozen)
    assert not torch.equal(model[1].weight.detach(), trainable)
