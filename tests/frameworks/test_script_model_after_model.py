"""A script that trains one model after another: k-fold cross-validation's folds, a sweep's runs, a
model per seed, each a new model with a new optimizer once the last is trained. The agent refused
the second ("the script trains a second model"): `mixprec run` exited 2 at the second fold, after
the first had trained. Now, in a run, a new model's optimizer built once the script holds the last
model no more starts the model anew: the step in progress ends, the candidate is applied to the new
model as to the first. Each fold is compared bit for bit with the AMP recipe's hand edit. Where the
script still holds the last model (a teacher trained first) it is refused, saying why; a check
stops at the second model with the reason (it compares one model's steps)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from frameworks.in_process import Exited, under
from frameworks.test_script_agent import hand, same

FOLDS = 3
STEPS = 4


def fold_batches(fold: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(fold)
    return [
        (torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(STEPS)
    ]


def k_fold(precision: str | None, *, dtype: torch.dtype | None = None) -> nn.ModuleList:
    """Each fold a new model and optimizer, trained, then kept in a list (``dtype``: the model cast
    to it by hand, as a *-true candidate casts it)."""
    torch.manual_seed(0)
    trained = []
    for fold in range(FOLDS):
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dtype or torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ctx, scaler = hand(precision)  # (the recipe's scaler made with each fold's optimizer)
        for x, y in fold_batches(fold):
            with ctx():
                loss = F.cross_entropy(model(x.to(dtype or torch.float32)), y)
            optimizer.zero_grad()
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
        trained.append(model)
    return nn.ModuleList(trained)


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_each_fold_of_a_k_fold_script_trains_under_the_candidate_as_the_hand_edit(policy):
    with under(policy) as agent:
        injected = k_fold(None)
    assert same(injected, k_fold(policy)), "a fold differs from the hand edit"
    assert not same(injected, k_fold(None)), "the candidate changed nothing"
    assert len(agent.steps) == FOLDS * STEPS
    assert agent.model is not None and any(agent.model is m for m in injected[-1].modules())


def test_each_fold_gets_a_true_candidates_cast():
    with under("bf16-true") as agent:
        injected = k_fold(None)
    assert all(p.dtype == torch.bfloat16 for p in injected.parameters())
    assert same(injected, k_fold(None, dtype=torch.bfloat16))
    assert len(agent.steps) == FOLDS * STEPS


class Fold:
    """A fold's trainer, its optimizer built in ``__init__`` (``trainer = Fold(k)``: while the next
    one is built, the variable still holds the last, and its model)."""

    def __init__(self, fold: int) -> None:
        self.fold = fold
        self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def fit(self) -> None:
        for x, y in fold_batches(self.fold):
            F.cross_entropy(self.model(x), y).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()


def test_folds_trained_by_a_trainer_object_built_anew_each_fold():
    with under("bf16-mixed") as agent:
        torch.manual_seed(0)
        trainer = None
        for fold in range(FOLDS):
            trainer = Fold(fold)
            trainer.fit()
    assert trainer is not None and len(agent.steps) == FOLDS * STEPS
    assert agent.model is trainer.model
    assert len(agent.optimizers.all) == 1, "the earlier folds' optimizers (and their state) are kept"


def test_a_model_trained_after_one_the_script_still_holds_is_refused_with_the_reason(tmp_path):
    """A teacher trained first, then a student beside it (the teacher still in a variable): one
    candidate for one model at a time, said so."""
    from mixprec.frameworks.script.messages import TraceRecord

    out = tmp_path / "trace.pt"
    with pytest.raises(Exited), under("bf16-mixed", mode="trace", steps=50, out=str(out)):
        teacher = nn.Sequential(nn.Linear(16, 4))
        opt = torch.optim.SGD(teacher.parameters(), lr=0.1)
        for x, y in fold_batches(0):
            F.cross_entropy(teacher(x), y).backward()
            opt.step()
            opt.zero_grad()
        student = nn.Sequential(nn.Linear(16, 4))
        torch.optim.SGD(student.parameters(), lr=0.1)
    said = TraceRecord.load(out).error or ""
    assert f"after {STEPS} steps" in said and "still holds" in said and "two runs" in said, said


def test_a_check_stops_at_the_second_fold_saying_it_compares_one_models_steps(tmp_path):
    from mixprec.frameworks.script.messages import TraceRecord

    out = tmp_path / "trace.pt"
    with pytest.raises(Exited), under("bf16-mixed", mode="trace", steps=2 * STEPS, out=str(out)):
        k_fold(None)
    said = TraceRecord.load(out).error or ""
    assert "one model after another" in said and "checks one model's steps" in said, said


def build(fold: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


class OwnOptimizer(nn.Module):
    """A model that builds its own optimizer in ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("form", ["factory", "module"])
