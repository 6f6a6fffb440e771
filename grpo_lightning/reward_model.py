"""A Bradley-Terry reward model trained on a preference file, as a LightningModule.

``grpo-lightning reward-model fit --config experiments/reward_model.yaml`` (a LightningCLI over
``RewardModelModule`` and ``PreferenceData``).

The model is a pretrained causal LM (the embedded SmolLM2-135M-Instruct by default) with a scalar
head: transformers' ``AutoModelForSequenceClassification`` with ``num_labels=1``, which reads the
hidden state of the last non-padding token. Under Bradley-Terry, P(chosen beats rejected) =
sigmoid(r(chosen) - r(rejected)), so the loss is ``-logsigmoid(r_chosen - r_rejected)``, the
loss of TRL's ``RewardTrainer``. Logged: ``train/loss``, ``train/accuracy``; on the held-out pairs
``val/loss``, ``val/accuracy`` (the fraction of pairs the model orders as the labeller did) and
``val/margin`` (mean r_chosen - r_rejected). At the end the model and tokenizer are saved in Hugging
Face format to ``<log dir>/hf_model`` (LoRA adapters merged in): a directory that loads with
``AutoModelForSequenceClassification.from_pretrained`` and that ``rewards.LearnedReward`` scores with.

Texts are encoded by ``encode_texts`` in training and in ``LearnedReward`` alike: the tokenizer's
start-of-document token, then prompt + completion, right-padded.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

from .config import GRPOConfigError
from .distributed import export_once
from .lora import LoraSettings, default_target_modules
from .models import check_model_name, load_tokenizer, resolve_model_path, _load_error
from .preferences import PreferencePair, training_pairs
from .sampling import default_start_token


# ---------------------------------------------------------------------------------------------
# Pure pieces: encoding and the loss
# ---------------------------------------------------------------------------------------------


def prepare_tokenizer(tokenizer):
    """Right padding with a pad token (the EOS where there is none): the head reads the last token that is
    not padding, and right padding keeps every text's positions what they are unpadded."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def encode_texts(tokenizer, texts: list[str], max_length: int) -> dict[str, Tensor]:
    """``input_ids`` and ``attention_mask`` (B, T) of start-of-document token + text, truncated to
    ``max_length`` tokens. One function for training and scoring, so both see the same tokens."""
    start = default_start_token(tokenizer)
    return tokenizer(
        [start + text for text in texts], padding=True, truncation=True, max_length=max_length,
        add_special_tokens=False, return_tensors="pt",
    )  # fmt: skip


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> Tensor:
    """Mean negative log-likelihood of the labels under Bradley-Terry: -log sigmoid(r_c - r_r)."""
    return -F.logsigmoid(chosen - rejected).mean()


