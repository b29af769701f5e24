"""The suite's own order under pytest-xdist (tests/suite_order.py)."""

from __future__ import annotations

import suite_order


def test_each_workers_first_send_is_balanced_and_runs_longest_first():
    seconds = {"a": 60.0, "b": 50.0, "c": 30.0, "d": 20.0, "e": 5.0, "f": 2.0}
    ids = ["f", "x", "a", "y", "b", "c", "z", "d", "e"]  # x, y, z unknown: 1 s each
    order = suite_order.longest_first(ids, ids, 2, seconds)
    assert sorted(order) == sorted(ids)  # a permutation
    sizes = suite_order.first_sends(len(ids), 2)
    assert sizes == [4, 5]  # what worksteal sends each worker first: 9 // 2, then the rest
    runs = [order[: sizes[0]], order[sizes[0] :]]
    times = [[seconds.get(i, 1.0) for i in run] for run in runs]
    assert all(t == sorted(t, reverse=True) for t in times)  # longest first on each worker
    assert {runs[0][0], runs[1][0]} == {"a", "b"}  # the two longest start at once, one per worker
    assert abs(sum(times[0]) - sum(times[1])) <= 60.0


def test_without_workers_or_durations_the_collection_order_stays():
    ids = ["b", "a", "c"]
    assert suite_order.longest_first(ids, ids, 1, {"a": 9.0}) == ids
    assert suite_order.longest_first(ids, ids, 2, {}) == ids  # all unknown: ties keep the order
