"""TuneConfig: a BenchConfig and a CheckConfig plus tune's own settings; the keyword API's flat names
map onto the nested configs, and a bad value is refused before anything runs."""

from __future__ import annotations

import pytest

import mixprec
import mixprec.tuning.run as run_module
from mixprec.errors import UsageError
from mixprec.tuning.config import TuneConfig


def test_flat_keyword_names_reach_the_nested_configs():
    config = TuneConfig().with_fields(
        steps=2, warmup=1, batch_size=8, device="cpu", check_steps=3, fix=False, train_steps=500, budget_s=60
    )
    assert (config.bench.steps, config.bench.warmup, config.bench.batch_size, config.device) == (
        2,
        1,
        8,
        "cpu",
    )
    assert (config.check.steps, config.check.fix, config.train_steps) == (3, False, 500)
    assert config.budget_s == 60
    assert TuneConfig().bench.steps == 4 and TuneConfig().check.steps == 6 and TuneConfig().check.fix


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"budget_s": 0}, "budget must be a finite number of seconds > 0, got 0"),
        ({"budget_s": True}, "budget must be a finite number of seconds > 0, got True"),
        ({"noise": 2}, r"noise must be a number in \[0, 1\)"),
        ({"batch": "max"}, "batch must be 'auto'"),
        ({"memory_budget": "1GiB"}, "apply to batch='auto'"),
        ({"train_steps": 0}, "train_steps must be an integer >= 1, got 0"),
        ({"check_steps": 0}, "^check_steps must be an integer >= 1, got 0"),
        ({"steps": 0}, "^steps must be an integer >= 1, got 0"),
        ({"stepz": 3}, r"tune\(\) has no setting 'stepz'. Did you mean 'steps'\? Valid: .*check_steps"),
    ],
)
def test_a_bad_setting_is_refused_before_anything_runs(fields, message, monkeypatch):
    monkeypatch.setattr(run_module, "framework_of", lambda w: pytest.fail("tune ran"))
    with pytest.raises(UsageError, match=message):
        mixprec.tune(object(), **fields)


def test_one_device_for_measuring_and_checking():
    with pytest.raises(UsageError, match="one device"):
        TuneConfig(bench=mixprec.BenchConfig(device="cpu"), check=mixprec.CheckConfig(device="cuda"))


def test_check_config_takes_names_or_a_comma_separated_string():
    assert mixprec.CheckConfig(policies="bf16-mixed, fp16-mixed").policies == ("bf16-mixed", "fp16-mixed")
    assert mixprec.CheckConfig(policies=["bf16-mixed"], emulate="bf16").emulate == ("bf16",)
    with pytest.raises(UsageError, match="fix must be True or False"):
        mixprec.CheckConfig(fix="yes")
    with pytest.raises(UsageError, match=r"check\(\) has no setting 'step'. Did you mean 'steps'"):
        mixprec.check(object(), step=3)