def load_reward_backbone(name_or_path: str | None, seed: int = 0):
    """A sequence-classification model with one output, float32. From a causal LM checkpoint the head is
    new: its initialisation is drawn from ``seed`` (the caller's global RNG is left as it was)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(name_or_path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "score.weight newly initialized": expected, it is what we train
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    except (OSError, ValueError) as error:
        raise _load_error(path, error) from error
    finally:
        hf_logging.set_verbosity(verbosity)
    return model


@torch.no_grad()
def score_texts(model, tokenizer, texts: list[str], max_length: int, batch_size: int = 32) -> Tensor:
    """The reward model's scalar for each text, float32 on the CPU, (B,)."""
    device = next(model.parameters()).device
    chunks = []
    for start in range(0, len(texts), batch_size):
        batch = encode_texts(tokenizer, texts[start : start + batch_size], max_length)
        logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits
        chunks.append(logits[:, 0].float().cpu())
    return torch.cat(chunks) if chunks else torch.zeros(0)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def split_pairs(pairs: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """A seeded shuffle, then the last ``val_fraction`` held out (at least one pair each side when possible)."""
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = min(len(pairs) - 1, max(1, round(val_fraction * len(pairs)))) if val_fraction > 0 else 0
    shuffled = [pairs[i] for i in order]
    return shuffled[: len(pairs) - n_val], shuffled[len(pairs) - n_val :]


class PreferenceData(L.LightningDataModule):
    def __init__(self, path: str = "preferences.jsonl", val_fraction: float = 0.2, batch_size: int = 8,
                 max_length: int = 128, seed: int = 1, model_name_or_path: str | None = None):  # fmt: skip
        """
        Args:
            path: the preference file (JSON Lines with prompt/chosen/rejected, as ``grpo-lightning label``
                writes and the hub's preference datasets use); ties are skipped.
            val_fraction: fraction of the pairs held out for val/accuracy and val/margin, picked by ``seed``.
            batch_size: pairs per training step.
            max_length: tokens kept of each text (start token + prompt + completion).
            seed: seed of the held-out split and of the shuffling.
            model_name_or_path: whose tokenizer encodes the texts (linked to model.model_name_or_path).
        """
        super().__init__()
        if not 0 <= val_fraction < 1:
            raise GRPOConfigError(f"data.val_fraction ({val_fraction}) must be in [0, 1)")
        if batch_size < 1:
            raise GRPOConfigError(f"data.batch_size ({batch_size}) must be at least 1")
        self.pairs = training_pairs(path)  # read now: a bad file stops the run before any model loads
        if len(self.pairs) < 2 and val_fraction > 0:
            raise GRPOConfigError(f"{path}: {len(self.pairs)} pair; holding some out needs at least 2 (or val_fraction 0)")
        self.train_pairs, self.val_pairs = split_pairs(self.pairs, val_fraction, seed)
        self.batch_size, self.max_length, self.seed = batch_size, max_length, seed
        self.model_name_or_path = model_name_or_path
        self.tokenizer = None

    def setup(self, stage: str) -> None:
        if self.tokenizer is None:
            self.tokenizer = prepare_tokenizer(load_tokenizer(self.model_name_or_path))

    def collate(self, pairs: list[PreferencePair]) -> dict[str, Tensor]:
        """Chosen texts then rejected texts, one padded batch of 2B rows: one forward pass per step."""
        texts = [p.chosen_text for p in pairs] + [p.rejected_text for p in pairs]
        return encode_texts(self.tokenizer, texts, self.max_length)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_pairs, self.batch_size, shuffle=True, generator=generator, collate_fn=self.collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_pairs, self.batch_size, collate_fn=self.collate)


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------


class RewardModelModule(L.LightningModule):
    def __init__(self, model_name_or_path: str | None = None, lr: float = 2e-5, weight_decay: float = 0.0,
                 warmup_fraction: float = 0.1, lora: bool | LoraSettings = False, seed: int = 1,
                 export_dir: str | None = "hf_model"):  # fmt: skip
        """
        Args:
            model_name_or_path: the backbone: a causal LM (a new scalar head is added) or a saved reward
                model; hub id or local directory; unset for the embedded SmolLM2-135M-Instruct.
            lr: AdamW peak learning rate, reached after warmup, then decayed linearly to 0.
            weight_decay: AdamW weight decay.
            warmup_fraction: fraction of the training steps of linear warmup.
            lora: true (default settings) or a block of LoraSettings: train LoRA adapters and the head only.
            seed: seed of the head's (and adapters') initialisation.
            export_dir: where, inside the run's log directory, the trained reward model and tokenizer
                are saved in Hugging Face format at the end (adapters merged); null to skip.
        """
        super().__init__()
        check_model_name(model_name_or_path)
        if lr <= 0:
            raise GRPOConfigError(f"model.lr ({lr}) must be > 0")
        if not 0 <= warmup_fraction < 1:
            raise GRPOConfigError(f"model.warmup_fraction ({warmup_fraction}) must be in [0, 1)")
        if isinstance(lora, dict):
            lora = LoraSettings(**lora)
        self.lora: LoraSettings | None = LoraSettings() if lora is True else (lora or None)
        self.save_hyperparameters()
        self.model = None
        self.tokenizer = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.tokenizer = prepare_tokenizer(load_tokenizer(self.hparams.model_name_or_path))
        model = load_reward_backbone(self.hparams.model_name_or_path, self.hparams.seed)
        model.config.pad_token_id = self.tokenizer.pad_token_id  # the head pools the last non-pad token
        if self.lora is not None:
            from peft import LoraConfig, get_peft_model

            settings = self.lora
            config = LoraConfig(
                r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout, task_type="SEQ_CLS",
                target_modules=settings.target_modules or default_target_modules(model),
            )  # fmt: skip  # SEQ_CLS: peft trains the new head ("score") in full next to the adapters
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.hparams.seed)
                model = get_peft_model(model, config)
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float()

    def _pair_step(self, batch: dict[str, Tensor], stage: str) -> Tensor:
        rewards = self(batch["input_ids"], batch["attention_mask"])
        chosen, rejected = rewards.chunk(2)
        loss = bradley_terry_loss(chosen, rejected)
        n = chosen.numel()
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss, batch_size=n, on_step=on_step, on_epoch=not on_step, prog_bar=True)
        self.log(f"{stage}/accuracy", (chosen > rejected).float().mean(), batch_size=n, on_step=on_step,
                 on_epoch=not on_step, prog_bar=stage == "val")  # fmt: skip
        if stage == "val":
            self.log("val/margin", (chosen - rejected).mean(), batch_size=n, on_epoch=True)
        return loss

    def training_step(self, batch, batch_idx: int) -> Tensor:
        # The backbone stays in the eval mode from_pretrained left it in (Lightning keeps a module's mode):
        # no dropout, so a pair's rewards are the same function in training, validation and as a reward.
        return self._pair_step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> None:
        self._pair_step(batch, "val")

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = int(self.hparams.warmup_fraction * total)

        def scale(step: int) -> float:  # linear warmup, then linear decay to 0 at the last step
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return max(0.0, (total - step) / max(1, total - warmup))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, scale)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_end(self) -> None:
        if self.hparams.export_dir is not None:  # by rank 0, the other ranks waiting for it
            export_once(self.trainer, self.hparams.export_dir, self.export)

    def export(self, out: str) -> None:
        export_reward_model(self.model, self.tokenizer, out)
        link = point_latest(self.trainer.default_root_dir, out)
        print(f"{link} -> {out} (the path a LearnedReward config can name)", flush=True)


