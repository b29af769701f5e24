"""Unit tests of the script agent's parts, in this process and in seconds: the typed messages both
ends share, the script's own-precision rules, discovery, each torch patch and its removal, the
sitecustomize chain, the spawned-worker guard and an interpreter that is not mixprec's. (What a whole
loop does under the agent: test_script_agent.py; the script as a process: test_script_process.py.)"""

from __future__ import annotations

import copy
import inspect
import io
import os
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim import optimizer as optimizer_module

from frameworks.in_process import under
from mixprec.errors import UsageError
from mixprec.frameworks.script import agent as agent_module
from mixprec.frameworks.script.copies import CompiledForward
from mixprec.frameworks.script.framework import own_policy
from mixprec.frameworks.script.messages import (
    OWNER_ENV,
    PLAN_ENV,
    Done,
    Ending,
    Facts,
    Failed,
    Observed,
    Ready,
    Step,
    TraceRecord,
    decode,
    encode,
)
from mixprec.frameworks.script.models import describe, find_models, model_of, preparing
from mixprec.frameworks.script.workload import preflight
from mixprec.frameworks.torch.ranges import collect_ranges

BOOT = Path(agent_module.__file__).parent / "boot" / "sitecustomize.py"


# ---------------------------------------------------------------------- messages
def test_every_pipe_event_reads_back_as_it_was_sent():
    facts = Facts(model="GPT", modules=[("blocks.0", "Block")], own={"autocast": [], "scaler": True})
    events = [
        Ready(facts),
        Step(3, 0.25, 16, skipped=True, loss=2.5),
        Done(1 << 20, "peak RSS", 2, Observed("fc1", "bfloat16")),
        Failed("UsageError", "the script trains a second model"),
        Ending("the script trains a new model once done with the first"),
    ]
    for event in events:
        line = encode(event)
        assert line.endswith("\n") and line.count("\n") == 1
        assert decode(line) == event


