"""The models of ``GRPOModule`` (a mixin): loading the policy and its frozen reference, the checks that refuse
what cannot work before any weights load, and the reference's log-probabilities.

It reads the module's ``args``, ``lora``, ``reward``, ``prompts``, ``eval_prompts``, ``start_token``,
``chat_template``, ``stop_at_eos``, ``activation_checkpointing``, ``attn_implementation`` and
``trust_remote_code``, and sets its ``tokenizer``, ``policy``, ``ref_model``, ``stop_tokens`` and
``max_positions``.
"""

from __future__ import annotations

import contextlib
import os

from torch import Tensor

from rewards.base import prepare_reward

from .activation_checkpointing import enable_activation_checkpointing
from .fused_attention import use_fused_attention
from .fused_decode import switched_on
from .fused_training import use_fused_layers
from .heldout import heldout_rows
from .lora import apply_lora
from .models import check_model_fits, load_causal_lm, load_model_config, load_tokenizer, resolve_model_path
from .objectives import get_logprobs_batched
from .packed_linear import KEEP_REFERENCE_LAYOUT_ENV, decode_matmul_backend, prepared_linear_layers
from .rollout import prompt_text
from .sampling import default_start_token, encode_prompt, stop_token_ids
from .training_products import training_matmul_backend, use_training_products

# Up to this many tokens per sequence, plain ("eager") attention beats the fused kernel on CPU (a
# learning step of 32 x 33 tokens of SmolLM2-135M: 3.16 s against 3.54 s); its seq x seq matrices stay small.
SHORT_SEQUENCE_TOKENS = 64


class PolicyModels:
    """The model hooks and helpers of ``GRPOModule``: ``configure_model``, ``check_inputs`` and
    ``get_ref_logprobs`` (module docstring)."""

    @property
    def uses_reference(self) -> bool:
        return self.args.kl_coef > 0

    def configure_model(self) -> None:
        """Loads the models once (Lightning and ``load_from_checkpoint`` may both call this)."""
        if self.policy is not None:
            return
        self.check_inputs()  # loads the tokenizer; refuses what cannot work before any weights load
        prepare_reward(self.reward)  # load a reward model now: a missing classifier fails before training
        if self.stop_at_eos:
            self.stop_tokens = stop_token_ids(self.tokenizer)
        attention = self.attention_kernel()
        self.policy = load_causal_lm(self.args.base_model, attention, self.trust_remote_code)
        if self.lora is not None:
            # The reference is this same network with its adapters disabled: no second copy.
            self.policy = apply_lora(self.policy, self.lora, seed=self.args.seed)
            from .lora_products import use_lora_products  # imports peft, which only LoRA runs need

            use_lora_products(self.policy)  # the adapters' update added in place, forward and backward
        elif self.uses_reference:
            reference = load_causal_lm(self.args.base_model, attention, self.trust_remote_code)
            self.ref_model = reference.requires_grad_(False)
        if self.activation_checkpointing:
            enable_activation_checkpointing(self.policy)
        use_training_products(self.policy)  # the learning step's fp32 products through oneDNN where faster
        # norms, gated MLPs and attention as fused kernels, forward and backward
        for model in (self.policy, self.ref_model):
            if model is not None:
                use_fused_layers(model)
                use_fused_attention(model)

    def check_inputs(self) -> None:
        """Loads the tokenizer (once) and, before any weights load, refuses a tokenizer that does not fit
        the model, a prompt + gen_len beyond its context, or truncated weight files. The command line
        calls it before the trainer is built, so that a refusal is all a run prints."""
        decode_matmul_backend(), training_matmul_backend()  # a misspelt library override: one line, now
        path = resolve_model_path(self.args.base_model)
        config = load_model_config(path, self.trust_remote_code)  # first: the smallest file, read alone
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(path, self.trust_remote_code)
        start = default_start_token(self.tokenizer) if self.start_token is None else self.start_token
        # As encode_prompt counts, without the tokenizer's warning about texts beyond its maximum length.
        prompt_tokens = max(len(self.tokenizer(text, add_special_tokens=False, verbose=False).input_ids)
                            for text in self.known_prompt_texts(start))  # fmt: skip
        check_model_fits(config, path, len(self.tokenizer), prompt_tokens, self.args.gen_len)
        self.max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)

    def known_prompt_texts(self, start: str) -> list[str]:
        """The texts the model will be asked, where they are known before training: the single prompt, or
        every row of a fixed prompt set (a generated stream is checked as it is drawn), and the held-out
        prompts."""
        rows = []
        if self.prompts is not None:
            with contextlib.suppress(NotImplementedError):
                rows = self.prompts.all_rows()
        if self.eval_prompts is not None:
            rows = rows + heldout_rows(self.eval_prompts)
        texts = [prompt_text(self.tokenizer, row["prompt"], self.start_token, self.chat_template) for row in rows]
        return texts or [start + self.args.prompt]

    def attention_kernel(self) -> str | None:
        """``attn_implementation``, or for null: "eager" for short sequences, else transformers' default."""
        if self.attn_implementation is not None:
            return self.attn_implementation
        if self.prompts is not None or self.chat_template:
            return None  # lengths known only as prompts are drawn: transformers' default kernel
        prompt_tokens = encode_prompt(self.tokenizer, self.args.prompt, self.start_token).shape[1]
        return "eager" if prompt_tokens + self.args.gen_len <= SHORT_SEQUENCE_TOKENS else None

    def get_ref_logprobs(self, sample_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor | None:
        """(B, T) log-probabilities under the reference policy; None when there is none (kl_coef=0).
        With LoRA, the reference is the policy with its adapters switched off."""
        if not self.uses_reference:
            return None
        reference = self.ref_model if self.lora is None else self.policy
        context = self.policy.disable_adapter() if self.lora is not None else contextlib.nullcontext()
        # Where oneDNN multiplies (packed_linear.py: its layout fits any row count): fp32 on the AMD Zen 4
        # machine took 6-8 % off this pass on plain weights, and 7-9 % more laid out once; bf16 autocast too.
        # The reference's weights are frozen: laid out at the first phase and kept (keeps_reference_layout).
        if self.keeps_reference_layout():
            products = self.reference_layout.prepared(reference, rows=None)
        else:
            self.reference_layout.clear()
            products = prepared_linear_layers(reference, rows=None)
        with context, products:
            chunk = self.phase_args.minibatch_size
            return get_logprobs_batched(reference, sample_ids, self.args.gen_len, chunk, attention_mask)

    def keeps_reference_layout(self) -> bool:
        """Whether the reference's prepared products are kept from one phase to the next (``KeptLayout``: one
        layout per run instead of one per phase, for as much memory as its linear weights, held through the
        learning phase too). By default yes, unless activation checkpointing is on: a run that trades compute
        for memory. ``GRPO_LIGHTNING_KEEP_REFERENCE_LAYOUT=1`` or ``0`` chooses, as the other switches do."""
        if os.environ.get(KEEP_REFERENCE_LAYOUT_ENV, "").strip():  # 0, false, no or off: not kept
            return switched_on(KEEP_REFERENCE_LAYOUT_ENV)
        return not self.activation_checkpointing
