"""The contract every export target keeps, the seven that write training code and the five that write
a precision map alike: one vocabulary of names, one header whose first statement names the policy,
the device and the target, one refusal type with a reason and an alternative, and one UsageError
for a name that is none of them. Pure text: no framework is imported."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from mixprec import Candidate
from mixprec.errors import ExportRefused, UsageError
from mixprec.exports import EXPORT_TARGETS, MAP_TARGETS, export, export_status
from mixprec.exports.registry import ALIASES, ALL_TARGETS
from mixprec.policy import PolicyConfig

ALL = (*EXPORT_TARGETS, *MAP_TARGETS)


def mlp(*dims: int) -> nn.Sequential:
    """Linear layers fc1, fc2, head (``dims[i] -> dims[i+1]``), a GELU between each two."""
    torch.manual_seed(0)
    names = ("fc1", "fc2", "head")
    model = nn.Sequential()
    for i, name in enumerate(names):
        if i:
            model.add_module(f"act{i}", nn.GELU())
        model.add_module(name, nn.Linear(dims[i], dims[i + 1]))
    return model


MODEL = mlp(64, 128, 128, 32)
WIDE = mlp(128, 256, 256, 128)  # every dimension a multiple of 128
# A candidate every target of its kind writes faithfully on a GPU.
FAITHFUL = {
    **dict.fromkeys(EXPORT_TARGETS, Candidate("bf16-mixed", keep_fp32=("head",), optimizer="fused")),
    **dict.fromkeys(MAP_TARGETS, Candidate("fp8-tensorwise", keep_bf16=("head",))),
}
# What each target refuses on a GPU, where its own stack is the reason (the device refusal, shared
# by every target, is tested on its own below).
REFUSED: dict[str, tuple[Candidate | PolicyConfig, nn.Module | None]] = {
    "mixprec": (PolicyConfig("bf32", "cuda"), None),
    "pytorch": (Candidate("mxfp8"), None),
    "lightning": (Candidate("fp16-true"), None),
    "accelerate": (Candidate("fp8-rowwise"), MODEL),  # the training script: no fp8 path
    "deepspeed": (Candidate("fp32", compile="default", compile_scope="step"), None),
    "fsdp2": (Candidate("bf16-mixed", channels_last=True), None),
    "hf": (Candidate("fp16-mixed", optimizer="fused"), None),
    "torchao": (Candidate("mxfp8", keep_bf16=("fc2:forward",)), MODEL),
    "torchtitan": (Candidate("nvfp4", keep_bf16=("head",)), WIDE),
    "accelerate-fp8": (Candidate("mxfp8", keep_bf16=("head",)), MODEL),
    "megatron": (Candidate("fp8-rowwise", keep_bf16=("head",)), MODEL),
    "transformer-engine": (Candidate("nvfp4", keep_bf16=("fc1:wgrad",)), WIDE),
}


def first_statement(text: str) -> str:
    """The header's first statement: the comment lines before "# What runs:", joined."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("# ") or line == "# What runs:":
            break
        lines.append(line[2:])
    return " ".join(lines)


@pytest.mark.parametrize("target", ALL)
def test_the_first_header_line_names_policy_device_and_target(target):
    candidate = FAITHFUL[target]
    text = export(candidate, target, device="cuda", model=MODEL)
    first = first_statement(text)
    assert first.startswith(f"mixprec export: policy '{candidate.policy}' on cuda"), first
    assert f" -> {ALL_TARGETS[target].title}" in first, first
    assert "checked against" in first or target in ("mixprec", "pytorch", "fsdp2")
    header = text.split("\n\n")[0].splitlines()
    assert "# What runs:" in header, target
    assert any(line.startswith("# You fill in: ") for line in header), target
    assert export_status(candidate, target, device="cuda", model=MODEL) == (True, "")


