"""Up-front validation: one strict-fp32 step before any measuring turns each workload mistake into
one line naming the function and what it returned (exit 2), in bench (isolated or in-process),
check, lint and tune; and optimizer_fn receives the module (one that fails on it and builds on its
parameters, the older form, gets those: told apart by calling it, never by a parameter's name)."""

from __future__ import annotations

import functools
import textwrap
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from extras import require
from mixprec.cli import main
from mixprec.errors import UsageError
from mixprec.frameworks.session import BenchSettings
from mixprec.frameworks.torch.session import TrainingSession
from mixprec.policy import Candidate
from mixprec.workload import Workload, validate_workload

CPU = torch.device("cpu")


def _model() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(batch_size: int, device: torch.device):
    return torch.randn(batch_size, 8, device=device), torch.randint(0, 4, (batch_size,), device=device)


def _ce(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _workload(**kw) -> Workload:
    return Workload(
        model=kw.pop("model", None) or _model(),
        make_batch=kw.pop("make_batch", _batch),
        loss_fn=kw.pop("loss_fn", _ce),
        default_batch_size=4,
        **kw,
    )


@dataclass
class Output:
    """What a model returns when it computes its own loss (as Hugging Face's ModelOutput)."""

    loss: torch.Tensor
    logits: torch.Tensor


OTHER = _model()


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        (
            lambda: _workload(loss_fn=lambda m, b: Output(_ce(m, b), m(b[0]))),
            rf"^loss_fn returned {__name__}\.Output; return a scalar tensor, e\.g\. `out\.loss`\.$",
        ),
        (
            lambda: _workload(loss_fn=lambda m, b: (_ce(m, b), m(b[0]))),
            r"^loss_fn returned tuple; return a scalar tensor, e\.g\. `out\[0\]`\.$",
        ),
        (
            lambda: _workload(loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")),
            r"loss_fn returned a tensor of shape \(4,\); return a scalar, e\.g\. `loss\.mean\(\)`",
        ),
        (lambda: _workload(loss_fn=lambda m, b: _ce(m, b).detach()), r"without a gradient path"),
        (lambda: _workload(loss_fn=lambda m, b: _ce(m, b) * float("nan")), r"loss_fn returned nan"),
        (lambda: _workload(loss_fn=lambda m, b: (m(b[0]) > 0).sum()), r"returned a int64 tensor"),
        (lambda: _workload(loss_fn=lambda m, b: _ce(OTHER, b)), r"reached none of the 4 parameters"),
        (
            lambda: _workload(make_batch=lambda bs, dev: (torch.randn(bs, 8, device="meta"), None)),
            r"make_batch\(4, 'cpu'\) returned batch\[0\] on meta, not on cpu; .*\.to\(device\)",
        ),
        (lambda: _workload(make_batch=lambda bs, dev: ["a", "b"]), r"returned list with no tensor"),
        (
            lambda: _workload(make_batch=lambda bs, dev: 1 / 0),
            r"^make_batch\(4, 'cpu'\) raised ZeroDivisionError: division by zero; fix it",
        ),
        (
            lambda: _workload(optimizer_fn=lambda model: torch.optim.SGD(OTHER.parameters(), lr=0.1)),
            r"optimizer_fn returned torch\.optim\.sgd\.SGD over 4 parameter\(s\), none of them the "
            r"model's: build it from the model it is given",
        ),
        (  # issue 37: one line naming the function and the fix, not "name its first parameter `model`"
            lambda: _workload(optimizer_fn=lambda m: m.configure_optimizers()),
            r"optimizer_fn <lambda> \(test_validate\.py:\d+\) of workload 'sequential' fails with the "
            r"model \(AttributeError: .*configure_optimizers.*\) and with model\.parameters\(\) .*; "
            r"optimizer_fn takes the model: return e\.g\. torch\.optim\.AdamW\(model\.parameters\(\)",
        ),
        (lambda: _workload(optimizer_fn=lambda params: "sgd"), r"returned str, expected a torch\.optim"),
        (  # issue 26: it said "without a gradient path ... computed under torch.no_grad()?"
            lambda: _workload(model=_model().requires_grad_(False)),
            r"^the model has no parameter that requires grad \(4 floating-point parameters, all frozen\)",
        ),
    ],
)
def test_each_workload_mistake_is_one_line(workload, message):
    with pytest.raises(UsageError, match=message) as info:
        validate_workload(workload(), device="cpu")
    assert "\n" not in str(info.value)


