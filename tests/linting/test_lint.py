"""mixprec lint: one model that triggers each rule and a near-identical one that does not,
the zoo, a deliberately misaligned model, --measure end to end, the CLI contract."""

from __future__ import annotations

import ast
import graphlib
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec.cli
import mixprec.linting
from mixprec import UnsupportedError, UsageError, Workload
from mixprec.cli import lint as lint_cli
from mixprec.cli import main
from mixprec.hardware.device import DeviceInfo
from mixprec.linting import RULES, Finding, Remedy, lint, run_lint
from mixprec.linting.runner import find_grad_scalers
from mixprec.report.lint import group_findings
from mixprec.schema import SCHEMA_VERSION
from mixprec.workload.zoo import build_zoo_workload

# --------------------------------------------------------------------------------------------------
# Small workloads


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def images(
    model: nn.Module, *, channels: int = 3, size: int = 16, classes: int = 10, batch: int = 8, **kw
) -> Workload:
    convert = kw.pop("channels_last_inputs", False)

    def make_batch(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(b, channels, size, size, device=device)
        if convert:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, torch.randint(0, classes, (b,), device=device)

    return Workload(
        model=model, make_batch=make_batch, loss_fn=kw.pop("loss_fn", _ce), default_batch_size=batch, **kw
    )


def vectors(model: nn.Module, *, features: int = 64, classes: int = 16, batch: int = 8, **kw) -> Workload:
    def make_batch(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, features, device=device), torch.randint(0, classes, (b,), device=device)

    return Workload(
        model=model, make_batch=make_batch, loss_fn=kw.pop("loss_fn", _ce), default_batch_size=batch, **kw
    )


def tokens(model: nn.Module, *, vocab: int = 1024, seq: int = 16, batch: int = 8) -> Workload:
    def make_batch(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, vocab, (b, seq + 1), device=device)
        return t[:, :-1], t[:, 1:]

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        logits = model(batch[0])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[1].reshape(-1))

    return Workload(model=model, make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch)


def cnn(
    *widths: int, groups: int = 1, act: Callable[[], nn.Module] = nn.ReLU, classes: int = 10
) -> nn.Sequential:
    """stem(3 -> widths[0]) then 3x3 convs through ``widths``, pooled, and a Linear head."""
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, padding=1), act()]
    for cin, cout in itertools.pairwise(widths):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, groups=groups), act()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], classes)]
    return nn.Sequential(*layers)


