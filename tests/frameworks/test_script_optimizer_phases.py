"""Optimizers that do not step once each per iteration, as scripts are written: a WGAN's critic
stepped n times per generator step (the generator's optimizer built first), fine-tuning's second
phase with a new optimizer over the unfrozen model, an optimizer built anew each epoch.

Before, the first optimizer built (the *lead*) paced the steps and the scale was updated once per
step of it: under fp16-mixed each of these loops crashed ("step() has already been called since the
last update()": GradScaler steps an optimizer once per update), and under bf16-mixed a second phase
was not counted (`mixprec run` said 10 steps of 20; a monitor saw none of them). Now a new optimizer
over the parameters the lead holds, built once training began, takes the lead; and a backward that
reaches an optimizer stepped since the last update has the scale updated first, where the AMP
recipe calls ``scaler.update()`` after each step. Each loop is compared bit for bit with the
recipe's hand edit of it, an overflow planted in one step to have the scale backed off between."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from frameworks.in_process import Exited, under
from frameworks.test_script_agent import hand, recipe_step, same
from mixprec.frameworks.script.optimizers import reached_optimizers

ITERATIONS = 4
CRITIC = 3  # critic steps per generator step
PHASE = 4  # steps of each fine-tuning phase
OVERFLOW = 1e30  # a loss this large overflows fp16's gradients at any scale GradScaler starts at


def wgan(
    precision: str | None, *, recompute: str | None = None, overflow: tuple[int, int] = (1, 1)
) -> nn.Module:
    """A WGAN's loop, the generator's optimizer built first; ``recompute``: the critic in a
    reentrant checkpoint of the ``"module"`` or of a ``"function"`` calling it (whose graph hides
    the critic's weights from the backward). The critic step at ``overflow`` (iteration, step) overflows."""
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    net_d = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-3, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=1e-3, betas=(0.5, 0.9))
    ctx, scaler = hand(precision)
    gen = torch.Generator().manual_seed(1)

    def critic(x: torch.Tensor) -> torch.Tensor:
        if recompute == "module":
            return checkpoint(net_d, x.requires_grad_(), use_reentrant=True)
        if recompute == "function":
            return checkpoint(lambda x: net_d(x), x.requires_grad_(), use_reentrant=True)
        return net_d(x)

    for it in range(ITERATIONS):
        for k in range(CRITIC):
            real, noise = torch.randn(32, 16, generator=gen) + 1, torch.randn(32, 8, generator=gen)
            with ctx():
                fake = net_g(noise).detach()
                loss_d = critic(fake).mean() - critic(real).mean()
            opt_d.zero_grad()
            recipe_step(loss_d * (OVERFLOW if (it, k) == overflow else 1.0), opt_d, scaler)
        with ctx():
            loss_g = -critic(net_g(torch.randn(32, 8, generator=gen))).mean()
        opt_g.zero_grad()
        recipe_step(loss_g, opt_g, scaler)
    return nn.ModuleList([net_g, net_d])


def batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(n)]


def two_phases(precision: str | None) -> nn.Module:
    """Fine-tuning in two phases: the head alone with the backbone frozen, then the whole model
    with a new optimizer and its scheduler. One step of the second phase overflows."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    head = nn.Linear(32, 4)
    model = nn.Sequential(backbone, head)
    backbone.requires_grad_(False)
    ctx, scaler = hand(precision)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    for x, y in batches(PHASE, seed=1):
        with ctx():
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        recipe_step(loss, optimizer, scaler)
    backbone.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, PHASE)
    for i, (x, y) in enumerate(batches(PHASE, seed=2)):
        with ctx():
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        recipe_step(loss * (OVERFLOW if i == 1 else 1.0), optimizer, scaler)
        schedule.step()
    return model


def optimizer_each_epoch(precision: str | None) -> nn.Module:
    """The learning rate decayed the old way: an optimizer built anew each epoch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ctx, scaler = hand(precision)
    for epoch in range(3):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * 0.5**epoch, momentum=0.9)
        for x, y in batches(PHASE, seed=epoch):
            with ctx():
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            recipe_step(loss, optimizer, scaler)
    return model


