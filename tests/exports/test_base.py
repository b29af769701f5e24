"""What every export target shares (exports/facts.py): the facts of a Candidate or a config,
converted once, and clear errors for what cannot be exported."""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec.exports.facts import Facts
from mixprec.policy import Candidate


def test_a_candidate_is_converted_whole_on_the_device_asked_for():
    facts = Facts.of(
        Candidate(
            "fp16-mixed", channels_last=True, keep_fp32=("head",), compile="max-autotune", optimizer="fused"
        ),
        device="cpu",
    )
    assert facts.name == "fp16-mixed" and facts.device_type == "cpu"
    assert facts.channels_last and facts.keep == ["head"] and facts.mixed == torch.float16
    assert facts.scaler is not None and facts.min_scale == 1.0  # loss scaling, mixprec's defaults
    assert facts.compile_lines() == [
        'model = torch.compile(model, mode="max-autotune")  # measured compiled: the first step compiles'
    ]
    assert facts.optimizer_flag == "fused=True"
    cuda = Facts.of(Candidate("tf32"), device="cuda:1")  # exportable for a GPU from a CPU machine
    assert cuda.device_type == "cuda" and {value for _, _, value in cuda.knobs()} == {"tf32"}


def test_the_step_scope_is_carried_from_the_candidate_and_a_config_has_none():
    step = Facts.of(Candidate("fp16-mixed", compile="max-autotune", compile_scope="step"), device="cpu")
    assert step.compile_scope == "step" and step.compiles_step and not step.compiles_model
    assert step.compile_lines() == []  # the model is compiled inside the step, not on its own
    assert step.step_compile_lines() == [
        "# compiled: forward + loss, their backward, the optimizer step; GradScaler runs eagerly",
        'train_step = torch.compile(train_step, mode="max-autotune")',
    ]
    assert step.optimizer_line("prepare()").startswith(
        "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)"
    )
    assert step.describe() == '\'fp16-mixed\' on cpu (compile="max-autotune", compile_scope="step")'
    model = Facts.of(Candidate("bf16-mixed", compile="default", compile_scope="model"), device="cpu")
    assert model.compile_scope is None and model.compiles_model and model.step_compile_lines() == []
    config = Facts.of(mixprec.get_policy("bf16-mixed", device="cpu").config)
    assert config.compile_scope is None and not config.compiles_step and not config.compiles_model


def test_a_config_keeps_its_scaler_options_and_its_device():
    config = mixprec.get_policy("fp16-mixed", device="cpu", init_scale=1024.0).config
    facts = Facts.of(config)
    assert facts.scaler_changes() == {"init_scale": 1024.0} and facts.compile is None
    assert Facts.of(config, device="cuda").device_type == "cuda"


@pytest.mark.parametrize(
    ("source", "device", "fragment"),
    [
        ("bf16-mixed", None, "takes a mixprec Candidate, PolicyConfig or Policy, got str"),
        (Candidate("bf16-mixed", framework="tensorflow"), "cpu", "tensorflow"),
        (Candidate("bf16-mixed"), "tpu", "Cannot export for"),
    ],
)
def test_what_cannot_be_exported_is_one_clear_error(source, device, fragment):
    with pytest.raises(mixprec.UsageError, match=fragment):
        Facts.of(source, device=device)


def test_the_micro_batch_and_accumulation_are_carried_from_the_candidate_and_a_config_has_none():
    facts = Facts.of(Candidate("bf16-mixed", micro_batch=16, accumulation_steps=4), device="cpu")
    assert (facts.micro_batch, facts.accumulation_steps, facts.effective_batch) == (16, 4, 64)
    assert (
        facts.accumulates and facts.describe() == "'bf16-mixed' on cpu (micro_batch=16, accumulation_steps=4)"
    )
    one = Facts.of(Candidate("bf16-mixed", micro_batch=16), device="cpu")
    assert not one.accumulates and one.effective_batch == 16 and "accumulation" not in one.describe()
    config = Facts.of(mixprec.get_policy("bf16-mixed", device="cpu").config)
    assert (config.micro_batch, config.accumulation_steps, config.effective_batch) == (None, 1, None)
    assert config.batch_runs("DataLoader batch_size") == []