def mlp(*widths: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 1024, dim: int = 64, heads: int = 4, tied: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        return self.head(x + self.proj(y))


class Depthwise(nn.Module):
    """A MobileNet-like stack: depthwise 3x3 + pointwise 1x1 blocks."""

    def __init__(self, width: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(
            *(
                nn.Sequential(nn.Conv2d(width, width, 3, padding=1, groups=width), nn.Conv2d(width, width, 1))
                for _ in range(blocks)
            )
        )
        self.fc = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(F.relu(self.stem(x))).mean((2, 3)))


class WithBCELoss(nn.Module):
    """A model whose forward computes its own loss with nn.BCELoss (as some wrappers do)."""

    def __init__(self, with_logits: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 16)
        self.loss = nn.BCEWithLogitsLoss() if with_logits else nn.BCELoss()
        self.with_logits = with_logits

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = self.fc(x)
        return self.loss(z if self.with_logits else torch.sigmoid(z), y)


def _bce_workload(with_logits: bool) -> Workload:
    def make_batch(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 64, device=device), torch.rand(b, 16, device=device)

    return Workload(
        model=WithBCELoss(with_logits),
        make_batch=make_batch,
        loss_fn=lambda model, batch: model(*batch),
        default_batch_size=8,
    )


def _functional_bce(with_logits: bool) -> Workload:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        out = model(batch[0])
        target = F.one_hot(batch[1], 16).float()
        if with_logits:
            return F.binary_cross_entropy_with_logits(out, target)
        return F.binary_cross_entropy(torch.sigmoid(out), target)

    return vectors(mlp(64, 64, 16), loss_fn=loss_fn)


def _adam(eps: float) -> Callable:
    return lambda params: torch.optim.Adam(params, lr=1e-3, eps=eps)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _sgd(momentum: float) -> Callable:
    return lambda params: torch.optim.SGD(params, lr=1e-2, momentum=momentum)


def _with_scaler(use: bool) -> Workload:
    workload = vectors(mlp(64, 64, 16))
    workload.scaler = torch.amp.GradScaler("cpu", enabled=use)  # kept next to the workload
    return workload


def _cl_model(feed_channels_last: bool) -> Workload:
    model = cnn(32, 32).to(memory_format=torch.channels_last)
    return images(model, channels_last_inputs=feed_channels_last)


CPU_NO_HALF = DeviceInfo("cpu", "test cpu without bf16/fp16")
CPU_BF16 = DeviceInfo("cpu", "test cpu with bf16", cpu_flags=frozenset({"avx512_bf16"}))
CPU_FP16 = DeviceInfo("cpu", "test cpu with fp16", cpu_flags=frozenset({"amx_fp16", "avx512_bf16"}))
GPU_T4 = DeviceInfo("cuda", "Tesla T4", index=0, capability=(7, 5))
GPU_A100 = DeviceInfo("cuda", "A100", index=0, capability=(8, 0))


@dataclass
class Case:
    rule: str
    bad: Callable[[], Workload]
    good: Callable[[], Workload]
    kwargs: dict[str, Any] = field(default_factory=dict)  # for run_lint, both models
    bad_kwargs: dict[str, Any] = field(default_factory=dict)
    good_kwargs: dict[str, Any] = field(default_factory=dict)
    modules: set[str | None] | None = None  # exactly the modules the bad model's findings name
    severity: str | None = None


CUDA = {"policy": "bf16-mixed", "target": "cuda"}

CASES = [
    Case("MP101", lambda: images(cnn(32, 30, 32)), lambda: images(cnn(32, 32, 32)), CUDA, modules={"2", "4"}),
    Case("MP102", lambda: images(cnn(32, 16, 32)), lambda: images(cnn(32, 32, 32)), CUDA, modules={"2", "4"}),
    Case(
        "MP103",
        lambda: images(cnn(32, 64, groups=32)),
        lambda: images(cnn(32, 32, groups=32)),
        CUDA,
        modules={"2"},
    ),
    Case(
        "MP104",
        lambda: vectors(mlp(64, 100, 16)),
        lambda: vectors(mlp(64, 104, 16)),
        CUDA,
        modules={"0", "2"},
    ),
    Case(
        "MP105",
        lambda: tokens(TinyLM(vocab=1001), vocab=1001),
        lambda: tokens(TinyLM(vocab=1024), vocab=1024),
        CUDA,
        modules={"wte"},
        severity="warning",
    ),
    Case(
        "MP106", lambda: vectors(mlp(64, 64, 16), batch=30), lambda: vectors(mlp(64, 64, 16), batch=32), CUDA
    ),
    Case("MP107", lambda: tokens(TinyLM(), seq=30), lambda: tokens(TinyLM(), seq=32), CUDA),
    Case("MP108", lambda: tokens(TinyLM(dim=48, heads=4)), lambda: tokens(TinyLM(dim=64, heads=4)), CUDA),
    Case(
        "MP109",
        lambda: vectors(mlp(64, 104, 16)),  # 104: aligned for bf16 (8), not for fp8 (16)
        lambda: vectors(mlp(64, 112, 16)),
        {"policy": "fp8-rowwise", "target": "cuda"},
        modules={"0", "2"},
    ),
    Case(
        "MP201",
        lambda: images(cnn(32, 32)),
        lambda: images(cnn(32, 32)),
        CUDA,
        good_kwargs={"channels_last": True},
        modules={None},
    ),
    Case(
        "MP202",
        lambda: images(Depthwise()),
        lambda: images(Depthwise()),
        CUDA,
        bad_kwargs={"channels_last": True},
        good_kwargs={"channels_last": False},
    ),
    Case("MP203", lambda: _cl_model(False), lambda: _cl_model(True), CUDA, modules={"0"}),
    Case(
        "MP301",
        lambda: _functional_bce(False),
        lambda: _functional_bce(True),
        CUDA,
        modules={None},
        severity="error",
    ),
    Case(
        "MP301",
        lambda: _bce_workload(False),
        lambda: _bce_workload(True),
        {"policy": "bf16-mixed"},
        modules={"loss"},
    ),
    Case(
        "MP302",
        lambda: vectors(mlp(64, 64, 16), optimizer_fn=_adam(1e-8)),
        lambda: vectors(mlp(64, 64, 16), optimizer_fn=_adam(1e-4)),
        {"policy": "fp16-true", "device_info": CPU_FP16},
        severity="error",
    ),
    Case("MP303", lambda: _with_scaler(True), lambda: _with_scaler(False), {"policy": "bf16-mixed"}),
    Case(
        "MP304",
        lambda: vectors(mlp(64, 64, 16)),
        lambda: vectors(mlp(64, 64, 16)),
        {"policy": "bf16-mixed"},
        bad_kwargs={"device_info": GPU_T4},
        good_kwargs={"device_info": GPU_A100},
        severity="error",
    ),
    Case(
        "MP304",
        lambda: vectors(mlp(64, 64, 16)),
        lambda: vectors(mlp(64, 64, 16)),
        {"policy": "bf16-mixed"},
        bad_kwargs={"device_info": CPU_NO_HALF},
        good_kwargs={"device_info": CPU_BF16},
        severity="warning",
    ),
    Case(
        "MP305",
        lambda: vectors(mlp(64, 64, 16)),
        lambda: vectors(mlp(64, 64, 16)),
        {"policy": "fp16-mixed"},
        bad_kwargs={"device_info": CPU_BF16},
        good_kwargs={"device_info": CPU_FP16},
        severity="error",
    ),
    Case(
        "MP306",
        lambda: vectors(mlp(64, 64, 16), optimizer_fn=_adamw),
        lambda: vectors(mlp(64, 64, 16), optimizer_fn=_adamw),
        {"device_info": CPU_BF16},
        bad_kwargs={"policy": "bf16-true"},
        good_kwargs={"policy": "bf16-mixed"},  # fp32 master weights: fp32 state
        modules={None},
        severity="warning",
    ),
    Case(
        "MP306",
        lambda: vectors(mlp(64, 64, 16), optimizer_fn=_sgd(momentum=0.9)),
        lambda: vectors(mlp(64, 64, 16), optimizer_fn=_sgd(momentum=0.0)),  # plain SGD keeps no state
        {"policy": "fp16-true", "device_info": CPU_FP16},
    ),
    Case(
        "MP306",
        lambda: vectors(mlp(64, 64, 16).to(torch.bfloat16), optimizer_fn=_adamw),  # the model as given
        lambda: vectors(mlp(64, 64, 16), optimizer_fn=_adamw),
        {"policy": "fp32"},
    ),
    Case(
        "MP401",
        lambda: images(cnn(32, 32, act=nn.LeakyReLU)),
        lambda: images(cnn(32, 32, act=nn.ReLU)),
        CUDA,
        modules={"1", "3"},
    ),
]


def test_every_rule_has_a_case():
    assert {c.rule for c in CASES} == set(RULES)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.rule}-{i}" for i, c in enumerate(CASES)])
