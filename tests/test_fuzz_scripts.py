"""The generated-script fuzz tier (issue 51): training scripts written the way people write them
(tests/frameworks/script_shapes.py: an LR scheduler, every clip path, every backward path,
accumulation, a model trained in eval mode or called part by part, two optimizers after one backward,
the script's own AMP), each run under a candidate and compared with the same script edited by hand as
the PyTorch AMP recipe says.

The properties, for bf16-mixed and fp16-mixed:

- ``mixprec run``'s injection trains as the hand edit: the final weights are equal bit for bit, and
  each step's loss (what a check compares) is the hand edit's, step for step;
- the script's step is a step: as many as the script's loop runs, under the candidate and as written.

Most shapes run in this process (the agent installed around the script, as in its own process), so
the tier tries many; one goes through the real command line, ``mixprec run``, as a user runs it
(all of them: benchmarks/script_fuzz_cli.py). ``MIXPREC_FUZZ_SCALE=4`` tries four times as many.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
from pathlib import Path

import pytest
import torch

from frameworks.in_process import Losses, under
from frameworks.script_shapes import AXES, STEPS, Shape, render, shapes
from mixprec.cli import main

SCALE = float(os.environ.get("MIXPREC_FUZZ_SCALE", "1"))
SHAPES = shapes(int(24 * SCALE))
FORMAT = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}


def run_here(path: Path, *args: str) -> list[float]:
    """``python path args`` in this process; the losses it printed."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [str(path), *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = argv
    return [float(line.split()[2]) for line in out.getvalue().splitlines() if line.startswith("loss ")]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread, and the same arithmetic in every run of them."""


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_generated_script_trains_under_the_candidate_as_its_hand_edit(tmp_path, shape: Shape, policy):
    script, edited = tmp_path / "train.py", tmp_path / "by_hand.py"
    script.write_text(render(shape))
    edited.write_text(render(shape, hand=True))
    want = run_here(edited, "--amp", FORMAT[policy], "--out", str(tmp_path / "hand.pt"))
    seen = Losses()
    with under(policy, observers=[seen]) as agent:
        run_here(script, "--out", str(tmp_path / "run.pt"))
    assert same(weights(tmp_path / "run.pt"), weights(tmp_path / "hand.pt")), "not the hand edit's weights"
    assert len(agent.steps) == STEPS
    assert seen.losses == pytest.approx(want, rel=1e-6), "not the hand edit's losses"
    assert agent.observed.dtype == {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[policy]


def test_as_written_a_generated_script_steps_as_its_loop(tmp_path):
    """The script's own precision (its --amp), run as written: one step per iteration of its loop,
    whatever its optimizers and accumulation (a GAN's two optimizers counted two before)."""
    for shape in SHAPES[:6]:
        script = tmp_path / f"{abs(hash(shape))}.py"
        script.write_text(render(shape))
        own = shape.own_amp if shape.own_amp != "none" else None
        label = {"bf16": "bf16-mixed", "fp16": "fp16-mixed", None: "fp32"}[own] + " (as written)"
        with under(label) as agent:
            run_here(script, "--out", str(tmp_path / "w.pt"))
        assert len(agent.steps) == STEPS, shape


def test_the_tier_tries_every_value_of_every_axis():
    """Every value of every axis is in a shape the tier runs. (It counted the values the tier's tests
    had tried in this process: under pytest-xdist a worker that ran a part of them failed it.)"""
    tried = {f"{axis}={value}" for shape in SHAPES for axis, value in vars(shape).items()}
    missing = [
        f"{axis}={value}"
        for axis, values in AXES.items()
        for value in values
        if f"{axis}={value}" not in tried
    ]
    assert not missing, missing


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES[1:2], ids=str)
def test_the_command_line_runs_a_generated_script_as_its_hand_edit(tmp_path, monkeypatch, shape):
    """A shape through the real command, as a user runs it: `mixprec run` leaves the hand edit's
    weights. (benchmarks/script_fuzz_cli.py runs every shape so, and `mixprec check` on each; the
    check of a script is tested in tests/frameworks/test_script.py.)"""
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text(render(shape))
    Path("by_hand.py").write_text(render(shape, hand=True))
    # the hand edit here, on this process' one thread; the script's process on one thread too (the
    # same order of arithmetic: its default two threads sum in another)
    run_here(Path("by_hand.py"), "--amp", "bf16", "--out", "hand.pt")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert (
        main(
            [
                "run",
                "--policy",
                "bf16-mixed",
                "--out",
                "out",
                "--",
                sys.executable,
                "train.py",
                "--out",
                "run.pt",
            ]
        )
        == 0
    )
    assert same(weights(tmp_path / "run.pt"), weights(tmp_path / "hand.pt"))