def test_folds_built_by_a_factory_or_by_a_model_that_builds_its_optimizer(form):
    """``model, opt = build(k)`` and ``model = OwnOptimizer()``: while the new one is built, the
    variable it goes to still holds the last one (they were refused as "still holds")."""
    with under("bf16-mixed") as agent:
        torch.manual_seed(0)
        for fold in range(FOLDS):
            if form == "factory":
                model, optimizer = build(fold)
            else:
                model = OwnOptimizer()
                optimizer = model.optimizer
            for x, y in fold_batches(fold):
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    assert len(agent.steps) == FOLDS * STEPS


def test_a_model_taken_to_be_done_with_and_trained_again_is_refused(tmp_path):
    """A teacher trainer and a student trainer of one class (the teacher's, in a variable of the
    caller, looks like a last fold's): when the teacher steps again, the script is stopped, saying
    why (it trained on without the candidate's hooks, its gradients read scaled)."""
    import json

    with pytest.raises(Exited) as exited, under("bf16-mixed", out=str(tmp_path)):
        teacher = Fold(0)
        teacher.fit()
        student = Fold(1)
        student.fit()
        teacher.fit()
    said = json.loads((tmp_path / "run.json").read_text())["error"]
    assert exited.value.code == 2
    assert "a model it trained before its current one" in said and "two runs" in said, said


def test_the_monitor_watches_each_fold_and_withholds_a_bad_batch_in_any():
    """`mixprec run --monitor` (or --rescue) of a k-fold script stopped it at the second fold, after
    the first had trained: the monitor was built for one model. Each model now gets a monitor of its
    own (its hooks, snapshots, detectors from its first step); a NaN batch in the second fold is
    found there, diagnosed and withheld, its finding tagged with the model, and every fold trains."""
    from mixprec.monitor.script import ScriptMonitor

    with under("bf16-mixed") as agent:
        monitor = ScriptMonitor(agent, {"rescue": True})
        agent.observers.append(monitor)
        torch.manual_seed(0)
        trained = []
        for fold in range(FOLDS):
            model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for i, (x, y) in enumerate(fold_batches(fold)):
                bad = fold == 1 and i == 2
                loss = F.cross_entropy(model(x * math.nan if bad else x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            trained.append(model)
    record = monitor.summary()
    assert len(agent.steps) == FOLDS * STEPS and len(record["losses"]) == FOLDS * STEPS
    assert [len(m["losses"]) for m in record["models"]] == [STEPS] * FOLDS
    assert [m["withheld"] for m in record["models"]] == [[], [2], []], record["models"]
    spikes = [(f["evidence"].get("model"), f["step"]) for f in record["findings"] if f["kind"] == "spike"]
    assert spikes == [(2, 2)], record["findings"]
    assert record["healthy"] is True
    assert all(torch.isfinite(p).all() for m in trained for p in m.parameters())


def test_the_monitor_lets_go_of_each_fold_it_is_done_with():
    """Each closed fold's Monitor was kept for the record: with it the fold's model, its optimizer's
    state and the rescue's snapshot, every fold's to the run's end (a k-fold of a large model held
    k of them). Its record is kept; the monitor and the model go."""
    import gc
    import weakref

    from mixprec.monitor.script import ScriptMonitor

    with under("bf16-mixed") as agent:
        monitor = ScriptMonitor(agent, {"rescue": True})
        agent.observers.append(monitor)
        earlier = []
        for fold in range(FOLDS):
            model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
            earlier.append(weakref.ref(model))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for x, y in fold_batches(fold):
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        del model, optimizer, loss
        gc.collect()
        alive = [fold for fold, ref in enumerate(earlier[:-1]) if ref() is not None]
    assert alive == [], f"the folds' models {alive} live on after the script let them go"
    record = monitor.summary()
    assert [m["model"] for m in record["models"]] == [1, 2, 3]
    assert [len(m["losses"]) for m in record["models"]] == [STEPS] * FOLDS


def test_a_stop_the_monitor_decides_as_it_closes_a_fold_ends_the_run(tmp_path):
    """The last model's monitor is closed where the next fold begins, and its closing read of the
    last losses can stop the run: that stop was dropped, and the next fold trained on."""
    import json

    from frameworks.in_process import Losses

    class StopsAtTheFold(Losses):
        def new_model(self, agent):
            return "the monitor stopped the run: planted at the fold's end"

    with (
        pytest.raises(Exited) as exited,
        under("bf16-mixed", out=str(tmp_path), observers=[StopsAtTheFold()]),
    ):
        k_fold(None)
    assert exited.value.code == 4
    said = json.loads((tmp_path / "run.json").read_text())["error"]
    assert "planted at the fold's end" in said, said
