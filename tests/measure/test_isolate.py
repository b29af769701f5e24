"""Candidate sessions in their own process and in this one: the same interface, failures as a
status (never a crash of the sweep), limits and stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from mixprec.frameworks import framework_named
from mixprec.frameworks.session import BenchSettings, HonestyError
from mixprec.measure.isolate import ChildSession, LocalSession, SessionEnded
from mixprec.policy import Candidate
from mixprec.workload import load_workload

SETTINGS = BenchSettings(device="cpu", batch_size=8, steps=2, warmup=1, threads=1, profile=False)
TORCH = framework_named("torch")


def child(candidate: Candidate, **kwargs) -> ChildSession:
    spec = load_workload("mlp").spec
    return ChildSession(
        spec, candidate, SETTINGS, build=TORCH.session_builder(), preload=TORCH.preload(spec), **kwargs
    )


def no_limit(index: int, timed: bool) -> None:
    return None


def test_a_child_session_warms_up_steps_and_reports_its_isolated_memory():
    session = child(Candidate("bf16-mixed"))
    seen: list[dict] = []
    warm = session.warm_up(no_limit, seen.append)
    timed = session.steps(2, no_limit, seen.append)
    measurement = session.finish()
    assert warm and len(timed) == 2 and [e["timed"] for e in seen][-2:] == [True, True]
    assert measurement.observed_dtype == "bfloat16" and measurement.step_times_s == timed
    assert measurement.peak_memory_bytes and "isolated candidate process" in measurement.memory_method


def test_a_child_step_over_its_limit_is_pruned_and_a_stop_is_a_stop():
    session = child(Candidate("fp32"))
    with pytest.raises(SessionEnded) as ended:
        session.warm_up(lambda index, timed: 1e-9, lambda event: None)  # no step can be that fast
    assert ended.value.status == "pruned" and "still running after" in ended.value.reason
    with pytest.raises(SessionEnded) as ended:  # told to stop while the child builds the workload
        child(Candidate("fp32"), should_stop=lambda: True)
    assert ended.value.status == "stopped"


def test_a_local_session_turns_a_failing_build_or_step_into_a_status():
    def broken():
        raise MemoryError("planted")

    with pytest.raises(SessionEnded) as ended:
        LocalSession(Candidate("fp32"), broken)
    assert ended.value.status == "oom" and "MemoryError: planted" in ended.value.reason

    workload = load_workload("mlp")
    session = LocalSession(
        Candidate("fp32"), lambda: TORCH.session(workload, Candidate("fp32"), SETTINGS, None)
    )
    session._session.step = lambda timed: (_ for _ in ()).throw(RuntimeError("step broke"))  # type: ignore[method-assign]
    with pytest.raises(SessionEnded) as ended:
        session.steps(1, no_limit, lambda event: None)
    assert ended.value.status == "error" and "RuntimeError: step broke" in ended.value.reason

    # a script's candidate that did not take effect is found when its session finishes: that
    # candidate's row, not the end of the whole tune (a Lightning script's fp16-mixed ran bf16 on a
    # CPU and `tune -- python script.py` exited 1, its measured rows lost)
    def dishonest():
        raise HonestyError("labelled fp16-mixed but 'net.0' computed in bfloat16")

    session._session.finish = dishonest  # type: ignore[method-assign]
    with pytest.raises(SessionEnded) as ended:
        session.finish()
    assert ended.value.status == "error" and "HonestyError: labelled fp16-mixed" in ended.value.reason


VICTIM = """
import os, signal


def body():
    from tqdm import tqdm

    tqdm(total=1, disable=True)  # as torch.fx's interpreter makes one while compiling
    os.kill(os.getpid(), signal.SIGKILL)  # the budget stopped it mid-compile
"""


def test_a_child_killed_mid_compile_leaves_no_semaphore_to_warn_about(tmp_path):
    """tqdm's lock, made in a candidate's child that was then killed, was left to the resource
    tracker, which printed "There appear to be 1 leaked semaphore objects" as the tune ended."""
    pytest.importorskip("tqdm")
    (tmp_path / "victim.py").write_text(VICTIM)
    code = (
        "from mixprec.measure import isolate\n"
        "import victim\n"
        "proc = isolate._context().Process(target=victim.body)\n"
        "proc.start(); proc.join()\n"
        "print('exit', proc.exitcode)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert f"exit -{int(signal.SIGKILL)}" in done.stdout, done.stdout + done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr


def test_the_main_process_keeps_its_own_excepthook_and_makes_no_tqdm_lock():
    """What the candidates' fork server sets up as it starts (a hook silent on a closed pipe, tqdm's
    lock for its children to share) is the fork server's: the process that runs tune imported it
    with isolate and hid its own broken pipes, and made a semaphore it never needed."""
    pytest.importorskip("tqdm")
    code = (
        "import sys\n"
        "from mixprec.measure import isolate\n"
        "from tqdm import tqdm\n"
        "print('hook', sys.excepthook is sys.__excepthook__, 'lock', hasattr(tqdm, '_lock'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "hook True lock False" in done.stdout, done.stdout + done.stderr