def test_rule_fires_on_the_bad_model_only(case: Case):
    bad = run_lint(case.bad(), **{**case.kwargs, **case.bad_kwargs})
    good = run_lint(case.good(), **{**case.kwargs, **case.good_kwargs})
    hits = [f for f in bad.findings if f.rule == case.rule]
    assert hits, f"{case.rule} did not fire: {[(f.rule, f.where) for f in bad.findings]}"
    assert not [f for f in good.findings if f.rule == case.rule], "fired on the near-identical good model"
    if case.modules is not None:
        assert {f.module for f in hits} == case.modules
    if case.severity is not None:
        assert {f.severity for f in hits} == {case.severity}
    for f in hits:  # every finding is concrete
        assert f.message and f.fix and f.name == RULES[case.rule].name


def test_half_optimizer_state_is_what_the_optimizer_keeps():
    """MP306 says what a stock AdamW really does over bf16-true's parameters (its exp_avg and
    exp_avg_sq are bf16 after a step) and counts only the parameters stored in bf16: the fp32 island
    and BatchNorm, which bf16-true keeps fp32, are left out, and an island over the whole model
    leaves nothing to report. The fix names the *-mixed policy."""
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 16))
    workload = vectors(model, optimizer_fn=_adamw)
    (hit,) = [
        f
        for f in lint(workload, policy=mixprec.Candidate("bf16-true", keep_fp32=("3",)))
        if f.rule == "MP306"
    ]
    assert hit.details["tensors"] == 2 and hit.details["values"] == 64 * 64 + 64  # layer 0 only
    assert hit.details["state"] == ["exp_avg", "exp_avg_sq"] and hit.details["dtype"] == "bf16"
    assert hit.fix.startswith("train with bf16-mixed")

    policy = mixprec.get_policy("bf16-true", device="cpu")
    trained = policy.prepare(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)))
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    F.mse_loss(trained(torch.randn(8, 64, dtype=torch.bfloat16)).float(), torch.zeros(8, 16)).backward()
    optimizer.step()
    assert {str(s[k].dtype) for s in optimizer.state.values() for k in hit.details["state"]} == {
        "torch.bfloat16"
    }

    everything = lint(workload, policy=mixprec.Candidate("bf16-true", keep_fp32=("*",)))
    assert not [f for f in everything if f.rule == "MP306"]


