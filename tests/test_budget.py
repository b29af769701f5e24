"""The one Budget of bench, check and tune: shares, the reserve, can-pay, cuts and a stop."""

from __future__ import annotations

import math
import time

import pytest

from mixprec.budget import Budget
from mixprec.errors import UsageError


def test_a_share_ends_early_on_the_same_clock_and_keeps_the_reserve():
    budget = Budget(100.0, reserve_s=10.0, start=time.perf_counter())
    first = budget.share(0.45)
    assert first.deadline == pytest.approx(budget.start + 45.0)
    assert budget.deadline == pytest.approx(budget.start + 90.0)  # the reserve is kept back
    assert first.whole().deadline == pytest.approx(budget.deadline)
    assert budget.can_pay(60.0) and not budget.can_pay(95.0)


def test_cuts_are_shared_by_every_share_and_can_be_restored():
    budget = Budget(10.0)
    budget.share(0.5).cut("the numerics of fp16-mixed")
    budget.cut("the numerics of fp16-mixed")
    assert budget.cuts == ["the numerics of fp16-mixed"]
    budget.restore("the numerics of fp16-mixed")
    assert budget.cuts == []


def test_a_stop_expires_it_and_an_unlimited_one_never_does():
    stop = [False]
    budget = Budget(60.0, stop=lambda: stop[0])
    assert not budget.expired()
    stop[0] = True
    assert budget.expired() and not budget.can_pay(0.0)
    forever = Budget.unlimited()
    assert forever.seconds == math.inf and not forever.expired() and forever.can_pay(1e9)
    past = Budget(1.0, start=time.perf_counter() - 5)
    assert past.expired() and past.left() < 0


@pytest.mark.parametrize("bad", [0, -1, "60", True, float("nan")])
def test_a_budget_that_is_no_number_of_seconds_is_refused(bad):
    with pytest.raises(UsageError, match="budget must be a number of seconds > 0"):
        Budget(bad)


def test_a_cut_of_fp32_work_alone_does_not_count_against_a_lower_precision():
    """The exit-5 rule's input: a cut known to keep back fp32's own work (its compiles) cannot have
    kept a lower precision from the pick; any other cut may have, and so does one said both ways."""
    budget = Budget(60.0)
    share = budget.share(0.5)
    share.cut("compiled candidates were not measured", fp32_only=True)
    assert budget.cuts == ["compiled candidates were not measured"] and not budget.cut_a_lower_precision
    budget.whole().cut("the numerics of bf16-mixed were not checked")
    assert budget.cut_a_lower_precision
    budget.restore("the numerics of bf16-mixed were not checked")
    assert not budget.cut_a_lower_precision
    budget.keeping(5.0).cut("compiled candidates were not measured")  # (a lower precision's compile too)
    assert budget.cut_a_lower_precision
