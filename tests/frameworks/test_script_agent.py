"""The script agent in this process: training loops written the way people write them, run under
an agent (``mixprec run``'s mode) and compared with the same loop edited by hand as the PyTorch AMP
recipe says (autocast around forward and loss; for fp16 a GradScaler, ``unscale_`` before anything
reads the gradients). Bitwise on the CPU. Each test is a shape that broke a script (issue 51).

The agent patches torch process-wide; ``under`` installs it for one loop and puts torch back."""

from __future__ import annotations

import contextlib
import copy
import io
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from frameworks.in_process import Exited, under
from mixprec.frameworks.script.agent import Agent
from mixprec.frameworks.script.messages import TraceRecord

DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def hand(
    policy: str | None,
) -> tuple[Callable[[], contextlib.AbstractContextManager], torch.amp.GradScaler | None]:
    """The AMP recipe's two pieces for ``policy`` (None: the loop as written, no precision code)."""
    if policy is None:
        return contextlib.nullcontext, None
    dtype = DTYPES[policy]
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    return lambda: torch.autocast("cpu", dtype=dtype), scaler


def recipe_step(loss: torch.Tensor, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """The backward and step of the AMP recipe (``hand``'s scaler, None: the loop as written)."""
    (scaler.scale(loss) if scaler else loss).backward()
    recipe_update(opt, scaler)


def recipe_backward_for_a_clip(
    loss: torch.Tensor, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
) -> None:
    """The AMP recipe's backward with ``unscale_`` before a clip (``hand``'s scaler; None: as written)."""
    if scaler:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
    else:
        loss.backward()


def recipe_update(opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """The AMP recipe's step and scale update (``hand``'s scaler; None: the loop as written)."""
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def batches(n: int = 4, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size, 16, generator=g) * 3, torch.randint(0, 4, (size,), generator=g)) for _ in range(n)
    ]


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def train_briefly(steps: int = 2) -> nn.Module:
    """A fresh MLP trained ``steps`` plain SGD steps (the loop a test runs under the agent)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(steps):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def compare(loop: Callable[[str | None], nn.Module], policy: str) -> Agent:
    """``loop`` under the agent leaves the weights the hand edit leaves (and not the loop's own)."""
    with under(policy) as agent:
        injected = loop(None)
    by_hand, plain = loop(policy), loop(None)
    assert same(injected, by_hand), "the agent's run differs from the hand edit"
    assert not same(injected, plain), "the candidate changed nothing"
    return agent


# ---------------------------------------------------------------------- the optimizer seam
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_a_scheduler_made_after_the_optimizer_trains_as_the_hand_edit(policy):
    """lr_scheduler wraps optimizer.step through __func__: the agent's step must be a bound method
    (it was a function: AttributeError before the first step)."""

    def loop(precision: str | None) -> nn.Module:
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        ctx, scaler = hand(precision)
        for x, y in batches(6):
            with ctx():
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            recipe_step(loss, opt, scaler)
            sched.step()
        return model

    agent = compare(loop, policy)
    assert len(agent.steps) == 6


def _clip(kind: str, model: nn.Module) -> None:
    params = list(model.parameters())
    if kind == "clip_grad_norm_":
        torch.nn.utils.clip_grad_norm_(params, 0.5)
    elif kind == "total_norm":  # what FSDP2 recipes (torchtitan) call
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, 0.5, norm)
    elif kind == "clip_grad_value_":
        torch.nn.utils.clip_grad_value_(params, 0.01)
    else:  # by hand, reading .grad
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))
        for p in params:
            p.grad.mul_(min(1.0, 0.5 / (float(norm) + 1e-6)))


@pytest.mark.parametrize("kind", ["clip_grad_norm_", "total_norm", "clip_grad_value_", "by_hand"])
def test_every_clip_path_sees_the_unscaled_gradients(kind):
    """fp16-mixed: the gradients a clip reads are the true ones (get_total_norm +
    clip_grads_with_norm_ saw the scaled ones: the model never learned, exit 0)."""

    def loop(precision: str | None) -> nn.Module:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ctx, scaler = hand(precision)
        for x, y in batches(6):
            with ctx():
                loss = F.cross_entropy(model(x), y)
            recipe_backward_for_a_clip(loss, opt, scaler)
            _clip(kind, model)
            recipe_update(opt, scaler)
            opt.zero_grad()
        return model

    compare(loop, "fp16-mixed")


