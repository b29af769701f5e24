"""Activation checkpointing in a script under the agent: inside the model (HF's and timm's
``gradient_checkpointing``, a block wrapped in ``torch.utils.checkpoint.checkpoint``) and at the top of
the loop (``checkpoint(encoder, x)`` over a model in parts, ``checkpoint_sequential(model, ...)``),
reentrant (torch's default still) and not. Each is compared, bit for bit, with the same loop edited
by hand as the AMP recipe says, autocast around the checkpoint.

The recomputation runs forwards *inside* the backward: they are no step's first forward, no samples
and no loss; a reentrant checkpoint's own ``torch.autograd.backward`` is no backward of the script's
(it crashed under fp16-mixed, its outputs scaled a second time). A checkpoint called before the
model's first forward records the autocast state its recomputation restores: the candidate's
autocast begins there (it began inside, and the recomputation ran in fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from frameworks.in_process import Exited, Losses, under
from frameworks.test_script_agent import batches, hand, recipe_step, same
from mixprec.frameworks.script.messages import TraceRecord

POLICIES = ["bf16-mixed", "fp16-mixed"]
STEPS = 5


class Blocks(nn.Module):
    """A model that checkpoints its middle block, as ``gradient_checkpointing`` does."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Linear(16, 32), nn.GELU())
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(x)


def inside(precision: str | None, reentrant: bool, losses: list[float]) -> nn.Module:
    model = Blocks(reentrant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctx, scaler = hand(precision)
    for x, y in batches(STEPS):
        with ctx():
            loss = F.cross_entropy(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        recipe_step(loss, opt, scaler)
    return model


def at_the_top(precision: str | None, reentrant: bool, losses: list[float]) -> nn.Module:
    """A model in parts, its encoder checkpointed by the loop."""
    from torch.utils.checkpoint import checkpoint  # (a script imports it after the agent is in)

    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
    dec = nn.Linear(32, 4)
    opt = torch.optim.AdamW([*enc.parameters(), *dec.parameters()], lr=1e-2)
    ctx, scaler = hand(precision)
    for x, y in batches(STEPS):
        x = x.clone().requires_grad_(reentrant)  # (reentrant: else the encoder gets no gradient)
        with ctx():
            hidden = checkpoint(enc, x, use_reentrant=reentrant)
            loss = F.cross_entropy(dec(hidden), y)
        losses.append(loss.item())
        opt.zero_grad()
        recipe_step(loss, opt, scaler)
    return nn.ModuleList([enc, dec])


def sequential(precision: str | None, reentrant: bool, losses: list[float]) -> nn.Module:
    """``checkpoint_sequential``: the model's own forward never runs, its children do."""
    from torch.utils.checkpoint import checkpoint_sequential

    torch.manual_seed(0)
    hidden = [layer for _ in range(2) for layer in (nn.Linear(32, 32), nn.GELU())]
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), *hidden, nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx, scaler = hand(precision)
    for x, y in batches(STEPS):
        x = x.clone().requires_grad_(reentrant)
        with ctx():
            loss = F.cross_entropy(checkpoint_sequential(model, 2, x, use_reentrant=reentrant), y)
        losses.append(loss.item())
        opt.zero_grad()
        recipe_step(loss, opt, scaler)
    return model


def whole(precision: str | None, reentrant: bool, losses: list[float]) -> nn.Module:
    """The whole model checkpointed by the loop (a reentrant checkpoint runs its forward without
    grad, and its recomputation inside the backward: no forward of the step counts the batch)."""
    from torch.utils.checkpoint import checkpoint

    model = Blocks(reentrant=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctx, scaler = hand(precision)
    for x, y in batches(STEPS):
        x = x.clone().requires_grad_(reentrant)
        with ctx():
            loss = F.cross_entropy(checkpoint(model, x, use_reentrant=reentrant), y)
        losses.append(loss.item())
        opt.zero_grad()
        recipe_step(loss, opt, scaler)
    return model


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("loop", [inside, at_the_top, sequential, whole], ids=lambda f: f.__name__)
def test_a_checkpointed_loop_trains_as_the_hand_edit(loop, policy, reentrant):
    """The weights, each step's loss and samples: the hand edit's (fp16-mixed crashed with a
    reentrant checkpoint; a checkpoint at the top recomputed in fp32 under the candidate, and raised
    CheckpointError where not reentrant; the recomputation counted its batch again)."""
    seen, hand_losses = Losses(), []
    with under(policy, observers=[seen]) as agent:
        injected = loop(None, reentrant, [])
    by_hand, plain = loop(policy, reentrant, hand_losses), loop(None, reentrant, [])
    assert same(injected, by_hand), "the agent's run differs from the hand edit"
    assert not same(injected, plain), "the candidate changed nothing"
    assert seen.losses == hand_losses
    assert [s.samples for s in agent.steps] == [8] * STEPS


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_model_as_written_counts_each_batch_once(reentrant):
    """fp32 as written too: the recomputation's forwards are no new step's and no samples."""
    seen, losses = Losses(), []
    with under("fp32 (as written)", observers=[seen]) as agent:
        inside(None, reentrant, losses)
    assert seen.losses == losses
    assert [s.samples for s in agent.steps] == [8] * STEPS


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_model_is_traced_as_the_hand_edit_trains(reentrant, tmp_path):
    """The numerics check's trace (fp16-mixed, every layer's ranges): each step's loss is the hand
    edit's, and the first output is the step's forward's, not its recomputation's."""
    hand_losses: list[float] = []
    inside("fp16-mixed", reentrant, hand_losses)
    out = tmp_path / "trace.pt"
    with pytest.raises(Exited), under("fp16-mixed", mode="trace", steps=3, out=str(out), ranges=True):
        inside(None, reentrant, [])
    record = TraceRecord.load(out)
    assert [s.loss for s in record.steps] == pytest.approx(hand_losses[:3], abs=0)
    assert [s.samples for s in record.steps] == [8] * 3
    ctx, _ = hand("fp16-mixed")
    x, _ = batches(1)[0]
    with ctx():
        expected = Blocks(reentrant)(x)
    assert torch.equal(record.first_output, expected.detach().float())
