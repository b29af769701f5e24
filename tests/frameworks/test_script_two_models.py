"""Two models, each with an optimizer of its own, as the PyTorch DCGAN tutorial writes a GAN: ``netG``
and ``netD`` built, then ``optimizerD`` and ``optimizerG`` (the discriminator's first). The agent took
the first optimizer's model as the model and refused the second ("the script trains a second model":
`mixprec run` exited 2 on the tutorial's loop). At the first optimizer, every other model the script
holds whose weights train, that no optimizer holds yet and whose parameters its code hands an
optimizer is now part of the model, so both get the candidate before anything runs; each loop below
is compared bit for bit with the AMP recipe's hand edit of it (bf16-true: cast by hand). What is no
second model: an EMA of the model, a backbone left out of the optimizer, a teacher. A GAN in one
module whose children the loop calls crashed under bf16-true (the input cast was on the model
alone)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from frameworks.in_process import Exited, under
from frameworks.test_script_agent import hand, same

STEPS = 5


def nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
    net_d = nn.Sequential(nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return net_g, net_d


def iterate(
    net_g: nn.Module,
    net_d: nn.Module,
    opt_d: torch.optim.Optimizer,
    opt_g: torch.optim.Optimizer,
    precision: str | None,
    losses: list[float] | None = None,
) -> None:
    """The DCGAN tutorial's iteration (D on real, then on a detached fake; G through D), its AMP as
    the recipe has it where ``precision`` is given: one scaler, updated once both have stepped."""
    ctx, scaler = hand(precision)
    bce = nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        real, noise = torch.randn(8, 16, generator=gen) + 1.0, torch.randn(8, 8, generator=gen)
        net_d.zero_grad()
        with ctx():
            err_real = bce(net_d(real).view(-1), torch.ones(8))
        (scaler.scale(err_real) if scaler else err_real).backward()
        with ctx():
            fake = net_g(noise)
            err_fake = bce(net_d(fake.detach()).view(-1), torch.zeros(8))
        (scaler.scale(err_fake) if scaler else err_fake).backward()
        scaler.step(opt_d) if scaler else opt_d.step()
        net_g.zero_grad()
        with ctx():
            err_g = bce(net_d(fake).view(-1), torch.ones(8))
        (scaler.scale(err_g) if scaler else err_g).backward()
        scaler.step(opt_g) if scaler else opt_g.step()
        if scaler:
            scaler.update()
        if losses is not None:
            losses.append(err_g.item())


def adams(net_g: nn.Module, net_d: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """The tutorial's optimizers, the discriminator's first."""
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-3, betas=(0.5, 0.999))
    return opt_d, opt_g


def as_globals(precision: str | None = None, losses: list[float] | None = None) -> nn.Module:
    """The tutorial's shape: two variables, then the two optimizers (a function's locals here)."""
    net_g, net_d = nets()
    opt_d, opt_g = adams(net_g, net_d)
    iterate(net_g, net_d, opt_d, opt_g, precision, losses)
    return nn.ModuleList([net_g, net_d])


class Trainer:
    """A trainer object holding both models, as class-based scripts do (``self.net_g``)."""

    def __init__(self) -> None:
        self.net_g, self.net_d = nets()
        self.opt_d, self.opt_g = adams(self.net_g, self.net_d)


def as_attributes(precision: str | None = None) -> nn.Module:
    trainer = Trainer()
    iterate(trainer.net_g, trainer.net_d, trainer.opt_d, trainer.opt_g, precision)
    return nn.ModuleList([trainer.net_g, trainer.net_d])


LOOPS: dict[str, Callable[..., nn.Module]] = {"variables": as_globals, "attributes": as_attributes}


@pytest.mark.parametrize("shape", LOOPS)
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_two_models_with_their_own_optimizers_train_as_the_amp_recipes_hand_edit(policy, shape):
    loop = LOOPS[shape]
    with under(policy) as agent:
        injected = loop()
    assert same(injected, loop(policy)), "the agent's run differs from the hand edit"
    assert not same(injected, loop()), "the candidate changed nothing"
    assert len(agent.steps) == STEPS
    facts = agent.facts()  # in the order the optimizers hold them: the discriminator's first
    assert facts.model == "net_d (Sequential) + net_g (Sequential)", facts.model
    assert facts.params[0] == "net_d.0.weight" and facts.params[-1] == "net_g.2.bias"


def bf16_by_hand() -> nn.Module:
    """The tutorial's loop made bf16-true by hand: both models cast before their optimizers, each
    iteration's tensors made in bf16 (the inputs cast, the targets made under a bf16 default dtype)."""
    from mixprec.policy.hooks import default_dtype

    net_g, net_d = (net.to(torch.bfloat16) for net in nets())
    opt_d, opt_g = adams(net_g, net_d)
    bce = nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        real, noise = torch.randn(8, 16, generator=gen) + 1.0, torch.randn(8, 8, generator=gen)
        real, noise = real.to(torch.bfloat16), noise.to(torch.bfloat16)
        with default_dtype(torch.bfloat16):
            net_d.zero_grad()
            bce(net_d(real).view(-1), torch.ones(8)).backward()
            fake = net_g(noise)
            bce(net_d(fake.detach()).view(-1), torch.zeros(8)).backward()
            opt_d.step()
            net_g.zero_grad()
            bce(net_d(fake).view(-1), torch.ones(8)).backward()
            opt_g.step()
    return nn.ModuleList([net_g, net_d])


