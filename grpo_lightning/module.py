"""GRPOModule: GRPO as a LightningModule. One phase = one epoch.

Read top to bottom, in the order a phase runs:
  configure_model        load the policy (and, with kl_coef > 0, a frozen reference copy): PolicyModels
                         (grpo_lightning.policy_models), with the input checks and the reference's log-probs
  on_train_epoch_start   rollout under no_grad: sample, score, advantages, old/ref log-probs -> memory
  train_dataloader       an IterableDataset over the memory: shuffled minibatches
  training_step          clipped surrogate - kl_coef * k2, maximised by AdamW(maximize=True)
  configure_optimizers   AdamW + warmup/linear-decay schedule stepped once per phase
  validation_step        with eval_prompts: greedy answers to held-out prompts, scored (grpo_lightning.heldout)
Lightning does backward, gradient clipping, precision, devices, checkpoints and logging.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Callable

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from torchmetrics import MaxMetric, MeanMetric

from rewards import CharCount, Reward
from rewards.base import describe_reward

from .activation_checkpointing import flag_checkpointed_layers
from .config import GRPO_Args, GRPOConfigError, validate_module_settings
from .distributed import (
    all_gather_objects,
    check_process_split,
    export_once,
    gather_rollout,
    rank_and_world,
    rank_share,
    token_mean_denominator,
)
from .kl import kl_loss_penalty, kl_loss_terms
from .losses import kl_objective, surrogate_objective
from .losses import loss_variant as loss_variant_named
from .lora import LoraSettings
from .machine import competing_processes, cpu_contention_warning, fit_threads_to_cpus
from .memory import ReplayDataset, ReplayMemory, ReplayMinibatch
from .guards import NonFiniteSteps
from .models import check_model_name
from .objectives import calc_clipped_surrogate_objective, clip_fraction, generated_logprobs
from .optim import get_optimizer_and_scheduler
from .packed_linear import KeptLayout
from .persistence import drop_frozen_keys, export_policy, forgive_missing_frozen_keys
from .policy_models import PolicyModels
from .phase_logging import PhaseTimer, RolloutRecord, perf_scalars, rollout_scalars, sample_table, write_histograms
from .reporting import phase_line, render_console_table, render_markdown_table
from .rollout_stats import importance_ratio_stats
from .heldout import HeldOutEvaluation, HeldOutScores, heldout_rows
from .prompts import PromptSource, describe_source
from .rollout_phase import run_rollout


# Intentional, explained choices that Lightning warns about on every run:
# - the models stay in eval mode while training (no dropout; see on_train_epoch_start);
# - the replay dataset is an IterableDataset with a __len__ (the fixed number of minibatches per phase).
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
# - the model summary cannot size bf16-mixed parameters (they are fp32; the summary says so itself);
warnings.filterwarnings("ignore", message=r"Precision bf16-mixed is not supported by the model summary")
# - a reward model is stored in hparams as plain data (its class_path/init_args), not as a module.
warnings.filterwarnings("ignore", message=r"Attribute 'reward' is an instance of `nn.Module`")
# - a step with a NaN or inf loss is skipped by returning None from training_step (counted and logged).
# - a resumed run writes into a new version directory, so its checkpoint callback starts afresh there.
warnings.filterwarnings("ignore", message=r"The dirpath has changed from")
warnings.filterwarnings("ignore", message=r"`training_step` returned `None`")
# - under DDP the rollout/ scalars are computed from every rank's gathered record (grpo_lightning.distributed):
#   they are the whole phase's already, the same on every rank, with nothing left to reduce.
warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('rollout/")
# - the held-out scores are torchmetrics metrics, summed over processes when computed (grpo_lightning.heldout).
warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('eval/")
# - without held-out prompts the validation loader is an empty list: no validation, on purpose (heldout_loader).
warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero")


def _not_an_advertisement(record: logging.LogRecord) -> bool:
    """Lightning's trainer logs a tip that advertises its hosted logger on every run without one; the run's
    first lines are kept for what it does (the precision chosen, the devices)."""
    return not str(record.msg).startswith("💡 Tip:")


# Lightning's rank-zero helpers log through one of these two, whichever package set it last.
for _logger in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
    logging.getLogger(_logger).addFilter(_not_an_advertisement)


def phase_seed(seed: int, phase: int, rank: int) -> int:
    """A distinct, reproducible seed per (run seed, phase, process): a resumed run samples exactly
    what an uninterrupted one would have, and each rank of a multi-device run samples its own group."""
    return ((seed * 1_000_003 + phase) * 1_009 + rank) % (2**63)


class GRPOModule(PolicyModels, HeldOutEvaluation, L.LightningModule):
    def __init__(
        self,
        reward: Reward | Callable[[list[str]], Tensor] | None = None,
        model_name_or_path: str | None = None,
        prompt: str = "This is",
        start_token: str | None = None,
        prompts: PromptSource | None = None,
        prompts_per_phase: int = 1,
        refill_flat_groups: int = 0,
        chat_template: bool = False,
        eval_prompts: PromptSource | None = None,
        eval_every_n_phases: int = 5,
        eval_before_training: bool = True,
        total_phases: int = 100,
        batch_size: int = 128,
        num_minibatches: int = 4,
        batches_per_learning_phase: int = 2,
        gen_len: int = 30,
        temperature: float = 1.0,
        lr: float = 1e-5,
        warmup_steps: int = 10,
        final_scale: float = 0.1,
        max_grad_norm: float = 1.0,
        max_nonfinite_steps: int = 3,
        clip_coef: float = 0.2,
        kl_coef: float = 0.3,
        kl_estimator: str = "k2",
        stop_at_eos: bool = False,
        loss_variant: str = "grpo",
        clip_coef_high: float | None = None,
        seed: int = 1,
        samples_shown: int = 8,
        export_dir: str | None = "hf_model",
        lora: bool | LoraSettings = False,
        recompute_old_logprobs: bool = False,
        activation_checkpointing: bool = False,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
    ):
        """
        Args:
            reward: maps samples (prompt + completion strings) to a float tensor (B,). In YAML, a
                ``class_path``/``init_args`` block, e.g. ``rewards.CharCount``; null (the default) is
                the reference's period count, ``rewards.CharCount`` with char ".".
            model_name_or_path: Hugging Face hub id or local directory of a causal LM; unset (null)
                uses the embedded SmolLM2-135M-Instruct.
            prompt: the text every completion continues (one prompt, so the whole batch is one group).
            start_token: prepended to the prompt as a start-of-document marker; null picks the
                tokenizer's own (``<|endoftext|>`` for GPT-2 and SmolLM2); "" for none.
            prompts: prompts as data instead of the single ``prompt``: a ``PromptSource`` block, e.g.
                ``grpo_lightning.prompts.PromptFile`` with ``path: data.jsonl`` (rows with a ``prompt``
                column and any others, which rewards may read). Each phase draws ``prompts_per_phase``
                rows (which ones depends on the seed and the phase only) and samples ``batch_size``
                completions of each: one group per prompt, advantages normalised within each group.
            prompts_per_phase: prompts (groups) per phase, with ``prompts``.
            refill_flat_groups: dynamic sampling, with ``prompts``: rounds of replacing each group whose
                rewards are all equal (zero advantages, no signal) by a group of a newly drawn prompt;
                0 (default) keeps them. ``rollout/refilled_groups`` counts the replacements.
            chat_template: render each prompt through the tokenizer's chat template as a user turn (how
                instruct models are meant to be asked) instead of start_token + prompt.
            eval_prompts: held-out prompts to evaluate the policy on, a fixed ``PromptSource`` (e.g.
                ``grpo_lightning.tasks.ArithmeticProblems`` with ``split: heldout``): answered greedily and
                scored with the reward, logged as ``eval/accuracy`` and ``eval/mean_reward``
                (``grpo_lightning.heldout``); null (default): no evaluation.
            eval_every_n_phases: with eval_prompts, evaluate after every this many phases (the trainer's
                ``check_val_every_n_epoch``).
            eval_before_training: with eval_prompts, evaluate the starting model too, before phase 1 of
                a new run (logged at step 0).
            total_phases: phases to train (a phase = rollout + learning = one epoch).
            batch_size: completions per prompt, the GRPO group size G (per phase: G x prompts_per_phase).
            num_minibatches: minibatches the group is split into for the learning phase.
            batches_per_learning_phase: shuffled passes over the group per learning phase.
            gen_len: tokens generated per completion (always exactly this many).
            temperature: sampling temperature (1.0 samples the policy's own distribution).
            lr: peak learning rate of AdamW.
            warmup_steps: phases of linear LR warmup.
            final_scale: LR multiplier reached at the last phase, after linear decay.
            max_grad_norm: gradient-norm clipping threshold (the trainer's gradient_clip_val wins if set).
            max_nonfinite_steps: a learning step whose loss or gradient is NaN or inf is skipped (nothing
                is applied) and counted (``train/nonfinite_steps``); this many in a row stop the run with
                one line, the last good checkpoint intact.
            clip_coef: epsilon of the clipped surrogate, in (0, 1).
            kl_coef: beta, weight of the KL penalty to the reference model; 0 loads no reference.
            kl_estimator: how the KL is penalised: "k2" (default) in the loss, whose gradient is that of
                the reverse KL(pi || pi_ref); "k3" in the loss (its gradient follows the forward KL, for
                comparison); "k1_reward": ``kl_coef * sum_t log(pi/pi_ref)`` subtracted from each reward
                before advantages are computed. See ``grpo_lightning.kl``.
            stop_at_eos: false (default, the chapter's) samples exactly gen_len tokens per completion;
                true ends a completion at its first end token (eos, or a chat model's end of turn such
                as ``<|im_end|>``), at most gen_len tokens; the padding after it never counts (a
                completion mask is carried through log-probabilities, KL, surrogate and statistics).
            loss_variant: how advantages are scaled and per-token terms summed: "grpo" (the chapter's),
                "dapo", "dr_grpo" or "gspo"; see ``grpo_lightning.losses`` and the README's table.
            clip_coef_high: the clipped surrogate's upper epsilon (DAPO's "clip higher", e.g. 0.28);
                null: clip_coef.
            seed: seed of sampling and minibatch shuffling (per phase, so resumed runs match).
            samples_shown: samples printed and logged per phase, the best and worst of the group included.
            export_dir: where, inside the run's log directory, the trained policy and tokenizer are
                saved in Hugging Face format at the end of training; null to skip. With LoRA, the
                adapter is saved (peft format) in ``<export_dir>/adapter``, and the merged model in
                ``<export_dir>`` only if ``lora.merge_on_export``.
            lora: true (default settings) or a block of LoraSettings to train LoRA adapters instead
                of the whole policy; the reference policy is then the policy with adapters disabled.
            recompute_old_logprobs: false (default) keeps log pi_old as sampling computed it, from the
                very logits each token was drawn from (same weights, same precision context); true
                recomputes it with a separate forward pass over the group after sampling, as the
                reference does (identical in exact arithmetic, one more forward pass per phase).
            activation_checkpointing: recompute each decoder layer's activations in the backward pass
                instead of keeping them: much less memory in the learning phase, about a third more
                compute there. See ``grpo_lightning.activation_checkpointing``.
            attn_implementation: the policy's attention kernel, as transformers names it ("eager",
                "sdpa", ...); null picks "eager" for sequences (prompt + gen_len) of at most
                64 tokens, where it is 10-15% faster on CPU than the fused kernel, and transformers'
                default otherwise (eager attention keeps a seq x seq matrix per head for backward).
            trust_remote_code: run the Python files a model directory or hub repo ships with its weights
                (models whose architecture transformers lacks). Off by default: nothing from a model
                directory is executed unless you turn this on for a model you trust.
        """
        super().__init__()
        check_model_name(model_name_or_path)
        self.variant = loss_variant_named(loss_variant)
        if reward is None:
            reward = CharCount(".")
        if isinstance(reward, torch.nn.Module):  # a reward model: a child, so Lightning places it; never trained
            reward.requires_grad_(False).eval()
        validate_module_settings(
            kl_estimator=kl_estimator, clip_coef_high=clip_coef_high, samples_shown=samples_shown,
            max_nonfinite_steps=max_nonfinite_steps, has_prompts=prompts is not None,
            eval_every_n_phases=eval_every_n_phases,
            prompts_per_phase=prompts_per_phase, refill_flat_groups=refill_flat_groups, batch_size=batch_size,
            num_minibatches=num_minibatches,
        )  # fmt: skip
        self.args = GRPO_Args(
            seed=seed, total_phases=total_phases, prompt=prompt, batch_size=batch_size,
            num_minibatches=num_minibatches, batches_per_learning_phase=batches_per_learning_phase,
            lr=lr, max_grad_norm=max_grad_norm, warmup_steps=warmup_steps, final_scale=final_scale,
            clip_coef=clip_coef, kl_coef=kl_coef, base_model=model_name_or_path, gen_len=gen_len,
            temperature=temperature, reward_fn=reward,
        )  # fmt: skip
        self.reward = reward
        self.start_token = start_token
        self.prompts = prompts
        self.prompts_per_phase = prompts_per_phase
        self.refill_rounds = refill_flat_groups
        self.chat_template = chat_template
        if eval_prompts is not None:
            heldout_rows(eval_prompts)  # a fixed, non-empty set, or one line now, before anything loads
        self.eval_prompts = eval_prompts
        self.eval_before_training = eval_before_training
        self.kl_estimator = kl_estimator
        self.stop_at_eos = stop_at_eos
        self.clip_coef_high = clip_coef_high
        self.stop_tokens: list[int] | None = None  # the ids that end a completion, with stop_at_eos
        self.max_positions: int | None = None  # the model's context, read by check_inputs
        self.samples_shown = samples_shown
        self.export_dir = export_dir
        self.recompute_old_logprobs = recompute_old_logprobs
        self.activation_checkpointing = activation_checkpointing
        self.attn_implementation = attn_implementation
        self.nonfinite = NonFiniteSteps(max_nonfinite_steps)
        self.trust_remote_code = trust_remote_code
        if isinstance(lora, dict):  # as stored in a checkpoint's hyperparameters
            lora = LoraSettings(**lora)
        self.lora: LoraSettings | None = LoraSettings() if lora is True else (lora or None)
        if self.lora is not None:
            self.lora.validate()
        self.save_hyperparameters()
        # Checkpoints must hold plain data only, to stay loadable with torch.load(weights_only=True).
        if not isinstance(self.hparams.reward, dict):  # built in Python, not by the CLI (which stores its config)
            self.hparams.reward = describe_reward(reward)
        for name in ("prompts", "eval_prompts"):
            if isinstance(self.hparams[name], PromptSource):
                self.hparams[name] = describe_source(self.hparams[name])
        if isinstance(self.hparams.lora, LoraSettings):
            self.hparams.lora = dataclasses.asdict(self.hparams.lora)

        self.policy: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        self.reference_layout = KeptLayout()  # the reference's products, laid out once (get_ref_logprobs)
        self.tokenizer = None
        self.memory: ReplayMemory | None = None
        self._shuffle_generator: torch.Generator | None = None
        self.timer = PhaseTimer()  # seconds per part of the current phase; read by benchmarks/phase_time.py
        # Importance ratios over a whole learning phase (the per-step values are logged too).
        self.ratio_mean = MeanMetric()
        self.ratio_max = MaxMetric()
        self.heldout = HeldOutScores(examples_kept=samples_shown)

        # The frozen reference and reward models never change: keep them out of checkpoints, and
        # forgive exactly their keys when loading, so that loading stays strict for everything else.
        self.register_state_dict_post_hook(drop_frozen_keys)
        self.register_load_state_dict_post_hook(forgive_missing_frozen_keys)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None,
                             weights_only: bool = True, **kwargs):  # fmt: skip
        """Lightning's, loading with ``weights_only=True`` unless asked otherwise: a checkpoint of this module
        holds plain data only, so no code in a checkpoint file ever runs."""
        return super().load_from_checkpoint(checkpoint_path, map_location, hparams_file, strict, weights_only, **kwargs)

    # (the models: configure_model, check_inputs and get_ref_logprobs are PolicyModels', in policy_models.py)

    # ---- the phase's rows ------------------------------------------------------------------

    @property
    def sequences_per_phase(self) -> int:
        """This process's sequences per phase: a group of batch_size per prompt row it rolls out (under DDP
        its share of the phase's rows; with the single prompt, one group per process)."""
        if self.prompts is None:
            return self.args.batch_size
        return self.args.batch_size * self.prompts_per_phase // rank_and_world(self)[1]

    @property
    def phase_args(self) -> GRPO_Args:
        """The settings with batch_size = the sequences of a whole phase (all groups): what the replay
        memory splits into minibatches."""
        if self.prompts is None:
            return self.args
        return dataclasses.replace(self.args, batch_size=self.sequences_per_phase)

    def draw_rows(self) -> list[dict]:
        """This process's prompt rows: the single prompt, or its share of the ``prompts_per_phase`` rows drawn
        by seed and phase (every rank draws them all, the same, and keeps whole groups of its own)."""
        if self.prompts is None:
            return [{"prompt": self.args.prompt}]
        rows = self.prompts.draw(self.args.seed, self.current_epoch, self.prompts_per_phase)
        return rank_share(rows, *rank_and_world(self))

    @property
    def on_policy(self) -> bool:
        """One minibatch, one pass: every step's policy is the one that sampled, so log pi_old is
        exactly the detached current log pi (the importance ratio is exactly 1)."""
        return self.args.num_minibatches == 1 and self.args.batches_per_learning_phase == 1

    # ---- rollout phase ---------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        # The command line checks this before it starts the other processes; here for Trainer(...).fit.
        check_process_split(self, self.trainer.world_size)

    def on_fit_start(self) -> None:
        max_epochs = self.trainer.max_epochs
        if max_epochs != self.args.total_phases:
            raise GRPOConfigError(
                f"trainer.max_epochs ({max_epochs}) must equal model.total_phases ({self.args.total_phases}): "
                "one epoch is one GRPO phase and the LR schedule is laid out over total_phases"
            )
        # One process on the CPU: say so if others compete for its cores (other ranks of a multi-process
        # run would count as competitors, so only single-process runs check).
        if self.device.type == "cpu" and self.trainer.world_size == 1:
            for message in (fit_threads_to_cpus(), cpu_contention_warning(competing_processes())):
                if message:
                    warnings.warn(message, stacklevel=1)

    def relay_lr_schedule(self) -> None:
        """On resume, the checkpoint restored the optimizer's learning rates as they were: lay the schedule out
        again from the settings of this run, so that a changed lr or total_phases is honoured. Unchanged
        settings give back the very same numbers (the formula LambdaLR itself uses)."""
        if self.trainer.ckpt_path is None:
            return
        for config in self.trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            scheduler.base_lrs = [self.args.lr] * len(scheduler.base_lrs)
            for group, lr_lambda in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
                group["initial_lr"] = self.args.lr
                group["lr"] = self.args.lr * lr_lambda(scheduler.last_epoch)

    def on_train_start(self) -> None:
        self.relay_lr_schedule()
        if self.eval_prompts is not None and self.eval_before_training and self.trainer.ckpt_path is None:
            self.evaluate_starting_model()

    def on_train_epoch_start(self) -> None:
        # eval() switches off dropout only (gradients still flow): rollout, learning and reference
        # log-probabilities must all come from the same deterministic function.
        self.policy.eval()
        if self.activation_checkpointing:
            flag_checkpointed_layers(self.policy)  # eval() cleared the flag checkpointing needs
        seed = phase_seed(self.args.seed, self.current_epoch, self.global_rank)
        torch.manual_seed(seed)
        self._shuffle_generator = torch.Generator().manual_seed(seed + 1)
        self.timer.reset()
        with torch.no_grad(), self.rollout_precision_context(), self.timer.measure("rollout"):
            self.memory = self.rollout_phase()

    def rollout_precision_context(self):
        """The precision context of ``training_step``, so the first minibatch's importance ratio is 1 (up to
        that precision's rounding, since log pi_old comes from the KV-cached sampling pass).

        Under mixed precision it is Lightning's autocast with the cast-weight cache switched on: the
        weights do not change during the rollout, so each is cast to bf16 once, not once per generated
        token (Lightning turns the cache off because training steps change the weights)."""
        plugin = self.trainer.precision_plugin
        autocast = getattr(plugin, "autocast_context_manager", None)  # Lightning's MixedPrecision plugin
        if autocast is not None:
            lightning_autocast = autocast()
            return torch.autocast(lightning_autocast.device, dtype=lightning_autocast.fast_dtype, cache_enabled=True)
        return plugin.forward_context()

    def rollout_phase(self) -> ReplayMemory:
        """Sample, score and measure this phase's groups (``grpo_lightning.rollout_phase``), report them,
        and keep them in the replay memory for the learning phase."""
        memory, record, refilled = run_rollout(self)
        self.log_rollout(record)
        if self.refill_rounds:  # each rank refills its own groups
            self.log("rollout/refilled_groups", float(sum(all_gather_objects(refilled))), on_step=False,
                     on_epoch=True, batch_size=1)  # fmt: skip
        return memory

    def log_rollout(self, record: RolloutRecord) -> None:
        # Under DDP: every rank's groups (a collective), so that all of this describes the whole phase.
        record, components = gather_rollout(record, getattr(self.reward, "last_components", {}))
        scalars = rollout_scalars(record, group_size=self.args.batch_size)  # one prompt: one group
        for name, values in components.items():  # e.g. WeightedSum's terms
            scalars[f"rollout/reward_components/{name}"] = values.float().mean().cpu()
        self.log_dict(scalars, on_step=False, on_epoch=True, batch_size=len(record.samples))

        rows = sample_table(record, self.samples_shown)
        kl = scalars.get("rollout/kl_k1")
        if self.trainer.is_global_zero:
            line = phase_line(self.current_epoch + 1, self.args.total_phases, scalars["rollout/reward_mean"].item(),
                              None if kl is None else kl.item())  # fmt: skip
            print(f"\n{line}\n{render_console_table(rows)}", flush=True)
        experiment = getattr(self.logger, "experiment", None)
        if hasattr(experiment, "add_text"):  # TensorBoard
            experiment.add_text("rollout/samples", render_markdown_table(rows), self.global_step)
            write_histograms(experiment, record, self.global_step)

    # The learning phase is timed step by step (forward, backward, clipping and optimizer step), so
    # that checkpoint writing at the end of the epoch is not counted in it.
    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        self.timer.seconds["learn"] = self.timer.seconds.get("learn", 0.0) + time.perf_counter() - self._step_start

    def on_train_epoch_end(self) -> None:
        mask = self.memory.completion_mask
        generated_tokens = self.sequences_per_phase * self.args.gen_len if mask is None else int(mask.sum())
        scalars = perf_scalars(self.timer, generated_tokens)
        rate = scalars.pop("perf/generated_tokens_per_s", None)
        # Under DDP: the slowest rank's seconds (the others wait for it), and all ranks' tokens per second.
        self.log_dict(scalars, on_step=False, on_epoch=True, batch_size=1, sync_dist=True, reduce_fx="max")
        if rate is not None:
            self.log("perf/generated_tokens_per_s", rate, on_step=False, on_epoch=True, batch_size=1, sync_dist=True,
                     reduce_fx="sum")  # fmt: skip

    # ---- learning phase --------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        num_batches = self.args.num_minibatches * self.args.batches_per_learning_phase
        dataset = ReplayDataset(lambda: self.memory, num_batches, lambda: self._shuffle_generator)
        # batch_size=None: the dataset already yields whole minibatches. The DataLoader's own generator
        # keeps iter() from drawing on the global RNG, which would differ in a resumed run.
        return DataLoader(dataset, batch_size=None, generator=torch.Generator())

    def training_step(self, minibatch: ReplayMinibatch, batch_idx: int) -> Tensor:
        args = self.args
        logprobs = generated_logprobs(self.policy, minibatch.sample_ids, args.gen_len, minibatch.attention_mask)  # (b, T)
        # On-policy (one minibatch, one pass): log pi_old is this very forward pass, detached; the
        # ratio is exactly 1 and the gradient is the plain policy gradient, with no rounding noise.
        old_logprobs = logprobs.detach() if self.on_policy else minibatch.logprobs
        surrogate, kl_penalty = self.surrogate_and_kl_penalty(logprobs, old_logprobs, minibatch)
        objective = surrogate - kl_penalty
        # Every rank skips, or none does: a rank without a backward would leave the others waiting in DDP's
        # gradient all-reduce.
        if self.guards_numerics and not self.trainer.strategy.reduce_boolean_decision(bool(torch.isfinite(objective))):
            self.nonfinite.skipped("loss", self.where())
            self.log("train/nonfinite_steps", float(self.nonfinite.total), on_step=True, on_epoch=False)
            return None  # Lightning then runs neither backward nor the optimizer step
        mask = minibatch.completion_mask
        if mask is not None:  # statistics over generated tokens only
            logprobs, old_logprobs = logprobs[mask], old_logprobs[mask]
        ratio_mean, ratio_max = importance_ratio_stats(logprobs, old_logprobs)
        self.ratio_mean.update(ratio_mean)
        self.ratio_max.update(ratio_max)
        stats = {
            "train/objective": objective.detach(),
            "train/clipped_surrogate": surrogate.detach(),
            "train/kl_penalty": kl_penalty.detach(),
            "train/clip_fraction": clip_fraction(logprobs, old_logprobs, args.clip_coef),
            "train/ratio_mean": ratio_mean,
            "train/lr": torch.tensor(self.optimizers().param_groups[0]["lr"]),
        }
        # Under DDP: the mean over ranks (the union minibatch's value, the ranks' minibatches being of one
        # size), and the largest ratio of any rank.
        size = len(minibatch.advantages)
        self.log_dict(stats, on_step=True, on_epoch=False, batch_size=size, sync_dist=True)
        self.log("train/ratio_max", ratio_max, on_step=True, on_epoch=False, batch_size=size, sync_dist=True,
                 reduce_fx="max")  # fmt: skip
        self.log("train/ratio_mean_phase", self.ratio_mean, on_step=False, on_epoch=True)
        self.log("train/ratio_max_phase", self.ratio_max, on_step=False, on_epoch=True)
        # Returned as is, not negated: the optimizer is AdamW(maximize=True), as in the reference.
        return objective

    def surrogate_and_kl_penalty(self, logprobs: Tensor, old_logprobs: Tensor, minibatch: ReplayMinibatch):
        """The clipped surrogate and the KL penalty of a minibatch, both scalars (objective = surrogate - penalty).

        Fixed-length completions with the "grpo" variant: the chapter's formulas as they are. Otherwise
        the variant's, over the completion mask (see ``grpo_lightning.losses``)."""
        args, mask = self.args, minibatch.completion_mask
        no_penalty = torch.zeros((), device=logprobs.device)
        if mask is None and self.variant.name == "grpo" and self.clip_coef_high is None:
            surrogate = calc_clipped_surrogate_objective(logprobs, old_logprobs, minibatch.advantages, args.clip_coef)
            if not self.uses_reference:
                return surrogate, no_penalty
            return surrogate, kl_loss_penalty(logprobs, minibatch.ref_logprobs, args.kl_coef, self.kl_estimator)
        # A token mean over completions that end: under DDP, divided by the tokens of all ranks (a collective).
        tokens = None
        if mask is not None and self.variant.aggregation == "token_mean":
            tokens = token_mean_denominator(mask, self.trainer)
        mask = torch.ones_like(logprobs, dtype=torch.bool) if mask is None else mask
        surrogate = surrogate_objective(self.variant, logprobs, old_logprobs, minibatch.advantages, mask, args.clip_coef,
                                        self.clip_coef_high, max_len=args.gen_len, tokens=tokens)  # fmt: skip
        if not self.uses_reference or self.kl_estimator == "k1_reward":  # k1_reward: the KL is in the rewards
            return surrogate, no_penalty
        terms = kl_loss_terms(logprobs, minibatch.ref_logprobs, self.kl_estimator)
        return surrogate, args.kl_coef * kl_objective(self.variant, terms, mask, max_len=args.gen_len, tokens=tokens)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        clip_val = self.args.max_grad_norm if gradient_clip_val is None else gradient_clip_val
        if all(p.grad is None for group in optimizer.param_groups for p in group["params"]):
            return  # training_step returned None (a skipped step): no backward ran, nothing to clip or count
        if (gradient_clip_algorithm or "norm") != "norm":
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            self.skip_step_if_nonfinite(optimizer, torch.nn.utils.get_total_norm(grads))
            self.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)
            return
        # Clipped here rather than through Lightning's precision plugin, which refuses a fused AdamW (it
        # cannot unscale fp16 gradients for one). Gradients are true ones by now: bf16 and fp32 scale
        # nothing, and fp16 runs get the unfused optimizer, which Lightning unscales before this hook.
        # clip_grad_norm_ returns the norm before clipping: one pass over the gradients gives both.
        params = [p for group in optimizer.param_groups for p in group["params"]]
        total_norm = torch.nn.utils.clip_grad_norm_(params, clip_val)
        self.log("train/grad_norm", total_norm, on_step=True, on_epoch=False)
        self.skip_step_if_nonfinite(optimizer, total_norm)

    @property
    def guards_numerics(self) -> bool:
        # fp16's loss scaler skips steps with inf gradients itself, and lowers its scale: not a fault.
        return not str(self.trainer.precision).startswith("16")

    def where(self) -> str:
        return f"phase {self.current_epoch + 1}, step {self.global_step + 1}"

    def skip_step_if_nonfinite(self, optimizer, grad_norm: Tensor) -> None:
        """A NaN or inf gradient is dropped before the optimizer sees it: AdamW leaves a parameter without a
        gradient untouched (no update, no weight decay, no moment change), so nothing is applied."""
        if not self.guards_numerics:
            return
        if torch.isfinite(grad_norm):
            self.nonfinite.passed()
        else:
            optimizer.zero_grad(set_to_none=True)
            self.nonfinite.skipped("gradient", self.where())
        self.log("train/nonfinite_steps", float(self.nonfinite.total), on_step=True, on_epoch=False)

    def configure_optimizers(self):
        # fp16 with loss scaling needs Lightning to unscale gradients before clipping: no fused kernel there.
        fused = None if not str(self.trainer.precision).startswith("16") else False
        optimizer, scheduler = get_optimizer_and_scheduler(self.args, self.policy, fused=fused)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["nonfinite_steps"] = self.nonfinite.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.nonfinite.load_state_dict(checkpoint.get("nonfinite_steps", {}))

    # ---- the end ---------------------------------------------------------------------------

    def on_fit_end(self) -> None:
        if self.export_dir is not None:  # by rank 0, the other ranks waiting for it
            write = lambda out: export_policy(self.policy, self.tokenizer, out, self.lora)  # noqa: E731
            export_once(self.trainer, self.export_dir, write)