@pytest.mark.parametrize("target", ALL)
def test_a_refusal_is_the_one_refusal_type_with_reason_and_alternative(target):
    candidate, model = REFUSED[target]
    with pytest.raises(ExportRefused) as info:
        export(candidate, target, device="cuda", model=model)
    err = info.value
    assert type(err) is ExportRefused and isinstance(err, UsageError) and err.exit_code == 2
    assert (err.target, err.policy, err.device) == (ALL_TARGETS[target].title, candidate.spec.name, "cuda")
    assert err.reason and err.alternative, target
    assert str(err).startswith(f"Cannot export policy {candidate.spec.name!r} on cuda to {err.target}: ")
    assert str(err).endswith(f"Nearest faithful alternative: {err.alternative}.")
    status = export_status(candidate, target, device="cuda", model=model)
    assert status == (False, f"{err.reason}; instead: {err.alternative}")


@pytest.mark.parametrize("target", ALL)
def test_the_device_refusal_is_shared_by_every_target(target):
    """fp8 on a CPU runs reference kernels only: every target refuses it with the same words."""
    candidate = Candidate("fp8-tensorwise", keep_bf16=("head",))
    with pytest.raises(ExportRefused) as info:
        export(candidate, target, device="cpu", model=MODEL)
    assert "fp8 tensor cores" in info.value.reason and "device='cuda'" in info.value.alternative


def test_a_map_refusal_names_the_entry_and_the_targets_that_can():
    with pytest.raises(ExportRefused) as info:
        export(Candidate("mxfp8", keep_bf16=("fc2:forward",)), "torchao", device="cuda", model=MODEL)
    assert info.value.entry == "fc2:forward" and "entry 'fc2'" in info.value.alternative
    assert "no target here expresses this map; mixprec's own policy" in info.value.alternative
    with pytest.raises(ExportRefused) as info:
        export(Candidate("fp8-rowwise", keep_bf16=("head",)), "megatron", device="cuda", model=MODEL)
    assert info.value.entry is None and "the torchao or torchtitan or accelerate-fp8 targets" in str(
        info.value
    )
    with pytest.raises(ExportRefused) as info:
        export(Candidate("fp16-true"), "lightning", device="cuda")
    assert info.value.entry is None  # a training-code refusal names no map entry


@pytest.mark.parametrize(("typo", "meant"), [("lightnin", "lightning"), ("torchtitian", "torchtitan")])
def test_an_unknown_target_is_one_usage_error_naming_every_valid_one(typo, meant):
    for call in (export, export_status):
        with pytest.raises(UsageError) as info:
            call(Candidate("fp8-tensorwise"), typo, device="cuda", model=MODEL)
        message = str(info.value)
        assert type(info.value) is UsageError and f"Unknown export target {typo!r}" in message
        assert all(re.search(rf"\b{re.escape(name)}\b", message) for name in ALL), message
        assert message.endswith(f"Did you mean '{meant}'?")


def test_one_vocabulary_where_every_name_means_one_target():
    names = [t.name for t in ALL_TARGETS.values()]
    assert names == list(ALL) and len(set(names)) == len(names) == 12
    assert not set(ALIASES) & set(names)
    aliases = [alias for t in ALL_TARGETS.values() for alias in t.aliases]
    assert len(aliases) == len(set(aliases))
    assert ALL_TARGETS["accelerate"].title == "HF Accelerate"  # the training script
    assert "accelerate" not in MAP_TARGETS and "accelerate-fp8" in MAP_TARGETS  # the precision map
    assert export(Candidate("fp8-tensorwise"), "TE", device="cuda", model=MODEL) == export(
        Candidate("fp8-tensorwise"), "transformer-engine", device="cuda", model=MODEL
    )


@pytest.mark.parametrize("target", MAP_TARGETS)
def test_a_map_target_needs_the_model_and_the_others_ignore_it(target):
    with pytest.raises(UsageError, match=re.escape(f"export(candidate, {target!r}, model=model)")):
        export(Candidate("fp8-tensorwise"), target, device="cuda")
    bf16 = Candidate("bf16-mixed")
    assert export(bf16, "pytorch", device="cuda", model=MODEL) == export(bf16, "pytorch", device="cuda")