def test_hugging_face_output_object_is_named():
    transformers = require("transformers", "hf")
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )
    model = transformers.BertForSequenceClassification(config)
    w = Workload(
        model,
        lambda bs, dev: {
            "input_ids": torch.randint(1, 100, (bs, 8), device=dev),
            "labels": torch.randint(0, 2, (bs,), device=dev),
        },
        lambda m, batch: m(**batch),  # the mistake: the output object, not out.loss
    )
    with pytest.raises(UsageError) as info:
        validate_workload(w, device="cpu", batch_size=2)
    assert str(info.value) == (
        "loss_fn returned transformers.modeling_outputs.SequenceClassifierOutput; "
        "return a scalar tensor, e.g. `out.loss`."
    )


def test_validation_runs_once_and_changes_nothing():
    calls = []

    def make_batch(batch_size, device):
        calls.append(batch_size)
        return _batch(batch_size, device)

    w = _workload(make_batch=make_batch)
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    rng = torch.get_rng_state()
    validate_workload(w, device="cpu")
    validate_workload(w, device="cpu")
    assert calls == [4]  # the second call: already validated for (cpu, 4)
    validate_workload(w, device="cpu", batch_size=2)
    assert calls == [4, 2]
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, w.model.state_dict()[k]) for k, v in before.items())


def test_out_of_memory_is_left_to_the_sweep():
    def make_batch(batch_size, device):
        raise torch.OutOfMemoryError("planted: the batch does not fit")

    w = _workload(make_batch=make_batch)
    validate_workload(w, device="cpu")  # not the workload's fault: no error here
    result = mixprec.bench(w, policies="fp32", channels_last="off", steps=1, warmup=1, isolate=False)
    assert result.rows[0].status == "oom", result.rows[0].reason


# --------------------------------------------------------------------------------------------------
# The commands: one line and exit 2, before any measuring

BROKEN = textwrap.dedent(
    """
    import torch
    from torch import nn
    import mixprec

    def _workload(**kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        def make_batch(batch_size, device):
            x = torch.randn(batch_size, 8, device=device)
            return x, torch.randint(0, 4, (batch_size,), device=device)
        def loss_fn(model, batch):
            return nn.functional.cross_entropy(model(batch[0]), batch[1])
        return mixprec.Workload(**{"model": model, "make_batch": make_batch, "loss_fn": loss_fn,
                                   "default_batch_size": 4, **kw})

    def batch_raises():
        def make_batch(batch_size, device):
            raise KeyError("no column 'pixels' in the dataset")
        return _workload(make_batch=make_batch)

    def returns_output():
        class Output(dict):
            pass
        return _workload(loss_fn=lambda model, batch: Output(logits=model(batch[0])))
    """
)


