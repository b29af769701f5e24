"""The micro-batch over a script (issue 55): ``--batch-arg NAME`` rewrites the script's own batch
size, gradient accumulation keeps its samples per optimizer step (the agent's in a plain loop, the
framework's switch in the HF Trainer and Lightning), the memory model's peak is the script's
measured one, and the pick's ``mixprec run`` line carries both."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from extras import require
from frameworks.in_process import Losses, under
from mixprec.cli import main
from mixprec.errors import UsageError
from mixprec.frameworks.script import ScriptFramework, ScriptWorkload
from mixprec.frameworks.script.batch import accumulation, at_size, batched, find, rewrite
from mixprec.policy import Candidate

SCRIPTS = Path(__file__).parent / "scripts"
PY = sys.executable


def script(folder: Path, *args: str) -> ScriptWorkload:
    (folder / "train.py").write_text("pass\n")
    return ScriptWorkload.from_command([PY, "train.py", *args], cwd=folder)


# ---------------------------------------------------------------------- the command line
def test_the_batch_argument_is_rewritten_in_either_spelling():
    argv = ["python", "train.py", "--batch-size", "64", "--lr", "1e-3", "--eval-batch-size", "8"]
    assert rewrite(argv, "batch-size", 16) == (
        "python", "train.py", "--batch-size", "16", "--lr", "1e-3", "--eval-batch-size", "8"
    )  # fmt: skip
    assert rewrite(["train.py", "--batch-size=64"], "batch-size", 16) == ("train.py", "--batch-size=16")
    assert find(["train.py", "--bs=32", "--bs", "64"], "--bs").value == 64  # the last one, as argparse


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["train.py", "--lr", "1"], "the command has no --batch-size"),
        (["train.py", "--batch-size", "big"], "--batch-size is 'big'"),
        (["train.py", "--batch-size"], "--batch-size is ''"),
        (["train.py", "--batch-size=0"], "not a positive integer"),
    ],
)
def test_a_batch_argument_the_command_lacks_is_one_line_naming_the_fix(argv, said):
    with pytest.raises(UsageError) as caught:
        find(argv, "batch-size")
    message = str(caught.value)
    assert said in message and "--batch-size 64" in message and "\n" not in message


def test_a_batched_script_runs_each_micro_batch_with_the_flag_rewritten(tmp_path):
    workload = batched(script(tmp_path, "--batch-size", "64", "--steps", "9"), "batch-size")
    assert workload.default_batch_size == 64  # the effective batch, known before the script runs
    small = at_size(workload, 16)
    assert small.given == (PY, "train.py", "--batch-size", "16", "--steps", "9")
    assert small.command[1:] == ("train.py", "--batch-size", "16", "--steps", "9")
    assert at_size(workload, 64) is workload and accumulation(workload, 16) == 4
    with pytest.raises(UsageError, match="does not divide the script's --batch-size 64"):
        accumulation(workload, 24)
    with pytest.raises(UsageError, match="needs --batch-arg NAME"):
        at_size(script(tmp_path, "--batch-size", "64"), 16)


def test_the_run_line_of_a_batch_pick_carries_the_micro_batch_and_the_accumulation(tmp_path):
    workload = batched(script(tmp_path, "--batch-size", "64"), "batch-size")
    pick = Candidate("bf16-mixed", framework="script", micro_batch=16, accumulation_steps=4)
    texts, _ = ScriptFramework().exports(pick, "cpu", workload)
    line = f"mixprec run --policy bf16-mixed --accumulate 4 -- {shlex.quote(PY)} train.py --batch-size 16"
    assert texts["run"] == line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["tune", "--batch-arg", "batch-size"],
            "--batch-arg applies to the micro-batch search; pass --batch auto",
        ),
        (
            ["tune", "--batch", "auto", "--memory-budget", "1GiB"],
            "--batch auto over a script needs --batch-arg",
        ),
        (["tune", "--batch", "auto", "--batch-arg", "bs", "--memory-budget", "1GiB"], "has no --bs"),
        (
            ["tune", "--batch", "auto", "--batch-arg", "batch-size", "--effective-batch", "32"],
            "its effective batch is its own --batch-size 64",
        ),
        (["bench", "--batch-sizes", "8,16"], "--batch-sizes over a script needs --batch-arg"),
        (["bench", "--batch-arg", "batch-size"], "pass --batch-sizes too"),
    ],
)
def test_the_batch_options_over_a_script_are_checked_before_it_runs(
    tmp_path, monkeypatch, capsys, args, said
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('ran')\n")
    assert main([*args, "--", PY, "train.py", "--batch-size", "64"]) == 2
    assert said in capsys.readouterr().err


def test_mixprec_run_takes_a_positive_accumulation_only(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["run", "--policy", "fp32", "--accumulate", "0", "--", PY, "train.py"])
    assert caught.value.code == 2 and "expected a positive integer" in capsys.readouterr().err


# ---------------------------------------------------------------------- accumulation in a plain loop
def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def loop(batch_size: int, iterations: int, scaler: bool = False) -> nn.Module:
    """A loop as people write it: zero_grad, forward, backward, a clip that binds, the optimizer's
    step and a scheduler's, every iteration (``scaler``: the AMP recipe's GradScaler, fp16)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    amp = torch.amp.GradScaler("cpu", enabled=scaler)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(256, 16, generator=g) * 3, torch.randint(0, 4, (256,), generator=g)
    )
    for i, (x, y) in enumerate(torch.utils.data.DataLoader(data, batch_size=batch_size)):
        if i == iterations:
            break
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler):
            loss = F.cross_entropy(model(x), y)
        amp.scale(loss).backward()
        amp.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        amp.step(opt)
        amp.update()
        sched.step()
    return model


