"""Process plumbing (mixprec.process): a signal that lands while a candidate's process starts waits
for the start to finish, then reaches the handler it had."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

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
    with pytest.raises(KeyboardInterrupt), signals_deferred():
        os.kill(os.getpid(), signal.SIGINT)  # Python's own handler raises KeyboardInterrupt
        time.sleep(0.05)
        ran_on = True
    assert ran_on  # the block itself ran to its end


def test_the_gloo_workers_are_found_by_name_and_gone_with_their_group(one_gloo_rank):
    """The workers carry the name the wait looks for (renamed by torch, the wait would return at
    once and guard nothing); after a collective they look idle; once the group is destroyed with
    nothing else holding it, they are gone."""
    import torch
    import torch.distributed as dist

    from mixprec.process import gloo_workers, let_gloo_workers_finish

    before = one_gloo_rank
    dist.all_reduce(torch.ones(3))  # (after it: a worker ran it, so it has named itself)
    assert set(gloo_workers()) > before
    assert let_gloo_workers_finish(timeout_s=10.0)
    dist.destroy_process_group()
    assert set(gloo_workers()) == before


@pytest.mark.usefixtures("one_gloo_rank")
def test_a_worker_running_python_is_waited_for():
    """A worker thread that runs Python (a future's callback, as a DDP comm hook's is): the wait
    returns after the callback, not while it runs (a wait that returned at once would fail here;
    the rule for a worker asleep on the GIL is pinned by the planted looks below)."""
    import torch
    import torch.distributed as dist

    from mixprec.process import gloo_workers, let_gloo_workers_finish

    seen: dict[str, float] = {}

    def busy(future):
        seen["thread"] = threading.get_native_id()
        started = time.monotonic()
        while time.monotonic() - started < 0.5:  # Python, for 0.5 s: the GIL, taken and given back
            pass
        seen["ended"] = time.monotonic()
        return future.value()

    # the workers kept busy a moment first (one-rank all-gathers of 16M floats: copies), so the
    # small collective completes on a worker after .then attached its callback, not before
    large = torch.ones(2**24)
    held = [dist.all_gather([torch.empty_like(large)], large, async_op=True) for _ in range(4)]
    future = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(busy)
    while "thread" not in seen:
        time.sleep(0.001)
    assert str(seen["thread"]) in gloo_workers(), "the callback ran outside gloo's workers"
    assert let_gloo_workers_finish(timeout_s=10.0)
    assert "ended" in seen  # (it returned after the callback's 0.5 s, not during them)
    future.wait()
    for work in held:
        work.wait()


def test_the_wait_wants_a_quiet_window_and_gives_up_at_its_timeout(monkeypatch):
    """Planted looks: a worker counts as idle only asleep with no context switch between two
    looks; one that keeps switching (a GIL waiter wakes every switch interval) or runs is waited
    for until the timeout."""
    import mixprec.process as process

    looks = iter([{"1": ("S", 5)}, {"1": ("S", 6)}, {"1": ("R", 7)}, {"1": ("S", 8)}, {"1": ("S", 8)}])
    seen: list[dict] = []

    def workers() -> dict:
        seen.append(next(looks))
        return seen[-1]

    monkeypatch.setattr(process, "gloo_workers", workers)
    monkeypatch.setattr(process.sys, "getswitchinterval", lambda: 0.0)
    assert process.let_gloo_workers_finish(timeout_s=10.0)
    assert len(seen) == 5  # asleep at 5 and 6, but it switched between: not yet
    counter = iter(range(10**9))
    monkeypatch.setattr(process, "gloo_workers", lambda: {"1": ("S", next(counter))})
    assert not process.let_gloo_workers_finish(timeout_s=0.05)
    monkeypatch.setattr(process, "gloo_workers", lambda: {"1": ("R", 0)})
    assert not process.let_gloo_workers_finish(timeout_s=0.05)
    monkeypatch.setattr(process, "gloo_workers", dict)
    assert process.let_gloo_workers_finish()  # none: at once
