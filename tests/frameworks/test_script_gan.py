"""What GAN scripts are made of, under the agent: a gradient penalty (WGAN-GP's, R1's) taken with
``torch.autograd.grad``, and layers under a parametrization (``spectral_norm``, ``weight_norm``),
each compared bit for bit with the same loop edited by hand as the PyTorch AMP recipe says.

- The AMP recipe's gradient penalty: ``autograd.grad`` outside autocast, from outputs scaled by the
  loss scale, its gradients multiplied by the inverse scale; the penalty itself inside autocast.
  The agent ran it under the candidate's autocast (a double-backward graph in the candidate's dtype)
  and, under fp16-mixed, unscaled.
- The agent's first-step probe read ``layer.weight`` to learn its dtype: under ``spectral_norm`` that
  runs one more power iteration than the script does (in fp32, outside autocast), so its ``u``/``v``
  and then its weights differed from the hand edit's under every candidate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from frameworks.in_process import Exited, under
from frameworks.test_script_agent import GAN, batches, hand, recipe_step, same
from mixprec.frameworks.script.messages import TraceRecord

POLICIES = ["bf16-mixed", "fp16-mixed"]


def wgan_gp(precision: str | None, steps: int = 5) -> nn.Module:
    """WGAN-GP, the penalty as the AMP recipe writes it where ``precision`` is given (the
    generator's optimizer made first: its step ends the iteration)."""
    gan = GAN()
    opt_g = torch.optim.Adam(gan.g.parameters(), lr=1e-3, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(gan.d.parameters(), lr=1e-3, betas=(0.5, 0.9))
    ctx, scaler = hand(precision)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        real, z = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        eps = torch.rand(8, 1, generator=gen)
        with ctx():
            fake = gan.g(z).detach()
            mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
            critic = gan.d(mixed).sum()
        if scaler:
            (grad,) = torch.autograd.grad(scaler.scale(critic), mixed, create_graph=True)
            grad = grad * (1.0 / scaler.get_scale())
        else:
            (grad,) = torch.autograd.grad(critic, mixed, create_graph=True)
        with ctx():
            penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
            d_loss = gan.d(fake).mean() - gan.d(real).mean() + 10 * penalty
        opt_d.zero_grad()
        (scaler.scale(d_loss) if scaler else d_loss).backward()
        scaler.step(opt_d) if scaler else opt_d.step()
        with ctx():
            g_loss = -gan.d(gan.g(z)).mean()
        opt_g.zero_grad()
        (scaler.scale(g_loss) if scaler else g_loss).backward()
        scaler.step(opt_g) if scaler else opt_g.step()
        if scaler:
            scaler.update()
    return gan


@pytest.mark.parametrize("policy", POLICIES)
def test_a_gradient_penalty_is_taken_as_the_amp_recipe_takes_it(policy):
    with under(policy):
        injected = wgan_gp(None)
    assert same(injected, wgan_gp(policy)), "the agent's run differs from the hand edit"
    assert not same(injected, wgan_gp(None)), "the candidate changed nothing"


def test_a_gradient_penalty_as_written_is_the_scripts_own():
    """fp32 as written: nothing of the recipe is put in (no autocast, no scale)."""
    with under("fp32 (as written)"):
        injected = wgan_gp(None)
    assert same(injected, wgan_gp(None))


def normed(precision: str | None, kind: str, losses: list[float], steps: int = 5) -> nn.Module:
    norms = nn.utils.parametrizations
    wrap = {"spectral": norms.spectral_norm, "weight": norms.weight_norm}
    torch.manual_seed(0)
    model = nn.Sequential(wrap[kind](nn.Linear(16, 32)), nn.LeakyReLU(0.2), wrap[kind](nn.Linear(32, 4)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ctx, scaler = hand(precision)
    for x, y in batches(steps):
        with ctx():
            loss = nn.functional.cross_entropy(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        recipe_step(loss, opt, scaler)
    return model


@pytest.mark.parametrize("kind", ["spectral", "weight"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_parametrized_layer_trains_as_the_hand_edit(policy, kind):
    with under(policy):
        injected = normed(None, kind, [])
    assert same(injected, normed(policy, kind, [])), "the agent's run differs from the hand edit"


def test_a_spectral_norm_model_is_traced_as_it_trains(tmp_path):
    """The numerics check's trace of the script as written (probed in every traced run): its
    losses are the script's own, step for step (the probe's power iteration moved them)."""
    losses: list[float] = []
    normed(None, "spectral", losses)
    out = tmp_path / "trace.pt"
    with pytest.raises(Exited), under("fp32 (as written)", mode="trace", steps=4, out=str(out)):
        normed(None, "spectral", [])
    assert [s.loss for s in TraceRecord.load(out).steps] == losses[:4]


def test_autograd_grad_in_a_disabled_autocast_of_the_scripts_own_leaves_autocast_as_it_was():
    """``with torch.autocast(enabled=False): autograd.grad(...)`` (a script that keeps its penalty in
    fp32 itself): the agent left its autocast inside the script's, out of order, and the script's
    exit turned it back on for good, owned by no one: on through the backward, every later step and
    the agent's removal."""

    def loop(precision: str | None) -> nn.Module:
        gan = GAN()
        opt = torch.optim.Adam(gan.d.parameters(), lr=1e-3)
        ctx, scaler = hand(precision)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            real = torch.randn(8, 16, generator=gen).requires_grad_(True)
            with ctx():
                critic = gan.d(real)
            with torch.autocast("cpu", enabled=False):
                (grad,) = torch.autograd.grad(critic.sum(), real, create_graph=True)
            with ctx():
                loss = -critic.mean() + 10 * grad.pow(2).sum(1).mean()  # (R1)
            opt.zero_grad()
            recipe_step(loss, opt, scaler)
            assert not torch.is_autocast_enabled("cpu")
        return gan

    with under("bf16-mixed"):
        injected = loop(None)
    assert not torch.is_autocast_enabled("cpu")
    assert same(injected, loop("bf16-mixed"))


@pytest.mark.parametrize("policy", POLICIES)
def test_a_penalty_over_a_dict_of_inputs_has_its_gradients_as_a_dict(policy):
    """``autograd.grad(out, {"x": x})`` returns a dict: unscaled, it must stay one (a TypeError)."""
    with under(policy):
        gan = GAN()
        opt = torch.optim.SGD(gan.parameters(), lr=0.1)
        real = torch.randn(8, 16).requires_grad_(True)
        critic = gan.d(real).float().mean()  # (fp16's own scalar times the first scale, 2^16, is inf)
        by_name = torch.autograd.grad(critic, {"real": real}, retain_graph=True)
        (plain,) = torch.autograd.grad(critic, real, retain_graph=True)
        critic.backward()
        opt.step()
    assert set(by_name) == {"real"} and torch.equal(by_name["real"], plain)
    assert torch.isfinite(plain).all()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_model_the_script_compiles_trains_under_the_candidate(policy):
    """torch.compile's AOTAutograd takes the backward with ``autograd.grad`` on fake tensors, in the
    loop's thread: taken for a gradient penalty, they were scaled by the real scaler under
    fp16-mixed ("Mixing fake modes NYI"), and autocast left mid-trace."""
    torch._dynamo.reset()

    def loop(precision: str | None) -> nn.Module:
        gan = GAN()
        d = torch.compile(gan.d, backend="aot_eager")
        opt = torch.optim.Adam(gan.d.parameters(), lr=1e-3)
        ctx, scaler = hand(precision)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            with ctx():
                loss = d(torch.randn(8, 16, generator=gen)).pow(2).mean()
            opt.zero_grad()
            recipe_step(loss, opt, scaler)
        return gan

    with under(policy):
        injected = loop(None)
    assert same(injected, loop(policy))