@pytest.fixture()
def broken(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(BROKEN, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--in-process", "--policies", "fp32"],
        ["bench", "--policies", "fp32"],
        ["check", "--policies", "bf16-mixed"],
        ["lint"],
        ["tune", "--budget", "30"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_make_batch_raising_is_one_line_and_exit_2(broken, argv, capsys):
    assert main([*argv, "--workload", f"{broken}:batch_raises", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "mixprec: error: make_batch(4, 'cpu') raised KeyError: "
        "\"no column 'pixels' in the dataset\"; fix it (run it directly, or use 'mixprec --debug', to "
        "see the traceback).\n"
    )


@pytest.mark.parametrize("command", ["bench", "check", "lint", "tune"])
def test_an_output_object_instead_of_a_loss_is_one_line_and_exit_2(broken, command, capsys):
    assert main([command, "--workload", f"{broken}:returns_output", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "loss_fn returned" in err and "Output; return a scalar tensor" in err


# --------------------------------------------------------------------------------------------------
# optimizer_fn(model), and the older optimizer_fn(params)


class _Recipe:
    def __call__(self, anything) -> torch.optim.Optimizer:
        return torch.optim.SGD(anything.parameters(), lr=0.1)


def _grouped(m):
    decay = [p for p in m.parameters() if p.dim() >= 2]
    return torch.optim.AdamW([{"params": decay}, {"params": [p for p in m.parameters() if p.dim() < 2]}])


@pytest.mark.parametrize(
    "fn",
    [
        lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),  # issue 37: 'generator' has no 'parameters'
        lambda model: torch.optim.AdamW(model.parameters(), lr=3e-3),
        lambda net, lr=0.1: torch.optim.SGD(net.parameters(), lr=lr),
        _grouped,
        _Recipe(),
        lambda p: torch.optim.SGD(p, lr=0.1),  # the older form: told apart by calling, not by a name
        lambda params: torch.optim.Adam(params),
        lambda model: torch.optim.Adam(model),  # named `model`, but it wants the parameters
        torch.optim.AdamW,
        functools.partial(torch.optim.SGD, lr=0.1),
        mixprec.workload.default_optimizer,
    ],
)
def test_optimizer_fn_is_told_apart_by_calling_it_never_by_a_parameters_name(fn):
    """optimizer_fn takes the model; one that turns out to want the parameters (it fails on the
    module and builds on model.parameters()) still works. Never decided by a parameter's name."""
    w = _workload(optimizer_fn=fn)
    opt = w.make_optimizer(w.model)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in w.model.parameters()}
    assert isinstance(w.make_optimizer(w.model), type(opt))  # the form it found is kept
    validate_workload(w, device="cpu")


def test_optimizer_fn_gets_the_prepared_model_being_trained():
    seen: list[nn.Module] = []

    def optimizer_fn(model: nn.Module) -> torch.optim.Optimizer:
        seen.append(model)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0}]
        return torch.optim.AdamW(groups)

    w = _workload(optimizer_fn=optimizer_fn)
    session = TrainingSession(w, Candidate("bf16-true"), BenchSettings(device="cpu", batch_size=4))
    assert seen == [session.model] and session.model is not w.model
    assert all(p.dtype == torch.bfloat16 for p in session.optimizer.param_groups[0]["params"])
    assert [g["weight_decay"] for g in session.optimizer.param_groups] == [0.1, 0]
    session.step(timed=False)


def test_the_parameter_form_still_works_and_a_module_form_refuses_parameters():
    w = _workload(optimizer_fn=lambda params: torch.optim.Adam(params, lr=1e-3))
    opt = w.make_optimizer(w.model)
    assert isinstance(opt, torch.optim.Adam)
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in w.model.parameters()}
    assert isinstance(w.make_optimizer(w.model.parameters()), torch.optim.Adam)  # as before
    modern = _workload(optimizer_fn=lambda m: torch.optim.Adam(m.parameters()))
    with pytest.raises(UsageError, match=r"optimizer_fn <lambda> .* was given parameters.*pass the module"):
        modern.make_optimizer(modern.model.parameters())


def test_what_optimizer_fn_prints_shows_once(capsys):
    def optimizer_fn(model):
        print("using fused AdamW: False")
        return torch.optim.AdamW(model.parameters())

    w = _workload(optimizer_fn=optimizer_fn)
    for _ in range(3):
        w.make_optimizer(_model())
    assert capsys.readouterr().out == "using fused AdamW: False\n"


def test_the_cpu_allocators_out_of_memory_is_one_line_naming_the_batch(tmp_path, capsys):
    """Issue 26: "loss_fn(model, batch) raised RuntimeError: ... can't allocate memory ...; fix it"
    blamed the workload for the CPU allocator's error, which a smaller batch fixes."""
    factory = tmp_path / "big.py"
    factory.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn
            import mixprec

            def loss_fn(model, batch):
                raise RuntimeError(
                    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                    "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)"
                )

            def workload():
                return mixprec.Workload(
                    model=nn.Linear(8, 4),
                    make_batch=lambda b, d: torch.randn(b, 8, device=d),
                    loss_fn=loss_fn,
                    default_batch_size=4,
                )
            """
        )
    )
    w = mixprec.load_workload(f"{factory}:workload")
    validate_workload(w, device="cpu")  # not the workload's fault: left to the sweep
    result = mixprec.bench(w, policies="fp32", channels_last="off", steps=1, warmup=1, isolate=False)
    assert result.rows[0].status == "oom"
    code = main(["bench", "--workload", f"{factory}:workload", "--policies", "fp32", "--in-process"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert "out of memory at batch 4 for every candidate (it tried to allocate 68719476736 bytes)" in err
    assert "lower --batch-size" in err
