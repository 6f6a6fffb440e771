"""Each distinct prompt runs once in the learning and reference forward passes (grpo_lightning.shared_prompts):
the same log-probabilities and gradients as running every row whole, for fewer positions."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_llama

from grpo_lightning import shared_prompts
from grpo_lightning.activation_checkpointing import enable_activation_checkpointing
from grpo_lightning.lora import LoraSettings, apply_lora
from grpo_lightning.objectives import generated_logprobs
from grpo_lightning.shared_prompts import PromptGroups, can_share_prompts, prompt_groups, saved_share

VOCAB, GEN_LEN = 300, 5


def test_rows_with_the_same_prompt_columns_share_a_prompt():
    ids = torch.tensor([[1, 2, 9], [1, 2, 8], [3, 2, 7], [1, 2, 6]])  # gen_len 1: the prompt is the first 2 columns
    groups = prompt_groups(ids, gen_len=1, attention_mask=None)
    assert len(groups.first_rows) == 2
    row_prompt = groups.row_prompt.tolist()
    assert row_prompt[0] == row_prompt[1] == row_prompt[3] != row_prompt[2]
    for row in range(4):  # each row's representative holds the same prompt
        assert torch.equal(ids[groups.first_rows[row_prompt[row]], :2], ids[row, :2])


def test_the_same_ids_with_different_padding_are_different_prompts():
    ids = torch.tensor([[0, 5, 9], [0, 5, 8]])  # token 0 is padding in one row, a real token in the other
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert len(prompt_groups(ids, 1, mask).first_rows) == 2
    assert len(prompt_groups(ids, 1, None).first_rows) == 1


def test_saved_share_counts_the_prompt_positions_not_run():
    # 4 rows of 2 prompts, prompts of 2 tokens, 3 generated: per row 2 + 3 - 1 = 4 positions run, 16 in all;
    # running the prompts once skips (4 - 2) * 2 = 4 of them.
    groups = PromptGroups(first_rows=torch.tensor([0, 2]), row_prompt=torch.tensor([0, 0, 1, 1]))
    assert saved_share(groups, prompt_len=2, gen_len=3) == 4 / 16


def group_batch(prompt_lens: list[int], rows_per_prompt: int, seed: int = 0):
    """Rows of a few prompts of different lengths, left-padded with 0, shuffled; completions of GEN_LEN."""
    g = torch.Generator().manual_seed(seed)
    width = max(prompt_lens)
    ids, mask = [], []
    for length in prompt_lens:
        prompt = torch.cat([torch.zeros(width - length, dtype=torch.long), torch.randint(1, VOCAB, (length,), generator=g)])
        prompt_mask = (torch.arange(width) >= width - length).long()
        for _ in range(rows_per_prompt):
            ids.append(torch.cat([prompt, torch.randint(1, VOCAB, (GEN_LEN,), generator=g)]))
            mask.append(torch.cat([prompt_mask, torch.ones(GEN_LEN, dtype=torch.long)]))
    order = torch.randperm(len(ids), generator=g)
    return torch.stack(ids)[order], torch.stack(mask)[order]


def row_by_row(model, ids, mask):
    """Each row alone, unpadded, through the model's plain forward: log-probs of its generated tokens."""
    rows = []
    for row, row_mask in zip(ids, mask):
        real = row[row_mask.bool()][None]
        logits = model(input_ids=real).logits[0, -GEN_LEN - 1 : -1].log_softmax(-1)
        rows.append(logits.gather(-1, real[0, -GEN_LEN:, None])[:, 0])
    return torch.stack(rows)


def count_calls(model):
    calls = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)),
                                    with_kwargs=True)  # fmt: skip
    return calls