def test_findings_name_the_module_shape_and_a_concrete_fix():
    findings = lint(vectors(mlp(64, 1001, 16)), policy="bf16-mixed", target="cuda")
    (first, second) = sorted((f for f in findings if f.rule == "MP104"), key=lambda f: f.module)
    assert first.module == "0" and first.fix == "pad out_features 1001 -> 1008"
    assert "Linear(64, 1001) on [8, 64] -> [8, 1001]" in first.shape
    assert second.module == "2" and second.fix == "pad in_features 1001 -> 1008"
    assert first.details["assumes"].startswith("policy bf16-mixed: bf16 tensor cores want multiples of 8")
    assert first.remedy == Remedy("pad", "0", out_to=1008)


def test_alignment_follows_the_policy():
    wl = vectors(mlp(64, 100, 16))  # 100: a multiple of 4 (tf32) but not of 8 (fp16/bf16)
    assert any(f.rule == "MP104" for f in lint(wl, policy="fp16-mixed", target="cuda"))
    assert not any(f.rule == "MP104" for f in lint(wl, policy="tf32", target="cuda"))
    result = run_lint(wl, policy="fp32", target="cuda")  # no tensor cores: nothing to judge, and said so
    assert not any(f.rule.startswith("MP1") for f in result.findings)
    assert any("judge nothing under fp32" in n for n in result.notes)


def test_cpu_target_reports_tensor_core_rules_at_info():
    wl = images(cnn(32, 30, 32))
    on_cuda = run_lint(wl, policy="bf16-mixed", target="cuda")
    on_cpu = run_lint(wl, policy="bf16-mixed", target="cpu")
    assert {f.severity for f in on_cuda.findings if f.rule == "MP101"} == {"warning"}
    cpu_hits = [f for f in on_cpu.findings if f.rule == "MP101"]
    assert {f.severity for f in cpu_hits} == {"info"}
    assert all(f.details["severity_on_cuda"] == "warning" for f in cpu_hits)
    assert any("--target cuda" in n for n in on_cpu.notes)


def test_unavoidable_stem_and_small_head_are_suppressed_with_a_reason():
    result = run_lint(images(cnn(32, 32, classes=10)), policy="bf16-mixed", target="cuda")
    assert not [f for f in result.findings if f.rule in ("MP101", "MP104")]
    reasons = {f.module: f.suppressed for f in result.suppressed}
    assert "image stem" in reasons["0"]
    assert "classifier head with 10 outputs" in reasons["6"]


def test_large_misaligned_head_is_reported():
    findings = lint(vectors(mlp(64, 256, 1001), classes=1001), policy="bf16-mixed", target="cuda")
    assert [f.fix for f in findings if f.rule == "MP104"] == ["pad out_features 1001 -> 1008"]


