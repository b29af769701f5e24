"""lint --measure's bench job (mixprec.measure.lint_gains): drop-in fixes compute what the model
did, the layers and steps are timed and the findings ranked by gain, and ``mixprec.lint`` is
linting's lint plus ``measure=True``."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Workload
from mixprec.linting import Remedy, run_lint
from mixprec.measure import lint_gains
from mixprec.measure.lint_gains import drop_in_fix, measure_findings


def _mlp(*widths: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _vectors(model: nn.Module, *, features: int = 64, classes: int = 16, batch: int = 8) -> Workload:
    def make_batch(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, features, device=device), torch.randint(0, classes, (b,), device=device)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    return Workload(model=model, make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch)


class _TiedLM(nn.Module):
    """An embedding and a language-model head sharing one [vocab, dim] weight."""

    def __init__(self, vocab: int, dim: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.wte(idx))))


def test_drop_in_fixes_compute_the_same_outputs():
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 30, 3), nn.ReLU(), nn.Conv2d(30, 12, 3))
    x = torch.randn(2, 3, 12, 12)
    for remedy in (Remedy("pad", "0", out_to=32), Remedy("pad", "2", in_to=32, out_to=16)):
        fixed = drop_in_fix(conv, remedy)
        assert fixed.get_submodule(remedy.module).weight.shape[0] == (remedy.out_to or 30)
        torch.testing.assert_close(fixed(x), conv(x))
    lm = _TiedLM(vocab=1000)
    idx = torch.randint(0, 1000, (2, 8))
    fixed = drop_in_fix(lm, Remedy("pad", "head", out_to=1024))
    assert fixed.wte.weight is fixed.head.weight and fixed.wte.num_embeddings == 1024
    torch.testing.assert_close(fixed(idx), lm(idx))


def test_measure_times_layers_and_steps_and_ranks_by_gain():
    wl = _vectors(_mlp(64, 100, 16), batch=16)
    result = run_lint(wl, policy="bf16-mixed", target="cuda")
    measure_findings(wl, result, steps=1, warmup=1, layer_min_time_s=0.01, step_min_time_s=0.0)
    measured = [f for f in result.findings if f.measured is not None]
    assert {f.module for f in measured} == {"0", "2"}
    for f in measured:
        m = f.measured
        assert m.layer_before_ms > 0 and m.layer_after_ms > 0
        assert m.step_before_ms > 0 and m.step_after_ms > 0
        assert m.gain_pct == m.step_gain_pct
    gains = [f.measured.gain_pct for f in measured]
    assert gains == sorted(gains, reverse=True)
    assert any("baseline step" in n for n in result.notes)


def test_mixprec_lint_measures_only_when_asked(monkeypatch):
    timed = []
    monkeypatch.setattr(lint_gains, "measure_findings", lambda wl, result: timed.append(result))
    wl = _vectors(_mlp(64, 100, 16), batch=16)
    plain = mixprec.lint(wl, policy="bf16-mixed", target="cuda")
    assert timed == [] and {f.module for f in plain if f.rule == "MP104"} == {"0", "2"}
    measured = mixprec.lint(wl, policy="bf16-mixed", target="cuda", measure=True)
    assert len(timed) == 1 and measured == timed[0].findings
    assert [f.rule for f in measured] == [f.rule for f in plain]
