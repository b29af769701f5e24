"""The fuzz tier (issue 14): random command lines, random bytes in every file mixprec reads, random
``state_dict`` structures. The properties:

- a command ends with an exit code in {0, 1 (lint --strict), 2, 3, 4, 5, 130}, prints no traceback
  and at most one ``mixprec: error:`` line (the last one), and changes no file outside the output
  paths it was given;
- a reader (row stream, caches, ``report`` input) never raises anything but a UsageError;
- ``Policy.load_state_dict`` either loads or raises PolicyError and leaves the policy as it was.

Examples are derandomised (the same inputs on every run, so CI cannot flake) and sized to keep the
tier near two minutes on a 2-core CPU; ``MIXPREC_FUZZ_SCALE=10`` tries ten times as many.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import stat
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec.cli import main
from mixprec.errors import MixprecError, PolicyError, UsageError
from mixprec.hardware import peaks
from mixprec.measure.results import BenchRow
from mixprec.measure.rowstore import RowStore, encode, scan
from mixprec.policy import Candidate
from mixprec.report.jsonio import write_json
from mixprec.tuning.cache import read_cache

SCALE = float(os.environ.get("MIXPREC_FUZZ_SCALE", "1"))


def _settings(examples: int) -> settings:
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,  # no example database: every run tries the same inputs (.hypothesis/ ignores itself)
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,  # single_thread: set once for all examples
        ],
    )


EXIT_CODES = {0, 1, 2, 3, 4, 5, 130}


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


# ------------------------------------------------------------------ the CLI

# Values every option may get: sane, out of range, of the wrong type, and paths of every kind.
NUMBERS = ["1", "2", "0", "-1", "abc", "", "nan", "inf", "1e9", "0.5", "True"]
PATHS = [
    "{t}/o/r.json",
    "{t}/o/r.jsonl",
    "{t}/o/r.csv",
    "{t}/o/r.md",
    "{t}/o/p.png",
    "{t}/o/p.txt",
    "{t}/o/p",
    "{t}/link.json",  # a symlink to a file the run must not touch
    "{t}/fifo",
    "{t}/dir",
    "{t}/precious.txt/x.json",  # a file used as a folder
    "/proc/self/x.json",
    "",
]
WORDS = ["mlp", "fp32", "bf16-mixed", "tf32", "bf16-mix", "all", "", "cuda", "tpu", "on", "off", "MP101"]

# Per command: cheap settings put first (so a valid command line finishes in about a second), then
# the options the fuzzer draws, each with its value pool (None: a flag). Later options override.
BASE = {
    "env": ["--device", "cpu"],
    "demo": ["--device", "cpu", "--steps", "1"],
    "bench": [
        *("--model", "mlp", "--device", "cpu", "--in-process", "--steps", "1", "--warmup", "1"),
        *("--min-time", "0", "--policies", "fp32"),
    ],
    "check": ["--model", "mlp", "--device", "cpu", "--steps", "1", "--policies", "bf16-mixed"],
    "lint": ["--model", "mlp", "--device", "cpu"],
    "tune": [
        *("--model", "mlp", "--device", "cpu", "--budget", "0.001", "--no-compile", "--no-lint"),
        *("--steps", "1", "--check-steps", "1"),
    ],
    "report": [],
}
OPTIONS: dict[str, dict[str, list[str] | None]] = {
    "env": {"--json": PATHS, "--device": ["cpu", "cuda", "tpu", ""]},
    "demo": {"--policy": WORDS, "--steps": ["1", "0", "-1", "x"], "--device": ["cpu", "tpu"]},
    "bench": {
        "--policies": ["fp32", "bf16-mixed", "fp32,bf16-mixed", "tf32", "bf16-mix", "", ","],
        "--channels-last": ["off", "on", "both", "maybe"],
        "--steps": ["1", "0", "-1", "x"],
        "--warmup": ["1", "0", "x"],
        "--min-time": ["0", "-1", "nan", "x"],
        "--prune-factor": ["5", "1", "0", "nan", "x"],
        "--batch-size": ["1", "4", "0", "-2", "x"],
        "--json": PATHS,
        "--csv": PATHS,
        "--markdown": PATHS,
        "--plot": PATHS,
        "--resume": None,
        "--resume-anyway": None,
        "--model": WORDS,
        "--workload": ["{t}/wl.py:make", "{t}/wl.py:nope", "{t}/missing.py:f", "os:getcwd", ":", "x"],
        "--image-size": ["8", "0", "x"],
        "--seq-len": ["8", "0"],
        "--device": ["cpu", "cuda:7", "tpu"],
        "--nproc": ["0", "x"],
    },
    "check": {
        "--policies": ["bf16-mixed", "fp16-mixed", "tf32", "nope", "", "fp32"],
        "--steps": ["1", "0", "x"],
        "--emulate": ["bf16", "fp8_e4m3", "fp7", ""],
        "--json": PATHS,
        "--plot": PATHS,
        "--model": WORDS,
        "--batch-size": ["2", "0"],
        "--device": ["cpu", "tpu"],
    },
    "lint": {
        "--policy": WORDS,
        "--channels-last": ["on", "off", "x"],
        "--target": ["cpu", "cuda", "h100", "tpu"],
        "--ignore": ["MP101", "MP999", "nope", ""],
        "--strict": None,
        "--steps": ["1"],
        "--json": PATHS,
        "--verbose": None,
        "--list-rules": None,
        "--model": WORDS,
        "--batch-size": ["2", "0"],
    },
    "tune": {
        "--budget": ["0.001", "0", "-1", "nan", "x"],
        "--steps": ["1", "0", "x"],
        "--check-steps": ["1", "0"],
        "--compile": ["default", "fast", ""],
        "--train-steps": ["1", "0", "x"],
        "--json": PATHS,
        "--report": PATHS,
        "--model": WORDS,
    },
    "report": {"--out": PATHS},
}
REPORT_INPUTS = ["{t}/tune.json", "{t}/precious.txt", "{t}/dir", "{t}/missing.json", "{t}/link.json"]
REPORT_INPUTS += ["{t}/garbage.bin", "{t}/list.json"]

WORKLOAD = """
import torch
from torch import nn
import mixprec

