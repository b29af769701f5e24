"""No pass without a test: a candidate whose format never ran, whose buffers went non-finite, whose
complex tensors were cast to real, or whose fp32 islands name nothing is never a `pass`."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.checking.check import candidates_of, check, check_islands
from mixprec.errors import PolicyError
from mixprec.frameworks import framework_of


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def _regression(
    model: nn.Module, in_features: int, dtype=None, scale: float = 1.0, name="w"
) -> mixprec.Workload:
    def make_batch(batch_size, device):
        x = torch.randn(batch_size, in_features, device=device, dtype=dtype) * scale
        return x, torch.randn(batch_size, 4, device=device, dtype=dtype)

    def loss_fn(m, batch):
        return nn.functional.mse_loss(m(batch[0]).float(), batch[1].float())

    return mixprec.Workload(model, make_batch, loss_fn, name=name, default_batch_size=16)


def _mlp(dtype=None) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype or torch.float32)


def test_a_float64_model_never_runs_bf16_and_is_an_error_not_a_pass():
    w = _regression(_mlp(torch.float64), 16, dtype=torch.float64, name="float64_mlp")
    result = check(w, policies=["bf16-mixed"], steps=3, device="cpu")
    cand = result.candidates[0]
    assert cand.verdict == "error", (cand.verdict, cand.reason)
    assert "nothing was tested" in cand.reason and "float64" in cand.reason
    assert result.failed  # the CLI exits non-zero


def test_a_float64_default_dtype_never_runs_bf16_either():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        w = _regression(_mlp(torch.get_default_dtype()), 16, name="default_float64")
        result = check(w, policies=["bf16-mixed"], steps=3, device="cpu")
    finally:
        torch.set_default_dtype(previous)
    cand = result.candidates[0]
    assert cand.verdict == "error" and "never ran" in cand.reason, cand.reason


class _RunningSquare(nn.Module):
    """A running mean of squared activations kept in a buffer (as normalisers and EMA statistics do),
    cast with the model under a *-true policy."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * x.pow(2).mean(0))
        return x


def test_a_running_statistic_that_overflows_fp16_true_fails():
    # Activations ~1e3: their square (~1e6) is past fp16's 65504, so fp16-true's running statistic
    # becomes inf (the model is broken for eval) while the training loss stays finite.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(_RunningSquare(16), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    w = _regression(model, 16, scale=1e3, name="big_statistic")
    w.optimizer_fn = lambda params: torch.optim.SGD(params, lr=0.3)  # updates fp16 storage keeps
    fp16 = check(w, policies=["fp16-true"], steps=3, device="cpu").candidates[0]
    assert fp16.verdict == "fail", fp16.reason
    assert "0.ema" in fp16.reason and "non-finite" in fp16.reason


def test_batchnorm_statistics_stay_fp32_under_fp16_true_so_large_activations_pass():
    """The same activations through BatchNorm: *-true keeps its running statistics fp32 (they
    overflowed to inf in fp16 before), so the check has nothing non-finite to find there."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    w = _regression(model, 16, scale=1e3, name="big_batchnorm")
    w.optimizer_fn = lambda params: torch.optim.SGD(params, lr=0.3)
    fp16 = check(w, policies=["fp16-true"], steps=3, device="cpu").candidates[0]
    # the verdict itself: with the statistics in fp32 nothing overflows, and the run matches fp32
    # (it failed on "0.running_var ... non-finite" before; a reason without it proves nothing alone)
    assert fp16.verdict == "pass", (fp16.verdict, fp16.reason)
    assert fp16.reason.startswith("matches fp32") and "running_var" not in fp16.reason, fp16.reason


class _ComplexFilter(nn.Module):
    """A learned complex spectral filter (FNO/FFT-conv style) followed by a real head."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(9, dtype=torch.complex64) * 0.5)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(x.float(), dim=-1) * self.weight
        return self.head(torch.fft.irfft(spectrum, n=16, dim=-1))


def _complex_workload() -> mixprec.Workload:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return _regression(_ComplexFilter(), 16, name="complex_filter")


def test_complex_parameters_are_compared_whole_under_bf16_mixed():
    # bf16-mixed leaves the complex filter alone; the check must not drop its imaginary part either
    # (it once compared complex gradients by their real part, with torch's warning)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Casting complex values to real")
        result = check(_complex_workload(), policies=["bf16-mixed"], steps=3, device="cpu")
    cand = result.candidates[0]
    assert cand.verdict == "pass", cand.reason
    grads = dict(cand.worst_grads)
    assert math.isfinite(grads["weight"])  # the complex parameter's gradient was compared


