"""The monitor's decisions agreed across data-parallel ranks (issue 54): DDP on 2 gloo ranks, a
bad batch on rank 1 only (targets x1000 at step ``BAD_AT``). The ranks hold the same all-reduced
gradients, so the poisoned update must be withheld on both or the ranks' weights part for good;
rank 1's monitor finds and diagnoses it from its own batch, and rank 0's takes the same decision.
Spawned as tests/distributed/test_distributed.py spawns (FileStore, a deadline): once for the whole
module, every scenario in turn in one process group (each child pays the torch import once, not once
per scenario), each with its own model, optimizer, monitor and folder."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_distributed import _spawn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mixprec
from mixprec.monitor import Monitor
from mixprec.monitor.core import PoisonedCheckpointError
from mixprec.monitor.findings import (
    CHECKPOINT_REFUSED,
    DATA,
    OVERFLOW,
    REPLICAS_DIFFER,
    RESCUE,
    SPIKE,
    STOP,
    MonitorFinding,
)

STEPS = 120
BAD_AT = 80
PER_RANK = 16


def _loss(model, batch):
    return F.mse_loss(model(batch[0]).float(), batch[1])


def _train(
    rank: int,
    world: int,
    bad_rank: int | None,
    *,
    broken: bool = False,
    monitored: bool = True,
    **monitor_kw,
) -> dict:
    """``bad_rank``'s batch ``BAD_AT`` has targets x1000; ``broken``: from there on its inputs are NaN
    (its data pipeline broke)."""
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them anyway)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    policy = mixprec.get_policy("bf16-mixed", device="cpu")
    ddp = DistributedDataParallel(policy.prepare(model))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    monitor = None
    if monitored:
        monitor = Monitor(ddp, policy, optimizer=optimizer, loss_fn=_loss, every=20, **monitor_kw)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    stopped_at = None
    for step in range(STEPS):
        x = torch.randn(PER_RANK, 16, generator=data)
        y = x @ teacher + 0.3 * torch.randn(PER_RANK, 1, generator=data)
        if rank == bad_rank and step == BAD_AT:
            y = y * 1000.0
        if rank == bad_rank and broken and step >= BAD_AT:
            x = torch.full_like(x, math.nan)
        with policy.autocast():
            loss = _loss(ddp, (x, y))
        optimizer.zero_grad()
        policy.backward(loss)
        try:
            if monitor is not None:
                monitor.before_step(loss, (x, y), batch_index=step)
            policy.step(optimizer)
            if monitor is not None:
                monitor.observe(loss, (x, y))
        except mixprec.monitor.MonitorStop:
            stopped_at = step
            break
    held_out = torch.randn(256, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        eval_loss = F.mse_loss(model(held_out), held_out @ teacher).item()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "weights": weights,
        "eval_loss": eval_loss,
        "stopped_at": stopped_at,
        "withheld": list(monitor.withheld) if monitor else [],
        "findings": [(f.step, f.kind, dict(f.evidence)) for f in monitor.findings] if monitor else [],
        "world": dist.get_world_size(),
    }


def _clean(rank, world, out):
    return _train(rank, world, None)


def _bad_on_rank_1(rank, world, out):
    return _train(rank, world, 1, rescue=True)


def _bad_unmonitored(rank, world, out):
    return _train(rank, world, 1, monitored=False)


def _stop_on_rank_1(rank, world, out):
    # rank 1's data pipeline breaks: NaN batches in a row, and its monitor stops the run (the data);
    # rank 0's gradients are NaN too (all-reduced), though its own batches are fine
    return _train(rank, world, 1, broken=True, rescue=True)


def test_a_bad_batch_on_one_rank_is_withheld_on_every_rank_and_the_weights_stay_equal(scenarios):
    clean, rescued, poisoned = (scenarios.ranks(name) for name in ("clean", "rescued", "poisoned"))
    assert [r["world"] for r in rescued] == [2, 2]
    # rank 1 found it in its own batch: a data spike, its rank and step named
    seen = [(step, evidence) for step, kind, evidence in rescued[1]["findings"] if kind == SPIKE]
    assert seen and seen[0][0] == BAD_AT and seen[0][1]["rank"] == 1, rescued[1]["findings"]
    assert seen[0][1]["verdict"] == DATA and seen[0][1]["batch_index"] == BAD_AT
    # rank 0 saw a normal loss and withheld the update too, saying whose evidence decided it
    agreed = [ev for step, kind, ev in rescued[0]["findings"] if kind == RESCUE and step == BAD_AT]
    assert agreed and agreed[0]["decided_by_ranks"] == [1] and agreed[0]["rank"] == 0, rescued[0]["findings"]
    assert rescued[0]["withheld"] == rescued[1]["withheld"] == [BAD_AT]
    # a rank-local decision leaves the ranks with different weights for good; agreed, they are equal
    assert torch.equal(rescued[0]["weights"], rescued[1]["weights"])
    assert torch.equal(clean[0]["weights"], clean[1]["weights"])
    # the poisoned update damages the run; withheld on both ranks, it ends where the clean run does
    damaged, healthy = poisoned[0]["eval_loss"], clean[0]["eval_loss"]
    assert damaged > 1.5 * healthy, (damaged, healthy)
    assert abs(rescued[0]["eval_loss"] - clean[0]["eval_loss"]) <= 0.2 * clean[0]["eval_loss"]


def test_a_stop_on_one_rank_stops_every_rank_at_the_same_step_and_none_hangs(scenarios):
    ranks = scenarios.ranks("stopped")
    assert ranks[1]["stopped_at"] is not None and ranks[0]["stopped_at"] == ranks[1]["stopped_at"], ranks
    assert BAD_AT < ranks[1]["stopped_at"] < BAD_AT + 20
    assert all(torch.isfinite(r["weights"]).all() for r in ranks)  # no NaN update landed on either rank
    assert any(kind == STOP and ev.get("decided_by_ranks") == [1] for _, kind, ev in ranks[0]["findings"])
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])


CHECK_EVERY = 10  # replica checks in these runs (the default, 100, is longer than a test)


def _replicas(rank, world, out, *, fault: str):
    """31 steps with a replica check every 10; at the end of step 29, rank 1 alone: ``nudge`` adds
    1e-3 to one weight (a corrupted copy), ``nan`` puts a NaN in its AdamW state. Rank 0 then saves a
    checkpoint after step 30, whose pre-step hook checked (``torch.save`` on rank 0 only, as scripts
    do): its own state is still finite there."""
    import mixprec.monitor.gate as gate

    gate.REPLICA_CHECK_EVERY = CHECK_EVERY
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    policy = mixprec.get_policy("bf16-mixed", device="cpu")
    ddp = DistributedDataParallel(policy.prepare(model))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    monitor = Monitor(ddp, policy, optimizer=optimizer, loss_fn=_loss, every=20)
    data = torch.Generator().manual_seed(100 + rank)
    refused = None
    for step in range(31):
        x, y = torch.randn(PER_RANK, 16, generator=data), torch.randn(PER_RANK, 1, generator=data)
        with policy.autocast():
            loss = _loss(ddp, (x, y))
        optimizer.zero_grad()
        policy.backward(loss)
        monitor.before_step(loss, (x, y))
        policy.step(optimizer)
        monitor.observe(loss, (x, y))
        if step == 29 and rank == 1:
            with torch.no_grad():
                if fault == "nudge":
                    model[0].weight[0, 0] += 1e-3
                else:
                    optimizer.state[model[2].weight]["exp_avg"][0, 0] = math.nan
        if step == 30 and rank == 0:
            try:
                monitor.save({"model": model.state_dict()}, out / "ckpt.pt")
            except PoisonedCheckpointError as exc:
                refused = str(exc)
    return {"findings": [(f.step, f.kind, dict(f.evidence)) for f in monitor.findings], "refused": refused}


def _nudged(rank, world, out):
    return _replicas(rank, world, out, fault="nudge")


def _poisoned_state(rank, world, out):
    return _replicas(rank, world, out, fault="nan")


def test_replicas_that_part_are_found_at_the_next_check_on_every_rank(scenarios):
    ranks = scenarios.ranks("nudged")
    for r in ranks:
        found = [step for step, kind, _ in r["findings"] if kind == REPLICAS_DIFFER]
        assert found and found[0] == 30, r["findings"]  # the first check after step 29
    assert ranks[0]["refused"] is None  # finite everywhere: differing replicas say so, not refuse


def test_a_checkpoint_rank_0_saves_is_refused_when_rank_1s_state_is_not_finite(scenarios):
    ranks = scenarios.ranks("poisoned_state")
    refused = ranks[0]["refused"]
    assert refused is not None and "rank 1's weights or optimizer state held inf/NaN at step 30" in refused
    assert any(kind == CHECKPOINT_REFUSED for _, kind, _ in ranks[0]["findings"])
    assert scenarios.folder("poisoned_state").is_dir()
    assert not (scenarios.folder("poisoned_state") / "ckpt.pt").exists()


ISLAND_AT = 12


def _island_on_rank_1(rank, world, out):
    """fp16-mixed DDP; rank 1's detectors alone ask for an fp32 island of module '0' at step
    ``ISLAND_AT`` (as the overflow detector does where only its own batch locates the overflow)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    policy = mixprec.get_policy("fp16-mixed", device="cpu")
    ddp = DistributedDataParallel(policy.prepare(model))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    monitor = Monitor(ddp, policy, optimizer=optimizer, loss_fn=_loss, rescue=True)
    data = torch.Generator().manual_seed(100 + rank)
    islanded_at = None
    for step in range(ISLAND_AT + 6):
        x = torch.randn(PER_RANK, 16, generator=data)
        with policy.autocast():
            loss = _loss(ddp, (x, x[:, :1]))
        optimizer.zero_grad()
        policy.backward(loss)
        monitor.before_step(loss, (x, x[:, :1]), batch_index=step)
        policy.step(optimizer)
        monitor.observe(loss, (x, x[:, :1]))
        if rank == 1 and step == ISLAND_AT:
            finding = MonitorFinding(step, OVERFLOW, "planted: module '0' overflows on this batch", "0")
            monitor.report(finding, monitor.rescuer.action("island", "0"))
        if islanded_at is None and "0" in policy.config.keep_fp32:
            islanded_at = step
    return {
        "islanded_at": islanded_at,
        "keep_fp32": list(policy.config.keep_fp32),
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
        "findings": [(f.step, f.kind, dict(f.evidence)) for f in monitor.findings],
    }