class Misaligned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(32, 30, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(30)
        self.conv3 = nn.Conv2d(30, 64, 3, padding=1)
        self.conv4 = nn.Conv2d(64, 64, 3, padding=1)
        self.fc1 = nn.Linear(64, 1001)
        self.fc2 = nn.Linear(1001, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.conv4(F.relu(self.conv3(x))))
        return self.fc2(F.relu(self.fc1(x.mean((2, 3)))))


def test_misaligned_model_findings_name_exactly_the_misaligned_layers():
    result = run_lint(images(Misaligned(), size=32), policy="bf16-mixed", target="cuda")
    shape_findings = [f for f in result.findings if f.rule in ("MP101", "MP102", "MP104")]
    assert {f.module: f.fix for f in shape_findings} == {
        "conv2": "pad out_channels 30 -> 32",
        "conv3": "pad in_channels 30 -> 32",
        "fc1": "pad out_features 1001 -> 1008",
        "fc2": "pad in_features 1001 -> 1008",
    }
    assert {f.module for f in result.suppressed} == {"stem", "fc2"}


@pytest.mark.parametrize(
    ("name", "sizes", "expected"),
    [
        ("resnet50", {}, {"MP201"}),
        ("vgg19", {}, {"MP201"}),
        ("densenet121", {}, {"MP201"}),
        ("gpt2", {"seq_len": 64, "n_layer": 2}, {"MP105"}),
        ("mlp", {}, set()),
    ],
)
def test_zoo_models_have_no_errors_and_short_reports(name, sizes, expected):
    result = run_lint(build_zoo_workload(name, **sizes), policy="bf16-mixed", target="cuda")
    assert not [f for f in result.findings if f.severity == "error"]
    assert {f.rule for f in result.findings} == expected


def test_lint_changes_nothing_in_the_model_or_the_rng():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Dropout(0.5), nn.Flatten(), nn.LazyLinear(10)
    )
    wl = images(model)
    wl.model(torch.randn(2, 3, 16, 16))  # materialise the lazy layer
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    run_lint(wl, policy="bf16-mixed")
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_data_dependent_forward_falls_back_to_an_eager_trace():
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 100)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if float(x.abs().sum()) > 0 else self.fc(-x)

    result = run_lint(vectors(DataDependent(), classes=100), policy="bf16-mixed", target="cuda")
    assert result.trace_mode == "eager" and any("meta trace failed" in n for n in result.notes)
    assert [f.module for f in result.findings if f.rule == "MP104"] == ["fc"]


def test_ignore_silences_rules_and_rejects_unknown_ids():
    wl = images(cnn(32, 30, 32))
    result = run_lint(wl, policy="bf16-mixed", target="cuda", ignore="MP101,channels-last")
    assert not {f.rule for f in result.findings} & {"MP101", "MP201"}
    assert result.ignored == ("MP101", "MP201")
    with pytest.raises(UsageError, match=r"unknown rule id 'MP999'; valid ids: MP101, MP102"):
        run_lint(wl, ignore=["MP999"])


def test_the_default_policy_is_the_devices_best_default_whatever_the_target():
    wl = vectors(mlp(64, 100, 16))  # 100: not a multiple of 8 (bf16 tensor cores)
    native = run_lint(wl, device="cpu", device_info=CPU_BF16, target="cuda")
    assert native.policy_chosen and native.policy == "bf16-mixed"
    assert any(f.rule == "MP104" for f in native.findings)
    emulated = run_lint(wl, device="cpu", device_info=CPU_NO_HALF, target="cuda")  # an AVX2-only CPU
    assert emulated.policy_chosen and emulated.policy == "fp32"
    assert not any(f.rule.startswith("MP1") for f in emulated.findings)
    assert any("judge nothing under fp32" in n for n in emulated.notes)


def test_policy_unsupported_here_is_refused_unless_judging_another_target():
    wl = vectors(mlp(64, 64, 16))
    with pytest.raises(UnsupportedError, match="--target cuda"):
        run_lint(wl, policy="tf32", device_info=CPU_BF16)
    result = run_lint(wl, policy="tf32", device_info=CPU_BF16, target="cuda")
    assert result.policy == "tf32"


def test_grad_scalers_are_found_in_closures_and_globals():
    scaler = torch.amp.GradScaler("cpu")

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        if scaler.is_enabled():  # referenced only: never called on the traced (meta) loss
            pass
        return F.cross_entropy(model(batch[0]), batch[1])

    assert find_grad_scalers(vectors(mlp(64, 64, 16), loss_fn=loss_fn)) == (scaler,)
    assert find_grad_scalers(vectors(mlp(64, 64, 16))) == ()


def test_group_findings_merges_repeated_findings():
    findings = [
        Finding("MP102", "conv-channels-small", "info", f"layer{i}", "same", "pad") for i in range(12)
    ]
    findings.append(Finding("MP104", "linear-features", "warning", "fc", "other", "pad"))
    groups = group_findings(findings)
    assert [g.label for g in groups] == ["MP102 x 12", "MP104"]
    assert groups[0].where == "12 layers: layer0, layer1, layer2, +9 more"
    many = [Finding("MP101", "conv-channels", "info", f"c{i}", f"msg {i}", f"fix {i}") for i in range(7)]
    assert [g.label for g in group_findings(many, max_rows_per_rule=4)] == ["MP101"] * 3 + ["MP101 x 4"]


