"""Suite-wide guards: no test may leak global torch precision state or its process's signal state."""

from __future__ import annotations

import os
import signal

# Two pytest-xdist workers share the two cores, and most of the suite's time is in processes the tests
# start (candidates, scripts, ranks) on torch's default thread count. libgomp's idle threads spin
# waiting for work by default, on the cores the other worker's processes need: passive waiting made
# the script, rank and Keras modules 16% faster (492 -> 414 s, -n 2). Set before torch loads libgomp;
# every process the tests start inherits it. Timings are never asserted, so no test's meaning changes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
import torch._dynamo  # before any test module imports tensorflow (see below)

import suite_order
from mixprec import state

# A worker collects every test module, the Keras ones' `import tensorflow` among them; triton
# (torch._dynamo, any torch.compile) loaded after TensorFlow kills the process with a segmentation
# fault (mixprec.frameworks.keras.backend.tf guards mixprec's own import; this guards the tests').


def pytest_collection_modifyitems(config, items):
    workers = getattr(config, "workerinput", {}).get("workercount", 1)  # under pytest-xdist
    ids = [item.nodeid for item in items]
    items[:] = suite_order.longest_first(items, ids, workers, suite_order.recorded())
    if torch.cuda.is_available():
        return
    # MIXPREC_GPU_TEST_DEVICE=cpu rehearses the modules that say REHEARSABLE (tests/test_gpu_paths.py)
    # on the CPU before GPU time is spent on them
    rehearse = os.environ.get("MIXPREC_GPU_TEST_DEVICE") == "cpu"
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
    for item in items:
        if "gpu" in item.keywords and not (rehearse and getattr(item.module, "REHEARSABLE", False)):
            item.add_marker(skip)


_DURATIONS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each test's setup, call and teardown, as the process that prints the results sees them (the
    controller under pytest-xdist), for ``MIXPREC_STORE_DURATIONS=1`` (tests/suite_order.py)."""
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("MIXPREC_STORE_DURATIONS") and not hasattr(session.config, "workerinput"):
        suite_order.store(_DURATIONS)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the suite on every core (pytest-xdist): each worker computes on one intra-op
    # thread, so two workers on a 2-core machine do not oversubscribe it (OpenMP threads waiting on
    # a core another worker holds made steps many times slower). Commands a test starts in a
    # process of their own keep torch's default count.
    torch.set_num_threads(1)


@pytest.fixture
def single_thread():
    """Tiny tensors: one intra-op thread is much faster than two contending ones, and deterministic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_gloo_rank(tmp_path):
    """A world of one gloo rank in this process, from a FileStore (no TCP port to collide with other
    runs); destroyed after the test unless the test destroyed it itself. Yields the gloo worker
    threads this process had before it (mixprec.process.gloo_workers)."""
    from datetime import timedelta

    import torch.distributed as dist

    from mixprec.process import gloo_workers

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    before = frozenset(gloo_workers())
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        yield before
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def fresh_accelerator_state():
    """Accelerate keeps its state process-wide (the HF Trainer makes an Accelerator too): a test
    starts and ends without one, whichever framework's test ran before it in this process. Its
    GradientState too: a Trainer that stops at max_steps leaves its dataloader active at its end, and
    the next Accelerator's accumulate() would sync every micro-batch."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _torch_state_unchanged():
    """Every test leaves TF32/bf32 flags, matmul precision, cudnn.benchmark and default dtype as found."""
    before = state.snapshot()
    grad_enabled = torch.is_grad_enabled()
    autocast_cpu = torch.is_autocast_enabled("cpu")
    yield
    after = state.snapshot()
    state.restore(before)  # so one leaking test does not fail every later one
    assert after == before, f"global torch state leaked: {before} -> {after}"
    assert torch.is_grad_enabled() == grad_enabled
    assert torch.is_autocast_enabled("cpu") == autocast_cpu


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _inherited() -> tuple[frozenset[int], frozenset[int]]:
    """What a process started now inherits of SIGINT and SIGTERM: which are ignored (an ignored
    signal stays ignored across exec; a Python handler does not) and which this thread blocks."""
    ignored = frozenset(s for s in _SIGNALS if signal.getsignal(s) == signal.SIG_IGN)
    return ignored, frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, ())) & frozenset(_SIGNALS)


def _take_interrupts() -> None:
    """SIGINT and SIGTERM as a terminal's foreground job has them: delivered, not ignored."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# A suite started in the background of a non-interactive shell (`.ci/run > log &` from a script) has