def make(image_size=8, seq_len=8):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    def make_batch(batch_size, device):
        return torch.randn(batch_size, 4, device=device), torch.randint(0, 2, (batch_size,), device=device)
    def loss_fn(m, b):
        return nn.functional.cross_entropy(m(b[0]).float(), b[1])
    return mixprec.Workload(model=model, make_batch=make_batch, loss_fn=loss_fn, name="tiny",
                            default_batch_size=4)
"""


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    command = draw(st.sampled_from(sorted(OPTIONS)))
    argv = [command, *BASE[command]]
    if command == "report":
        argv.append(draw(st.sampled_from(REPORT_INPUTS)))
    options = OPTIONS[command]
    for name in draw(st.lists(st.sampled_from(sorted(options)), max_size=4)):
        pool = options[name]
        argv += [name] if pool is None else [name, draw(st.sampled_from(pool))]
    if draw(st.booleans()) and draw(st.booleans()):
        argv.append(draw(st.sampled_from(["--bogus", "-x", "--", "positional"])))
    return argv


def _fixture_tree(root: Path, tune_json: bytes) -> None:
    (root / "o").mkdir()
    (root / "dir").mkdir()
    (root / "cwd").mkdir()
    (root / "precious.txt").write_text("must not change")
    (root / "link.json").symlink_to(root / "precious.txt")
    os.mkfifo(root / "fifo")
    (root / "wl.py").write_text(WORKLOAD)
    (root / "tune.json").write_bytes(tune_json)
    (root / "garbage.bin").write_bytes(bytes(range(256)))
    (root / "list.json").write_text("[1, 2, 3]")


def _state(root: Path) -> dict[str, Any]:
    """Every entry under ``root``: its type, and a regular file's bytes."""
    found: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        mode = os.lstat(path).st_mode
        key = str(path.relative_to(root))
        if stat.S_ISREG(mode):
            found[key] = path.read_bytes()
        elif stat.S_ISLNK(mode):
            found[key] = ("link", os.readlink(path))
        else:
            found[key] = stat.S_IFMT(mode)
    return found