def linting_import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the ``mixprec.linting`` modules it imports (anywhere in it, lazy imports too),
    read with ``ast`` from the package's files below ``root``."""
    modules: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = ["mixprec", "linting", *path.relative_to(root).with_suffix("").parts]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . / .. import
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import submodule` imports the submodule; `from mod import name` the module
                imported.update(
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
                )
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def test_lint_package_has_no_import_cycle():
    graph = linting_import_graph(Path(mixprec.linting.__file__).parent)
    assert {"mixprec.linting.runner", "mixprec.linting.rules", "mixprec.linting.rules.shapes"} <= set(graph)
    assert "mixprec.linting.rules" in graph["mixprec.linting.runner"]  # one way: the runner calls the rules
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle in mixprec.linting: {' -> '.join(exc.args[1])}")


# --------------------------------------------------------------------------------------------------
# CLI


@pytest.fixture
def cli(monkeypatch):
    """``main`` with the lint subcommand registered (whether or not the CLI lists it yet)."""
    if lint_cli not in mixprec.cli.SUBCOMMANDS:
        monkeypatch.setattr(mixprec.cli, "SUBCOMMANDS", (*mixprec.cli.SUBCOMMANDS, lint_cli))

    def run(argv: list[str]) -> int:
        try:
            return main(argv)
        except SystemExit as exc:
            return int(exc.code)

    return run


WORKLOAD_FILE = """
import torch, torch.nn.functional as F
from torch import nn
import mixprec
from mixprec.schema import SCHEMA_VERSION

def workload(bce: bool = False):
    model = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 16))
    def loss_fn(m, batch):
        out = m(batch[0])
        y = F.one_hot(batch[1], 16).float()
        return F.binary_cross_entropy(torch.sigmoid(out), y) if bce else F.cross_entropy(out, batch[1])
    return mixprec.Workload(
        model=model,
        make_batch=lambda b, d: (torch.randn(b, 64, device=d), torch.randint(0, 16, (b,), device=d)),
        loss_fn=loss_fn, name="tiny", default_batch_size=16,
    )

def with_bce():
    return workload(bce=True)
"""


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(WORKLOAD_FILE)
    return str(path)


# Judged for a GPU under bf16-mixed on every CPU: the default policy is this CPU's best default, strict
# fp32 where bf16 is only emulated (an AVX2-only CPU), and under fp32 the tensor-core rules judge nothing
CLI_CUDA = ["--policy", "bf16-mixed", "--target", "cuda"]


def test_cli_report_json_and_exit_codes(cli, tiny, tmp_path, capsys):
    out_json = tmp_path / "lint.json"
    assert cli(["lint", "--workload", f"{tiny}:workload", *CLI_CUDA, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "MP104" in out and "pad out_features 100 -> 104" in out and "2 warnings" in out
    data = json.loads(out_json.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["kind"] == "lint" and "env" in data
    assert {f["module"] for f in data["findings"] if f["rule"] == "MP104"} == {"0", "2"}
    # --strict fails only on error severity: BCE under autocast judged for CUDA is one.
    assert cli(["lint", "--workload", f"{tiny}:workload", *CLI_CUDA, "--strict"]) == 0
    assert cli(["lint", "--workload", f"{tiny}:with_bce", *CLI_CUDA, "--strict"]) == lint_cli.STRICT_EXIT
    assert cli(["lint", "--workload", f"{tiny}:with_bce", *CLI_CUDA]) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["lint", "--model", "mlp", "--ignore", "MP1O1"], "unknown rule id 'MP1O1'; valid ids: MP101"),
        (["lint", "--model", "mlp", "--steps", "2"], "--steps applies to --measure"),
        (["lint", "--model", "mlp", "--target", "tpu"], "invalid choice"),
        (["lint", "--model", "mlp", "--policy", "tf32", "--device", "cpu"], "not supported on cpu"),
    ],
)
def test_cli_errors_are_one_line(cli, argv, fragment, capsys):
    assert cli(argv) in (2, 3)
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


def test_cli_list_rules(cli, capsys):
    assert cli(["lint", "--list-rules"]) == 0
    out = capsys.readouterr().out
    assert all(rule_id in out for rule_id in RULES)


@pytest.mark.slow
def test_cli_measure_end_to_end(cli, tiny, capsys):
    code = cli(["lint", "--workload", f"{tiny}:workload", *CLI_CUDA, "--measure", "--steps", "1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "layer ms" in out and "step ms" in out and "gain" in out and "->" in out