def check(loop: Callable[[str | None], nn.Module], policy: str, steps: int) -> None:
    with under(policy) as agent:
        injected = loop(None)
    assert same(injected, loop(policy)), "the agent's run differs from the hand edit"
    assert not same(injected, loop(None)), "the candidate changed nothing"
    assert len(agent.steps) == steps, [s.index for s in agent.steps]
    if policy == "fp16-mixed":
        assert any(s.skipped for s in agent.steps), "the planted overflow skipped no step"


@pytest.mark.parametrize("overflow", [(1, 1), (1, CRITIC - 1)], ids=["mid-critic", "last-critic"])
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_a_critic_stepped_n_times_per_generator_step_trains_as_the_recipes_hand_edit(policy, overflow):
    """The generator's optimizer (built first) paces the steps; the scale is updated before each
    critic backward after the first, as GradScaler requires of the hand edit (fp16-mixed crashed
    on the second). The generator's backward, which reaches the critic too, is updated for at the
    step's end (the recipe updates before it: the same weights, where the last critic overflowed)."""
    check(lambda precision: wgan(precision, overflow=overflow), policy, steps=ITERATIONS)


def test_a_critic_in_a_reentrant_checkpoint_is_seen_through_its_module():
    """A reentrant checkpoint's node keeps the critic's weights out of the graph's leaves (its
    backward makes a graph of its own): the node's module says whose they are."""
    check(lambda precision: wgan(precision, recompute="module"), "fp16-mixed", steps=ITERATIONS)


def test_a_critic_whose_graph_hides_its_weights_steps_after_an_update_at_its_step():
    """A checkpointed function hides the critic from the look: the scale is updated at the
    critic's next step instead, its gradients brought to the new scale (the recipe's backward would
    have run at it: after a back-off this one overflows again, so its run is not the hand edit's
    bit for bit). It trained before: the critic's second step crashed."""
    with under("fp16-mixed") as agent:
        trained = wgan(None, recompute="function")
    assert len(agent.steps) == ITERATIONS
    assert any(s.skipped for s in agent.steps)
    assert all(torch.isfinite(p).all() for p in trained.parameters())
    assert not same(trained, wgan(None, recompute="function")), "the candidate changed nothing"


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_fine_tuning_with_a_second_optimizer_is_trained_and_counted_in_both_phases(policy):
    check(two_phases, policy, steps=2 * PHASE)


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_an_optimizer_built_anew_each_epoch_paces_the_steps_of_its_epoch(policy):
    with under(policy) as agent:
        injected = optimizer_each_epoch(None)
    assert same(injected, optimizer_each_epoch(policy))
    assert len(agent.steps) == 3 * PHASE


def test_the_optimizers_a_backward_reaches_are_those_it_accumulates_gradients_for():
    first, second, third = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)
    opt_first, opt_second = torch.optim.SGD(first.parameters()), torch.optim.SGD(second.parameters())
    owner = {id(p): opt for opt in (opt_first, opt_second) for g in opt.param_groups for p in g["params"]}
    x = torch.randn(2, 4, requires_grad=True)  # (a leaf of no optimizer's)
    hidden = first(x)
    through_both, second_only = second(hidden).sum(), second(hidden.detach()).sum()
    assert {id(o) for o in reached_optimizers((through_both,), owner)} == {id(opt_first), id(opt_second)}
    assert list(reached_optimizers((second_only,), owner)) == [opt_second]
    assert list(reached_optimizers((third(x).sum(),), owner)) == []  # (no optimizer's parameters)
    assert list(reached_optimizers((torch.ones(()),), owner)) == []  # (no graph at all)
    recomputed = checkpoint(second, hidden.detach().requires_grad_(), use_reentrant=True).sum()
    assert list(reached_optimizers((recomputed,), owner)) == [opt_second]  # (through the checkpoint's module)


