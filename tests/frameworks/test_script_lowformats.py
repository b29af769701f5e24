"""The low formats over a script (issue 55): fp8-rowwise/tensorwise, MXFP8 and NVFP4 applied to the
script's own model by the agent (the Policy a Workload gets), their numerics predicted on the
script's own data where the device cannot run them fast, the precision map searched where one
fails, and tune's predictions from the same code as over a Workload. A format that can take no
Linear of the script's model is said in one line, naming the layer and the fix.

The scripts are tiny (tests/frameworks/scripts/outlier_loop.py: the planted outlier of
examples/planted_outlier.py in a plain loop); each launch of one is a few seconds of torch's import."""

from __future__ import annotations

import argparse
import math
import sys
import types
from pathlib import Path

import pytest

from extras import require
from mixprec.budget import Budget
from mixprec.frameworks import framework_named
from mixprec.frameworks.script import ScriptWorkload
from mixprec.frameworks.script.session import take_census as take
from mixprec.frameworks.script.workload import ScriptFacts
from mixprec.hardware.device import detect
from mixprec.numerics.compare import compare
from mixprec.numerics.results import CandidateCheck
from mixprec.policy import Candidate
from mixprec.status import Status
from mixprec.tuning.config import TuneConfig

require("torchao", "fp8")  # fails, not skips, under make test (MIXPREC_REQUIRE_FRAMEWORKS=1)

SCRIPTS = Path(__file__).parent / "scripts"
PY = sys.executable
LOW = ("fp8-rowwise", "fp8-tensorwise", "mxfp8", "nvfp4")
CPU = detect("cpu")


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    """The scripts' tensors are tiny: one intra-op thread each (two contend on a 2-core machine)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def planted() -> ScriptWorkload:
    return ScriptWorkload.from_command([PY, str(SCRIPTS / "outlier_loop.py")])


def cand(policy: str, **kw) -> Candidate:
    return Candidate(policy, framework="script", **kw)


def test_the_low_formats_are_predicted_in_a_plain_loop_and_refused_through_a_framework():
    """They were refused outright ("not injected into scripts yet", and on a CPU no prediction): a
    plain loop gets them as a Workload does; a framework's precision switch has no low formats."""
    framework = framework_named("script")
    for name in LOW:
        assert not framework.support(cand(name), CPU)  # no fp8/Blackwell tensor cores here
        assert "numerics predicted on cpu" in framework.predictable(cand(name), CPU, planted())
    hf = planted()
    hf.facts = ScriptFacts("hf", "fp32", {}, "Model", [], [], "cpu", 8, [1.0])
    support = framework.support(cand("mxfp8"), CPU, hf)
    assert not support and "through the HF Trainer" in support.reason
    assert framework.predictable(cand("mxfp8"), CPU, hf) is None
    # the precision map a check finds is one mixprec run applies, with no edit of the script
    from mixprec.cli.run import candidate_of

    given = {
        "keep_fp32": "",
        "channels_last": False,
        "compile": None,
        "compile_scope": None,
        "optimizer": None,
    }
    args = argparse.Namespace(policy="mxfp8", keep_bf16="mix:forward", **given)
    assert candidate_of(args).keep_bf16 == ("mix:forward",)
    assert framework.map_snippet(candidate_of(args)) == (
        "mixprec run --policy mxfp8 --keep-bf16 mix:forward -- <your command>"
    )


def test_no_census_is_taken_where_the_budget_can_check_no_low_format(monkeypatch):
    """The census is a run of the script: tune took it after its budget was spent (17 s past a 50 s
    budget), then said "fp8-rowwise numerics not predicted: budget spent". Where no check can be
    paid, the candidates come back unsorted and no run is made."""
    from mixprec.frameworks.script import session

    def no_run(*args, **kwargs):
        raise AssertionError("the census ran")

    monkeypatch.setattr(session, "take_census", no_run)
    predicted, notes = framework_named("script").predictions(planted(), CPU, lambda candidate: False)
    assert {c.policy for c in predicted} == set(LOW) and notes == []
    # nor where tune was given no low format (`--policies bf16-mixed`: 6 s of a census for nothing)
    everything = lambda candidate: True  # noqa: E731
    predicted, notes = framework_named("script").predictions(
        planted(), CPU, everything, policies=["bf16-mixed"]
    )
    assert predicted == [] and notes == []


def test_the_census_of_the_scripts_first_step_says_what_each_format_takes():
    """One strict-fp32 step of the script, its Linear layers seen by the format: shapes, directions,
    operand SQNR on the script's own data, the step's FLOPs; and what each format cannot take, why."""
    found = take(planted(), Candidate("mxfp8").spec)
    census = found.census
    assert list(census.shapes) == ["mix"] and census.shapes["mix"] == (64, 128, 64)
    assert census.directions["mix"] == {"forward", "dgrad"}  # frozen: no weight gradient
    assert census.sqnr_db["mix"] < 1.0  # the outliers' block scales leave nothing of its weights
    assert census.refused == {
        "embed": "in_features 24 not a multiple of 32: pad it to one",
        "head": "out_features 16 not a multiple of 32: pad it to one",
    }
    # every GEMM of the step: the three Linears' (no dgrad into the input) and the script's teacher
    gemm = 2 * 64
    flops = gemm * (24 * 96 * 2 + 128 * 64 * 2 + 64 * 16 * 3 + 24 * 16)
    assert census.step_flops == flops  # the census's own quantised GEMMs left out
    assert found.formats["nvfp4"].low == found.formats["fp8-rowwise"].low == ["mix", "head"]
    assert list(found.formats["mxfp8"].refused) == ["embed", "head"]


