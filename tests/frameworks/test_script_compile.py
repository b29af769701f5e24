"""Compiling over a script (issue 55): the step scope in a plain loop (the model's forward and each
optimizer's update compiled, PyTorch's compiled-optimizer recipe), and through a framework its own
compile switch, and only that (the HF Trainer's and Lightning's: tests/frameworks/test_script.py).
Before, a script was compiled as a model alone: no step scope, and Lightning and Accelerate were
not compiled at all under a compiled candidate's name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from extras import require
from frameworks.in_process import Losses, under
from mixprec.cli import main
from mixprec.frameworks import framework_named
from mixprec.frameworks.script import ScriptWorkload
from mixprec.frameworks.script.framework import run_line
from mixprec.frameworks.script.session import trace
from mixprec.frameworks.script.workload import ScriptFacts
from mixprec.hardware.device import detect
from mixprec.policy import Candidate

SCRIPTS = Path(__file__).parent / "scripts"


def _loop(steps: int = 6) -> None:
    """A plain loop as people write it: AdamW, a cosine schedule, zero_grad before backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 100)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _run(scope: str | None) -> tuple[list[float], dict]:
    torch._dynamo.reset()
    losses = Losses()
    with under("bf16-mixed", observers=[losses], compile="default", compile_scope=scope) as agent:
        _loop()
    return losses.losses, agent.framework_flags


def test_the_step_scope_compiles_the_scripts_optimizer_update_too():
    """The update runs compiled (the record says so) and trains as the model-compiled run does,
    its learning rate changed by the scheduler every step (one recompile, then traced as a value)."""
    model_only, flags = _run(None)
    assert "compiled" not in flags
    step, flags = _run("step")
    assert flags["compiled"] == ["AdamW.step"]
    assert step == pytest.approx(model_only, rel=1e-3)


def _workload(tmp_path: Path, framework: str) -> ScriptWorkload:
    tmp_path.mkdir()
    (tmp_path / "train.py").write_text("")
    workload = ScriptWorkload.from_command([sys.executable, "train.py"], cwd=tmp_path)
    workload.facts = ScriptFacts(
        framework, "fp32", {}, "Net", [("fc", "Linear")], ["fc.weight"], "cpu", 8, [1.0]
    )
    return workload


def test_the_step_scope_is_a_plain_loops_and_tune_plans_it_there_only(tmp_path):
    backend, info = framework_named("script"), detect("cpu")
    step = Candidate("bf16-mixed", compile="default", compile_scope="step", framework="script")
    assert "step" in backend.compile_scopes
    assert backend.support(step, info, _workload(tmp_path / "a", "plain"))
    refused = backend.support(step, info, _workload(tmp_path / "b", "lightning"))
    assert not refused and "its own compile switch" in refused.reason
    # the pick's mixprec run line carries the scope, which mixprec run takes
    line = run_line(step, ["python", "train.py"])
    assert line == "mixprec run --policy bf16-mixed --compile default --compile-scope step -- python train.py"
    with pytest.raises(SystemExit):
        main(["run", "--policy", "bf16-mixed", "--compile-scope", "graph", "--", "python", "train.py"])


ACCELERATE_LOOP = """
import torch
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = accelerator.prepare(model, opt)
for step in range(1000):
    x = torch.randn(8, 16)
    loss = (model(x) - x[:, :1]).pow(2).mean()
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
"""


def test_accelerate_is_compiled_through_its_dynamo_plugin(tmp_path):
    """``Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode=...))``, as the
    accelerate export writes it (a compiled candidate was measured eager under its name)."""
    require("accelerate", "frameworks")
    (tmp_path / "train.py").write_text(ACCELERATE_LOOP)
    workload = ScriptWorkload.from_command([sys.executable, "train.py"], cwd=tmp_path)
    record = trace(workload, Candidate("bf16-mixed", compile="default", framework="script"), 1)
    assert record.facts.framework == "accelerate"
    assert record.facts.framework_flags == {
        "mixed_precision": "bf16",
        "dynamo_plugin": "inductor, mode=default",
    }
    assert record.observed.dtype == "bfloat16"