def export_reward_model(model, tokenizer, out: str) -> None:
    """Hugging Face format, adapters merged: ``AutoModelForSequenceClassification.from_pretrained(out)``."""
    import copy

    if hasattr(model, "merge_and_unload"):
        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"Saved the reward model and tokenizer (Hugging Face format) to {out}", flush=True)


LATEST_LINK = "latest_hf_model"


def point_latest(root: str, target: str) -> str:
    """Points ``<root>/latest_hf_model`` (a relative link) at ``target``, swapped atomically, so that one
    fixed path in a GRPO config names the newest reward model."""
    link = os.path.join(root, LATEST_LINK)
    tmp = f"{link}.tmp-{os.getpid()}"
    os.symlink(os.path.relpath(target, root), tmp)
    os.replace(tmp, link)
    return link


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def make_reward_model_cli(args=None, run: bool = True):
    from lightning.pytorch.cli import LightningCLI

    from .cli import settle_precision

    class RewardModelCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            parser.link_arguments("model.model_name_or_path", "data.model_name_or_path")

        def before_instantiate_classes(self) -> None:
            trainer = (self.config[self.subcommand] if self.subcommand else self.config).trainer
            trainer.precision = settle_precision(trainer.precision, trainer.accelerator)

    return RewardModelCLI(
        RewardModelModule, PreferenceData,
        trainer_defaults={
            "default_root_dir": "runs/reward_model", "log_every_n_steps": 1, "num_sanity_val_steps": 0,
            "max_epochs": 2,
            # Minutes of training: the product is the exported hf_model, not a resumable checkpoint
            # (one would weigh 1.6 GB for the embedded model). --trainer.enable_checkpointing true keeps them.
            "enable_checkpointing": False,
        },
        seed_everything_default=1, parser_kwargs={"exit_on_error": False}, args=args, run=run,
    )  # fmt: skip


def main(argv: list[str]) -> int:
    """``grpo-lightning reward-model fit ...``: errors end in one line (exit 2 for settings and data)."""
    from jsonargparse import ArgumentError

    from .cli import _one_line, _project_error
    from .config import GRPOError

    program, sys.argv = sys.argv, [sys.argv[0], *argv]  # what LightningCLI reads: no "reward-model" in it
    try:
        make_reward_model_cli()
    except (GRPOError, ArgumentError, ValueError) as error:
        own = _project_error(error)
        if own is None and not isinstance(error, ArgumentError):
            raise
        print(f"error: {_one_line(own or error)}", file=sys.stderr)
        sys.exit(2 if own is None or isinstance(own, GRPOConfigError) else 1)
    finally:
        sys.argv = program
    return 0
