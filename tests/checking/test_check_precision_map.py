"""`check --fix` on the low-format Linear policies: the planted outlier layer fails fp8 and MXFP8
whole-model, the precision-map search keeps exactly it (or one of its GEMMs) in bf16, the map is a
real fix in a plain training run, and the report's figures (FLOP shares, operand SQNR, roofline)
are consistent with the model."""

from __future__ import annotations

import json
import math
import time
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from extras import require
from mixprec.checking.check import check, field_rules
from mixprec.errors import UsageError
from mixprec.frameworks.torch.session import make_batches
from mixprec.frameworks.torch.trajectory import run_trajectory
from mixprec.hardware.roofline import DEFAULT_GPU, estimate
from mixprec.numerics.results import CandidateCheck
from mixprec.policy import Candidate

require("torchao", "fp8")  # fails, not skips, under make test (MIXPREC_REQUIRE_FRAMEWORKS=1)

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "planted_outlier.py") + ":workload"
STEPS = 6
LOW = ["fp8-rowwise", "mxfp8"]


@pytest.fixture(scope="module")
def result():
    """One check of the planted outlier (fp8, MXFP8, bf16; with --fix), shared by the tests here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = mixprec.load_workload(EXAMPLE)
        return check(w, policies=[*LOW, "bf16-mixed"], steps=STEPS, device="cpu", fix=True)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def _by(result, label):
    return next(c for c in result.candidates if c.label == label)


def _max_rel_loss_diff(ref, run):
    return max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))


@pytest.mark.parametrize("policy", LOW)
def test_the_whole_model_fails_and_the_verified_map_is_the_outlier_layer(result, policy):
    cand = _by(result, policy)
    assert cand.verdict == "fail", cand.reason
    assert cand.predicted  # a CPU runs the format's numerics, not its speed
    assert "precision map" in cand.suggestion
    assert cand.fix_verified, cand.fix_note
    assert cand.fix_keep_fp32 == []  # a low-format policy is fixed with bf16, not fp32 islands
    if policy == "fp8-rowwise":
        assert cand.fix_keep_bf16 == ["mix"]  # fp8 converts a Linear whole: no directions
    else:
        # one GEMM where one suffices; 'mix' is frozen, so it has no wgrad to keep
        assert cand.fix_keep_bf16 in (["mix"], ["mix:forward"]), cand.fix_keep_bf16
    assert cand.fix_metrics["steps"] == STEPS
    assert cand.fix_metrics["max_rel_loss_diff"] <= cand.thresholds["max_rel_loss_diff"]


@pytest.mark.parametrize("policy", LOW)
def test_the_precision_map_block_is_consistent_with_the_model(result, policy):
    cand = _by(result, policy)
    pm = cand.precision_map
    assert pm is not None and pm["format"] == cand.candidate.spec.low_format
    assert pm["gpu"] == DEFAULT_GPU[pm["format"]] and "prediction" in pm["speedup_is"]
    layers = {x["name"]: x for x in pm["layers"]}
    # 'head' (16 out features) takes no 32-element MXFP8 blocks; fp8 takes every Linear here
    expected = ["embed", "mix", "hidden", "head"] if policy == "fp8-rowwise" else ["embed", "mix", "hidden"]
    assert list(layers) == expected
    batch = result.batch_size
    assert layers["mix"]["m"] == batch and (layers["mix"]["k"], layers["mix"]["n"]) == (128, 64)
    worst = min(layers.values(), key=lambda x: x["operand_sqnr_db"])
    assert worst["name"] == "mix"
    assert all(
        x["operand_sqnr_db"] > layers["mix"]["operand_sqnr_db"] + 10 for n, x in layers.items() if n != "mix"
    )
    assert 0.0 < pm["low_share_mapped"] < pm["low_share_whole"] <= 1.0

    # the shares from the architecture: embed's input needs no gradient (no dgrad), mix's weight
    # is frozen (no wgrad), the rest run all three GEMMs of 2*M*K*N FLOPs each
    runs = {"embed": 2, "mix": 2, "hidden": 3, "head": 3}
    shapes = {"embed": (32, 96), "mix": (128, 64), "hidden": (64, 64), "head": (64, 16)}
    flops = {n: 2.0 * batch * k * out * runs[n] for n, (k, out) in shapes.items()}
    assert pm["step_flops"] == pytest.approx(sum(flops.values()))  # only the Linear GEMMs count
    whole = sum(flops[n] for n in expected) / pm["step_flops"]
    assert pm["low_share_whole"] == pytest.approx(whole)
    kept = {"mix": flops["mix"] if cand.fix_keep_bf16 == ["mix"] else flops["mix"] / 2}
    assert pm["low_share_mapped"] == pytest.approx(whole - kept["mix"] / pm["step_flops"])
    assert layers["embed"]["low_directions"] == ["forward", "wgrad"]
    assert layers["hidden"]["low_directions"] == ["dgrad", "forward", "wgrad"]
    assert layers["mix"]["low_directions"] == ([] if cand.fix_keep_bf16 == ["mix"] else ["dgrad"])
    # the layers are tiny: the roofline says none of those still in the format gains from it
    assert set(pm["no_gain"]) == {n for n, x in layers.items() if x["low_directions"]}


def test_bf16_mixed_passes_on_the_outliers(result):
    cand = _by(result, "bf16-mixed")
    assert cand.verdict == "pass", cand.reason
    assert cand.precision_map is None and cand.fix_keep_bf16 == []


def test_the_map_survives_json(result):
    cand = _by(result, "mxfp8")
    back = CandidateCheck.from_dict(json.loads(json.dumps(cand.to_dict())))
    assert back.fix_keep_bf16 == cand.fix_keep_bf16 and back.precision_map == cand.precision_map
    assert back.candidate == cand.candidate


@pytest.mark.parametrize("policy", LOW)
def test_the_verified_map_is_a_fix_in_a_plain_training_run(result, policy):
    cand = _by(result, policy)
    w = mixprec.load_workload(EXAMPLE)
    batches = make_batches(w, result.batch_size, torch.device("cpu"), 0, STEPS)
    ref = run_trajectory(w, mixprec.get_policy("fp32", device="cpu"), batches, STEPS)
    fixed = Candidate(policy, keep_bf16=tuple(cand.fix_keep_bf16))
    mapped = run_trajectory(w, mixprec.get_policy(fixed, device="cpu", check=False), batches, STEPS)
    whole = run_trajectory(w, mixprec.get_policy(policy, device="cpu", check=False), batches, STEPS)
    limit = cand.thresholds["max_rel_loss_diff"]
    assert mapped.error is None and all(mapped.stepped)
    assert _max_rel_loss_diff(ref, mapped) <= limit
    assert whole.error is None and _max_rel_loss_diff(ref, whole) > limit  # the map is what fixed it
    # the map's run learns as fp32 does; the whole-model run cannot ('mix' passes nothing on)
    assert mapped.losses[-1] < mapped.losses[0] and ref.losses[-1] < ref.losses[0]


# ---------------------------------------------------------------------------- field rules
class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 32)
        self.first = nn.Linear(32, 32)
        self.proj = nn.Linear(32, 64, bias=False)
        self.proj.weight = self.wte.weight  # tied, but not the last Linear to run
        self.mid = nn.Linear(64, 64)
        self.last = nn.Linear(64, 32)


def test_field_rules_keep_the_first_and_last_linear_and_a_tied_head():
    w = types.SimpleNamespace(model=_LM())
    layers = ["first", "proj", "mid", "last"]
    assert field_rules(w, layers) == ["first", "last", "proj"]
    assert field_rules(w, ["mid"]) == ["mid"]  # first and last are one layer: named once
    assert field_rules(w, []) == []
    assert field_rules(w, ["first", "mid", "last"]) == ["first", "last"]  # the tied one is not a layer here
    untied = _LM()
    untied.proj.weight = nn.Parameter(untied.wte.weight.detach().clone())
    assert field_rules(types.SimpleNamespace(model=untied), layers) == ["first", "last"]
    assert field_rules(types.SimpleNamespace(), layers) == ["first", "last"]  # another framework's


# ---------------------------------------------------------------------------- roofline
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4"])
def test_a_large_layer_gains_in_every_format_a_tiny_one_does_not(fmt):
    big = estimate(4096, 4096, 4096, fmt)
    small = estimate(64, 64, 64, fmt)
    assert big.gpu == DEFAULT_GPU[fmt] and small.gpu == big.gpu
    assert big.speedup > 1.0
    assert small.speedup < 1.0  # the casts cost more than the GEMMs save
    assert big.bf16_s > 0 and big.low_s > 0


def test_nvfp4_gains_more_than_mxfp8_on_a_large_layer():
    for shape in ((4096, 4096, 4096), (8192, 8192, 28672), (16384, 4096, 4096)):
        assert estimate(*shape, "nvfp4").speedup >= estimate(*shape, "mxfp8").speedup, shape


def test_the_roofline_grows_with_the_layer():
    sizes = [estimate(n, n, n, "mxfp8").speedup for n in (64, 256, 1024, 4096)]
    assert sizes == sorted(sizes)


def test_an_unknown_gpu_is_refused_naming_the_known_ones():
    with pytest.raises(UsageError, match="A100") as info:
        estimate(4096, 4096, 4096, "fp8", gpu="A100")
    for gpu in ("H100", "H200", "B200"):
        assert gpu in str(info.value)
    with pytest.raises(UsageError, match="known GPUs for it: B200"):
        estimate(4096, 4096, 4096, "nvfp4", gpu="H100")  # no fp4 tensor cores before Blackwell


def test_an_unknown_format_is_refused():
    with pytest.raises(UsageError, match="'int8'"):
        estimate(4096, 4096, 4096, "int8")


def test_an_unknown_format_is_refused_naming_the_known_formats():
    for fmt, gpu in (("bf16", "H100"), ("int8", None), ("fp4", "B200")):
        with pytest.raises(UsageError) as info:
            estimate(4096, 4096, 4096, fmt, gpu=gpu)
        for known in ("fp8", "mxfp8", "nvfp4"):
            assert known in str(info.value), (fmt, str(info.value))


def test_mxfp8_has_no_roofline_before_blackwell():
    for gpu in ("H100", "H200"):
        with pytest.raises(UsageError, match="B200"):
            estimate(4096, 4096, 4096, "mxfp8", gpu=gpu)


# ---------------------------------------------------------------------------- fp32 islands
@pytest.fixture(scope="module")
def island_result():
    """mxfp8 with the outlier layer an fp32 island instead of mapped to bf16."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = mixprec.load_workload(EXAMPLE)
        return check(w, policies=[Candidate("mxfp8", keep_fp32=("mix",))], steps=4, device="cpu")
    finally:
        torch.set_num_threads(before)