def test_a_clip_of_parameters_added_to_the_optimizer_later_sees_unscaled_gradients():
    """Fine-tuning that unfreezes the backbone after a few steps (``add_param_group``) and clips it:
    under fp16-mixed the clip read its gradients scaled (a norm of ~30,000 for a true 0.5), so it cut
    them to a hair and the backbone barely trained."""

    def loop(precision: str | None) -> nn.Module:
        model = mlp()
        backbone = model[:2]
        backbone.requires_grad_(False)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        ctx, scaler = hand(precision)
        for step, (x, y) in enumerate(batches(6)):
            if step == 2:  # unfreeze: the backbone joins the optimizer at a lower learning rate
                backbone.requires_grad_(True)
                opt.add_param_group({"params": list(backbone.parameters()), "lr": 0.1})
            if step == 4:  # a head re-initialised in place of the old one's parameters, in its group
                model[4] = nn.Linear(32, 4)
                opt.param_groups[0]["params"] = [*model[2].parameters(), *model[4].parameters()]
            with ctx():
                loss = F.cross_entropy(model(x), y)
            recipe_backward_for_a_clip(loss, opt, scaler)
            if step >= 4:  # (first: the first gradient read unscales the whole optimizer)
                torch.nn.utils.clip_grad_norm_(model[4].parameters(), 0.5)
            if step >= 2:
                torch.nn.utils.clip_grad_norm_(backbone.parameters(), 0.5)
            recipe_update(opt, scaler)
            opt.zero_grad()
        return model

    compare(loop, "fp16-mixed")


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_two_optimizers_after_one_backward_are_one_step(policy):
    """The Muon/AdamW split: the second optimizer's step is not a step of its own (it read as a NaN
    loss), and the scale is updated once per step."""

    def loop(precision: str | None) -> nn.Module:
        model = mlp()
        matrices = [p for p in model.parameters() if p.dim() == 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        a, b = torch.optim.SGD(matrices, lr=0.1, momentum=0.9), torch.optim.AdamW(vectors, lr=1e-2)
        ctx, scaler = hand(precision)
        for x, y in batches(5):
            with ctx():
                loss = F.cross_entropy(model(x), y)
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(a)
                scaler.step(b)
                scaler.update()
            else:
                loss.backward()
                a.step()
                b.step()
            a.zero_grad()
            b.zero_grad()
        return model

    agent = compare(loop, policy)
    losses = [s for s in agent.steps]
    assert len(losses) == 5 and not any(s.skipped for s in losses)


def adamw_loop(precision: str | None, **implementation: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A loop whose AdamW names its own implementation (``foreach=True`` as written)."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **(implementation or {"foreach": True}))
    ctx, scaler = hand(precision)
    for x, y in batches(4):
        with ctx():
            loss = F.cross_entropy(model(x), y)
        recipe_step(loss, opt, scaler)
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_the_scripts_optimizer_is_built_with_the_candidates_implementation(policy):
    """optimizer='fused': the script's AdamW(foreach=True) is built fused, as AdamW(fused=True)
    builds it (GradScaler hands a fused step its own inf check), trains as the hand edit that
    writes fused=True, and the run's facts say so."""
    with under(policy, optimizer="fused") as agent:
        injected, opt = adamw_loop(None)
    assert opt.defaults["fused"] is True and opt.defaults["foreach"] is False
    assert opt._step_supports_amp_scaling
    by_hand, _ = adamw_loop(policy, fused=True)
    assert same(injected, by_hand)
    assert agent.facts().framework_flags == {"optimizer": {"AdamW": {"fused": True, "foreach": False}}}
    assert agent.facts().own["optimizers"] == [
        {"class": "AdamW", "implementations": ["foreach", "fused"], "as_written": "foreach"}
    ]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda ps: torch.optim.NAdam(ps), "NAdam has no fused implementation (it takes no fused= argument)"),
        (lambda ps: torch.optim.LBFGS(ps), "LBFGS has no fused implementation (it takes no fused= argument)"),
    ],
)
def test_an_optimizer_without_the_implementation_fails_the_candidate_in_one_line(make, message, tmp_path):
    """NAdam takes foreach= only; LBFGS neither (torch.optim's constructors set no fused= on it)."""
    import json

    with pytest.raises(Exited) as exited, under("bf16-mixed", optimizer="fused", out=str(tmp_path)):
        make(mlp().parameters())
    assert exited.value.code == 2
    error = json.loads((tmp_path / "run.json").read_text())["error"]
    assert error == f"the script's {message}: optimizer='fused' does not apply"


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.d = nn.Sequential(nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def gan_loop(precision: str | None, steps: int = 5) -> nn.Module:
    """A GAN in one module, the generator's optimizer made first: D steps, then G, each after its
    own backward."""
    gan = GAN()
    opt_g = torch.optim.Adam(gan.g.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(gan.d.parameters(), lr=1e-3, betas=(0.5, 0.999))
    ctx, scaler = hand(precision)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        real, z = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        with ctx():
            fake = gan.g(z)
            d_loss = F.softplus(-gan.d(real)).mean() + F.softplus(gan.d(fake.detach())).mean()
        opt_d.zero_grad()
        (scaler.scale(d_loss) if scaler else d_loss).backward()
        scaler.step(opt_d) if scaler else opt_d.step()
        with ctx():
            g_loss = F.softplus(-gan.d(fake)).mean()
        opt_g.zero_grad()
        (scaler.scale(g_loss) if scaler else g_loss).backward()
        scaler.step(opt_g) if scaler else opt_g.step()
        if scaler:
            scaler.update()
    return gan


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_a_gan_in_one_module_steps_once_per_iteration(policy):
    """As written and under a candidate alike (the candidates counted two steps per iteration and
    failed the script's own fp32 by 229%)."""
    agent = compare(gan_loop, policy)
    assert len(agent.steps) == 5
    with under("fp32 (as written)") as as_written:
        gan_loop(None)
    assert len(as_written.steps) == 5


def test_a_closure_step_runs_under_autocast_and_loss_scaling_refuses_it_in_one_line():
    """optimizer.step(closure) (LBFGS): it hung (no step ever ended); under fp16-mixed it is refused."""

    def loop() -> nn.Module:
        model = mlp()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
        for x, y in batches(3):

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
        return model

    with under("bf16-mixed") as agent:
        loop()
    assert len(agent.steps) == 3
    assert agent.observed.dtype == "bfloat16"
    with pytest.raises(Exited) as exited, under("fp16-mixed") as agent:
        loop()
    assert exited.value.code == 2


# ---------------------------------------------------------------------- what the agent must see
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("path", ["backward(gradient)", "autograd.backward"])
def test_every_backward_path_is_seen_and_scaled(policy, path):
    """The loss of backward(gradient) over per-sample losses and of torch.autograd.backward is the
    step's loss (it was NaN: 'its loss is nan at step 0'); fp16 scales it."""

    def loop(precision: str | None) -> nn.Module:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx, scaler = hand(precision)
        for x, y in batches(4):
            with ctx():
                per_sample = F.cross_entropy(model(x), y, reduction="none")
            if path == "backward(gradient)":
                weights = torch.full_like(per_sample, 1 / len(per_sample))
                (scaler.scale(per_sample) if scaler else per_sample).backward(weights)
            else:
                loss = per_sample.mean()
                torch.autograd.backward(scaler.scale(loss) if scaler else loss)
            scaler.step(opt) if scaler else opt.step()
            if scaler:
                scaler.update()
            opt.zero_grad()
        return model

    agent = compare(loop, policy)
    losses = [s for s in agent.steps]
    assert len(losses) == 4


def test_a_loop_in_eval_mode_trains_under_the_candidate():
    """Frozen BatchNorm: the loop trains in model.eval() (it trained in fp32 under bf16-mixed)."""

    def loop(precision: str | None) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).eval()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx, _ = hand(precision)
        for x, y in batches(4):
            with ctx():
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return model

    agent = compare(loop, "bf16-mixed")
    assert agent.observed.dtype == "bfloat16"


def test_a_loop_that_calls_the_models_parts_computes_in_the_candidate():
    """model['enc'], then model['dec']: the root's forward never runs (it trained in fp32)."""

    def loop(precision: str | None) -> nn.Module:
        torch.manual_seed(0)
        model = nn.ModuleDict({"enc": nn.Sequential(nn.Linear(16, 32), nn.GELU()), "dec": nn.Linear(32, 4)})
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ctx, _ = hand(precision)
        for x, y in batches(4):
            with ctx():
                loss = F.cross_entropy(model["dec"](model["enc"](x)), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return model

    agent = compare(loop, "bf16-mixed")
    assert agent.observed.dtype == "bfloat16"
    assert [s.samples for s in agent.steps] == [8] * 4


def encoder_decoder() -> tuple[nn.Module, nn.Module]:
    """A model in two parts, each the script's own variable (a VAE's, a seq2seq's)."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 32))
    dec = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
    return enc, dec


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed", "bf16-true"])
def test_a_model_in_parts_trains_every_part_under_the_candidate(policy):
    """An encoder and a decoder, one optimizer over both: the encoder was left out of the candidate
    (its forward in fp32 under bf16-mixed, its weights fp32 under bf16-true) under the candidate's
    name. Trained in parts, it is now what the same model trained as one nn.Sequential is, and what
    the AMP recipe's hand edit of the loop in parts is."""
    compute = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "bf16-true": torch.bfloat16}

    def loop(as_one: bool, precision: str | None = None) -> tuple[nn.Module, list[torch.dtype]]:
        enc, dec = encoder_decoder()
        one = nn.Sequential(enc, dec) if as_one else None  # (alive, it would hold both parts)
        params = one.parameters() if one is not None else [*enc.parameters(), *dec.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-2)
        ctx, scaler = hand(precision)
        computed: list[torch.dtype] = []
        enc[0].register_forward_hook(lambda m, a, out: computed.append(out.dtype))
        for x, y in batches(4):
            with ctx():
                loss = F.cross_entropy(one(x) if one is not None else dec(enc(x)), y)
            recipe_step(loss, opt, scaler)
            opt.zero_grad()
        return nn.ModuleList([enc, dec]), computed

    with under(policy) as agent:
        in_parts, computed = loop(as_one=False)
    with under(policy):
        as_one, _ = loop(as_one=True)
    assert computed == [compute[policy]] * 4  # the encoder's first layer, every step
    assert same(in_parts, as_one)
    if policy != "bf16-true":
        assert same(in_parts, loop(as_one=False, precision=policy)[0])
    weights = torch.bfloat16 if policy == "bf16-true" else torch.float32
    assert {p.dtype for p in in_parts.parameters()} == {weights}
    facts = agent.facts()
    assert facts.model == "enc (Sequential) + dec (Sequential)"
    assert facts.params[0] == "enc.0.weight" and facts.params[-1] == "dec.2.bias"
    assert [s.samples for s in agent.steps] == [8] * 4  # the batch the encoder takes, counted once


def test_the_monitor_replays_the_step_of_a_model_in_parts():
    """The monitor's shadow replays a step from its tape: each part's call, in the script's order."""
    from mixprec.monitor.script import ScriptMonitor

    with under("bf16-mixed") as agent:
        monitor = ScriptMonitor(agent, {"rescue": True})
        agent.observers.append(monitor)
        enc, dec = encoder_decoder()
        opt = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1)
        for i, (x, y) in enumerate(batches(12)):
            loss = F.cross_entropy(dec(enc(x * math.nan if i == 8 else x)), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    record = monitor.summary()
    assert "replay" not in record, record["replay"]
    spikes = [(f["step"], f["evidence"].get("verdict")) for f in record["findings"] if f["kind"] == "spike"]
    assert spikes == [(8, "data")], record["findings"]
    assert record["withheld"] == [8] and all(torch.isfinite(p).all() for p in enc.parameters())


def test_a_model_in_parts_counts_each_batch_once_and_replays_a_part_that_calls_another():
    """From a stranger's review: a loop that calls a part's submodule first (``backbone[:2](x)``, then
    the head) counted its batch twice; a part called inside another part's forward (blocks the
    script keeps in a plain list, their parameters added to the optimizer) broke the monitor's tape,
    so a NaN batch was neither diagnosed nor withheld and the weights went NaN."""
    from mixprec.monitor.script import ScriptMonitor

    enc, dec = encoder_decoder()
    with under("bf16-mixed") as agent:
        opt = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1)
        for x, y in batches(3):
            F.cross_entropy(dec(enc[2](enc[:2](x))), y).backward()
            opt.step()
            opt.zero_grad()
    assert [s.samples for s in agent.steps] == [8] * 3
    del enc, dec, opt  # (a second script in this frame: the first's models are not its own)

    class Net(nn.Module):
        def __init__(self, blocks: list[nn.Module]) -> None:
            super().__init__()
            self.inp, self.blocks, self.out = nn.Linear(16, 32), blocks, nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for block in self.blocks:  # (not registered: each block is a part of its own)
                x = block(x)
            return self.out(x)

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(2)]
    net = Net(blocks)
    with under("bf16-mixed") as agent:
        monitor = ScriptMonitor(agent, {"rescue": True})
        agent.observers.append(monitor)
        opt = torch.optim.SGD([*net.parameters(), *[p for b in blocks for p in b.parameters()]], lr=0.1)
        for i, (x, y) in enumerate(batches(12)):
            F.cross_entropy(net(x * math.nan if i == 8 else x), y).backward()
            opt.step()
            opt.zero_grad()
    record = monitor.summary()
    assert agent.facts().model == "net (Net) + sequential (Sequential) + sequential_1 (Sequential)"
    assert "replay" not in record, record["replay"]
    assert record["withheld"] == [8] and [s.samples for s in agent.steps][:3] == [8] * 3
    assert all(torch.isfinite(p).all() for b in [net, *blocks] for p in b.parameters())