def test_a_trace_record_loads_with_weights_only(tmp_path):
    """It was read with weights_only=False (a pickle of mixprec's classes); plain data now, its
    ranges whole (the overflow counts a check reads are not in RangeReport.to_dict)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ranges = collect_ranges(model, lambda: model(torch.randn(3, 4) * 1e6).sum())
    record = TraceRecord(
        steps=[Step(0, 0.1, 3, False, loss=1.0, scale=65536.0, stall=(2, 10))],
        facts=Facts(framework="lightning", framework_flags={"precision": "bf16-mixed"}),
        observed=Observed("0", "bfloat16"),
        first_output=torch.randn(3, 2),
        first_grads={"0.weight": torch.randn(8, 4)},
        series=[{"name": "0", "steps": [0]}],
        ranges=ranges,
    )
    record.save(str(tmp_path / "trace.pt"))
    back = TraceRecord.load(tmp_path / "trace.pt")  # (weights_only=True inside)
    assert back.steps == record.steps and back.facts == record.facts and back.observed == record.observed
    assert torch.equal(back.first_output, record.first_output)
    assert torch.equal(back.first_grads["0.weight"], record.first_grads["0.weight"])
    assert back.ranges is not None and back.ranges.to_dict() == ranges.to_dict()
    assert back.ranges.layers[1].forward.overflow_count == ranges.layers[1].forward.overflow_count


# ---------------------------------------------------------------------- the script's own precision
@pytest.mark.parametrize(
    "facts, policy",
    [
        (Facts(), "fp32"),
        (Facts(own={"framework": {"mixprec": "fp16-mixed"}}), "fp16-mixed"),
        (Facts(own={"framework": {"bf16": True, "fp16": False}}), "bf16-mixed"),
        (Facts(own={"framework": {"precision": "16-mixed"}}), "fp16-mixed"),
        (Facts(own={"framework": {"precision": "bf16-true"}}), "bf16-true"),
        (Facts(own={"framework": {"precision": "16-true"}}), "fp16-true"),
        (Facts(own={"framework": {"mixed_precision": "fp16"}}), "fp16-mixed"),
        (Facts(param_dtypes=["bfloat16"]), "bf16-true"),
        (Facts(param_dtypes=["float16"]), "fp16-true"),
        (Facts(own={"autocast": [{"dtype": "torch.float16"}]}), "fp16-mixed"),
        (Facts(own={"autocast": [{"dtype": "None"}], "scaler": True}), "fp16-mixed"),  # CUDA's default
        (Facts(own={"autocast": [{"dtype": "None"}]}), "bf16-mixed"),  # the CPU's default
        (Facts(own={"autocast": [{"dtype": "torch.bfloat16"}]}), "bf16-mixed"),
        (Facts(own={"framework": {"precision": "32-true"}}), "fp32"),
    ],
)
def test_the_scripts_own_policy_is_named_by_what_it_asks_for(facts, policy):
    assert own_policy(facts) == policy


@pytest.mark.parametrize(
    "candidate, scaler_on, dtype",
    [
        ("bf16-mixed", False, torch.bfloat16),
        ("fp16-mixed", True, torch.float16),
        ("fp32", False, None),  # no autocast: the script's is turned off
        ("fp16-mixed (as written)", True, torch.float16),  # as written: the script's own, untouched
        ("bf16-true", False, None),  # a *-true candidate's half is its weights': no autocast
    ],
)
def test_the_scripts_own_autocast_and_scaler_take_the_candidates_settings(candidate, scaler_on, dtype):
    with under(candidate):
        scaler = torch.amp.GradScaler("cpu", enabled=True)
        ctx = torch.autocast("cpu", dtype=torch.float16)
        assert scaler.is_enabled() is scaler_on
        assert (ctx.fast_dtype if ctx._enabled else None) == dtype
        with torch.autocast("cpu", enabled=False) as off:  # `autocast(enabled=use_amp)`, AMP off
            switched = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(candidate)
            assert (off.fast_dtype if off._enabled else None) == switched


# ---------------------------------------------------------------------- discovery
def test_the_model_is_every_outermost_module_holding_the_optimizers_parameters():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    net, other = Net(), nn.Linear(3, 3)
    temperature = nn.Parameter(torch.ones(()))
    live = [*net.modules(), *other.modules()]

    def found(*tensors: torch.Tensor) -> list[nn.Module]:
        return find_models([id(t) for t in tensors], live)

    assert found(*net.parameters(), temperature) == [net]  # not a part of it, not the bare parameter's
    assert found(*net.head.parameters()) == [net]
    assert found(temperature) == []
    # a model in parts (a backbone and a head, one optimizer): every part, in the optimizer's order
    assert found(*other.parameters(), *net.parameters()) == [other, net]
    shares = nn.Sequential(net.body, nn.Linear(4, 8))  # a second model on the first's backbone
    live += [shares, shares[1]]
    assert found(*net.parameters()) == [net]  # (it adds no parameter of the optimizer's)
    assert found(*net.parameters(), *shares[1].parameters()) == [net, shares]

    class Compiled(nn.Module):  # torch.compile's OptimizedModule: the model it compiles as _orig_mod
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self._orig_mod = model

    compiled = Compiled(other)
    assert find_models([id(p) for p in compiled.parameters()], [compiled, other]) == [other]


def test_a_model_in_parts_is_named_as_the_script_names_them():
    """The parts' names are the script's: its variables, else its object's attributes (a trainer's
    ``self.encoder``), else their classes; a name a module cannot take is not used."""

    class Encoder(nn.Linear): ...

    class Trainer:
        def __init__(self) -> None:
            self.encoder, self.decoder = Encoder(4, 4), nn.Linear(4, 2)

    enc, head = Encoder(4, 4), nn.Linear(4, 2)
    model = model_of([enc, head])
    assert [n for n, _ in model.named_children()] == ["enc", "head"]
    assert describe(model) == "enc (Encoder) + head (Linear)" and describe(enc) == "Encoder"
    assert model_of([enc]) is enc
    trainer = Trainer()
    names = [n for n, _ in model_of([trainer.encoder, trainer.decoder]).named_children()]
    assert names == ["encoder", "decoder"]
    training, _unnamed = nn.Linear(2, 2), nn.Linear(2, 2)  # nn.Module's own attribute; a private name
    names = [n for n, _ in model_of([training, _unnamed]).named_children()]
    assert names == ["linear", "linear_1"]
    with pytest.raises(TypeError, match="call each part"):
        model(torch.ones(1, 4))

    def build_optimizer(parts: list[nn.Module]) -> nn.Module:  # a helper of the script's
        return model_of(parts)

    encoder, decoder = nn.Linear(4, 4), nn.Linear(4, 2)  # (named a frame further out: they were classes)
    names = [n for n, _ in build_optimizer([encoder, decoder]).named_children()]
    assert names == ["encoder", "decoder"]


def test_a_policy_on_a_model_in_parts_casts_each_parts_inputs_until_it_is_widened():
    """bf16-true's input cast goes on each part the script calls (on the parts' holder it never ran:
    "mat1 and mat2 must have the same dtype"); a rescue's switch to bf16-mixed widens the weights and
    takes the cast off every part (its handle removed it from the holder alone: bf16 inputs met fp32
    weights)."""
    from mixprec import get_policy

    torch.manual_seed(0)
    enc, dec = nn.Linear(4, 8), nn.Linear(8, 2)
    model = model_of([enc, dec])
    policy = get_policy("bf16-true", device="cpu")
    with preparing(model, "bf16-true"):  # (as the agent applies a candidate)
        policy.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    assert dec(enc(x)).dtype == torch.bfloat16  # each part casts what it is given
    policy.switch("bf16-mixed", model, opt)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert dec(enc(x)).dtype == torch.float32  # no part casts any more
    assert all(not part._forward_pre_hooks for part in (enc, dec, model))


def test_a_copy_of_a_compiled_candidates_model_runs_its_own_forward():
    """A compile candidate's model.forward is compiled where the agent's hooks stay eager. As a
    function over the original's bound forward (torch.compile(model.forward)) it made a deep copy
    (an EMA, a snapshot) compute with the original's weights. The copy runs its own forward, eager;
    a pickled model, its class's. It keeps the forward's signature (HF's generate() reads it to pass
    position_ids). (The compiled forward itself is never called here: no compile.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model.forward = CompiledForward(model.forward, None)
    x = torch.randn(3, 4)
    assert inspect.signature(model.forward) == inspect.signature(nn.Sequential.forward.__get__(model))
    for twin in (copy.deepcopy(model), torch.load(_pickled(model), weights_only=False)):
        assert twin.forward.__self__ is twin
        with torch.no_grad():
            assert torch.equal(twin(x), nn.Sequential.forward(model, x))
            twin[2].weight.zero_()
            assert torch.equal(twin(x), twin[2].bias.expand(3, 2))


def _pickled(model: nn.Module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return buffer


# ---------------------------------------------------------------------- the patches
def _patched() -> dict[str, object]:
    from mixprec.policy.policy import Policy

    autocast, scaler = torch.amp.autocast_mode.autocast, torch.amp.grad_scaler.GradScaler
    return {
        "autocast.__init__": autocast.__dict__["__init__"],
        "autocast.__enter__": autocast.__dict__["__enter__"],
        "autocast.__exit__": autocast.__dict__["__exit__"],
        "GradScaler.__init__": scaler.__dict__["__init__"],
        "GradScaler.scale": scaler.__dict__["scale"],
        "GradScaler.step": scaler.__dict__["step"],
        "autograd.backward": torch.autograd.backward,
        "Tensor.backward": torch.Tensor.__dict__["backward"],
        "Optimizer.__init__": torch.optim.Optimizer.__dict__["__init__"],
        "Optimizer.zero_grad": torch.optim.Optimizer.__dict__["zero_grad"],
        "Module.zero_grad": nn.Module.__dict__["zero_grad"],
        "Policy.__init__": Policy.__dict__["__init__"],
        "os._exit": os._exit,
        "Tensor.grad": torch.Tensor.__dict__.get("grad"),
        "forward hooks": len(torch.nn.modules.module._global_forward_pre_hooks),
        "step hooks": len(optimizer_module._global_optimizer_pre_hooks),
    }


def test_each_patch_acts_in_a_loop_and_is_removed_after_it():
    """One fp16-mixed step of a plain loop goes through every patch: the optimizer names the model,
    the forward pre-hook starts the candidate's autocast, backward records and scales the loss, a
    .grad read unscales it, zero_grad is not a read, and the step is routed; then torch is whole."""
    before = _patched()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with under("fp16-mixed") as agent:
        during = _patched()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # Optimizer.__init__ -> adopt
        assert agent.model is model and agent.policy is not None
        x = torch.randn(4, 8)
        out = model(x)  # the global forward pre-hook entered the candidate's autocast
        assert out.dtype == torch.float16
        loss = out.float().pow(2).mean()
        loss.backward()  # recorded unscaled, scaled by the Policy's GradScaler
        assert agent.window.losses[0] is not loss and float(agent.window.losses[0]) == float(loss.detach())
        scale = float(agent.policy.scaler.get_scale())
        assert scale > 1 and agent.grads_scaled
        raw = model[0].weight.grad  # the first read unscales (in place): the true gradient
        expected = torch.autograd.grad(model(x).float().pow(2).mean(), model[0].weight)[0]
        torch.testing.assert_close(raw, expected, rtol=5e-2, atol=1e-3)
        opt.step()  # routed through the Policy; the scale is updated at the step's end
        opt.zero_grad()
    changed = [k for k in before if before[k] is not during[k] and before[k] != during[k]]
    assert set(changed) >= {
        "autocast.__init__",
        "GradScaler.__init__",
        "autograd.backward",
        "Tensor.backward",
        "Optimizer.__init__",
        "Optimizer.zero_grad",
        "Module.zero_grad",
        "Policy.__init__",
        "os._exit",
        "step hooks",
    }
    after = _patched()
    assert all(after[k] is before[k] or after[k] == before[k] for k in before), [
        k for k in before if not (after[k] is before[k] or after[k] == before[k])
    ]
    assert len(agent.steps) == 1 and not agent.steps[0].skipped


def test_an_lr_scheduler_made_after_the_optimizer_wraps_its_step():
    """`optimizer.step` is a bound method, as torch's own is (a plain function broke every scheduler)."""
    model = nn.Linear(4, 1)
    with under("bf16-mixed") as agent:
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(2):
            model(torch.randn(2, 4)).float().pow(2).mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    assert opt.param_groups[0]["lr"] == 0.25 and len(agent.steps) == 2


# ---------------------------------------------------------------------- the process it runs in
def test_the_boot_hook_runs_the_interpreters_own_sitecustomize_first(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['USERS_SITECUSTOMIZE'] = 'ran'\n")
    monkeypatch.setattr(sys, "path", [str(BOOT.parent), str(tmp_path), *sys.path])
    monkeypatch.delenv(PLAN_ENV, raising=False)
    monkeypatch.delenv("USERS_SITECUSTOMIZE", raising=False)
    runpy.run_path(str(BOOT))
    assert os.environ["USERS_SITECUSTOMIZE"] == "ran"


def test_a_worker_process_of_the_script_is_not_the_script(tmp_path, monkeypatch):
    """A DataLoader worker (spawned: a fresh interpreter importing the boot hook again) or any other
    child inherits the plan: only the process the plan was installed in runs the agent."""
    plan = tmp_path / "plan.json"
    plan.write_text('{"mode": "run", "candidate": {"policy": "bf16-mixed"}}')
    monkeypatch.setenv(PLAN_ENV, str(plan))
    monkeypatch.setenv(OWNER_ENV, str(os.getpid() + 1))  # the script, which started this one
    monkeypatch.setattr(agent_module, "AGENT", None)
    agent_module.install_from_env()
    assert agent_module.AGENT is None
    monkeypatch.delenv(PLAN_ENV)
    monkeypatch.delenv(OWNER_ENV)
    agent_module.install_from_env()  # no plan: not a script mixprec runs
    assert agent_module.AGENT is None


def test_a_python_that_is_not_mixprecs_is_probed_before_any_run(tmp_path):
    (tmp_path / "train.py").write_text("")
    old = tmp_path / "python3.8"
    old.write_text("#!/bin/sh\necho False 2.0.0\n")
    old.chmod(0o755)
    with pytest.raises(UsageError, match=r"older than Python 3\.11"):
        preflight([str(old), "train.py"], tmp_path)
    no_torch = tmp_path / "python"
    no_torch.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    no_torch.chmod(0o755)
    with pytest.raises(UsageError, match=r"cannot import torch .*No module named 'torch'"):
        preflight([str(no_torch), "train.py"], tmp_path)
    with pytest.raises(UsageError, match="cannot find the interpreter 'pyhton'"):
        preflight(["pyhton", "train.py"], tmp_path)
    preflight([sys.executable, "train.py"], tmp_path)  # mixprec's own: nothing to probe


# ---------------------------------------------------------------------- the backend holds no workload
def test_two_scripts_in_one_process_get_their_own_answers(tmp_path):
    """The backend kept the facts of the script validated last: a plain loop measured after a
    Lightning script was refused channels_last and exported as Lightning code (issue 52)."""
    from mixprec.frameworks import framework_named
    from mixprec.frameworks.script import ScriptWorkload
    from mixprec.frameworks.script.workload import ScriptFacts
    from mixprec.hardware.device import detect
    from mixprec.policy import Candidate

    def script(name: str, framework: str) -> ScriptWorkload:
        (tmp_path / name).write_text("")
        workload = ScriptWorkload.from_command([sys.executable, name], cwd=tmp_path)
        workload.facts = ScriptFacts(
            framework, "fp32", {}, "Net", [("conv", "Conv2d")], ["conv.weight"], "cpu", 8, [1.0]
        )
        return workload

    backend, info = framework_named("script"), detect("cpu")
    lightning, plain = script("lit.py", "lightning"), script("loop.py", "plain")
    cand = Candidate("bf16-mixed", channels_last=True, framework="script")
    for _ in range(2):  # in either order, whichever was asked last
        assert not backend.support(cand, info, lightning) and backend.support(cand, info, plain)
    fp16 = Candidate("fp16-mixed", framework="script")
    lit_texts, _ = backend.exports(fp16, "cpu", lightning)
    loop_texts, _ = backend.exports(fp16, "cpu", plain)
    assert "lightning" in lit_texts and "pytorch" not in lit_texts
    assert "pytorch" in loop_texts and "lightning" not in loop_texts
    assert lit_texts["run"].endswith("-- " + " ".join([sys.executable, "lit.py"]))
    assert loop_texts["run"].endswith("loop.py")


def test_tune_tries_the_scripts_optimizers_in_each_implementation_they_all_offer(tmp_path):
    """The optimizer axis over a script is the workload's: tune measures its pick with each
    implementation every optimizer the validating run saw offers (not the one they all use as
    written), and the pick's `mixprec run` line and export carry it."""
    from dataclasses import replace

    from mixprec.frameworks import framework_named
    from mixprec.frameworks.script import ScriptWorkload
    from mixprec.frameworks.script.workload import ScriptFacts
    from mixprec.policy import Candidate

    (tmp_path / "train.py").write_text("")
    workload = ScriptWorkload.from_command([sys.executable, "train.py"], cwd=tmp_path)
    backend, bf16 = framework_named("script"), Candidate("bf16-mixed", framework="script")
    adamw = {"class": "AdamW", "implementations": ["foreach", "fused"], "as_written": None}
    nadam = {"class": "NAdam", "implementations": ["foreach"], "as_written": None}

    def variants(*built: dict) -> list[str | None]:
        own = {"optimizers": list(built)}
        workload.facts = ScriptFacts(
            "plain", "fp32", own, "Net", [("fc", "Linear")], ["fc.weight"], "cpu", 8, [1.0]
        )
        return [c.optimizer for c in backend.optimizer_variants(workload, bf16)]

    assert variants(adamw) == ["foreach", "fused"]
    assert variants(adamw, nadam) == ["foreach"]  # what every optimizer of the script has
    assert variants({**adamw, "as_written": "fused"}) == ["foreach"]  # not the script's own again
    assert variants() == []
    as_written = Candidate("bf16-mixed", framework="script", as_written=True)
    assert backend.optimizer_variants(workload, as_written) == []
    texts, _ = backend.exports(replace(bf16, optimizer="fused"), "cpu", workload)
    assert texts["run"] == shlex.join(
        ["mixprec", "run", "--policy", "bf16-mixed", "--optimizer", "fused", "--", sys.executable, "train.py"]
    )
    assert "fused=True" in texts["pytorch"]