@pytest.mark.parametrize("padded", [False, True])
def test_shared_prompts_give_the_row_by_row_logprobs_and_gradients(padded):
    model = build_tiny_llama(VOCAB, seed=3)
    ids, mask = group_batch([12, 9, 11] if padded else [12, 12, 12], rows_per_prompt=4)
    mask = mask if padded else None
    weights = torch.randn(ids.shape[0], GEN_LEN, generator=torch.Generator().manual_seed(1))
    calls = count_calls(model)
    shared = generated_logprobs(model, ids, GEN_LEN, mask)
    # one call for the 3 distinct prompts (12 columns), one for the 12 rows' completions but their last token
    assert calls == [(3, 12), (12, GEN_LEN - 1)]
    (shared * weights).sum().backward()
    shared_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    expected = row_by_row(model, ids, torch.ones_like(ids) if mask is None else mask)
    (expected * weights).sum().backward()
    torch.testing.assert_close(shared, expected, rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(shared_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_adapters_on_and_off_share_prompts_too():
    model = apply_lora(build_tiny_llama(VOCAB, seed=3), LoraSettings(r=4))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; nonzero, the adapters change the output
            torch.nn.init.normal_(p, std=0.5, generator=torch.Generator().manual_seed(2))
    ids, mask = group_batch([10, 7], rows_per_prompt=3)
    calls = count_calls(model)
    with torch.no_grad():
        on = generated_logprobs(model, ids, GEN_LEN, mask)
        with model.disable_adapter():
            off = generated_logprobs(model, ids, GEN_LEN, mask)
        on_alone, off_alone = row_by_row(model, ids, mask), None
        with model.disable_adapter():
            off_alone = row_by_row(model, ids, mask)
    assert calls[:4] == [(2, 10), (6, GEN_LEN - 1)] * 2
    assert (on - off).abs().max() > 0.01  # the adapters matter here
    torch.testing.assert_close(on, on_alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(off, off_alone, rtol=0, atol=1e-5)


def test_prompts_run_with_every_row_where_sharing_cannot_or_does_not_pay():
    model = build_tiny_llama(VOCAB, seed=3)
    ids, mask = group_batch([12, 9], rows_per_prompt=4)
    calls = count_calls(model)
    # 2 rows of a 1-token prompt before 5 generated: 1 of the 2 * 5 positions saved, under MIN_SAVED_SHARE
    short, _ = group_batch([1], rows_per_prompt=2)
    assert saved_share(prompt_groups(short, GEN_LEN, None), 1, GEN_LEN) == 1 / 10 < shared_prompts.MIN_SAVED_SHARE
    generated_logprobs(model, short, GEN_LEN)
    assert calls == [(2, GEN_LEN)]  # whole rows but the last token, once
    # every row its own prompt: nothing to share
    calls.clear()
    distinct = torch.randint(1, VOCAB, (3, 10 + GEN_LEN), generator=torch.Generator().manual_seed(4))
    generated_logprobs(model, distinct, GEN_LEN)
    assert calls == [(3, 9 + GEN_LEN)]
    # checkpointed decoder layers: Hugging Face drops the cache there
    enable_activation_checkpointing(model)
    assert not can_share_prompts(model)
    calls.clear()
    checkpointed = generated_logprobs(model, ids, GEN_LEN, mask)
    assert calls == [(8, 11 + GEN_LEN)]
    torch.testing.assert_close(checkpointed, row_by_row(model, ids, mask), rtol=0, atol=1e-5)


def test_models_of_other_shapes_run_whole_rows():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()
    assert not can_share_prompts(model)
    ids, _ = group_batch([12], rows_per_prompt=4)
    calls = count_calls(model)
    generated_logprobs(model, ids, GEN_LEN)
    assert calls == [(4, 11 + GEN_LEN)]


def test_a_model_sharded_by_fsdp_runs_whole_rows():
    """FSDP would run each shard's forward twice before one backward: not measured, so not done."""
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no fully_shard")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process, in memory
    try:
        model = build_tiny_llama(VOCAB, seed=3)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fsdp.fully_shard(layer, mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)
        assert not can_share_prompts(model)
        ids, _ = group_batch([12], rows_per_prompt=4)
        calls = count_calls(model)
        generated_logprobs(model, ids, GEN_LEN)
        assert calls == [(4, 11 + GEN_LEN)]
    finally:
        dist.destroy_process_group()