def test_a_part_that_is_itself_a_converted_layer_is_refused_in_one_line(tmp_path, capsys):
    """From a stranger's review: under a block format a head that is a bare nn.Linear was replaced
    inside mixprec's holder of the parts while the script kept calling its own: it never computed in
    the format the check reported it in."""
    enc, _ = encoder_decoder()
    head = nn.Linear(32, 32)  # (a shape the format converts: 32 a side)
    with pytest.raises(Exited) as exited, under("mxfp8", mode="trace", steps=1, out=str(tmp_path / "t.pt")):
        opt = torch.optim.SGD([*enc.parameters(), *head.parameters()], lr=0.1)
        for x, y in batches(2):
            F.cross_entropy(head(enc(x)), y).backward()
            opt.step()
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert "'head' is itself a layer the format converts" in said and "--keep-bf16 head" in said


def test_a_checks_output_of_a_model_in_parts_is_not_its_loss_modules_scalar(tmp_path):
    """From a stranger's review: a learnable loss module (ArcFace's weights, in the optimizer) is a
    part; the traced output was its scalar loss, and the check's output SQNR was taken on it."""
    from mixprec.frameworks.script.messages import TraceRecord

    class Margin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 32))

        def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            logits = F.normalize(features) @ F.normalize(self.weight).t()
            return F.cross_entropy(16 * logits, labels)

    enc, _ = encoder_decoder()
    margin = Margin()
    out = tmp_path / "trace.pt"
    with pytest.raises(Exited), under("bf16-mixed", mode="trace", steps=1, out=str(out)):
        opt = torch.optim.AdamW([*enc.parameters(), *margin.parameters()], lr=1e-2)
        for x, y in batches(3):
            margin(enc(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert TraceRecord.load(out).first_output.shape == (8, 32)  # the embedding, not the loss


def test_a_traced_model_in_parts_records_each_layer_once_in_order(tmp_path):
    """From a stranger's review: a range collector's hooks on the parts' holder went on the parts
    (its pre-hook twice, its post-hook never), so the layers' order skipped numbers."""
    from mixprec.frameworks.script.messages import TraceRecord

    enc, dec = encoder_decoder()
    out = tmp_path / "trace.pt"
    with pytest.raises(Exited), under("bf16-mixed", mode="trace", steps=1, out=str(out), ranges=True):
        opt = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1)
        for x, y in batches(2):
            F.cross_entropy(dec(enc(x)), y).backward()
            opt.step()
            opt.zero_grad()
    layers = TraceRecord.load(out).ranges.layers
    assert [layer.order for layer in layers] == list(range(len(layers)))
    assert {layer.calls for layer in layers} == {1} and layers[0].name == "enc"


def test_the_monitor_refuses_to_save_a_poisoned_part_of_a_model_in_parts(tmp_path, capsys):
    """From a stranger's review: ``torch.save(enc)`` of a part with NaN weights was written (the
    guard looked for the parts' holder, which the script never saves)."""
    from mixprec.monitor.script import ScriptMonitor

    enc, dec = encoder_decoder()
    with under("bf16-mixed") as agent:
        agent.observers.append(ScriptMonitor(agent, {"rescue": False}))
        opt = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1)
        for i, (x, y) in enumerate(batches(10)):
            F.cross_entropy(dec(enc(x * math.nan if i == 8 else x)), y).backward()
            opt.step()
            opt.zero_grad()
        assert not all(torch.isfinite(p).all() for p in enc.parameters())
        torch.save(enc, tmp_path / "enc.pt")
        torch.save({"enc": enc, "dec": dec}, tmp_path / "both.pt")
    assert not list(tmp_path.iterdir())
    assert capsys.readouterr().err.count("not saved to") == 2


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_copies_of_the_model_made_after_the_optimizer_are_the_scripts_own(policy):
    """An EMA (AveragedModel), a best-so-far copy.deepcopy used as a teacher, torch.save(model):
    the agent's hooks on the model, bound methods of the agent, made each fail ("cannot pickle
    'generator' object": deepcopy and pickle copied the agent through them). The EMA and the
    weights are the hand edit's, bit for bit; the teacher's forwards are no training samples; the
    pickled model loads and computes outside the agent."""

    def loop(precision: str | None) -> tuple[nn.Module, nn.Module, bytes]:
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        ctx, scaler = hand(precision)
        teacher = copy.deepcopy(model)
        for x, y in batches(5):
            with ctx():
                out = model(x)  # (first: the agent's autocast begins at the model's first forward)
                target = teacher(x).detach().softmax(-1)  # (grad enabled: a forward like the model's)
                loss = F.cross_entropy(out, y) + F.cross_entropy(out, target)
            opt.zero_grad()
            recipe_step(loss, opt, scaler)
            ema.update_parameters(model)
            with torch.no_grad():
                ema(x)
            teacher = copy.deepcopy(model)
        saved = io.BytesIO()
        torch.save(model, saved)
        return model, ema.module, saved.getvalue()

    with under(policy) as agent:
        model, ema, saved = loop(None)
    by_hand, ema_by_hand, _ = loop(policy)
    assert same(model, by_hand) and same(ema, ema_by_hand)
    assert [s.samples for s in agent.steps] == [8] * 5
    loaded = torch.load(io.BytesIO(saved), weights_only=False)
    x = batches(1)[0][0]
    assert torch.equal(loaded(x), model(x))  # (outside the agent now: fp32)


