"""The argument checks every config shares (mixprec.validation): each bad value is one UsageError
that names the argument and the value and says what is valid."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

import mixprec
from mixprec import validation
from mixprec.checking.config import CheckConfig
from mixprec.errors import UsageError
from mixprec.measure.config import BenchConfig
from mixprec.monitor.config import MonitorConfig
from mixprec.tuning.config import TuneConfig


@pytest.mark.parametrize(
    ("check", "value", "message"),
    [
        (lambda v: validation.positive_int("steps", v), 0, "steps must be an integer >= 1, got 0"),
        (lambda v: validation.positive_int("steps", v), True, "steps must be an integer >= 1, got True"),
        (lambda v: validation.positive_int("steps", v), 2.0, "steps must be an integer >= 1, got 2.0"),
        (lambda v: validation.positive_int("hold", v, zero_ok=True), -1, "hold must be an integer >= 0"),
        (lambda v: validation.positive_int("image_size", v, minimum=75), 32, ">= 75, got 32"),
        (
            lambda v: validation.seconds("min_time_s", v),
            -1,
            "min_time_s must be a finite number of seconds >= 0",
        ),
        (
            lambda v: validation.seconds("budget", v, zero_ok=False),
            0,
            "budget must be a finite number of seconds > 0",
        ),
        (lambda v: validation.seconds("budget", v), math.inf, "seconds >= 0, got inf"),
        (
            lambda v: validation.number_above("prune_factor", v, 1),
            1,
            "prune_factor must be a number > 1, got 1",
        ),
        (lambda v: validation.fraction("noise", v), 1.5, "noise must be a number in [0, 1), got 1.5"),
        (lambda v: validation.boolean("fix", v), "false", "fix must be True or False, got 'false'"),
        (lambda v: validation.one_of("compile", v, ("off", "on")), "sometimes", "valid: off, on"),
    ],
)
def test_a_bad_value_is_one_line_naming_it_and_what_is_valid(check, value, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        check(value)


def test_good_values_come_back_normalised():
    assert validation.positive_int("steps", 3) == 3
    assert validation.optional_positive_int("batch_size", None) is None
    assert validation.seconds("budget", 2) == 2.0 and isinstance(validation.seconds("budget", 2), float)
    assert validation.one_of("compile", "on", ("off", "on")) == "on"


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("16GiB", 16 * 2**30),
        ("512MB", 512 * 2**20),
        (" 2g ", 2 * 2**30),
        (4096, 4096),
        (2.5e9, 2_500_000_000),
    ],
)
def test_a_memory_size_is_bytes_from_a_number_or_as_users_write_it(value, size):
    assert validation.byte_size("memory_budget", value) == size


@pytest.mark.parametrize("bad", ["lots", "-1GiB", 0, -5, True, "8XB", math.inf])
def test_tune_config_refuses_a_bad_memory_budget_when_it_is_made(bad):
    """Named with the bad value, the forms that are valid and the fix, when the config is made (it
    was refused only once the micro-batch search started, by one of two copies of the check)."""
    with pytest.raises(UsageError) as err:
        TuneConfig(batch="auto", memory_budget=bad)
    message = str(err.value)
    assert message.startswith("memory_budget must be a number of bytes > 0 or a size such as '16GiB'")
    assert f"got {bad!r}; write it like memory_budget='16GiB'." in message
    assert TuneConfig(batch="auto", memory_budget="2GiB").memory_budget == 2 * 2**30  # held as bytes


def test_every_facade_refuses_an_unknown_field_in_the_same_words():
    """One with_fields behind bench, bench_batches, check, tune and the Monitor: the name, the closest
    valid one and the valid ones, before anything runs (tune and the Monitor had words of their own)."""
    facades = {
        "bench": lambda **kw: mixprec.bench(object(), **kw),
        "bench_batches": lambda **kw: mixprec.bench_batches(object(), [8, 16], **kw),
        "check": lambda **kw: mixprec.check(object(), **kw),
        "tune": lambda **kw: mixprec.tune(object(), **kw),
        "Monitor": lambda **kw: mixprec.Monitor(torch.nn.Linear(2, 2), **kw),
    }
    for command, call in facades.items():
        with pytest.raises(UsageError) as err:
            call(hodl=3)
        assert re.fullmatch(
            rf"{command}\(\) has no setting 'hodl'\.( Did you mean '\w+'\?)? Valid: [\w, ]+\.", str(err.value)
        )
        typo, meant = ("evry", "every") if command == "Monitor" else ("stepz", "steps")
        with pytest.raises(
            UsageError, match=rf"^{command}\(\) has no setting '{typo}'\. Did you mean '{meant}'\? Valid: "
        ):
            call(**{typo: 3})


def test_every_config_records_each_of_its_fields_as_json():
    for config in (BenchConfig(), CheckConfig(), TuneConfig(), MonitorConfig()):
        data = json.loads(json.dumps(config.to_dict()))
        assert list(data) == [f.name for f in dataclasses.fields(config)]
    assert TuneConfig().to_dict()["check"] == CheckConfig(steps=6, fix=True).to_dict()  # nested: its own
