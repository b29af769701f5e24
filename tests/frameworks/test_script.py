"""The user's script as the source: `mixprec run|check|tune -- python train.py ...` on scripts written
the way people write them (tests/frameworks/scripts/), each unchanged.

Differential: `mixprec run --policy P` leaves the weights the same script edited by hand leaves
(bitwise, on the CPU); through the HF Trainer and Lightning the framework's own switch is the one
set and the model's matmuls compute in the candidate's dtype; the script's own autocast and
GradScaler are overridden, never stacked; real data that overflows fp16 is found and the layer
named; and every refusal is one line with exit 2."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from extras import require
from mixprec.cli import main
from mixprec.frameworks import framework_named
from mixprec.frameworks.script import ScriptWorkload
from mixprec.frameworks.script.session import trace
from mixprec.policy import Candidate

SCRIPTS = Path(__file__).parent / "scripts"
PY = sys.executable


def script(name: str, *args: str) -> ScriptWorkload:
    return ScriptWorkload.from_command([PY, str(SCRIPTS / name), *args])


def cand(policy: str, **kw) -> Candidate:
    return Candidate(policy, framework="script", **kw)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("policy, hand", [("fp16-mixed", "fp16")])
def test_run_leaves_the_weights_of_the_script_edited_by_hand(tmp_path, policy, hand):
    """torch.autocast around forward and loss, and a GradScaler, unscaled before the script's own
    clip_grad_norm_ (the script has no precision code; mixprec injects it all). Its
    CosineAnnealingLR, made after the optimizer, crashed every run before its first step. (bf16-mixed,
    and 24 script shapes under both, against their hand edits: tests/test_fuzz_scripts.py.)"""
    import subprocess

    by_hand, injected, plain = tmp_path / "hand.pt", tmp_path / "run.pt", tmp_path / "none.pt"
    subprocess.run([PY, SCRIPTS / "by_hand.py", "--hand", hand, "--out", by_hand], check=True)
    subprocess.run([PY, SCRIPTS / "by_hand.py", "--out", plain], check=True)
    command = ["run", "--policy", policy, "--out", str(tmp_path / "out"), "--"]
    assert main([*command, PY, str(SCRIPTS / "by_hand.py"), "--out", str(injected)]) == 0
    assert same(weights(injected), weights(by_hand))
    assert not same(weights(injected), weights(plain))  # the policy did something


def test_the_scripts_own_autocast_and_scaler_are_overridden_not_stacked():
    """nanoGPT-style: its own fp16 autocast and GradScaler; under bf16-mixed the autocast computes
    bf16 and the scaler is off (no fp16 anywhere, no scale); as written it is fp16 with a scale."""
    workload = script("plain_loop.py", "--steps", "100", "--amp", "fp16", "--d-model", "64", "--layers", "1")
    own = trace(workload, cand("fp16-mixed", as_written=True), 2)
    assert own.observed.dtype == "float16" and own.steps[0].scale == 65536.0
    assert own.facts.own["autocast"][0]["dtype"] == "torch.float16" and own.facts.own["scaler"]
    bf16 = trace(workload, cand("bf16-mixed"), 2)
    assert bf16.observed.dtype == "bfloat16"
    assert bf16.steps[0].scale is None  # the script's GradScaler was turned off


def test_validation_finds_the_framework_the_model_and_the_scripts_own_precision():
    framework = framework_named("script")
    own = script("plain_loop.py", "--steps", "100", "--amp", "bf16", "--d-model", "64", "--layers", "1")
    framework.validate_workload(own, "cpu", 1)
    facts = own.facts
    assert (facts.framework, facts.own_policy, facts.model, facts.samples_per_step) == (
        "plain",
        "bf16-mixed",
        "GPT",
        16,
    )
    assert "blocks.0.mlp.0" in facts.module_names and facts.first_losses
    plain = script("plain_loop.py", "--steps", "100", "--d-model", "64", "--layers", "1")
    framework.validate_workload(plain, "cpu", 1)
    assert plain.facts.own_policy == "fp32"


def test_the_hf_trainer_is_set_through_its_own_bf16_flag(tmp_path):
    require("transformers", "frameworks")
    workload = script("hf_trainer.py", "--output_dir", str(tmp_path), "--max_steps", "100", "--tiny")
    record = trace(workload, cand("bf16-mixed"), 2)
    facts = record.facts
    assert facts.framework == "hf" and facts.framework_flags == {"bf16": True, "fp16": False}
    # transformers imports deepspeed where it is installed: the Trainer is still what trains (tune
    # said "the script imports deepspeed ... its loop was measured as a plain one", untrue)
    assert facts.unknown_frameworks == []
    assert record.observed.dtype == "bfloat16"
    as_written = trace(workload, cand("fp32", as_written=True), 1)
    assert as_written.observed.dtype == "float32"
    assert not list(tmp_path.iterdir())  # measured runs write into mixprec's scratch folder, not yours


@pytest.mark.parametrize(
    "policy, flag, dtype", [("bf16-mixed", "bf16-mixed", "bfloat16"), ("fp16-mixed", "16-mixed", "float16")]
)
def test_lightning_is_set_through_its_own_precision_flag(policy, flag, dtype):
    # fp16-mixed: Trainer(accelerator="cpu", precision="16-mixed") silently runs bf16, so it goes
    # through the MixedPrecision plugin; tune over a Lightning script stopped with "labelled
    # fp16-mixed but ... computed in bfloat16" (exit 1)
    require("lightning", "frameworks")
    workload = script("lightning_module.py", "--max-steps", "100")
    record = trace(workload, cand(policy), 2)
    assert record.facts.framework == "lightning"
    assert record.facts.framework_flags == {"precision": flag}
    assert record.observed.dtype == dtype


def test_a_plain_loops_adamw_is_built_in_the_candidates_implementation():
    """Under optimizer='fused' the AdamW the script builds is fused; the record says what its
    AdamW offers and asked for itself (tune's variants of its pick come from the validating run's)."""
    workload = script("plain_loop.py", "--steps", "100", "--d-model", "64", "--layers", "1")
    fused = trace(workload, cand("bf16-mixed", optimizer="fused"), 1)
    assert fused.facts.framework_flags == {"optimizer": {"AdamW": {"fused": True, "foreach": False}}}
    assert fused.facts.own["optimizers"] == [
        {"class": "AdamW", "implementations": ["foreach", "fused"], "as_written": None}
    ]
    assert fused.observed.dtype == "bfloat16" and len(fused.steps) == 1


def test_the_hf_trainer_builds_the_candidates_optimizer_and_compiles_through_its_own_switches(tmp_path):
    """TrainingArguments(optim=): the script's "adamw_torch" becomes "adamw_torch_fused" under
    optimizer='fused', and the Trainer's AdamW is built fused; a compiled candidate sets its
    torch_compile (which crashed under the agent: its autocast patch refused the four positional
    arguments dynamo passes)."""
    require("transformers", "frameworks")
    # aot_eager: Dynamo traces through the agent as Inductor would (the crash was in the trace), without
    # Inductor generating the kernels (90 s of the suite on a 2-core CPU)
    args = ["--output_dir", str(tmp_path), "--max_steps", "100", "--tiny", "--optim", "adamw_torch"]
    args += ["--torch_compile_backend", "aot_eager"]
    candidate = cand("bf16-mixed", optimizer="fused", compile="default")
    record = trace(script("hf_trainer.py", *args), candidate, 1)
    assert record.facts.framework == "hf"
    assert record.facts.framework_flags == {
        "bf16": True,
        "fp16": False,
        "torch_compile": True,
        "torch_compile_mode": "default",
        "optim": "adamw_torch_fused",
        "optimizer": {"AdamW": {"fused": True, "foreach": False}},
    }


def test_lightning_builds_the_candidates_optimizer_and_compiles_as_its_users_do(monkeypatch):
    """configure_optimizers' torch.optim.Adam is built foreach under optimizer='foreach'; a
    compiled candidate is ``trainer.fit(torch.compile(module))`` (it was not compiled at all)."""
    require("lightning", "frameworks")
    # every graph to aot_eager (torch's own debug switch, inherited by the script's process): Dynamo
    # traces through the agent and Lightning's unwrapping as under Inductor, without Inductor
    # generating kernels (62-90 s of a 2-core CI, 14 s without), as the HF test above does by its flag
    monkeypatch.setenv("TORCH_COMPILE_OVERRIDE_BACKENDS", ">=0:aot_eager")
    candidate = cand("bf16-mixed", optimizer="foreach", compile="default")
    record = trace(script("lightning_module.py", "--max-steps", "100"), candidate, 1)
    assert record.facts.framework == "lightning"
    assert record.facts.framework_flags == {
        "precision": "bf16-mixed",
        "compile": "default",
        "optimizer": {"Adam": {"foreach": True, "fused": False}},
    }


@pytest.mark.slow
def test_check_finds_the_fp16_overflow_of_the_scripts_real_data_and_names_the_layer(capsys):
    """raw_sensors.py feeds unnormalised readings (tens of thousands): its first layer's outputs pass
    65504 on that data. No synthetic batch shows it; the script's own DataLoader does. (16 steps:
    over 4 or 8 its fp32 reference does not learn yet, and the check runs it again over 16 first.)"""
    command = ["check", "--policies", "fp16-mixed,bf16-mixed", "--steps", "16", "--"]
    code = main([*command, PY, str(SCRIPTS / "raw_sensors.py"), "--steps", "1000"])
    out = capsys.readouterr().out
    assert code == 4
    row = next(line for line in out.splitlines() if line.startswith("│ fp16-mixed"))
    assert "fail" in row and "proj / -" in row
    assert next(line for line in out.splitlines() if line.startswith("│ bf16-mixed")).count("pass") == 1
    # the script as written is fp32 at the CPU's strict default: the reference itself, not a second row
    assert "(as written)" not in out


@pytest.mark.parametrize(
    "command, message",
    [
        (["ls", "-l"], "'ls' is not a Python interpreter"),
        ([], "nothing after '--'"),
        (
            [PY, "-c", "raise SystemExit('bad config: lr missing')"],
            "does not train in strict fp32.*bad config: lr missing",
        ),
        ([PY, "-c", "print('no training here')"], "never called an optimizer step|ended before"),
    ],
)
def test_a_command_that_cannot_be_measured_is_one_line_and_exit_2(command, message, capsys):
    import re

    assert main(["check", "--policies", "bf16-mixed", "--", *command]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def test_a_second_model_built_after_the_first_optimizer_is_refused(tmp_path, capsys):
    """Both models built before their optimizers train (test_script_two_models); one built after
    the first optimizer is refused, saying the order that works."""
    two = tmp_path / "gan.py"
    two.write_text(
        "import torch\n"
        "g = torch.nn.Linear(4, 4)\n"
        "og = torch.optim.SGD(g.parameters(), lr=0.1)\n"
        "d = torch.nn.Linear(4, 1)\n"
        "od = torch.optim.SGD(d.parameters(), lr=0.1)\n"
        "for _ in range(5):\n"
        "    d(g(torch.randn(2, 4))).sum().backward(); og.step(); od.step()\n"
    )
    assert main(["check", "--policies", "bf16-mixed", "--", PY, str(two)]) == 2
    err = capsys.readouterr().err
    assert "second model" in err and "build every model, then their optimizers" in err, err


def test_run_refuses_a_linked_run_json_before_the_script_starts(tmp_path, capsys):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").symlink_to(tmp_path / "elsewhere.json")
    assert main(["run", "--policy", "bf16-mixed", "--out", str(out), "--", PY, str(script)]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert not marker.exists()  # refused before anything ran: nothing measured is lost


def test_run_builds_the_scripts_optimizer_in_the_implementation_named(tmp_path, capsys):
    """`mixprec run --optimizer fused`, the line tune writes for such a pick: the script's own SGD
    reads fused from inside it; a name that is no implementation is refused before it starts."""
    import json

    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\n"
        "model = torch.nn.Linear(8, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
        "for _ in range(2):\n"
        "    model(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "open(sys.argv[1], 'w').write(repr((opt.defaults['fused'], opt.defaults['foreach'])))\n"
    )
    seen, out = tmp_path / "seen.txt", tmp_path / "out"
    command = ["run", "--policy", "bf16-mixed", "--out", str(out)]
    assert main([*command, "--optimizer", "fused", "--", PY, str(script), str(seen)]) == 0
    assert seen.read_text() == "(True, False)"
    facts = json.loads((out / "run.json").read_text())["facts"]
    assert facts["framework_flags"] == {"optimizer": {"SGD": {"fused": True, "foreach": False}}}
    seen.unlink()
    assert main([*command, "--optimizer", "fast", "--", PY, str(script), str(seen)]) == 2
    assert "valid: for-loop, foreach, fused" in capsys.readouterr().err
    assert not seen.exists()


def test_the_commands_that_take_a_script_and_those_that_do_not(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["env", "--", PY, "train.py"])
    assert exc.value.code == 2 and "takes no training command" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--policy", "bf16-mixed"])
    assert "mixprec run --policy bf16-mixed -- python train.py" in capsys.readouterr().err
    assert main(["check", "--model", "mlp", "--", PY, "train.py"]) == 2
    assert "--model and a command after '--'" in capsys.readouterr().err


def test_a_script_whose_data_differs_run_to_run_is_compared_by_its_trends(tmp_path, monkeypatch):
    """Two strict-fp32 runs disagree at the first step (the script seeds from the clock): the
    reference says so and compares running means, with no first-step output or gradients to take
    an SQNR of (another batch). (The check reports the trajectory's note as its reference_note.)"""
    noisy = tmp_path / "noisy.py"
    noisy.write_text(
        "import time, torch\n"
        "torch.manual_seed(time.time_ns() % 2**31)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
        "for _ in range(1000):\n"
        "    x = torch.randn(16, 32)\n"
        "    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
    )
    framework = framework_named("script")
    workload = ScriptWorkload.from_command([PY, str(noisy)])
    framework.validate_workload(workload, "cpu", 1)  # the first strict-fp32 run
    reference = framework.trajectory(workload, framework.baseline, [], 3, "cpu")  # the second
    assert workload.facts is not None and workload.facts.deterministic is False
    assert "two strict-fp32 runs of the script disagree at the first step" in reference.note
    assert reference.first_output is None and reference.first_grads == {}
    losses = reference.losses  # running means of the run's losses
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    # the check's per-layer ranges of the reference are its run's first step: no launch of their own
    # (a check made one more launch of the script per candidate, seconds each)
    import mixprec.frameworks.script.framework as script_framework

    monkeypatch.setattr(script_framework, "trace", lambda *a, **k: pytest.fail("a launch for ranges"))
    ranges = framework.layer_ranges(workload, framework.baseline, None, "cpu", None)
    assert ranges.layers and all(layer.calls > 0 for layer in ranges.layers)


def test_the_readmes_run_line_runs_a_script_as_written(tmp_path):
    """README: `mixprec run --policy bf16-mixed -- python train.py --lr 3e-4`, here with train.py a
    copy of the nanoGPT-style script."""
    import re
    import shutil
    import subprocess

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    line = next(m for m in re.findall(r"^mixprec run [^#\n]*", readme, flags=re.M) if "train.py" in m)
    shutil.copy(SCRIPTS / "plain_loop.py", tmp_path / "train.py")
    args = line.split()[1:]
    args[args.index("python")] = PY
    args += ["--steps", "20", "--d-model", "64", "--layers", "1"]
    done = subprocess.run(
        [PY, "-m", "mixprec", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "20 optimizer steps of bf16-mixed (plain)" in done.stderr


@pytest.mark.slow
def test_tune_over_a_script_recommends_from_the_script_and_answers_in_its_terms(tmp_path):
    """A short tune of the nanoGPT-style script: every row is the script itself (as written among
    them), and the answer is the `mixprec run` line and the change for its framework."""
    import json

    out = tmp_path / "tune.json"
    # the small model (as the other tests here run it), strict fp32 and bf16-mixed, eager, the
    # optimizer as written (its implementations have their own test): 19 s on a quiet 2-core CPU.
    # The budget caps it, nothing below needs it to be reached: with 3600 s a loaded machine spent
    # 106 s re-measuring noisy rows, as a tune with time left does
    command = [PY, str(SCRIPTS / "plain_loop.py"), "--steps", "100000", "--d-model", "64", "--layers", "1"]
    tune = ["tune", "--policies", "bf16-mixed", "--budget", "60", "--no-compile", "--no-optimizers"]
    tune += ["--steps", "2", "--json", str(out)]
    code = main([*tune, "--", *command])
    data = json.loads(out.read_text())
    assert code in (0, 4, 5, 6), code  # 6: its fp32 run did not learn in the checked steps (warm-up)
    labels = {r["label"] for r in data["bench"]["rows"] if r["status"] == "ok"}
    assert "fp32" in labels  # the script itself, in strict fp32: the reference every row is paired with
    table = {c["label"]: c for c in data["candidates"]}
    # the script as written is strict fp32 here (no precision code, the CPU's default math mode): the
    # baseline is its row, not a second run of it (that read 0.83x of itself)
    assert "fp32 (as written)" not in table
    # bf16-mixed measured on the script (pruned: measured and found far slower than the best, as
    # where bf16 is emulated), or said to be left by the budget (a loaded machine); the policies not
    # named are not tried, and a note says so
    assert "bf16-mixed" in labels or table["bf16-mixed"]["status"] in ("pruned", "not-measured")
    assert "fp16-mixed" not in table and any("fp16-mixed" in n for n in data["notes"] if "--policies" in n)
    assert "-- " + " ".join(command) in data["command"] and "trained by its own loop" in data["description"]
    rec = data["recommendation"]
    if rec is not None and rec["candidate"]["policy"] != "fp32":
        assert data["exports"]["run"].startswith(f"mixprec run --policy {rec['candidate']['policy']} --")
        assert "pytorch" in data["exports"]
