"""The argument checks every config shares (mixprec.validation): each bad value is one UsageError
that names the argument and the value and says what is valid."""

from __future__ import annotations

import math

import pytest

from mixprec import validation
from mixprec.errors import UsageError


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