def test_mxfp8_and_nvfp4_run_emulated_on_the_scripts_own_data():
    """The agent applies the format to the script's model: the planted outlier layer in MXFP8 passes
    on nothing (the loss is the untrained one's), kept in bf16 by the map NVFP4 trains like fp32."""
    framework, workload = framework_named("script"), planted()
    fp32 = framework.trajectory(workload, framework.baseline, [], 2, "cpu")
    mx = framework.trajectory(workload, cand("mxfp8"), [], 2, "cpu")
    nv = framework.trajectory(workload, cand("nvfp4", keep_bf16=("mix",)), [], 2, "cpu")
    assert not (fp32.error or mx.error or nv.error), (mx.error, nv.error)
    assert mx.losses[0] == pytest.approx(math.log(16), rel=0.01) and fp32.losses[0] > 10 * mx.losses[0]
    assert nv.losses == pytest.approx(fp32.losses, rel=0.05)
    assert 5 < compare(fp32, nv).output_sqnr_db < 40  # NVFP4's 4-bit head, not fp32 or bf16


def test_a_format_that_takes_no_layer_is_said_in_one_line_and_tune_predicts_the_others(tmp_path):
    """tune's predictions over a script (tuning.checks.Checks.predict, as over a Workload): the
    formats that can take its Linear layers are rows predicted on its data; MXFP8, which can take
    none of them (48 features: no multiple of 32), a note naming the layer and the fix."""
    from mixprec.checking.checker import no_low_gemm
    from mixprec.frameworks.torch.linears import LinearCensus
    from mixprec.tuning.checks import Checks

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(100):\n"
        "    x = torch.randn(8, 48)\n"
        "    loss = model(x).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
    )
    workload = ScriptWorkload.from_command([PY, str(script)])
    setting = types.SimpleNamespace(
        framework=framework_named("script"),
        workload=workload,
        budget=Budget.unlimited(),
        baseline=cand("fp32"),
        config=TuneConfig(),
    )
    checks = Checks(setting, types.SimpleNamespace(prediction_check_s=lambda c: 1.0), {})
    judged = []

    def check(candidate, fix=None, micro_batch=None):  # (the check itself: test_check_over_a_script...)
        judged.append(candidate.policy)
        return CandidateCheck(candidate, Status.PASS, "matches fp32")

    checks.check = check
    rows, notes = checks.predict(CPU)
    assert judged == ["fp8-rowwise", "fp8-tensorwise", "nvfp4"]
    assert {r.status for r in rows.values()} == {Status.PREDICTED}
    assert "fp8-rowwise would pass the numerics check on an fp8 GPU" in " ".join(notes)
    said = [n for n in notes if n.startswith("mxfp8")]
    assert said == [
        "mxfp8 not predicted: mxfp8 can take no Linear layer of the script's model: '0': in_features 48 "
        "and out_features 48 not a multiple of 32: pad them to one (and 1 more)"
    ]
    # a check of it anyway: no verdict on a format that never ran, and the layer named
    refused = {"0": "in_features 48 and out_features 48 not a multiple of 32: pad them to one"}
    reason = no_low_gemm(cand("mxfp8"), LinearCensus(refused=refused))
    assert reason.startswith("nothing was tested") and "'0': in_features 48" in reason


@pytest.mark.slow
def test_check_over_a_script_predicts_fp8_and_finds_the_precision_map_naming_the_layer(capsys):
    """`mixprec check --policies fp8-rowwise --fix -- python outlier_loop.py` on a CPU: predicted on
    the script's data, failed by the planted layer, and the verified map keeps exactly it in bf16."""
    from mixprec.cli import main

    command = ["check", "--policies", "fp8-rowwise", "--steps", "3", "--fix", "--"]
    code = main([*command, PY, str(SCRIPTS / "outlier_loop.py")])
    out = capsys.readouterr().out
    assert code == 4, out  # a numerics failure
    row = next(line for line in out.splitlines() if line.startswith("│ fp8-rowwise"))
    assert "fail (predicted)" in row and "bf16:mix (verified)" in row
    assert "numerics predicted on cpu: torchao's rowwise fp8 recipe" in out
    assert "fix: mixprec run --policy fp8-rowwise --keep-bf16 mix -- <your command>" in out
    # the precision map's figures, from the census of the script's own step
    assert "of the step's FLOPs in fp8 under keep_bf16=['mix']" in out
