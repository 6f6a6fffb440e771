"""SentimentClassifier on a tiny DistilBERT classifier built and saved here (the real loading code,
no hub), and VaderSentiment on clearly positive and negative sentences."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from grpo_lightning.config import GRPOConfigError, GRPOError
from grpo_lightning.models import ModelLoadError
from grpo_lightning.reward_checks import score_samples
from rewards import RewardModule, SentimentClassifier, VaderSentiment, describe_reward, prepare_reward

WORDS = "i thought this movie was great terrible boring wonderful the acting plot and but very not a film".split()
MAX_LENGTH = 12  # the tokenizer's model_max_length; the model itself takes up to 32 positions
THREE_LABELS = {0: "NEGATIVE", 1: "neutral", 2: "Positive"}  # deliberately not [neg, pos] at [0, 1]


def save_tiny_classifier(path, id2label: dict[int, str], head_bias: list[float] | None = None, seed: int = 0) -> str:
    """A word-level tokenizer and a 1-layer DistilBERT sequence classifier, saved to ``path``.
    With ``head_bias``, the output layer's weights are zeroed, so the logits are exactly that bias
    whatever the input (softmax probabilities that can be computed by hand)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DistilBertConfig, DistilBertForSequenceClassification, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", model_max_length=MAX_LENGTH
    )
    torch.manual_seed(seed)
    config = DistilBertConfig(
        vocab_size=len(vocab), dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=32,
        pad_token_id=0, id2label=dict(id2label), label2id={v: k for k, v in id2label.items()},
    )  # fmt: skip
    model = DistilBertForSequenceClassification(config).eval()
    if head_bias is not None:
        with torch.no_grad():
            model.classifier.weight.zero_()
            model.classifier.bias.copy_(torch.tensor(head_bias))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def fixed_classifier_dir(tmp_path_factory) -> str:
    """Logits are log(1), log(2), log(3) for every input: softmax = 1/6, 2/6, 3/6."""
    return save_tiny_classifier(tmp_path_factory.mktemp("fixed-cls"), THREE_LABELS, [0.0, math.log(2), math.log(3)])


@pytest.fixture(scope="module")
def random_classifier_dir(tmp_path_factory) -> str:
    return save_tiny_classifier(tmp_path_factory.mktemp("random-cls"), {0: "NEGATIVE", 1: "POSITIVE"}, seed=3)


SAMPLES = [
    "i thought this movie was great",
    "i thought this movie was terrible and boring",
    "wonderful",
    "the acting was not very good but the plot was",  # "good" is unknown: [UNK]
    "a film",
]


# ---------------------------------------------------------------------------------------------
# SentimentClassifier
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "direction, expected",
    [("pos", 3 / 6), ("POS", 3 / 6), ("positive", 3 / 6), ("neg", 1 / 6), ("Negative", 1 / 6), ("neutral", 2 / 6)],
)
def test_classifier_picks_the_label_by_name(fixed_classifier_dir, direction, expected):
    reward = SentimentClassifier(fixed_classifier_dir, direction=direction)
    out = reward(SAMPLES)
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    assert_close(out, torch.full((len(SAMPLES),), expected), atol=1e-6, rtol=0)


def test_classifier_is_a_frozen_eval_mode_module(fixed_classifier_dir):
    reward = SentimentClassifier(fixed_classifier_dir, direction="neg")
    assert isinstance(reward, torch.nn.Module) and isinstance(reward, RewardModule)
    prepare_reward(reward)
    params = list(reward.parameters())
    assert params and not any(p.requires_grad for p in params)
    parent = torch.nn.Module()
    parent.reward = reward  # as GRPOModule holds it: a child module, moved with the policy
    assert [name for name, _ in parent.named_children()] == ["reward"]
    assert len(list(parent.parameters())) == len(params)
    parent.train()  # Lightning may switch the whole LightningModule to train mode
    assert not any(m.training for m in reward.modules())
    assert reward(["i thought"]).requires_grad is False