def close(a: nn.Module, b: nn.Module, tol: float) -> bool:
    return all(
        torch.allclose(x, y, rtol=tol, atol=tol)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_four_micro_batches_of_16_train_as_one_batch_of_64():
    """Two optimizer steps: the loop at batch 16 with accumulation 4 under the agent leaves the
    weights the loop at 64 leaves (no BatchNorm, fp32): the losses a quarter each, the optimizer,
    zero_grad, the clip and the scheduler once per four iterations; each step is 64 samples."""
    seen = Losses()
    with under("fp32", accumulate=4, observers=[seen]) as agent:
        accumulated = loop(16, 8)
    whole = loop(64, 2)
    assert close(accumulated, whole, 1e-5), "the accumulated steps differ from the whole batch's"
    assert not close(loop(16, 8), whole, 1e-3)  # (without the agent: eight steps of 16)
    assert [s.samples for s in agent.steps] == [64, 64]
    x, y = _first_batch()
    with torch.no_grad():
        want = float(F.cross_entropy(mlp()(x), y))
    assert seen.losses[0] == pytest.approx(want, rel=1e-5)  # the step's loss: the micro-batches' mean


def _first_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 16, generator=g) * 3, torch.randint(0, 4, (256,), generator=g)
    return x[:64], y[:64]


@pytest.mark.parametrize("policy", ["fp16-mixed", "fp16-mixed (as written)"])
def test_accumulation_under_loss_scaling_unscales_once_per_step(policy):
    """fp16 with loss scaling, mixprec's (its Policy routes the step) or the script's own GradScaler:
    the scaled micro-batch gradients add up and are unscaled once, before the clip of the last."""
    scaler = policy.endswith("(as written)")
    with under(policy, accumulate=4) as agent:
        accumulated = loop(16, 8, scaler=scaler)
    with under(policy) as whole_agent:
        whole = loop(64, 2, scaler=scaler)
    assert len(agent.steps) == len(whole_agent.steps) == 2
    assert close(accumulated, whole, 2e-3), "the accumulated fp16 steps differ from the whole batch's"


# ---------------------------------------------------------------------- the frameworks' switches
def test_the_hf_trainer_accumulates_through_its_own_argument(tmp_path):
    require("transformers", "frameworks")
    from transformers import TrainingArguments

    with under("bf16-mixed", accumulate=4) as agent:
        args = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=2, report_to=[])
        assert args.gradient_accumulation_steps == 8  # the script's own 2, four times
        assert agent.framework_flags["gradient_accumulation_steps"] == 8
        assert not agent.accumulation.on  # the Trainer divides the loss and holds the step itself


def test_lightning_accumulates_through_its_own_argument():
    require("lightning", "frameworks")
    import lightning.pytorch as pl

    with under("bf16-mixed", accumulate=4) as agent:
        trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False)
        assert trainer.accumulate_grad_batches == 4
        assert agent.framework_flags["accumulate_grad_batches"] == 4 and not agent.accumulation.on