# ---------------------------------------------------------------------- what must not change
def logging_after_the_step(precision: str | None, norms: list[float]) -> nn.Module:
    """A plain loop that logs the gradients' norm after the step and zeroes them by hand (the first
    form of the in-step update unscaled them a second time there: NaN by the third step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx, scaler = hand(precision)
    for x, y in batches(6, seed=3):
        with ctx():
            loss = F.cross_entropy(model(x), y)
        recipe_step(loss, optimizer, scaler)
        norms.append(float(torch.stack([p.grad.norm() for p in model.parameters()]).norm()))
        for p in model.parameters():
            p.grad.zero_()
    return model


def test_gradients_read_and_zeroed_after_the_step_are_the_hand_edits():
    injected_norms: list[float] = []
    with under("fp16-mixed") as agent:
        injected = logging_after_the_step(None, injected_norms)
    hand_norms: list[float] = []
    assert same(injected, logging_after_the_step("fp16-mixed", hand_norms))
    assert injected_norms == hand_norms and all(0 < n < 100 for n in hand_norms), (injected_norms, hand_norms)
    assert not any(s.skipped for s in agent.steps)


def dcgan_logging_the_critic(precision: str | None, norms: list[float]) -> nn.Module:
    """The DCGAN shape, the generator's optimizer built first, logging the discriminator's gradient
    norm after the generator's step (what the generator's backward left there, scaled in the recipe
    too) and zeroing it by hand."""
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    net_d = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(net_d.parameters(), lr=1e-3)
    ctx, scaler = hand(precision)
    gen = torch.Generator().manual_seed(4)
    for _ in range(ITERATIONS):
        real, noise = torch.randn(16, 16, generator=gen), torch.randn(16, 8, generator=gen)
        with ctx():
            fake = net_g(noise)
            loss_d = F.softplus(-net_d(real)).mean() + F.softplus(net_d(fake.detach())).mean()
        (scaler.scale(loss_d) if scaler else loss_d).backward()
        scaler.step(opt_d) if scaler else opt_d.step()
        with ctx():
            loss_g = F.softplus(-net_d(fake)).mean()
        opt_g.zero_grad()
        recipe_step(loss_g, opt_g, scaler)
        norms.append(float(torch.stack([p.grad.norm() for p in net_d.parameters()]).norm()))
        for p in net_d.parameters():
            p.grad.zero_()
    return nn.ModuleList([net_g, net_d])


def test_a_generators_backward_through_the_critic_waits_for_the_steps_one_update():
    injected_norms: list[float] = []
    with under("fp16-mixed") as agent:
        injected = dcgan_logging_the_critic(None, injected_norms)
    hand_norms: list[float] = []
    assert same(injected, dcgan_logging_the_critic("fp16-mixed", hand_norms))
    assert list(map(repr, injected_norms)) == list(map(repr, hand_norms))  # (NaN where the first overflowed)
    assert len(agent.steps) == ITERATIONS


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_an_optimizer_built_mid_training_that_never_steps_leaves_the_lead_where_it_is(policy):
    """An evaluation's helper over the model's parameters (never stepped): every step is counted."""
    torch.manual_seed(0)
    with under(policy) as agent:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (x, y) in enumerate(batches(8, seed=5)):
            if i == 3:
                torch.optim.SGD(model.parameters(), lr=0.0)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert len(agent.steps) == 8
    assert agent.optimizers.lead is optimizer


def test_the_optimizers_a_new_one_took_over_from_are_let_go():
    with under("fp16-mixed") as agent:
        optimizer_each_epoch(None)
    assert len(agent.optimizers.all) == 1


def phases_and_back(precision: str | None, *, ahead: bool = False, clip: bool = True) -> nn.Module:
    """The whole model, then the head alone with a new optimizer (built after the first's last step,
    or ``ahead`` of training), then the whole model again with the first optimizer; each step
    clipped (``clip``: unscaled, then the norm of the phase's parameters)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ctx, scaler = hand(precision)
    whole = torch.optim.SGD(model.parameters(), lr=0.1)
    head = torch.optim.SGD(model[2].parameters(), lr=0.1) if ahead else None
    for phase, seed in (("whole", 1), ("head", 2), ("whole", 3)):
        if phase == "head" and head is None:
            head = torch.optim.SGD(model[2].parameters(), lr=0.1)
        optimizer = whole if phase == "whole" else head
        assert optimizer is not None
        for x, y in batches(PHASE, seed=seed):
            with ctx():
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            (scaler.scale(loss) if scaler else loss).backward()
            if clip and scaler:
                scaler.unscale_(optimizer)
            if clip:
                torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
            scaler.step(optimizer) if scaler else optimizer.step()
            if scaler:
                scaler.update()
    return model


@pytest.mark.parametrize("ahead", [False, True], ids=["built-after", "built-ahead"])
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_an_earlier_optimizer_stepped_again_and_one_built_ahead_train_as_the_hand_edit(policy, ahead):
    """Going back to the first optimizer (it was let go: it is taken back), and a second phase's
    optimizer built before training: each takes the lead at its second step, its first counted
    with the step before it (before: 4 steps of 12; under fp16-mixed a clip's read went to the
    optimizer built last, and the step unscaled the head's gradients a second time)."""
    # (built ahead, the head's second backward is not known for its own before it steps: under
    # fp16-mixed a clip there would read its gradients scaled; without one, the hand edit's weights)
    clip = not (ahead and policy == "fp16-mixed")
    with under(policy) as agent:
        injected = phases_and_back(None, ahead=ahead, clip=clip)
    assert same(injected, phases_and_back(policy, ahead=ahead, clip=clip))
    assert len(agent.steps) == 3 * PHASE - (2 if ahead else 1)


@pytest.mark.parametrize("aux_first", [True, False], ids=["aux-first", "main-first"])
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_two_optimizers_over_a_shared_encoder_stepping_each_iteration_count_one_step_each(policy, aux_first):
    """An auxiliary loss's optimizer over the encoder beside the main one over the whole model,
    both stepped every iteration: the lead stays with one (a form that handed it over at every step
    the lead had not stepped in yet counted two steps an iteration, and updated the scale twice)."""

    scalers: list[torch.amp.GradScaler] = []

    def loop(precision: str | None) -> nn.Module:
        torch.manual_seed(0)
        enc, head = nn.Sequential(nn.Linear(16, 32), nn.GELU()), nn.Linear(32, 4)
        model = nn.ModuleDict({"enc": enc, "head": head})
        main = torch.optim.SGD(model.parameters(), lr=0.05)
        aux = torch.optim.SGD(enc.parameters(), lr=0.01)
        ctx, scaler = hand(precision)
        scalers.extend([scaler] if scaler else [])
        for x, y in batches(5, seed=6):
            for which in ("aux", "main") if aux_first else ("main", "aux"):
                with ctx():
                    loss = enc(x).pow(2).mean() if which == "aux" else F.cross_entropy(head(enc(x)), y)
                optimizer = aux if which == "aux" else main
                optimizer.zero_grad()
                (scaler.scale(loss) if scaler else loss).backward()
                scaler.step(optimizer) if scaler else optimizer.step()
            if scaler:
                scaler.update()
        return model

    with under(policy) as agent:
        injected = loop(None)
    assert len(agent.steps) == 5
    if policy == "fp16-mixed" and not aux_first:
        # the lead (the first built) steps first here: the step's one scale update comes between the
        # two optimizers, not after both (the first step's overflow backs the scale off before the
        # auxiliary's backward): as in a GAN whose discriminator's optimizer is built first
        return
    assert same(injected, loop(policy))
    if policy == "fp16-mixed":  # (one update an iteration: the scale grows as the hand edit's)
        tracker, scale = agent.policy.scaler._get_growth_tracker(), agent.policy.scaler.get_scale()
        assert (tracker, scale) == (scalers[0]._get_growth_tracker(), scalers[0].get_scale())


def test_a_second_backward_into_gradients_a_read_unscaled_is_refused_under_loss_scaling():
    """SAM's two passes (the first's gradients read to perturb the weights, then a second backward
    before the step): under fp16-mixed they trained silently on gradients of two scales."""
    torch.manual_seed(0)
    x, y = batches(1, seed=7)[0]
    with pytest.raises(Exited) as exited, under("fp16-mixed"):
        model = nn.Sequential(nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        F.cross_entropy(model(x), y).backward()
        norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()  # (SAM's first_step)
        assert torch.isfinite(norm)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert exited.value.code == 2