def test_a_precision_rescue_one_rank_asks_for_is_taken_on_every_rank_at_the_same_step(scenarios):
    """An fp32 island decided on rank 1 was made on rank 1 only: the ranks kept the same weights
    (the gradients are all-reduced) but computed module '0' in different formats from then on."""
    ranks = scenarios.ranks("islanded")
    assert [r["keep_fp32"] for r in ranks] == [["0"], ["0"]], ranks
    assert ranks[0]["islanded_at"] == ranks[1]["islanded_at"] == ISLAND_AT + 1
    agreed = [ev for _, kind, ev in ranks[0]["findings"] if kind == RESCUE]
    assert agreed and agreed[0]["decided_by_ranks"] == [1] and agreed[0]["rank"] == 0
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])


# ----------------------------------------------------------------------------------- one spawn
SCENARIOS = {
    "clean": _clean,
    "rescued": _bad_on_rank_1,
    "poisoned": _bad_unmonitored,
    "stopped": _stop_on_rank_1,
    "nudged": _nudged,
    "poisoned_state": _poisoned_state,
    "islanded": _island_on_rank_1,
}


def _every_scenario(rank, world, out):
    """Each scenario in turn on this rank, in its own folder under ``out``; every one builds its
    own model, optimizer and monitor from fixed seeds (what it computes does not depend on what ran
    before it), and the replica-check interval a scenario sets is put back after it."""
    import mixprec.monitor.gate as gate

    results = {}
    for name, fn in SCENARIOS.items():
        folder = out / name
        folder.mkdir(exist_ok=True)
        every = gate.REPLICA_CHECK_EVERY
        try:
            results[name] = fn(rank, world, folder)
        finally:
            gate.REPLICA_CHECK_EVERY = every
    return results


class _Scenarios:
    def __init__(self, out, ranks):
        self.out, self._ranks = out, ranks

    def ranks(self, name):
        """Scenario ``name``'s result on each rank, rank 0 first."""
        return [r[name] for r in self._ranks]

    def folder(self, name):
        return self.out / name


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """Every scenario above, on 2 gloo ranks, in one spawn."""
    tmp = tmp_path_factory.mktemp("monitor_agreed")
    with pytest.MonkeyPatch.context() as monkeypatch:
        ranks = _spawn(_every_scenario, tmp, monkeypatch, deadline_s=240.0)
    return _Scenarios(tmp / "out", ranks)
