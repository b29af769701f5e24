"""fp8 policies (torchao.float8): what they convert, that the plain-PyTorch export trains exactly as
the policy does, that a CPU refuses to time them but predicts their numerics, and that tune says so."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from extras import require
from mixprec.checking.check import check
from mixprec.exports import export
from mixprec.policy import PolicyConfig
from mixprec.workload import Workload

require("torchao", "fp8")  # fails, not skips, under make test (MIXPREC_REQUIRE_FRAMEWORKS=1)

from torchao.float8.float8_linear import Float8Linear  # noqa: E402

STEPS = 3


class Net(nn.Module):
    """Two fp8-eligible Linear layers, one that is not (30 features), and a head (an fp32 island)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64)
        self.odd = nn.Linear(64, 30)
        self.head = nn.Linear(30, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        h = torch.relu(self.mid(h))
        return self.head(torch.relu(self.odd(h)))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 32, generator=g), torch.randint(0, 16, (16,), generator=g)) for _ in range(STEPS)
    ]


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def fresh() -> nn.Module:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_prepare_converts_exactly_the_eligible_linear_layers(recipe):
    policy = mixprec.get_policy(f"fp8-{recipe}", device="cpu", check=False, keep_fp32=["head"])
    model = policy.prepare(fresh())
    assert policy.fp8_layers == ["up", "mid"]
    assert isinstance(model.up, Float8Linear) and isinstance(model.mid, Float8Linear)
    assert type(model.odd) is nn.Linear  # 30 features: torch._scaled_mm refuses it
    assert type(model.head) is nn.Linear  # the fp32 island
    with policy.autocast():
        out = model(batches()[0][0])
    assert out.dtype == torch.float32  # the head ran in fp32, outside autocast


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_plain_pytorch_export_trains_bit_for_bit_like_the_policy(recipe):
    """The export is written for an fp8 GPU; run on this CPU (device_type swapped), it must train
    the very weights Policy.prepare/autocast/step train."""
    config = PolicyConfig(name=f"fp8-{recipe}", device="cuda", keep_fp32=("head",))
    text = export(config, "pytorch").replace('device_type = "cuda"', 'device_type = "cpu"')
    namespace = {"__name__": "exported", "model": fresh(), "loader": batches(), "loss_fn": loss_fn}
    before = mixprec.state.snapshot()  # the export sets the fp32 math mode for good, as a script would
    try:
        exec(compile(text, "<fp8 export>", "exec"), namespace)
    finally:
        mixprec.state.restore(before)
    exported = namespace["model"]

    policy = mixprec.get_policy(f"fp8-{recipe}", device="cpu", check=False, keep_fp32=["head"])
    model = policy.prepare(fresh())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    with policy.precision_scope():
        for batch in batches():
            with policy.autocast():
                loss = loss_fn(model, batch)
            policy.backward(loss)
            if policy.step(optimizer, clip_grad_norm=1.0):
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    assert isinstance(exported.up, Float8Linear) and type(exported.odd) is nn.Linear
    for (name, a), (_, b) in zip(exported.state_dict().items(), model.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_fp8_is_not_timed_on_a_cpu_and_says_why():
    # the suggestion is the first of fp8's fallbacks this CPU computes natively: bf16-mixed with
    # AVX512-BF16 or AMX, strict fp32 on an AVX2-only CPU (bf16 and fp16 emulated, no bf32)
    cpu = mixprec.detect("cpu")
    instead = "bf16-mixed" if cpu.native_bf16 else "fp16-mixed" if cpu.native_fp16 else "fp32"
    with pytest.raises(mixprec.UnsupportedError, match=rf"compute capability >= 8\.9.*try {instead}\."):
        mixprec.get_policy("fp8-rowwise", device="cpu")
    for target in ("pytorch", "lightning"):
        status = mixprec.export_status(PolicyConfig(name="fp8-rowwise", device="cpu"), target)
        assert not status.faithful and "fp8 tensor cores" in status.reason


def test_only_mixprec_and_pytorch_export_fp8():
    config = PolicyConfig(name="fp8-tensorwise", device="cuda")
    faithful = {t for t in mixprec.EXPORT_TARGETS if mixprec.export_status(config, t).faithful}
    assert faithful == {"mixprec", "pytorch"}


_PATTERNS = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


def _batch(bs: int, dev: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Each input its class's fixed pattern plus noise: a task the check's reference learns within its
    steps (random labels gave the check no power: its verdict is then inconclusive)."""
    y = torch.randint(0, 16, (bs,))
    return (_PATTERNS[y] + torch.randn(bs, 32)).to(dev), y.to(dev)


def _workload() -> Workload:
    return Workload(
        model=fresh(),
        make_batch=_batch,
        optimizer_fn=lambda params: torch.optim.SGD(
            params, lr=0.2, momentum=0.9
        ),  # learns in a check's steps
        loss_fn=loss_fn,
        name="fp8net",
        default_batch_size=16,
    )


def test_check_on_a_cpu_predicts_fp8_numerics_with_the_real_recipe(single_thread):
    res = check(_workload(), policies=["fp8-rowwise", "bf16-mixed"], steps=4, device="cpu")
    fp8, bf16 = res.candidates
    assert fp8.predicted and "predicted on cpu" in fp8.predicted and bf16.predicted is None
    assert fp8.verdict in ("pass", "fail") and fp8.output_sqnr_db is not None
    # e4m3 keeps 3 mantissa bits to bf16's 7: about 24 dB less signal-to-noise if fp8 really ran
    assert fp8.output_sqnr_db < bf16.output_sqnr_db - 10


def test_tune_on_a_cpu_reports_the_fp8_prediction_never_a_speed(single_thread):
    # 2 timed steps, not 4: what the rows say of fp8, not how precisely the others were timed; the
    # work bounded by what is searched (strict fp32 and fp8-rowwise), not by a clock
    result = mixprec.tune(
        _workload(), policies=("fp8-rowwise",), budget_s=3600, steps=2, compile_modes=(), optimizers=False,
        lint=False, device="cpu",
    )  # fmt: skip
    rows = {r.label: r for r in result.ranked}
    assert rows["fp8-rowwise"].status == "unsupported" and rows["fp8-rowwise"].row.throughput is None
    notes = " ".join(result.notes)
    assert "fp8-rowwise would pass the numerics check on an fp8 GPU" in notes
    assert "torchao's rowwise fp8 recipe run here" in notes and "speed is not measurable here" in notes


def test_deepcopy_of_a_converted_model_keeps_fp8():
    policy = mixprec.get_policy("fp8-rowwise", device="cpu", check=False)
    model = copy.deepcopy(policy.prepare(fresh()))
    assert isinstance(model.up, Float8Linear)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_a_cpu_without_the_scaled_mm_kernel_predicts_with_torchaos_emulated_matmul(recipe, monkeypatch):
    """torch 2.11's CPU _scaled_mm takes per-tensor scales only: every rowwise prediction on a CPU
    crashed there (seen on the GPU machine's CPU tests, torch 2.11). Without the kernel, the layers
    run torchao's emulated matmul (the same e4m3 operands, multiplied in fp32): the same training
    as the kernel, to the rounding of the accumulation."""
    from mixprec.policy import fp8

    def trained(kernel: bool) -> tuple[nn.Module, list[float]]:
        monkeypatch.setattr(fp8, "cpu_scaled_mm_takes", lambda r: kernel)
        policy = mixprec.get_policy(f"fp8-{recipe}", device="cpu", check=False)
        model = policy.prepare(fresh())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for batch in batches():
            with policy.autocast():
                loss = loss_fn(model, batch)
            policy.backward(loss)
            policy.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        return model, losses

    emulated, emulated_losses = trained(kernel=False)
    assert emulated.up.config.emulate and isinstance(emulated.mid, Float8Linear)
    real, real_losses = trained(kernel=True)
    assert not real.up.config.emulate
    assert emulated_losses == pytest.approx(real_losses, rel=1e-2)
    for a, b in zip(emulated.parameters(), real.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
