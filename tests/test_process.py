"""Process plumbing (mixprec.process): a signal that lands while a candidate's process starts waits
for the start to finish, then reaches the handler it had."""

from __future__ import annotations

import os
import signal
import time

from mixprec.process import signals_deferred


def test_a_sigterm_during_the_block_reaches_its_handler_after_it():
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # (Python runs a handler between bytecodes: it had the chance)
            inside = list(got)
        assert inside == [] and got == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)  # the handler is back in place after the block
        time.sleep(0.05)
        assert got == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_interrupt_raised_by_the_handler_comes_out_of_the_block():
    import pytest

    with pytest.raises(KeyboardInterrupt), signals_deferred():
        os.kill(os.getpid(), signal.SIGINT)  # Python's own handler raises KeyboardInterrupt
        time.sleep(0.05)
        ran_on = True
    assert ran_on  # the block itself ran to its end


def test_the_gloo_workers_are_found_by_name_and_waited_for_until_asleep(tmp_path):
    """A real one-rank gloo group in this process: its worker threads carry the name the wait looks
    for (if torch renamed them, the wait would return at once and guard nothing), they are asleep
    after a collective, and gone once the group is destroyed with nothing else holding it."""
    from datetime import timedelta

    import pytest
    import torch
    import torch.distributed as dist

    from mixprec.process import gloo_worker_states, let_gloo_workers_finish

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    before = len(gloo_worker_states())
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        assert len(gloo_worker_states()) > before
        dist.all_reduce(torch.ones(3))
        assert let_gloo_workers_finish(timeout_s=10.0)
        assert set(gloo_worker_states()) == {"S"}
    finally:
        dist.destroy_process_group()
    assert len(gloo_worker_states()) == before


def test_the_wait_needs_two_asleep_looks_in_a_row_and_gives_up_at_its_timeout(monkeypatch):
    import mixprec.process as process

    looks = iter([["S", "R"], ["S", "S"], ["R", "S"], ["S", "S"], ["S", "S"]])
    seen: list[list[str]] = []

    def states() -> list[str]:
        seen.append(next(looks))
        return seen[-1]

    monkeypatch.setattr(process, "gloo_worker_states", states)
    assert process.let_gloo_workers_finish(timeout_s=10.0, look_every_s=0.0)
    assert len(seen) == 5  # the asleep look between two running ones did not count
    monkeypatch.setattr(process, "gloo_worker_states", lambda: ["R"])
    started = time.monotonic()
    assert not process.let_gloo_workers_finish(timeout_s=0.05, look_every_s=0.001)
    assert time.monotonic() - started < 5.0  # (it gave up; no timing claim beyond that)
    monkeypatch.setattr(process, "gloo_worker_states", list)
    assert process.let_gloo_workers_finish()  # none: at once