def test_a_true_policy_keeps_complex_parameters_complex_and_still_fails_what_does_not_run():
    # bf16-true once cast the complex filter to real (another model: a fail for the lost imaginary
    # part). Since issue 26 it keeps it complex64; this model then feeds its own fp32 activations
    # (x.float()) to a bf16 head, which crashes: a fail for that, never a pass.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Casting complex values to real")
        result = check(_complex_workload(), policies=["bf16-true"], steps=3, device="cpu")
    cand = result.candidates[0]
    assert cand.verdict == "fail", cand.reason
    assert "imaginary" not in cand.reason and "same dtype" in cand.reason


def test_a_keep_fp32_pattern_that_matches_nothing_is_a_policy_error_naming_the_closest():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential()
        model.add_module("encoder_block", nn.Linear(16, 32))
        model.add_module("act", nn.Tanh())
        model.add_module("head", nn.Linear(32, 4))
    w = _regression(model, 16, name="no_encoder")
    cand = mixprec.Candidate("bf16-mixed", keep_fp32=("encoder.*",))
    with pytest.raises(PolicyError) as err:
        check(w, policies=[cand], steps=2, device="cpu")
    assert "'encoder.*'" in str(err.value) and "'encoder_block'" in str(err.value)


def test_a_keep_fp32_pattern_that_matches_nothing_is_a_one_line_cli_error(tmp_path, capsys):
    from mixprec.cli import main

    code = main(
        [
            "check",
            "--workload",
            "mlp",
            "--policies",
            "bf16-mixed",
            "--keep-fp32",
            "encoder.*",
            "--steps",
            "2",
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err
    assert code != 0 and "'encoder.*'" in err


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.wte = nn.Embedding(32, 16)
            self.mid = nn.Linear(16, 16)
            self.lm_head = nn.Linear(16, 32, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(torch.tanh(self.mid(self.wte(idx))))


def _tied_workload() -> mixprec.Workload:
    def make_batch(batch_size, device):
        return torch.randint(0, 32, (batch_size, 6), device=device), torch.randint(
            0, 32, (batch_size, 6), device=device
        )

    def loss_fn(m, batch):
        return nn.functional.cross_entropy(m(batch[0]).float().flatten(0, 1), batch[1].flatten())

    return mixprec.Workload(_TiedLM(), make_batch, loss_fn, name="tied_lm", default_batch_size=4)


def test_keep_fp32_on_one_side_of_a_tie_under_a_true_policy_is_refused_before_any_run():
    """Issue 26: Policy.prepare refuses the split tie, but check ran the reference first and then
    reported the candidate as 'fail: training crashed: PolicyError: keep_fp32 splits a tied weight'."""
    stages = []
    cand = mixprec.Candidate("bf16-true", keep_fp32=("lm_head",))
    with pytest.raises(PolicyError) as err:
        check(_tied_workload(), policies=[cand], steps=2, device="cpu", events=stages.append)
    message = str(err.value)
    assert "splits a tied weight" in message and "'lm_head.weight'" in message and "'wte.weight'" in message
    assert "bf16-true" in message and "add 'wte' to keep_fp32" in message and "\n" not in message
    assert stages == []  # refused before the fp32 reference ran
    # a *-mixed policy keeps fp32 master weights, so one side alone is fine there; so are both sides
    w = _tied_workload()
    framework = framework_of(w)
    fine = [
        mixprec.Candidate("bf16-mixed", keep_fp32=("lm_head",)),
        mixprec.Candidate("bf16-true", keep_fp32=("lm_head", "wte")),
    ]
    check_islands(framework, w, candidates_of(framework, fine, ()))
    assert w.model.lm_head.weight is w.model.wte.weight  # the check left the model as it was


def test_keep_fp32_on_one_side_of_a_tie_is_a_one_line_cli_policy_error(capsys):
    from mixprec.cli import main

    code = main(
        [
            "check",
            "--model",
            "gpt2",
            "--model-config",
            "n_layer=1,n_head=2,n_embd=16,vocab_size=64,block_size=16",
            "--seq-len",
            "8",
            "--policies",
            "bf16-true",
            "--keep-fp32",
            "lm_head",
            "--steps",
            "2",
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err
    assert code == PolicyError.exit_code, err
    assert "splits a tied weight" in err and "'transformer.wte.weight'" in err
    assert len(err.strip().splitlines()) == 1, err