# ---------------------------------------------------------------------- the script's own process
def test_mixprec_run_accumulate_trains_the_script_at_16_as_at_64(tmp_path, monkeypatch, capsys):
    """The brief's differential: ``mixprec run --accumulate 4 -- python batch_loop.py --batch-size 16``
    (four of its iterations: one optimizer step) leaves the weights the script leaves at 64."""
    monkeypatch.chdir(tmp_path)
    loop_py = str(SCRIPTS / "batch_loop.py")
    args = ["run", "--policy", "fp32", "--accumulate", "4", "--out", "run"]
    assert main([*args, "--", PY, loop_py, "--batch-size", "16", "--steps", "4", "--out", "w16.pt"]) == 0
    assert "1 optimizer steps of fp32 (plain), 4 micro-batches each" in capsys.readouterr().err
    import subprocess

    subprocess.run([PY, loop_py, "--batch-size", "64", "--steps", "1", "--out", "w64.pt"], check=True)
    a, b = torch.load(tmp_path / "w16.pt"), torch.load(tmp_path / "w64.pt")
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in b)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["steps"] == 1


@pytest.mark.slow
def test_tune_searches_the_micro_batch_of_a_script_under_a_memory_budget(tmp_path):
    """``tune --batch auto --batch-arg batch-size --memory-budget 2.4GiB`` over a script whose fp32
    step peaks past 2.4 GiB at its own batch of 2 (its process' RSS on a CPU, the interpreter's with
    it): a pick at a micro-batch whose measured peak fits, and the run line that runs it."""
    out = tmp_path / "tune.json"
    # Each run of the script is a launch (seconds of torch's import): its own batch of 2 makes the
    # memory search two of them (micro-batches 1 and 2) where a batch of 4 made three. --wide
    # 4,000,000 is ~0.95 GiB a sample in fp32, so fp32 fits 2.4 GiB at a micro-batch of 1 and not at 2
    # for any interpreter between 0.5 and 1.45 GiB (0.7 on one CI machine, 0.92 on another: a sample
    # of 0.25 GiB left the second past 1 GiB at 1). --steps 2: the pick's row needs its peak only.
    command = [PY, str(SCRIPTS / "batch_loop.py"), "--batch-size", "2", "--wide", "4000000"]
    args = [
        "tune",
        "--batch",
        "auto",
        "--batch-arg",
        "batch-size",
        "--memory-budget",
        "2.4GiB",
        # the work is bounded by what is searched, not by the clock (a 40 s budget once left the
        # first strict-fp32 run 15 s, too few beside another test): the micro-batch of strict fp32
        "--policies",
        "fp32",
        "--budget",
        "3600",
        "--steps",
        "2",
    ]
    args += ["--no-compile", "--no-optimizers", "--device", "cpu", "--json", str(out)]
    code = main([*args, "--", *command])
    assert code == 0, code
    data = json.loads(out.read_text())
    budget = data["batches"]["memory_budget_bytes"]
    assert budget == int(2.4 * 2**30)
    planned = {c["label"]: c for c in data["batches"]["candidates"]}
    # strict fp32's search measured the script's own batch and found it past the budget (what rules
    # it out): 1 per micro-batch, accumulated twice
    points = {p["batch_size"]: p["peak_bytes"] for p in planned["fp32"]["memory_model"]["points"]}
    assert points[2] > budget >= points[1], points
    assert planned["fp32"]["micro_batch"] == 1
    assert set(planned) == {"fp32"}  # (no other precision searched: none was named)
    rec = data["recommendation"]["candidate"]
    m, k = rec["micro_batch"], rec["accumulation_steps"]
    assert (rec["policy"], m, k) == ("fp32", 1, 2) and planned["fp32"]["micro_batch"] == m
    assert 0 < planned[rec["policy"]]["peak_memory_bytes"] <= budget
    row = next(r for r in data["bench"]["rows"] if r["label"] == data["recommendation"]["label"])
    assert 0 < row["peak_memory_bytes"] <= budget  # the sweep's own run of the pick: the script's RSS
    assert data["exports"]["run"].endswith(f"-- {' '.join(command[:2])} --batch-size {m} --wide 4000000")
    assert (f"--accumulate {k}" in data["exports"]["run"]) == (k > 1)


def test_a_scripts_peak_memory_is_its_own_not_its_parents():
    """On Linux ``ru_maxrss`` is carried across ``exec`` from the process that forked: a script
    started by a 3.4 GB test worker read 3.4 GB at micro-batch 1, over any memory budget."""
    if not Path("/proc/self/status").exists():
        pytest.skip("reads /proc")
    held = bytearray(768 * 2**20)
    held[::4096] = b"\x01" * len(held[::4096])  # resident, page by page
    code = (
        "import resource; from mixprec.frameworks.script.modes import peak_rss; "
        "print(peak_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    said = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True).stdout
    own, inherited = map(int, said.split())
    assert inherited > len(held) > own  # the child holds torch and mixprec, not the parent's 768 MiB
    del held
