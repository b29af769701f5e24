"""``tune --policies``: the precisions tune chooses among. Strict fp32 is measured whatever is named
(every row is paired with it); the rest of the table says why the others were not tried; a name that
is not a policy, or one this device cannot run, is refused before anything runs."""

from __future__ import annotations

import pytest

import mixprec
import mixprec.tuning.run as run_module
from mixprec.cli import main
from mixprec.errors import PolicyError
from mixprec.tuning.config import TuneConfig


def test_policies_are_canonical_names_and_a_bad_one_is_refused_before_anything_runs(monkeypatch):
    assert TuneConfig().policy_names == list(mixprec.POLICY_NAMES)
    config = TuneConfig(policies="bf16, fp16-mixed")
    assert config.policy_names == ["bf16-mixed", "fp16-mixed"]
    assert config.to_dict()["policies"] == ["bf16-mixed", "fp16-mixed"]
    assert TuneConfig(policies=["bf16-mixed"]).policies == ("bf16-mixed",)
    monkeypatch.setattr(run_module, "framework_of", lambda w: pytest.fail("tune ran"))
    with pytest.raises(PolicyError, match=r"Unknown policy 'bf16-mixd'.*Did you mean 'bf16-mixed'"):
        mixprec.tune(object(), policies="bf16-mixd")


def test_the_autotune_cache_tells_two_policy_sets_apart():
    import torch

    from mixprec.tuning.cache import autotune_key

    workload = mixprec.load_workload("mlp")
    options = ({}, {"policies": "bf16-mixed"}, {"policies": ("bf16-mixed", "fp16-mixed")})
    keys = {autotune_key(workload, torch.device("cpu"), None, o) for o in options}
    assert len(keys) == 3


def test_tune_measures_fp32_and_the_named_policies_only(monkeypatch):
    """Work bounded by what is named, not by the clock: a budget this tune cannot spend."""
    import mixprec.tuning.search as search_module

    real_sweep = search_module.run_sweep
    swept: list[str] = []

    def recorded(workload, framework, config, **kwargs):
        swept.extend(c.label for c in config.candidates)
        return real_sweep(workload, framework, config, **kwargs)

    monkeypatch.setattr(search_module, "run_sweep", recorded)
    result = mixprec.tune(
        mixprec.load_workload("mlp"), policies=("bf16-mixed",), budget_s=3600, steps=2, warmup=1,
        check_steps=3, device="cpu", lint=False, compile_modes=(), optimizers=False,
    )  # fmt: skip
    assert set(swept) == {"fp32", "bf16-mixed"}, swept
    rows = {r.label: r for r in result.bench.rows if not r.baseline_repeat}
    assert rows["fp32"].status == "ok" and rows["bf16-mixed"].status in ("ok", "pruned")
    # nothing outside the set has a row, is checked or predicted (fp8's numerics on a CPU are
    # predicted by default): the ones left out are named once, in a note
    assert {r.candidate.policy for r in result.bench.rows} == {"fp32", "bf16-mixed"}
    checked = result.check.candidates if result.check is not None else []  # (none: bf16 pruned)
    assert {c.candidate.policy for c in checked} <= {"bf16-mixed"}
    assert {r.candidate.policy for r in result.ranked} == {"fp32", "bf16-mixed"}
    (note,) = [n for n in result.notes if "not among the policies tune was given" in n]
    assert note.endswith(
        ": tf32, bf32, fp16-mixed, bf16-true, fp16-true, fp8-rowwise, fp8-tensorwise, mxfp8, nvfp4"
    )
    assert result.budget_exhausted is None


@pytest.mark.parametrize(
    ("policies", "code", "said"),
    [
        ("bf16-mixd", 2, "Unknown policy 'bf16-mixd'; valid: fp32, tf32"),
        ("tf32", 3, "--policies names 'tf32', which is not supported on cpu"),
    ],
)
def test_the_command_line_refuses_a_bad_or_unsupported_policy_in_one_line(policies, code, said, capsys):
    assert main(["tune", "--model", "mlp", "--device", "cpu", "--policies", policies]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
