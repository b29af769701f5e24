"""The CUDA paths of what landed since the first GPU run: compile at both scopes, the race, fused
optimizers, fp8 (torchao) and the emulated block formats, the monitor and `mixprec train`,
`tune --batch auto`, the exports executed, models by name and the monitor inside a real Lightning
fit on the GPU.

Each test runs on ``DEVICE``: CUDA on a GPU machine (``pytest -m gpu``, as ``benchmarks/gpu_run.sh``
runs it). ``MIXPREC_GPU_TEST_DEVICE=cpu pytest tests/test_gpu_paths.py`` rehearses the same tests on
a CPU (conftest lets this module's gpu tests run then), so that GPU time goes to the GPU; the
assertions that only hold on CUDA (an fp8 candidate measured rather than predicted, CUDA memory)
say so with ``ON_CUDA``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from extras import require
from mixprec.policy import Candidate

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("MIXPREC_GPU_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
REHEARSABLE = True  # conftest: with MIXPREC_GPU_TEST_DEVICE=cpu these tests run on a CPU
ROOT = Path(__file__).resolve().parents[1]
LATE = f"{ROOT / 'examples' / 'late_overflow.py'}:workload"


def tiny_gpt() -> mixprec.Workload:
    """The zoo GPT at 2 layers x 128 (every block Linear fp8-eligible; the 50,257-word head is not)."""
    return mixprec.load_workload("gpt2", seq_len=64, n_layer=2, n_embd=128, n_head=4)


def by_label(rows):
    return {r.label: r for r in rows}


def test_compiled_candidates_of_both_scopes_and_fused_optimizers_run():
    """torch.compile of the model and of the whole step (forward, loss, backward, optimizer) and the
    fused AdamW, each in its own candidate process, honest about the dtype that ran."""
    cands = [
        Candidate("bf16-mixed", compile="default"),
        Candidate("bf16-mixed", compile="default", compile_scope="step"),
        Candidate("bf16-mixed", optimizer="fused"),
        Candidate("fp16-mixed", compile="default", compile_scope="step"),
    ]
    result = mixprec.bench(tiny_gpt(), candidates=cands, batch_size=8, steps=3, warmup=2, device=DEVICE)
    rows = by_label(result.rows)
    for cand in cands:
        row = rows[cand.label]
        assert row.status == "ok", (cand.label, row.reason, row.error_traceback[-2000:])
        expected = "float16" if cand.policy == "fp16-mixed" else "bfloat16"
        assert row.observed_dtype == expected
        if cand.compile:
            assert row.graphs is not None and row.graphs >= 1, (cand.label, row.graphs)
            assert row.graph_breaks is not None, cand.label
        assert row.throughput is not None and row.throughput > 0


@pytest.mark.parametrize("opt", ["AdamW", "SGD"])
def test_fused_and_foreach_optimizers_step_like_the_for_loop(opt):
    from mixprec.frameworks.torch.session import with_implementation

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(DEVICE)
    x = torch.randn(32, 64, device=DEVICE)
    weights = {}
    for impl in ("for-loop", "foreach", "fused"):
        model = copy.deepcopy(base)
        kwargs = {"lr": 1e-2} | ({"momentum": 0.9} if opt == "SGD" else {})
        optimizer = with_implementation(getattr(torch.optim, opt)(model.parameters(), **kwargs), impl)
        for _ in range(3):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        weights[impl] = torch.cat([p.detach().flatten() for p in model.parameters()])
    for impl in ("foreach", "fused"):
        torch.testing.assert_close(weights[impl], weights["for-loop"], rtol=1e-5, atol=1e-6)


def test_fp8_recipes_are_measured_and_judged_beside_bf16():
    """fp8-rowwise and fp8-tensorwise through torchao on fp8 tensor cores: measured rows (a CPU
    refuses to time them) and a verdict from the real recipe (a CPU predicts it)."""
    require("torchao", "fp8")
    names = ("bf16-mixed", "fp8-rowwise", "fp8-tensorwise")
    bench = mixprec.bench(
        tiny_gpt(), policies=names, channels_last="off", batch_size=8, steps=3, warmup=2, device=DEVICE
    )
    rows = by_label(bench.rows)
    for name in ("fp8-rowwise", "fp8-tensorwise"):
        if ON_CUDA:
            assert rows[name].status == "ok", (name, rows[name].reason, rows[name].error_traceback[-2000:])
            assert rows[name].observed_dtype == "bfloat16"
        else:
            assert rows[name].status == "unsupported"
    checked = mixprec.check(tiny_gpt(), policies=names, steps=6, device=DEVICE)
    verdicts = {c.candidate.policy: c for c in checked.candidates}
    for name in names:
        c = verdicts[name]
        assert c.verdict == "pass", (name, c.verdict, c.reason)
        assert (c.predicted is None) == (ON_CUDA or name == "bf16-mixed"), (name, c.predicted)
        assert c.output_sqnr_db is not None and c.output_sqnr_db > 10


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_block_formats_are_predicted_with_the_emulation_on_this_device(fmt):
    """No sm_100 here: mxfp8 and nvfp4 are predicted by mixprec's emulation, which must round the
    same on the GPU as on the CPU (elementwise maths: bit for bit), and must still pass the GPT."""
    from mixprec.policy.blockscale import mx_quantize, nvfp4_quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-6, 6, 256)
    quantize = mx_quantize if fmt == "mxfp8" else nvfp4_quantize
    assert torch.equal(quantize(x.to(DEVICE)).cpu(), quantize(x))
    checked = mixprec.check(tiny_gpt(), policies=(fmt,), steps=6, device=DEVICE)
    c = checked.candidates[0]
    assert c.verdict == "pass" and c.predicted, (c.verdict, c.reason, c.predicted)


def test_the_monitor_predicts_and_rescues_the_late_fp16_overflow():
    """examples/late_overflow.py under fp16-mixed with the monitor: the overflow of `head` is
    predicted before it happens, and rescue=True finishes the run with finite losses."""

    def run(rescue):
        w = mixprec.load_workload(LATE)
        policy = mixprec.get_policy("fp16-mixed", device=DEVICE)
        model = policy.prepare(w.model.to(DEVICE))
        optimizer = w.make_optimizer(model)
        monitor = mixprec.Monitor(
            model, policy, optimizer=optimizer, loss_fn=w.loss_fn, every=20, rescue=rescue
        )
        torch.manual_seed(0)
        losses = []
        for _ in range(300):
            batch = w.make_batch(64, torch.device(DEVICE))
            with policy.autocast():
                loss = w.loss_fn(model, batch)
            optimizer.zero_grad()
            policy.backward(loss)
            policy.step(optimizer)
            monitor.observe(loss, batch)
            losses.append(float(loss.detach()))
        monitor.close()
        return monitor, losses, policy

    alert, losses, _ = run(rescue=False)
    found = [(f.kind, f.module) for f in alert.findings]
    assert found[0] == ("predicted_overflow", "head"), found
    rescued, losses, policy = run(rescue=True)
    assert ("rescue", "head") in [(f.kind, f.module) for f in rescued.findings]
    assert policy.config.keep_fp32 == ("head",) and all(math.isfinite(v) for v in losses)


def test_mixprec_train_writes_its_record(tmp_path):
    out = tmp_path / "train"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mixprec",
            "train",
            "--model",
            "mlp",
            "--policy",
            "fp16-mixed",
            "--steps",
            "60",
            "--device",
            DEVICE,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads((out / "train.json").read_text())
    assert len(record["losses"]) == 60 and all(math.isfinite(v) for v in record["losses"])


def test_tune_races_compiled_candidates_and_exports_the_pick(tmp_path):
    """A short tune with compile and optimizer variants: the race runs on the device and the pick's
    exports are written."""
    result = mixprec.tune(tiny_gpt(), budget_s=100, steps=3, warmup=1, check_steps=4, device=DEVICE)
    pick = result.recommendation
    assert pick is not None and pick.candidate is not None, result.notes
    measured = [r for r in result.bench.rows if r.status == "ok"]
    assert len(measured) >= 3, [(r.label, r.status, r.reason) for r in result.bench.rows]
    # Which policy wins is the device's to say (a launch-bound tiny GPT under 12 test workers ran no
    # faster in bf16 in the fifth lease): what must hold is the decision's contract with its rows.
    # A lower precision that passed its check and whose whole paired interval beat strict fp32
    # is never passed over for fp32.
    beat_and_passed = [
        r.label
        for r in result.ranked
        if r.candidate.policy != "fp32"
        and r.verdict == "pass"
        and r.row is not None
        and r.row.speedup_ci is not None
        and r.row.speedup_ci[0] > 1.0
    ]
    assert pick.candidate.policy != "fp32" or not beat_and_passed, (beat_and_passed, pick.reason)
    text = mixprec.export(pick.candidate, "pytorch", device=DEVICE)
    assert "torch.autocast" in text or pick.candidate.policy in ("fp32", "tf32", "bf16-true", "fp16-true")


def test_batch_auto_keeps_every_candidate_inside_the_memory_budget():
    budget = 96 * 2**20
    result = mixprec.tune(
        mixprec.load_workload("mlp"),
        budget_s=90,
        steps=2,
        warmup=1,
        check_steps=3,
        device=DEVICE,
        batch="auto",
        memory_budget=budget,
        effective_batch=512,
        compile_modes=(),
        optimizers=False,
        lint=False,
    )
    ok = [r for r in result.bench.rows if r.status == "ok"]
    assert ok, [(r.label, r.status, r.reason) for r in result.bench.rows]
    for row in ok:
        assert row.candidate.micro_batch is not None
        assert row.candidate.micro_batch * row.candidate.accumulation_steps == 512
        if ON_CUDA:
            assert row.peak_memory_bytes is not None and row.peak_memory_bytes <= budget, row.label


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        return self.head(torch.relu(self.up(x)))


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed", "bf16-true", "fp8-rowwise"])
def test_the_plain_pytorch_export_trains_on_the_device(policy):
    """The pasted loop as written for CUDA (no device swap), run with a model and a loader."""
    if policy.startswith("fp8"):
        require("torchao", "fp8")
        if not ON_CUDA:
            pytest.skip("fp8 exports are written for an fp8 GPU (test_fp8.py runs them on the CPU)")
    text = mixprec.export(Candidate(policy), "pytorch", device=DEVICE)
    if not ON_CUDA:
        text = text.replace('device_type = "cuda"', 'device_type = "cpu"')
    torch.manual_seed(0)
    model = _Net()
    g = torch.Generator().manual_seed(1)
    loader = [
        (torch.randn(16, 32, generator=g).to(DEVICE), torch.randint(0, 16, (16,), generator=g).to(DEVICE))
        for _ in range(4)
    ]
    before = [p.detach().clone() for p in model.parameters()]
    namespace = {
        "__name__": "exported",
        "model": model,
        "loader": loader,
        "loss_fn": lambda m, b: F.cross_entropy(m(b[0]).float(), b[1]),
    }
    snapshot = mixprec.state.snapshot()
    try:
        exec(compile(text, f"<{policy} export>", "exec"), namespace)
    finally:
        mixprec.state.restore(snapshot)
    trained = namespace["model"]
    after = list(trained.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    changed = [
        not torch.equal(a.detach().float().cpu(), b.float()) for a, b in zip(after, before, strict=True)
    ]
    assert any(changed)


@pytest.mark.parametrize("name", ["hf:llama", "timm:resnet18"])
def test_models_by_name_train_under_bf16(name):
    hf = name.startswith("hf:")
    require("transformers" if hf else "timm", "hf" if hf else "timm")
    if hf:
        w = mixprec.load_workload(name, num_hidden_layers=2)
    else:
        w = mixprec.load_workload(name, image_size=64, num_classes=10)
    result = mixprec.bench(
        w,
        policies="bf16-mixed",
        channels_last="off" if hf else "on",
        batch_size=4,
        steps=2,
        warmup=1,
        device=DEVICE,
    )
    for row in result.rows:
        assert row.status == "ok", (row.label, row.reason, row.error_traceback[-2000:])


def test_lightning_fit_on_the_device_rescues_the_late_overflow(tmp_path):
    """Lightning's own 16-mixed precision plugin (its GradScaler on the device) with the monitor's
    callback: the predicted overflow of the head is rescued inside the fit."""
    require("lightning", "frameworks")
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    from mixprec.monitor.lightning import MonitorCallback

    w = mixprec.load_workload(LATE)
    torch.manual_seed(0)
    batches = [w.make_batch(64, torch.device("cpu")) for _ in range(300)]

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = w.model

        def training_step(self, batch, batch_idx):
            return w.loss_fn(self.net, batch)

        def configure_optimizers(self):
            return w.make_optimizer(self.net)

    callback = MonitorCallback(every=20, rescue=True)
    device_type = "cuda" if ON_CUDA else "cpu"
    trainer = pl.Trainer(
        max_steps=300,
        accelerator="gpu" if ON_CUDA else "cpu",
        devices=1,
        plugins=[MixedPrecision("16-mixed", device_type, scaler=torch.amp.GradScaler(device_type))],
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(batches, batch_size=None))
    found = [(f.kind, f.module) for f in callback.monitor.findings]
    assert found[:2] == [("predicted_overflow", "net.head"), ("rescue", "net.head")], found
    assert all(math.isfinite(v) for v in callback.monitor.losses)


@pytest.mark.parametrize("policy, hand", [("bf16-mixed", "bf16"), ("fp16-mixed", "fp16")])
def test_run_on_a_script_leaves_the_weights_of_the_hand_edit_on_the_device(tmp_path, policy, hand):
    """The script source on the device: `mixprec run --policy P -- python by_hand.py --device D`
    (a loop with no precision code) trains the weights the same loop edited by hand (autocast, and
    for fp16 a GradScaler on the device unscaled before the clip) trains; the same kernels in the
    same order, so bit for bit on CUDA as on the CPU."""
    from mixprec.cli import main

    script = ROOT / "tests" / "frameworks" / "scripts" / "by_hand.py"
    by_hand, injected, plain = tmp_path / "hand.pt", tmp_path / "run.pt", tmp_path / "none.pt"
    common = ["--device", DEVICE, "--steps", "12"]
    subprocess.run([sys.executable, script, "--hand", hand, "--out", by_hand, *common], check=True)
    subprocess.run([sys.executable, script, "--out", plain, *common], check=True)
    command = ["run", "--policy", policy, "--out", str(tmp_path / "out"), "--"]
    assert main([*command, sys.executable, str(script), "--out", str(injected), *common]) == 0
    a, b, none = (torch.load(p, weights_only=True) for p in (injected, by_hand, plain))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], none[k]) for k in a)  # the policy did something


def _synchronising_calls(run) -> list[str]:
    """Where ``run()`` made the host wait for the GPU: CUDA's sync debug mode warns at each such call
    (``.item()``, a device-to-host copy, ``nonzero``...); the Python line that asked, per warning."""
    import warnings

    torch.cuda.synchronize()
    # the first switch into the debug mode warns once by itself (the H200: one "sync" in torch/cuda)
    torch.cuda.set_sync_debug_mode("warn")
    torch.cuda.set_sync_debug_mode(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [f"{Path(w.filename).name}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("name", ["mlp", "resnet50"])
def test_the_monitors_normal_gpu_step_adds_one_host_read_the_loss_before_its_update(name, policy):
    """The monitor's unsampled step, with the loss handed over before the update (``before_step``,
    as ``mixprec train`` and the script source do), adds one host read to the plain loop's: the
    loss, which judging a spike before its update needs (the third lease's torchrun run updated on a
    1e6 loss it read only at the next sample). Under bf16-mixed the recipes' step reads nothing at
    all (the tensor rate on the CPU: it was read back per parameter group); fp16-mixed reads
    GradScaler's inf flag once a step (the policy counted its skip with a second read of the flag,
    which waited for the optimizer's kernels queued behind it), and the loss after it."""
    if not ON_CUDA:
        pytest.skip("CUDA's sync debug mode counts the host's reads of the device")
    device = torch.device(DEVICE)
    w = mixprec.load_workload(name, **({"image_size": 32} if name == "resnet50" else {}))
    batches = [w.make_batch(8, device) for _ in range(4)]

    def loop(monitored: bool) -> tuple[list[str], int]:
        p = mixprec.get_policy(policy, device=device)
        model = p.prepare(copy.deepcopy(w.model).to(device))
        optimizer = w.make_optimizer(model)
        monitor = mixprec.Monitor(model, p, optimizer=optimizer, loss_fn=w.loss_fn) if monitored else None
        sampled = [0]

        def step(i: int) -> None:
            batch = batches[i % len(batches)]
            with p.autocast():
                loss = w.loss_fn(model, batch)
            optimizer.zero_grad(set_to_none=True)
            p.backward(loss)
            if monitor is not None:
                monitor.before_step(loss, batch)
            p.step(optimizer)
            if monitor is not None:
                sampled[0] += monitor.sampler.due(monitor.step)
                monitor.observe(loss, batch)

        for i in range(12):  # start-up: the loop confirmed, the warm-up and GradScaler's first steps behind
            step(i)
        sampled[0] = 0
        calls = _synchronising_calls(lambda: [step(i) for i in range(12, 42)])
        return calls, sampled[0]

    plain, _ = loop(False)
    watched, samples = loop(True)
    # bf16-mixed: nothing; fp16-mixed: GradScaler's inf flag, once a step
    assert len(plain) == (0 if policy == "bf16-mixed" else 30), plain
    assert samples == 0  # (the default interval, 100: steps 12-41 are all unsampled)
    added = list(watched)
    for call in plain:
        added.remove(call)
    assert len(added) == 30 and {c.split(":")[0] for c in added} == {"gate.py"}, sorted(set(added))