def _allowed(argv: list[str], root: Path) -> set[str]:
    """The entries a command may change: the outputs it names, their row stream, a report folder."""
    allowed: set[str] = set()
    pairs = list(itertools.pairwise(argv))
    if argv[0] == "report" and "--out" not in argv:
        pairs.append(("--out", "mixprec-report"))  # its default
    for flag, value in pairs:
        if flag not in ("--json", "--csv", "--markdown", "--plot", "--report", "--out") or not value:
            continue
        path = root / "cwd" / value  # an absolute value stays itself
        with contextlib.suppress(ValueError):
            rel = path.relative_to(root)
            allowed.add(str(rel))
            allowed.add(str(rel.with_suffix(".jsonl")))
            if flag in ("--report", "--out"):
                allowed.add(str(rel) + "/")
    return allowed


@contextlib.contextmanager
def _captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


def _run(argv: list[str]) -> tuple[int, str, str]:
    with _captured() as (out, err), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own UserWarnings are not mixprec's output
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: usage errors, --help, --version
            code = exc.code if isinstance(exc.code, int) else 2
    return int(code), out.getvalue(), err.getvalue()


def _check_one_error_line(argv: list[str], code: int, err: str) -> None:
    assert code in EXIT_CODES, (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if line.startswith(("mixprec: error", "mixprec tune: error"))]
    assert len(errors) <= 1, (argv, err)
    if code not in (0, 1):
        assert errors and errors[0] == len(lines) - 1, (argv, code, err)


@pytest.fixture(scope="module")
def tune_json(tiny_tune_result) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_json(Path(tmp) / "t.json", "tune", tiny_tune_result.env, tiny_tune_result.to_dict())
        return path.read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(600)
@_settings(250)
@given(argv=command_lines())
def test_random_command_lines(argv, tune_json):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _fixture_tree(root, tune_json)
        argv = [a.replace("{t}", tmp) for a in argv]
        before = _state(root)
        cwd = os.getcwd()
        os.chdir(root / "cwd")
        try:
            code, _, err = _run(argv)
        finally:
            os.chdir(cwd)
        _check_one_error_line(argv, code, err)
        event(f"{argv[0]} exit {code}")  # the spread of outcomes, in --hypothesis-show-statistics
        after = _state(root)
        allowed = _allowed(argv, root)

        def may_change(key: str) -> bool:
            return key in allowed or any(key.startswith(a) for a in allowed if a.endswith("/"))

        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        assert {k for k in changed if not may_change(k)} == set(), (argv, code, err)
        leftovers = [k for k in after if k.endswith((".lock", ".tmp")) or "/.mixprec-probe" in k]
        assert not leftovers, (argv, leftovers)


# ------------------------------------------------------------------ files mixprec reads

ROW = BenchRow("mlp", Candidate("bf16-mixed"), "cpu", 8, "ok", step_times_ms=(1.0, 1.2))
SETTINGS = {"workload": "mlp", "steps": 1}


def _valid_stream() -> bytes:
    header = encode({"kind": "mixprec-bench-rows", "schema_version": 2, "settings": SETTINGS})
    rows = [
        encode(BenchRow("mlp", Candidate(p), "cpu", 8, "ok", step_times_ms=(1.0,)).to_dict())
        for p in ("fp32", "bf16-mixed", "fp16-mixed")
    ]
    return header + b"".join(rows)