def test_an_fp32_island_on_the_outlier_layer_passes_too(island_result):
    cand = island_result.candidates[0]
    assert cand.label == "mxfp8+fp32[mix]"
    assert cand.verdict == "pass", cand.reason
    assert cand.precision_map is not None


def test_an_fp32_island_is_not_reported_as_running_in_the_format(island_result):
    pm = island_result.candidates[0].precision_map
    names = [x["name"] for x in pm["layers"]]
    assert "mix" not in names, pm["layers"]
    assert names == ["embed", "hidden"]


def test_tune_on_a_cpu_predicts_the_low_formats_and_their_verified_maps():
    """tune cannot time fp8 or the block formats on a CPU: it predicts them, and where one fails
    whole-model it says which precision map would make it pass, verified."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # a budget this tune cannot spend (eager, the stock optimizer): every prediction and its
        # map search fit whatever this machine's speed (python benchmarks/budget_fits.py --only
        # precision-map-predictions times it at the 120 s it had)
        result = mixprec.tune(
            mixprec.load_workload(EXAMPLE),
            budget_s=3600,
            compile_modes=(),
            optimizers=False,
            lint=False,
            device="cpu",
        )
    finally:
        torch.set_num_threads(before)
    notes = " ".join(result.notes)
    assert "fp8-rowwise would fail the numerics check on an fp8 GPU" in notes
    assert "fp8-rowwise" in notes and "keep_bf16=['mix'] it would pass (verified over" in notes
    assert "mxfp8 would fail" in notes and "keep_bf16=['mix:forward'] it would pass" in notes
    assert result.recommendation is not None and result.recommendation.candidate.spec.low_format is None


# ---------------------------------------------------------------------------- the search itself
def _fake_run(calls: list, whole_only_over: int):
    """A run where keeping X whole passes, and a single direction of X passes only the short trials
    (``steps <= whole_only_over``): a map narrowed too far, which only the whole run can see."""
    figures = types.SimpleNamespace(
        max_rel_loss_diff=0.0,
        output_sqnr_db=0.0,
        min_grad_sqnr_db=0.0,
        total_grad_sqnr_db=0.0,
        skipped_steps=0,
    )

    def run(entries, steps):
        calls.append((list(entries), steps))
        ok = "X" in entries or (any(e.startswith("X:") for e in entries) and steps <= whole_only_over)
        return ok, "matches" if ok else "loss drift", figures

    return run


def _space(directions=()):
    from mixprec.numerics.fix import MapSpace

    return MapSpace(layers=["A", "B", "X", "C"], rules=["A", "C"], suspects=["X"], directions=directions)


def _trials(budget):
    from mixprec.numerics.fix import Trials

    return Trials(steps=20, search_steps=4, budget=budget, stage=lambda text: None)


def test_a_narrowed_layer_that_fails_the_whole_run_is_widened_back_not_grown_around():
    from mixprec.budget import Budget
    from mixprec.numerics.fix import search_precision_map

    calls: list = []
    result = CandidateCheck(candidate=Candidate("mxfp8"), verdict="fail", reason="")
    search_precision_map(
        _fake_run(calls, whole_only_over=4),
        Candidate("mxfp8"),
        result,
        _space(("wgrad", "dgrad", "forward")),
        _trials(Budget.unlimited()),
    )
    assert result.fix_keep_bf16 == ["X"] and result.fix_verified
    assert sum(steps == 20 for _, steps in calls) == 2  # the narrowed map, then X whole


@pytest.mark.parametrize("how", ["spent", "stopped"])
def test_a_search_out_of_time_says_so_rather_than_blaming_the_model(how):
    """Spent, or stopped by the budget's stop (a signal): the search took a float deadline and never
    polled the stop."""
    from mixprec.budget import Budget
    from mixprec.numerics.fix import search_precision_map

    budget = Budget(0.001) if how == "spent" else Budget(3600, stop=lambda: True)
    time.sleep(0.01)
    result = CandidateCheck(candidate=Candidate("mxfp8"), verdict="fail", reason="")
    search_precision_map(
        _fake_run([], whole_only_over=0), Candidate("mxfp8"), result, _space(), _trials(budget)
    )
    assert "time budget spent" in result.fix_note and "outside the Linear" not in result.fix_note


# ---------------------------------------------------------------------------- the census
def _census(model: nn.Module, policy: str = "mxfp8", loss=None):
    from mixprec.frameworks.torch.linears import census

    workload = mixprec.Workload(
        model=model,
        make_batch=lambda n, device: torch.randn(n, 64, device=device),
        loss_fn=loss or (lambda m, x: m(x).pow(2).mean()),
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1),
        name="census",
    )
    return census(workload, Candidate(policy).spec, torch.randn(32, 64), "cpu")


def test_the_census_survives_in_place_ops_after_a_linear():
    """A module backward hook raised 'a view ... is being modified inplace' on ReLU(inplace=True)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(inplace=True), nn.Linear(64, 64))
    found = _census(model)
    assert set(found.shapes) == {"0", "2"} and found.directions["2"] == {"forward", "dgrad", "wgrad"}
    assert all(math.isfinite(v) for v in found.sqnr_db.values())