@pytest.mark.parametrize(
    "policy, script_dtype, wrapped",
    [
        ("bf16-true", torch.float32, False),
        ("bf16-mixed", torch.bfloat16, False),
        ("bf16-true", torch.float32, True),
    ],
)
def test_an_ema_made_before_the_optimizer_takes_what_the_candidate_gave_the_model(
    policy, script_dtype, wrapped
):
    """AveragedModel(model) before the optimizer, which is where the agent applies the candidate:
    bf16-true cast the model and left the EMA fp32 (bf16-mixed widened a script's own bf16 weights
    to fp32 master weights and left its EMA bf16), and the EMA's second update failed: "expected
    dtype float for `end` but got dtype c10::BFloat16". The EMA takes the model's dtypes and values
    name by name (its fp32 island too, rounded as the model's was), its input cast and its island,
    so its evaluation computes as the model's; it is the average of the model's weights. Also
    where the optimizer is built on a wrapper of the model (DiT's EMA is a deepcopy made before
    DDP). A module of the model's shape with other weights, a meta skeleton of it and a lazy
    module are left alone (the last two made the search for copies raise)."""
    model = mlp().to(script_dtype)
    stranger = mlp(seed=1).to(script_dtype)
    with torch.device("meta"):
        skeleton = mlp()  # noqa: F841 (alive: the search for copies meets it)
    lazy = nn.LazyLinear(4)  # noqa: F841
    seen = []
    island = "module.2" if wrapped else "2"  # (named in what the optimizer trains)
    with under(policy, keep_fp32=(island,)) as agent:
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        trained = nn.DataParallel(model) if wrapped else model  # (on a CPU: calls the model)
        opt = torch.optim.SGD(trained.parameters(), lr=0.1)
        assert same(ema.module, model)  # (the model's values as prepared: its island went through bf16)
        for x, y in batches(3):
            loss = F.cross_entropy(trained(x.to(script_dtype)), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen.append([p.detach().clone() for p in model.parameters()])
            ema.update_parameters(model)
            with torch.no_grad():
                ema.eval()
                evaluated = ema(x.to(script_dtype))
    assert len(agent.steps) == 3
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {n: p.dtype for n, p in ema.module.named_parameters()} == dtypes
    assert dtypes["0.weight"] == (torch.bfloat16 if policy == "bf16-true" else torch.float32)
    assert dtypes["2.weight"] == torch.float32  # (the island)
    assert evaluated.dtype == dtypes["4.weight"]  # (outside the step's autocast: the weights' dtype)
    average = seen[0]  # AveragedModel's first update copies; each later one lerps by 1 - 0.9
    for later in seen[1:]:
        average = [torch.lerp(a, b, 0.1) for a, b in zip(average, later, strict=True)]
    assert all(torch.equal(a, b) for a, b in zip(ema.module.parameters(), average, strict=True))
    assert all(p.dtype == script_dtype for p in stranger.parameters())


def test_a_copy_made_in_the_first_step_neither_carries_nor_feeds_the_dtype_probe():
    """The probe that reads which dtype the first step computed in hooked the model's layers with
    closures until that step ended: a copy made meanwhile (an EMA after the optimizer) kept them,
    so torch.save(ema) failed for the rest of the run, and a teacher copy run before the model was
    what the probe read (fp32 under bf16-mixed: the candidate called ineffective)."""
    model = mlp()
    with under("bf16-mixed") as agent:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ema = copy.deepcopy(model)
        for x, y in batches(2):
            with torch.no_grad():
                ema(x)  # before the model, outside autocast: fp32
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        torch.save(ema, io.BytesIO())
    assert agent.observed.dtype == "bfloat16"


def test_a_compiled_models_fp32_island_stays_fp32_outside_autocast():
    """An fp32 island entered autocast(enabled=False) even outside any autocast; under torch.compile
    the agent read it as the script's AMP switched off and ran the island in bf16 ("mat1 and mat2
    must have the same dtype" in a no_grad evaluation after a step)."""
    model = mlp()
    with under("bf16-mixed", keep_fp32=("2",)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled = torch.compile(model, backend="aot_eager")
        x, y = batches(1)[0]
        F.cross_entropy(compiled(x), y).backward()
        opt.step()
        with torch.no_grad():
            out = compiled(x)
    assert out.dtype == torch.float32


def test_an_fp32_evaluation_before_training_is_not_the_training_step():
    """nanoGPT's shape: an evaluation under no_grad, in fp32, before the first step; what the step
    computes in is read from the training forward (bf16-mixed was marked 'never ran')."""
    model = mlp()
    with under("bf16-mixed") as agent:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for x, y in batches(3):
            with torch.no_grad():
                model.eval()
                F.cross_entropy(model(x), y)
                model.train()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert agent.observed.dtype == "bfloat16"
    assert len(agent.steps) == 3


def test_a_run_whose_candidate_does_not_take_effect_is_stopped(tmp_path):
    """The honesty probe of `mixprec run`: no layer of the first training step computes in bf16
    under a bf16 label (here the forward runs in a worker thread, where autocast, per thread, is
    not on): stopped, exit 3, the reason in run.json."""
    from concurrent.futures import ThreadPoolExecutor

    model = mlp()
    pool = ThreadPoolExecutor(1)
    with pytest.raises(Exited) as exited, under("bf16-mixed", out=str(tmp_path)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches(3):
            loss = F.cross_entropy(pool.submit(model, x).result(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert exited.value.code == 3
    import json

    record = json.loads((tmp_path / "run.json").read_text())
    assert "computed in bfloat16 (they computed in float32" in record["error"], record["error"]


@pytest.mark.parametrize("use_amp", [False, True])
def test_the_scripts_autocast_switch_takes_the_candidate_and_its_fp32_regions_stay(use_amp):
    """autocast(enabled=use_amp), the AMP recipe's switch: under bf16-mixed it computes bf16 either
    way; a disabled autocast inside it (a region the script keeps in fp32) stays fp32."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(16, 32), "head": nn.Linear(32, 4)})
    seen: dict[str, torch.dtype] = {}
    for name in ("body", "head"):
        model[name].register_forward_hook(
            lambda m, a, out, name=name: seen.setdefault(name, out.dtype) and None
        )
    with under("bf16-mixed"):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches(2):
            with torch.autocast("cpu", dtype=torch.float16, enabled=use_amp):
                h = model["body"](x)
                with torch.autocast("cpu", enabled=False):
                    loss = F.cross_entropy(model["head"](h.float()), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert seen == {"body": torch.bfloat16, "head": torch.float32}


# ---------------------------------------------------------------------- mixprec's own world
def test_a_learnable_temperature_outside_the_model_is_the_scripts_own():
    """A second parameter group with a bare nn.Parameter ('parameters of no single nn.Module')."""
    model = mlp()
    temperature = nn.Parameter(torch.tensor(1.0))
    with under("bf16-mixed") as agent:
        opt = torch.optim.AdamW([{"params": model.parameters()}, {"params": [temperature], "lr": 1e-2}])
        for x, y in batches(3):
            loss = F.cross_entropy(model(x) / temperature, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert agent.model is model and len(agent.steps) == 3
    assert temperature.dtype == torch.float32 and float(temperature.detach()) != 1.0


def test_a_half_precision_script_is_widened_for_an_fp32_candidate():
    """model.to(torch.bfloat16), inputs cast by the script: the strict-fp32 baseline trains fp32
    master weights (it refused: 'parameter is torch.bfloat16'); as written it stays bf16."""

    def loop() -> nn.Module:
        model = mlp().to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches(3):
            loss = F.cross_entropy(model(x.to(torch.bfloat16)).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return model

    with under("fp32") as agent:
        model = loop()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert agent.facts().param_dtypes == ["bfloat16"] and agent.facts().widened
    assert agent.observed.dtype == "float32"
    with under("bf16-true (as written)") as agent:
        model = loop()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_script_that_uses_mixprecs_policy_has_it_built_under_the_candidate():
    import mixprec

    model = mlp()
    with under("bf16-mixed") as agent:
        policy = mixprec.get_policy("fp32")
        policy.prepare(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with policy.precision_scope():
            for x, y in batches(3):
                with policy.autocast():
                    loss = F.cross_entropy(model(x), y)
                policy.backward(loss)
                policy.step(opt)
                opt.zero_grad()
    assert policy.name == "bf16-mixed" and agent.framework == "mixprec"
    assert agent.own.as_written["framework"] == {"mixprec": "fp32"}
    assert agent.observed.dtype == "bfloat16"
    assert len(agent.steps) == 3


def test_a_mask_buffer_of_minus_infinity_is_not_a_failure(tmp_path):
    """nn.Transformer.generate_square_subsequent_mask: -inf by design, unchanged by training (every
    candidate failed: 'buffers became non-finite while training (mask)')."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 4)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.mask.clamp(min=-1.0)[0]

    torch.manual_seed(0)
    model = Masked()
    out = tmp_path / "trace.pt"
    with pytest.raises(Exited), under("bf16-mixed", mode="trace", steps=2, out=str(out)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches(4):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    record = TraceRecord.load(out)
    assert record.nonfinite_buffers == [] and len(record.steps) == 2
    assert all(math.isfinite(s.loss) for s in record.steps)


def test_the_agent_puts_torch_back():
    before = (
        torch.autograd.backward,
        torch.optim.Optimizer.__init__,
        torch.amp.GradScaler.step,
        torch.optim.SGD.__init__,
        getattr(torch.utils.checkpoint, "_checkpoint_impl", None),
        torch.utils.checkpoint.checkpoint,
    )
    with under("fp16-mixed", optimizer="foreach"):
        train_briefly()
    assert (
        torch.autograd.backward,
        torch.optim.Optimizer.__init__,
        torch.amp.GradScaler.step,
        torch.optim.SGD.__init__,
        getattr(torch.utils.checkpoint, "_checkpoint_impl", None),
        torch.utils.checkpoint.checkpoint,
    ) == before
    assert "grad" not in torch.Tensor.__dict__
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_the_frameworks_switches_are_put_back_too():
    """Installed while Lightning is imported, the agent patched Trainer.__init__ and left it so: every
    later Trainer of the process had its precision set by an agent long gone."""
    from extras import require

    require("lightning", "frameworks")
    import lightning.pytorch as pl

    before = pl.Trainer.__init__
    with under("bf16-mixed"):
        assert pl.Trainer.__init__ is not before
    assert pl.Trainer.__init__ is before


@pytest.mark.parametrize("clip", [False, True])
def test_the_traced_first_gradients_are_unscaled_under_loss_scaling(tmp_path, clip):
    """What a check's gradient SQNR compares: the first step's gradients, unscaled, however the
    step unscaled them (GradScaler.step itself, or a clip's read first). Divided by the scale a
    second time they read 0.0 dB under fp16-mixed."""

    def first_grads(policy: str) -> dict[str, torch.Tensor]:
        out = tmp_path / f"{policy}-{clip}.pt"
        model = mlp()
        with pytest.raises(Exited), under(policy, mode="trace", steps=1, out=str(out)):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in batches(3):
                F.cross_entropy(model(x), y).backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
                opt.step()
                opt.zero_grad()
        return TraceRecord.load(out).first_grads

    want, got = first_grads("fp32"), first_grads("fp16-mixed")
    for name, g in want.items():
        error = (got[name] - g).norm() / g.norm()
        assert error < 1e-2, (name, float(error))


def test_a_runs_end_waits_for_gloos_workers_after_its_record_even_when_writing_it_fails(
    tmp_path, monkeypatch
):
    """`mixprec run`'s finish at the script's exit (atexit) ends with the wait for gloo's worker
    threads (mixprec.process.let_gloo_workers_finish): after the last step's collectives and the
    record, and also where writing the record raised, or a rank can abort as the interpreter shuts
    down."""
    import mixprec.frameworks.script.modes as modes

    calls: list[bool] = []
    record = tmp_path / "run.json"
    monkeypatch.setattr(modes, "let_gloo_workers_finish", lambda: calls.append(record.exists()))
    with under("bf16-mixed", out=str(tmp_path)):
        train_briefly()
    assert calls == [True]
    record.unlink()

    def broken(self, error=None):
        raise OSError("disk full")

    monkeypatch.setattr(modes.Run, "write", broken)
    with pytest.raises(OSError, match="disk full"), under("bf16-mixed", out=str(tmp_path)):
        train_briefly()
    assert calls == [True, False]
