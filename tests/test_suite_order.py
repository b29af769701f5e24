"""The suite's own order under pytest-xdist (tests/suite_order.py)."""

from __future__ import annotations

import suite_order


def test_each_workers_first_send_is_balanced_runs_longest_first_and_keeps_modules_whole():
    seconds = {"a.py::1": 60.0, "a.py::2": 5.0, "b.py::1": 50.0, "c.py::1": 30.0, "d.py::1": 20.0}
    ids = ["e.py::1", "a.py::1", "a.py::2", "b.py::1", "c.py::1", "d.py::1", "f.py::1", "f.py::2"]
    order = suite_order.longest_first(ids, ids, 2, seconds)  # e, f unknown: 1 s a test
    assert sorted(order) == sorted(ids)  # a permutation
    assert suite_order.first_sends(len(ids), 2) == [4, 4]  # what worksteal sends each worker first
    runs = [order[:4], order[4:]]
    assert {runs[0][0], runs[1][0]} == {"a.py::1", "b.py::1"}  # the two longest start at once
    assert order.index("a.py::2") == order.index("a.py::1") + 1  # a module whole, in its own order
    assert order.index("f.py::2") == order.index("f.py::1") + 1
    module_cost = [[seconds.get(i, 1.0) for i in run if i.endswith("::1")] for run in runs]
    assert all(c == sorted(c, reverse=True) for c in module_cost)  # longest modules first
    times = [sum(seconds.get(i, 1.0) for i in run) for run in runs]
    assert abs(times[0] - times[1]) <= 20.0


def test_without_workers_or_durations_the_collection_order_stays():
    ids = ["b.py::1", "a.py::1", "c.py::1"]
    assert suite_order.longest_first(ids, ids, 1, {"a.py::1": 9.0}) == ids
    assert suite_order.longest_first(ids, ids, 2, {}) == ids  # all unknown: ties keep the order
