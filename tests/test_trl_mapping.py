"""The mapping of phase_time.py's workloads onto TRL's GRPOConfig (benchmarks/trl_phase_time.py), checked without
TRL: it lives in its own venv (.venv-trl), not in the project's."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.phase_time import WORKLOADS
from benchmarks.trl_phase_time import (
    grpo_args,
    parse_args,
    parse_override,
    period_count,
    recomputes_old_logprobs,
    steps_per_phase,
    trl_settings,
)
from grpo_lightning import GRPO_Args


def test_the_script_does_not_import_trl():
    assert "trl" not in sys.modules


@pytest.mark.parametrize(
    "workload, minibatch, minibatches, passes",
    [("small", 16, 2, 1), ("default", 32, 4, 2)],
)
def test_a_phase_is_one_generation_round_then_minibatches_x_passes_steps(workload, minibatch, minibatches, passes):
    args = grpo_args(workload, phases=2)
    settings = trl_settings(args)
    group = WORKLOADS[workload]["batch_size"]
    assert settings["num_generations"] == group  # all G completions are of the one prompt
    assert settings["per_device_train_batch_size"] == minibatch == group // minibatches
    assert settings["steps_per_generation"] == minibatches  # generation batch = G
    assert settings["per_device_train_batch_size"] * settings["steps_per_generation"] == group
    assert settings["gradient_accumulation_steps"] == 1  # one optimizer step per minibatch
    assert settings["num_iterations"] == passes
    assert steps_per_phase(settings) == minibatches * passes
    assert settings["max_steps"] == (1 + 2) * minibatches * passes  # one warm-up phase + 2 measured
    assert settings["max_completion_length"] == settings["generation_kwargs"]["min_new_tokens"] == 30


def test_objective_sampling_and_precision_match_ours():
    ours = GRPO_Args()
    settings = trl_settings(grpo_args("small", phases=1))
    assert settings["beta"] == 0.3 and settings["epsilon"] == ours.clip_coef
    assert settings["learning_rate"] == ours.lr and settings["max_grad_norm"] == ours.max_grad_norm
    assert settings["temperature"] == ours.temperature and settings["top_k"] == 0 and settings["top_p"] == 1.0
    # TRL defaults to bf16 and activation (gradient) checkpointing: both must be off for fp32 like ours
    assert settings["bf16"] is False and settings["fp16"] is False and settings["activation_checkpointing"] is False
    assert settings["model_init_kwargs"] == {"dtype": "float32"} and settings["use_cpu"] is True
    assert settings["report_to"] == "none" and settings["save_strategy"] == "no" and settings["use_vllm"] is False
    json.dumps(settings)  # the JSON report keeps them


@pytest.mark.parametrize(
    "override, recomputes",
    [({}, True), ({"num_minibatches": 1, "batches_per_learning_phase": 1}, False),
     ({"num_minibatches": 1, "batches_per_learning_phase": 2}, True)],
)  # fmt: skip
def test_trl_recomputes_old_logprobs_unless_a_phase_is_one_step(override, recomputes):
    for workload in WORKLOADS:
        settings = trl_settings(grpo_args(workload, phases=1, override=override))
        assert recomputes_old_logprobs(settings) is recomputes


def test_period_count_reward():
    assert period_count(["a. b.", "", "..."]) == [2.0, 0.0, 3.0]


def test_override_for_smoke_tests():
    assert parse_override("batch_size=4,gen_len=4,prompt=Hi") == {"batch_size": 4, "gen_len": 4, "prompt": "Hi"}
    args = grpo_args("default", phases=1, override=parse_override("batch_size=8,gen_len=4"))
    assert (args.batch_size, args.gen_len, args.num_minibatches) == (8, 4, 4)
    with pytest.raises(SystemExit):  # not a GRPO_Args setting
        parse_args(["--override", "group=4"])
    with pytest.raises(SystemExit):  # default's 4 minibatches do not divide 6
        parse_args(["--workload", "default", "--override", "batch_size=6"])
