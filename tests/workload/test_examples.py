"""The examples run as a user runs them, at a tiny size: nanoGPT trains with its own
configure_optimizers (checked against nanoGPT's plain loop), its prints show once however many
candidates run, and the Hugging Face and timm examples measure cleanly."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import mixprec
from extras import require
from mixprec.frameworks.session import BenchSettings
from mixprec.frameworks.torch.session import TrainingSession, make_batches

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TINY_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16}


def _bench(workload: mixprec.Workload, policies: str, batch_size: int | None = None) -> dict[str, str]:
    """Each row's status, every candidate measured whatever its speed (a prune factor nothing reaches):
    that the examples run, not how fast; bf16 is emulated and far slower than fp32 on an AVX2-only CPU.
    ``batch_size``: the workload's default unless given."""
    result = mixprec.bench(
        workload,
        policies=policies,
        batch_size=batch_size,
        channels_last="off",
        steps=1,
        warmup=1,
        isolate=False,
        device="cpu",
        prune_factor=1e6,
    )
    return {row.label: row.status for row in result.rows}


@pytest.mark.usefixtures("single_thread")
def test_nanogpt_trains_with_its_own_configure_optimizers(capsys):
    w = mixprec.load_workload(f"{EXAMPLES / 'nanogpt.py'}:make_workload", **TINY_GPT)
    assert capsys.readouterr().out.count("number of parameters:") == 1
    settings = BenchSettings(device="cpu", batch_size=4, seed=0)
    batches = make_batches(w, 4, torch.device("cpu"), 0, 3)

    # nanoGPT's own loop: configure_optimizers as train.py calls it, then forward/backward/step
    model = copy.deepcopy(w.model)
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")
    for batch in batches:
        _, loss = model(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    session = TrainingSession(w, mixprec.Candidate("fp32"), settings, batches)
    groups = session.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in groups] == [len(g["params"]) for g in optimizer.param_groups]
    for _ in batches:
        session.step(timed=False)
    theirs = model.state_dict()
    for name, mine in session.model.state_dict().items():
        torch.testing.assert_close(mine, theirs[name], rtol=0, atol=0, msg=name)
    assert "num decayed parameter tensors" in capsys.readouterr().out


def _run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mixprec", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=280,
        check=False,
    )


@pytest.mark.slow
def test_factory_prints_show_once_however_many_candidates_run():
    """Each candidate runs in its own process, which rebuilds the workload: the factory's and the
    optimizer's prints show once (or, with --verbose, once per process, marked as such)."""
    config = ",".join(f"{k}={v}" for k, v in TINY_GPT.items())
    argv = ["bench", "--workload", "examples/nanogpt.py:make_workload", "--model-config", config]
    # two processes are "however many" (each rebuilds the workload); a third showed nothing new
    argv += ["--policies", "fp32,bf16-mixed", "--channels-last", "off", "--steps", "1"]
    argv += ["--warmup", "1", "--min-time", "0", "--batch-size", "4", "--device", "cpu"]
    with ThreadPoolExecutor(max_workers=2) as pool:  # two separate processes: side by side
        run, verbose = pool.map(lambda extra: _run_cli(*argv, *extra), [(), ("--verbose",)])
    assert run.returncode == 0, run.stderr
    both = run.stdout + run.stderr
    assert both.count("number of parameters:") == 1
    assert both.count("num decayed parameter tensors") == 1
    # every candidate ran (a busy machine may re-measure some "(again)": the order is the sweep's
    # business, not this test's)
    progress = [line.split(":")[0] for line in run.stderr.splitlines() if "(elapsed" in line]
    ran = {label.split("] ", 1)[1].removesuffix(" (again)") for label in progress}
    assert ran == {"fp32", "bf16-mixed"}
    assert verbose.returncode == 0, verbose.stderr
    rebuilt = [line for line in verbose.stderr.splitlines() if line.startswith("  | number of parameters")]
    assert len(rebuilt) == 2  # one per candidate process (the baseline and the candidate)


@pytest.mark.usefixtures("single_thread")
def test_hf_example_measures_with_the_hf_optimizer_groups():
    require("transformers", "hf")
    w = mixprec.load_workload(
        f"{EXAMPLES / 'hf_model.py'}:make_workload", hidden_size=64, num_hidden_layers=1, seq_len=8
    )
    optimizer = w.make_optimizer(w.model)
    no_decay = {id(p) for n, p in w.model.named_parameters() if "bias" in n or "LayerNorm.weight" in n}
    assert {id(p) for p in optimizer.param_groups[1]["params"]} == no_decay
    assert optimizer.param_groups[1]["weight_decay"] == 0.0
    assert _bench(w, "fp32,bf16-mixed") == {"fp32": "ok", "bf16-mixed": "ok"}


@pytest.mark.usefixtures("single_thread")
def test_timm_example_measures_with_timms_optimizer():
    require("timm", "timm")
    from timm.optim import create_optimizer_v2

    w = mixprec.load_workload(f"{EXAMPLES / 'timm_model.py'}:make_workload", image_size=32, num_classes=10)
    reference = create_optimizer_v2(w.model, "adamw", lr=1e-3, weight_decay=0.05)
    groups = [(g["weight_decay"], len(g["params"])) for g in w.make_optimizer(w.model).param_groups]
    assert groups == [(g["weight_decay"], len(g["params"])) for g in reference.param_groups]
    # 4 images a step, not the example's 32: that it measures, not how fast (convnext_atto's bf16 is
    # emulated on an AVX2-only CPU)
    assert _bench(w, "fp32,bf16-mixed", batch_size=4) == {"fp32": "ok", "bf16-mixed": "ok"}


HF_MISTAKE = """
import sys
sys.path.insert(0, {examples!r})
import dataclasses
import hf_model

def make_workload():
    w = hf_model.make_workload(hidden_size=32, num_hidden_layers=1, seq_len=8)
    return dataclasses.replace(w, loss_fn=lambda model, batch: model(**batch))  # not `.loss`
"""


def test_hf_output_instead_of_loss_is_the_only_line_on_stderr(tmp_path):
    """As a user meets it, in a fresh process: importing transformers (and torchao, when the fp8
    extra is installed) says nothing, the one line says what to fix, exit 2."""
    require("transformers", "hf")
    path = tmp_path / "mistake.py"
    path.write_text(HF_MISTAKE.format(examples=str(EXAMPLES)), encoding="utf-8")
    run = _run_cli("check", "--workload", f"{path}:make_workload", "--device", "cpu")
    assert (run.returncode, run.stdout, run.stderr) == (
        2,
        "",
        "mixprec: error: loss_fn returned transformers.modeling_outputs.SequenceClassifierOutput; "
        "return a scalar tensor, e.g. `out.loss`.\n",
    )