# SIGINT ignored, and so has every process its tests start: the tests that press Ctrl-C on a script
# saw the script sleep through it (three failed so on the AMX Xeon, exit 0 where 7 was expected).
_take_interrupts()


@pytest.fixture(autouse=True)
def _signals_unchanged():
    """Every test leaves SIGINT's and SIGTERM's handlers and this thread's mask as found. One that
    leaves either ignored or blocked fails (a later test's children would inherit it, and a Ctrl-C
    test fail in its place); a Python handler left behind is put back (children do not inherit it)."""
    handlers = [signal.getsignal(s) for s in _SIGNALS]
    before = _inherited()
    yield
    after = _inherited()
    _take_interrupts()
    for sig, handler in zip(_SIGNALS, handlers, strict=True):
        if handler is not None and signal.getsignal(sig) != handler:
            signal.signal(sig, handler)
    assert after == before, f"signals left ignored or blocked (ignored, blocked): {before} -> {after}"


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Measured CPU peaks are cached per user; tests keep theirs out of the real home directory."""

    old = {name: os.environ.get(name) for name in ("MIXPREC_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ["MIXPREC_CACHE_DIR"] = str(tmp_path_factory.mktemp("mixprec-cache"))
    # Inductor's artefacts in one directory for both workers of this run (mixprec's own cache directory
    # is per worker here; until tune stopped mistaking torch's default for a choice, both workers used
    # /tmp/torchinductor_<user>): a graph one worker compiled is read, not compiled again, by the
    # other. (The tests of that cache set their own.)
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(shared / "inductor")
    yield
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def own_cache_dir(tmp_path, monkeypatch):
    """A mixprec cache folder of the test's own (what the test reads and writes there is its
    business), holding the CPU matmul peaks this worker measured so far: MFU's denominators, timed
    again in every new folder otherwise (2-6 s a sweep). Peaks the test measured are kept for the
    next one."""
    import shutil
    from pathlib import Path

    shared = Path(os.environ["MIXPREC_CACHE_DIR"]) / "cpu_peaks.json"
    folder = tmp_path / "own-cache"
    folder.mkdir()
    if shared.is_file():
        shutil.copy(shared, folder / shared.name)
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(folder))
    yield folder
    if (folder / shared.name).is_file():
        shutil.copy(folder / shared.name, shared)


@pytest.fixture(scope="session")
def tiny_tune_result(_private_cache_dir, tmp_path_factory):
    """A real `tune` of the mlp workload on the CPU (about 20 s) with one torch thread: the result the
    report tests render. Run once for the whole test run: the first pytest-xdist worker to ask tunes
    and writes its JSON, the others wait for it and read it (each worker tuned it again, 20 s of the
    suite's wall time); every worker renders the result as read back, so all see the same."""
    import fcntl
    import json

    from mixprec.tuning.result import TuneResult

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = shared / "tiny_tune_result.json"
    with open(shared / "tiny_tune_result.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        if not path.is_file():
            path.write_text(json.dumps(_tiny_tune().to_dict()), encoding="utf-8")
    return TuneResult.from_dict(json.loads(path.read_text(encoding="utf-8")))


def _tiny_tune():
    import mixprec

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return mixprec.tune(
            mixprec.load_workload("mlp"),
            budget_s=60,
            steps=2,
            warmup=1,
            check_steps=3,
            device="cpu",
            lint=True,
            # eager candidates only: a compiled or fused pick is refused by five export targets,
            # and the report tests render all seven
            compile_modes=(),
            optimizers=False,
        )
    finally:
        torch.set_num_threads(before)