class _Looped(nn.Module):
    """One cell applied four times (an RNN cell, ALBERT's shared layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = torch.tanh(self.cell(x))
        return x


def test_the_census_counts_every_call_of_a_reused_linear():
    found = _census(_Looped())
    assert found.shapes["cell"] == (4 * 32, 64, 64)
    assert found.low_share(found.directions) == pytest.approx(1.0, rel=0.02)  # the step is the cell


def test_the_census_counts_no_backward_gemm_for_a_linear_run_under_no_grad():
    teacher, student = nn.Linear(64, 64), nn.Linear(64, 64)
    model = nn.ModuleDict({"teacher": teacher, "student": student})

    def loss(m, x):
        with torch.no_grad():
            target = m["teacher"](x)
        return (m["student"](x) - target).pow(2).mean()

    found = _census(model, loss=loss)
    assert found.directions["teacher"] == {"forward"}
    assert found.low_share(found.directions) <= 1.0


def test_the_cli_checks_a_map_again_and_refuses_one_naming_no_linear(tmp_path, capsys):
    from mixprec.cli import main

    out = tmp_path / "check.json"
    argv = ["check", "--workload", EXAMPLE, "--device", "cpu", "--steps", "4", "--json", str(out)]
    assert main([*argv, "--policies", "bf16-mixed,mxfp8", "--keep-bf16", "mix:forward"]) == 0
    labels = {c["label"]: c["verdict"] for c in json.loads(out.read_text())["candidates"]}
    assert labels == {"bf16-mixed": "pass", "mxfp8+bf16[mix:forward]": "pass"}  # the map is mxfp8's only
    assert main([*argv, "--policies", "mxfp8", "--keep-bf16", "nope"]) == 2
    assert "'nope' matches no Linear" in capsys.readouterr().err
