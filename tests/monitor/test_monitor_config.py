"""MonitorConfig: one frozen, keyword-only config checked once, that the Monitor takes whole or
field by field, and that names the sink's new name to a caller of the old one."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import textwrap

import pytest
from torch import nn

from mixprec.errors import UsageError
from mixprec.monitor import Monitor, MonitorConfig
from mixprec.monitor.detectors import Drift, detectors_for


def test_the_config_is_frozen_keyword_only_and_documented():
    config = MonitorConfig(every=20, rescue=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.every = 10  # type: ignore[misc]
    with pytest.raises(TypeError):
        MonitorConfig(20)  # type: ignore[misc]
    body = ast.parse(textwrap.dedent(inspect.getsource(MonitorConfig))).body[0].body  # type: ignore[attr-defined]
    documented = {
        node.target.id
        for node, after in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
    }  # fmt: skip
    assert documented == {f.name for f in dataclasses.fields(MonitorConfig)}  # a docstring under each


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"every": 0}, "every must be an integer >= 1, got 0"),
        ({"shadow_every": 1.5}, "shadow_every must be an integer >= 0, got 1.5"),
        ({"rescue": "yes"}, "rescue must be True or False, got 'yes'"),
        ({"train_steps": True}, "train_steps must be an integer >= 1, got True"),
        ({"hold": -1}, "hold must be an integer >= 0, got -1"),
        ({"max_rescues": None}, "max_rescues must be an integer >= 0, got None"),
        ({"snapshot_every": -5}, "snapshot_every must be an integer >= 0, got -5"),
        (
            {"schedule": {-1: "fp32"}},
            r"schedule keys must be steps or fractions of train_steps \(>= 0\), got -1",
        ),
        ({"schedule": {0.5: 16}}, "schedule values are policy names, got 16"),
    ],
)
def test_a_bad_field_is_one_line_when_the_config_is_made(fields, message):
    with pytest.raises(UsageError, match=message):
        MonitorConfig(**fields)


def test_the_monitor_takes_the_config_whole_or_field_by_field():
    model = nn.Linear(2, 2)
    config = MonitorConfig(every=20, train_steps=500)
    monitor = Monitor(model, config=config, rescue=True)
    assert monitor.config == MonitorConfig(every=20, train_steps=500, rescue=True)
    assert config.rescue is False and monitor.every == 20  # the given config is left as it was
    monitor.close()
    with pytest.raises(UsageError, match="config must be a MonitorConfig, got dict"):
        Monitor(model, config={"every": 20})  # type: ignore[arg-type]


def test_an_unknown_field_lists_the_valid_ones_and_the_old_sink_name_points_to_the_new():
    model = nn.Linear(2, 2)
    with pytest.raises(
        UsageError, match=r"Monitor\(\) has no setting 'evry'. Did you mean 'every'\? Valid: every, "
    ):
        Monitor(model, evry=20)
    with pytest.raises(UsageError, match=r"'events' \(the findings sink is findings= now\)"):
        Monitor(model, events="run.jsonl")
    assert getattr(model, "_mixprec_monitor", None) is None


def test_to_dict_is_json():
    config = MonitorConfig(every=20, schedule={0.9: "fp32", 100: "bf16-mixed"})
    data = json.loads(json.dumps(config.to_dict()))
    assert data["every"] == 20 and data["schedule"] == {"0.9": "fp32", "100": "bf16-mixed"}
    assert set(data) == {f.name for f in dataclasses.fields(MonitorConfig)}


def test_the_detectors_are_composed_from_the_config():
    names = [type(d).__name__ for d in detectors_for(MonitorConfig())]
    assert names == ["PoisonedWeights", "BadBatch", "Overflow", "PredictedRange", "Stall", "Spike"]
    assert "Spike" not in [type(d).__name__ for d in detectors_for(MonitorConfig(spikes=False))]
    assert isinstance(detectors_for(MonitorConfig(shadow_every=50))[-1], Drift)  # only when asked for