def test_a_data_spike_on_the_gpu_is_withheld_before_its_update():
    """The third lease's `mixprec run --rescue -- torchrun ... ddp_train.py` on CUDA exited 4: under
    bf16-mixed (no GradScaler) the monitor left a device loss unread until the next sampled step, so
    the 1e6 loss of a bad batch was found after its update had landed. Handed over before the update
    it is read then, diagnosed from the same weights and withheld, as on the CPU."""
    sys.path.insert(0, str(ROOT / "tests" / "monitor"))
    from monitor_faults import BAD_AT, loop, regression

    monitor, *_ = loop(regression(BAD_AT), BAD_AT + 5, device=torch.device(DEVICE), rescue=True)
    found = [(f.step, f.evidence.get("verdict")) for f in monitor.findings]
    assert found == [(BAD_AT, "data")] and monitor.withheld == [BAD_AT], monitor.findings


def test_the_recipes_sgd_compiled_whole_warms_up_and_trains_like_its_eager_step():
    """The recipes' tensor rate moved to the CPU after the third H200 lease (eager SGD read it back
    per parameter group, a sync each): a step compiled whole (compile_scope='step') now takes a CPU
    rate beside the device's weights. It must warm up and update as the eager step does. (Whether
    ``reduce-overhead`` keeps its CUDA graphs with it is for the next lease to see in its log.)"""
    from mixprec.workload.optimizers import WarmupSGD
    from warmup_step import warm_up_rates

    torch._dynamo.reset()

    def run(compiled: bool) -> tuple[list[float], list[torch.Tensor]]:
        return warm_up_rates(
            lambda params: WarmupSGD(params, lr=0.05, momentum=0.9, warmup_steps=3), compiled, DEVICE
        )

    eager_rates, eager_weights = run(False)
    rates, weights = run(True)
    assert eager_rates == pytest.approx([0.05 / 3, 0.1 / 3, 0.05, 0.05, 0.05])
    assert rates == pytest.approx(eager_rates)
    for got, want in zip(weights, eager_weights, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