def test_two_models_under_bf16_true_are_both_cast_as_by_hand():
    """Both models' weights in bf16, trained as the hand edit trains them (the generator is no less
    the model's than the discriminator whose optimizer came first)."""
    with under("bf16-true") as agent:
        two = as_globals()
    assert {p.dtype for p in two.parameters()} == {torch.bfloat16}
    assert len(agent.steps) == STEPS
    assert same(two, bf16_by_hand())


def test_the_scripts_own_fp32_is_left_as_written():
    losses: list[float] = []
    with under("fp32 (as written)") as agent:
        injected = as_globals(None, losses)
    expected: list[float] = []
    assert same(injected, as_globals(None, expected)) and losses == expected
    assert len(agent.steps) == STEPS


def distil(frozen: bool, resume: dict | None = None) -> tuple[nn.Module, nn.Module]:
    """A student trained beside a teacher (frozen, or left with weights that require grad, no
    optimizer holding them); ``resume``: the student's optimizer loads it before the loop."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).requires_grad_(not frozen)
    student = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    if resume is not None:
        opt.load_state_dict(resume)
    gen = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=gen)
        with torch.no_grad():
            target = teacher(x).softmax(-1)
        loss = nn.functional.cross_entropy(student(x).float(), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return student, teacher


def resumed_state() -> dict:
    """An fp32 AdamW state of the student's shape, two steps in (a checkpoint the script resumes)."""
    torch.manual_seed(5)
    student = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    for _ in range(2):
        student(torch.randn(4, 16)).square().mean().backward()
        opt.step()
    return copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("frozen", [False, True], ids=["unfrozen", "frozen"])
def test_a_teacher_is_no_second_model(frozen):
    """A teacher no optimizer of the script's code is given stays as the script has it, its weights
    left requiring grad or not (the student's candidate alone, as before)."""
    state = resumed_state()  # (before the agent: its optimizer is no script's)
    with under("bf16-true") as agent:
        student, teacher = distil(frozen=frozen, resume=state)
    assert agent.facts().model == "Sequential"
    assert {p.dtype for p in student.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in teacher.parameters()} == {torch.float32}


def ema_of(kind: str, model: nn.Module) -> nn.Module:
    if kind == "deepcopy":
        return copy.deepcopy(model)  # (its weights left requiring grad, as hand-written EMAs often are)
    if kind == "AveragedModel":
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    from timm.utils import ModelEmaV3

    return ModelEmaV3(model, decay=0.9)