@st.composite
def damaged_streams(draw: st.DrawFn) -> bytes:
    """A valid row stream cut, overwritten or extended at random places, or random bytes."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=400))
    data = bytearray(_valid_stream())
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["cut", "flip", "insert"]))
        at = draw(st.integers(0, len(data)))
        if kind == "cut":
            del data[at:]
        elif kind == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        else:
            data[at:at] = draw(
                st.binary(max_size=40) | st.sampled_from([b"\n", b"[1]\n", b"\xff\n", b"{}\n"])
            )
    return bytes(data)


@_settings(600)
@given(data=damaged_streams(), anyway=st.booleans())
def test_random_bytes_in_the_row_stream(data, anyway):
    found = scan(data)  # never raises
    assert found.good_end + found.torn_bytes == len(data)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        path.write_bytes(data)
        try:
            with RowStore(path, SETTINGS, resume=True, resume_anyway=anyway) as store:
                kept = store.rows
                store.append(ROW)
        except UsageError:
            assert path.read_bytes()[: found.good_end] == data[: found.good_end]
            return
        after = scan(path.read_bytes())
        assert after.torn_bytes == 0  # recovered: nothing is ever appended onto a torn line
        assert after.rows[: len(kept)] == kept and after.rows[-1] == ROW
        assert path.read_bytes().startswith(data[: found.good_end])  # intact rows are never rewritten


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@_settings(500)
@given(
    content=st.binary(max_size=200)
    | json_values.map(lambda v: json.dumps(v).encode())
    | json_values.map(lambda v: json.dumps({"schema_version": 1, "entries": {"k": v}}).encode())
    | json_values.map(lambda v: json.dumps({"version": 1, "entries": {"k": v}}).encode())
)
def test_random_bytes_in_the_caches(content):
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "cache.json"
        path.write_bytes(content)
        for entry in read_cache(path).values():
            assert isinstance(entry["config"], dict)
            mixprec.policy.policy_from_config(entry["config"])  # every entry kept rebuilds a policy
        for entry in peaks._read_cache(path).values():
            assert isinstance(entry["flops"], float) and entry["flops"] > 0


def _paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):
            yield from _paths(v, (*prefix, i))


def _replace(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    head, *rest = path
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[head] = _replace(value[head], tuple(rest), new)
    return copy


@pytest.mark.slow
@_settings(25)
@given(data=st.data())
def test_random_report_inputs(data, tune_json):
    original = json.loads(tune_json)
    choice = data.draw(st.integers(0, 3))
    if choice == 0:
        content = data.draw(st.binary(max_size=300))
    elif choice == 1:
        content = json.dumps(
            {"kind": "tune", **data.draw(st.dictionaries(st.text(max_size=10), json_values))}
        )
        content = content.encode()
    else:  # a real result with one value anywhere replaced by a random one
        spots = list(_paths(original))
        spot = data.draw(st.sampled_from(spots[1:]))
        content = json.dumps(_replace(original, spot, data.draw(json_values))).encode()
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "t.json"
        results.write_bytes(content)
        code, _, err = _run(["report", str(results), "--out", str(Path(tmp) / "out")])
        assert code in (0, 2), err
        _check_one_error_line(["report"], code, err)
        assert results.read_bytes() == content


def _trained_state() -> dict[str, Any]:
    policy = mixprec.get_policy("fp16-mixed", device="cpu", init_scale=64.0)
    model = policy.prepare(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        with policy.autocast():
            loss = model(torch.randn(4, 3)).float().sum()
        policy.backward(loss)
        policy.step(opt)
        opt.zero_grad()
    return policy.state_dict()


GOOD_STATE = _trained_state()


@st.composite
def state_dicts(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 3)) == 0:
        return draw(json_values)
    spots = list(_paths(GOOD_STATE))
    state = GOOD_STATE
    for _ in range(draw(st.integers(1, 2))):
        spots = list(_paths(state))
        spot = draw(st.sampled_from(spots))
        new = draw(json_values | st.sampled_from([float("nan"), float("inf"), True, -1, 0, "abc"]))
        state = _replace(state, spot, new) if spot else new
    return state


@_settings(600)
@given(state=state_dicts(), name=st.sampled_from(["fp16-mixed", "bf16-mixed"]))
def test_random_state_dicts_load_all_or_nothing(state, name):
    policy = mixprec.get_policy(
        name, device="cpu", **({"finite_check": True} if name == "bf16-mixed" else {})
    )
    scaler_before = policy.scaler.state_dict() if policy.scaler else None
    stats_before = policy.stats.as_dict()
    try:
        policy.load_state_dict(state)
    except PolicyError:
        assert (policy.scaler.state_dict() if policy.scaler else None) == scaler_before
        assert policy.stats.as_dict() == stats_before
        return
    except MixprecError as exc:  # any other of mixprec's errors would be a wrong type
        raise AssertionError(f"{type(exc).__name__}: {exc}") from exc
    # loaded: the policy is usable and its state serialises again
    policy.stats.as_dict()
    policy.state_dict()
