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