@pytest.mark.parametrize("kind", ["deepcopy", "AveragedModel", "ModelEmaV3"])
def test_an_ema_made_before_the_optimizer_is_no_second_model(kind):
    """An EMA holds a copy of the model: it follows the model (its dtypes), and trains with none."""
    with under("bf16-true") as agent:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
        ema = ema_of(kind, model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert agent.model is model
        for _ in range(2):
            model(torch.randn(4, 16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(model) if kind == "AveragedModel" else None
            ema.update(model) if kind == "ModelEmaV3" else None
    floating = [p for p in ema.parameters()]
    assert {p.dtype for p in floating} == {torch.bfloat16}


def test_a_backbone_left_out_of_the_optimizer_is_the_models_own():
    """Fine-tuning the head alone, the backbone kept as a variable and never frozen: it is inside
    the model, not a second one."""
    with under("bf16-true") as agent:
        model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
        backbone = model[0]
        torch.optim.SGD(model[2].parameters(), lr=0.1)
        assert agent.model is model and backbone.weight.dtype == torch.bfloat16


def test_looking_for_other_models_keeps_nothing_of_the_scripts_alive():
    """The scan of the script's variables read its frames' locals, a snapshot Python 3.11 keeps on
    the frame: a checkpoint the script loads, uses and deletes stayed in memory (peak memory, the
    micro-batch search). A dead weak proxy among them is passed by, not raised on."""
    import gc
    import weakref

    class Held:
        pass

    def main() -> bool:
        model = nn.Linear(4, 4)
        checkpoint = {"big": torch.zeros(1 << 16)}
        alive = weakref.ref(checkpoint["big"])
        gone = Held()
        proxy = weakref.proxy(gone)
        del gone
        torch.optim.SGD(model.parameters(), lr=0.1)
        del checkpoint, proxy
        gc.collect()
        return alive() is None

    with under("bf16-mixed"):
        assert main()


def test_a_model_built_after_the_first_optimizer_is_refused_saying_the_order_that_works(tmp_path):
    """G and its optimizer, then D and its: no second model existed at the first optimizer."""
    from mixprec.frameworks.script.messages import TraceRecord

    out = tmp_path / "trace.pt"
    with pytest.raises(Exited), under("bf16-mixed", mode="trace", steps=2, out=str(out)):
        net_g = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        torch.optim.Adam(net_g.parameters())
        net_d = nn.Sequential(nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        torch.optim.Adam(net_d.parameters())
    said = TraceRecord.load(out).error or ""
    assert "second model" in said and "DCGAN tutorial's order" in said, said


def in_one_module() -> tuple[nn.Module, nn.Module]:
    """The same GAN held in one module whose children the loop calls (``gan["d"](real)``). Returns
    the trained models and a deep copy of the GAN made after training (a snapshot)."""
    net_g, net_d = nets()
    gan = nn.ModuleDict({"g": net_g, "d": net_d})
    opt_d, opt_g = adams(gan["g"], gan["d"])
    iterate(gan["g"], gan["d"], opt_d, opt_g, None)
    return nn.ModuleList([net_g, net_d]), copy.deepcopy(gan)


def test_a_gan_in_one_module_whose_children_the_loop_calls_trains_under_bf16_true():
    """The model's input cast was on the model alone, which this loop never calls: bf16 weights met
    the fp32 batch ("mat1 and mat2 must have the same dtype"). A copy of the model casts alike."""
    with under("bf16-true"):
        one, snapshot = in_one_module()
        out = snapshot["d"](torch.randn(2, 16))  # (an fp32 batch, as the loop feeds it)
    assert out.dtype == torch.bfloat16
    assert same(one, bf16_by_hand())


class FloatNorm(nn.Module):
    """A model whose forward hands its norm an fp32 input on purpose (BatchNorm keeps fp32 weights
    under bf16-true): the cast for the loop's own calls of a child must not reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.norm = nn.Linear(16, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(x).float())


def test_a_childs_cast_is_for_the_loops_calls_not_the_models_own():
    seen: list[torch.dtype] = []
    with under("bf16-true"):
        model = FloatNorm()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        for _ in range(2):
            model(torch.randn(4, 16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        model.norm(torch.randn(4, 8, dtype=torch.float64))  # the loop's own call: cast
    assert seen == [torch.float32, torch.float32, torch.bfloat16]


class Checkpointed(FloatNorm):
    """FloatNorm's block under a checkpoint: its recomputation runs inside the backward, where the
    model's forward is over (a cast there made the recomputed input bf16: "CheckpointError")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda h: self.norm(self.body(h).float().exp()), x, use_reentrant=False)


class WithCriterion(nn.Module):
    """A model holding its loss module, which the loop calls itself: ``model.criterion(out, y)``."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.criterion = nn.Linear(16, 4), nn.MSELoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_childs_cast_leaves_a_recomputation_and_a_loss_module_alone():
    with under("bf16-true"):
        model = Checkpointed()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(4, 16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    del model, opt  # (a second script in this frame)
    with under("bf16-true"):
        model = WithCriterion()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(8, 16), torch.randn(8, 4)  # (made before the step computes: fp32)
        loss = model.criterion(model(x), y)
        loss.backward()
        opt.step()
    assert loss.dtype == torch.float32  # (bf16 output, fp32 target: promoted, as the hand edit's)