def test_classifier_batches_and_padding_match_one_sample_at_a_time(random_classifier_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward = SentimentClassifier(random_classifier_dir, direction="pos", batch_size=2)
    out = reward(SAMPLES)  # 3 batches (2, 2, 1), padded within each batch

    model = AutoModelForSequenceClassification.from_pretrained(random_classifier_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(random_classifier_dir)
    expected = []
    with torch.no_grad():
        for sample in SAMPLES:  # unpadded, one at a time
            ids = torch.tensor([tokenizer(sample)["input_ids"]])
            expected.append(model(input_ids=ids).logits.softmax(-1)[0, 1].item())
    assert_close(out, torch.tensor(expected), atol=1e-6, rtol=0)
    assert out.unique().numel() == len(SAMPLES)  # the input matters
    neg = SentimentClassifier(random_classifier_dir, direction="neg", batch_size=64)(SAMPLES)
    assert_close(neg, 1 - out, atol=1e-6, rtol=0)


def test_classifier_truncates_to_the_tokenizer_max_length(random_classifier_dir):
    reward = SentimentClassifier(random_classifier_dir, direction="pos")
    long = " ".join(WORDS * 3)  # 51 tokens: more than the model's 32 positions
    truncated = " ".join(WORDS[:MAX_LENGTH])
    out = reward([long, truncated])
    assert_close(out[0], out[1], atol=1e-6, rtol=0)
    assert reward([]).shape == (0,)


def test_classifier_is_described_by_its_settings(random_classifier_dir):
    reward = SentimentClassifier(random_classifier_dir, direction="neg", batch_size=8)
    reward.prepare()
    assert describe_reward(reward) == {
        "class_path": "rewards.sentiment.SentimentClassifier",
        "init_args": {"model_name_or_path": random_classifier_dir, "direction": "neg", "batch_size": 8},
    }


def test_classifier_labels_lacking_the_direction_are_refused_at_construction(tmp_path):
    path = save_tiny_classifier(tmp_path, {0: "LABEL_0", 1: "LABEL_1"})
    with pytest.raises(GRPOConfigError) as excinfo:
        SentimentClassifier(path, direction="pos")
    message = str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert message.startswith("SentimentClassifier: ")
    assert "direction 'pos'" in message and "['LABEL_0', 'LABEL_1']" in message, message


def test_classifier_ambiguous_direction_is_refused(tmp_path):
    path = save_tiny_classifier(tmp_path, {0: "negative", 1: "positive", 2: "positive-ish"})
    assert SentimentClassifier(path, direction="positive")._label_index == 1  # an exact name wins
    assert SentimentClassifier(path, direction="positive-")._label_index == 2
    message = r"direction 'pos' matches several labels .*\['positive', 'positive-ish'\]; pass a full label name"
    with pytest.raises(GRPOConfigError, match=message):
        SentimentClassifier(path, direction="pos")


def test_classifier_missing_directory_and_bad_batch_size(fixed_classifier_dir):
    message = r"^SentimentClassifier: model_name_or_path: no model directory at './no/such/classifier'"
    with pytest.raises(GRPOConfigError, match=message):
        SentimentClassifier("./no/such/classifier")
    with pytest.raises(GRPOConfigError, match=r"SentimentClassifier: batch_size \(0\) must be at least 1"):
        SentimentClassifier(fixed_classifier_dir, batch_size=0)


def test_classifier_hub_id_that_cannot_be_fetched(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no connection attempts
    reward = SentimentClassifier("no-such-org/no-such-classifier")  # a hub id: nothing loads yet
    with pytest.raises(ModelLoadError) as excinfo:
        reward.prepare()
    message = str(excinfo.value)
    assert isinstance(excinfo.value, GRPOError)
    assert message.startswith(
        "SentimentClassifier: could not load the classifier 'no-such-org/no-such-classifier' (hub id)"
    )
    assert "rewards.VaderSentiment" in message
    # scored during training, the same failure names the reward through score_samples
    with pytest.raises(GRPOError, match=r"reward SentimentClassifier raised ModelLoadError"):
        score_samples(reward, ["a"])


# ---------------------------------------------------------------------------------------------
# VaderSentiment
# ---------------------------------------------------------------------------------------------

POSITIVE = ["I loved this movie, it was wonderful and the acting was great!", "A truly excellent, happy film."]
NEGATIVE = ["I hated this movie, it was terrible and boring.", "An awful, disgusting waste of time."]
NEUTRAL = ["The movie is ninety minutes long.", ""]


def test_vader_orders_positive_above_negative():
    pos = VaderSentiment("pos")(POSITIVE + NEGATIVE + NEUTRAL)
    assert pos.dtype == torch.float32 and pos.shape == (6,)
    assert pos[:2].min() > 0.8 and pos[2:4].max() < 0.2, pos
    assert_close(pos[4:], torch.tensor([0.5, 0.5]), atol=0, rtol=0)  # no sentiment words: compound 0
    neg = VaderSentiment("neg")(POSITIVE + NEGATIVE + NEUTRAL)
    assert_close(neg, 1 - pos, atol=1e-6, rtol=0)
    assert ((0 <= pos) & (pos <= 1)).all()


def test_vader_maps_the_compound_score_to_zero_one():
    reward = VaderSentiment("neg")
    samples = POSITIVE + NEGATIVE
    compound = torch.tensor(reward.compound(samples))
    assert_close(reward(samples), (1 - compound) / 2, atol=1e-7, rtol=0)
    assert_close(VaderSentiment("pos")(samples), (1 + compound) / 2, atol=1e-7, rtol=0)


@pytest.mark.parametrize("bad", ["positive", "", None, "joy"])
def test_vader_rejects_unknown_directions(bad):
    with pytest.raises(GRPOConfigError, match=r"VaderSentiment: direction must be one of \['pos', 'neg'\]"):
        VaderSentiment(bad)
