"""The mixprec and plain-PyTorch exports, run on CPU: hooks confirm each policy, and both train the
same weights bit for bit (the plain text is everything Policy does, written out)."""

from __future__ import annotations

import inspect

import pytest
import torch
from harness import (
    CASES,
    STEPS,
    accumulating,
    check_accumulation,
    counting_steps,
    micro_batches,
    run_case,
    run_plain,
    skip_where_unsupported,
    with_sgd,
)

import mixprec

# tf32 is a CUDA math mode: on a CPU it would be plain fp32 under a tf32 label.
REFUSED = {"tf32"}


@pytest.mark.parametrize("target", ["mixprec", "pytorch"])
@pytest.mark.parametrize("case", CASES)
def test_export_runs_the_policy(target, case):
    run_case(target, case, REFUSED, lambda config: run_plain(config, target))


@pytest.mark.parametrize("case", [c for c in CASES if c not in REFUSED])
def test_plain_and_mixprec_train_identically(case):
    config = CASES[case]
    skip_where_unsupported(config)
    plain = run_plain(config, "pytorch")
    via_mixprec = run_plain(config, "mixprec")
    weights = plain.model.state_dict(), via_mixprec.model.state_dict()
    for key, value in weights[0].items():
        assert value.dtype == weights[1][key].dtype
        # bit for bit; NaN where both are (fp16-true with AdamW: its eps underflows in fp16)
        torch.testing.assert_close(value, weights[1][key], rtol=0, atol=0, equal_nan=True, msg=key)
    stats = via_mixprec.namespace["policy"].stats
    assert stats.steps == STEPS
    assert plain.namespace["scheduler"].last_epoch == stats.steps - stats.skipped_steps
    if config.spec.loss_scaling:
        assert plain.scaler.get_scale() == stats.scale
        if config.spec.autocast_dtype is not None:
            assert stats.skipped_steps == 1  # the planted overflow (fp16-true's AdamW makes NaN weights)


def _optimizer_step_compiles(steps: int) -> int:
    """How often dynamo compiles the optimizer's step inside a compiled train step over ``steps``
    steps, with a scheduler changing the (float) learning rate after every step."""
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    torch._dynamo.reset()
    clear_compilation_metrics()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)

    @torch.compile
    def train_step(x: torch.Tensor) -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(steps):
        train_step(torch.ones(4, 2))
        scheduler.step()
    code = inspect.unwrap(type(optimizer).step).__code__
    where = (code.co_filename, code.co_firstlineno)
    return sum(
        1
        for m in get_compilation_metrics()
        if (m.co_filename, m.co_firstlineno) == where and m.graph_op_count
    )


def test_a_scheduler_recompiles_the_compiled_optimizer_step_once():
    """Why the step-scope exports keep your optimizer's float lr: the compiled step specializes on
    it, the scheduler's first change recompiles it once with the lr as a dynamic value, and no later
    change does, so dynamo's recompile limit (past which the step would run eagerly) is never reached.
    PyTorch's compiled-optimizer recipe wraps the lr in a tensor for that; torch 2.14 does not need it."""
    assert _optimizer_step_compiles(steps=6) == 2


@pytest.mark.parametrize("target", ["mixprec", "pytorch"])
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_accumulation_steps_once_per_effective_batch(target, policy):
    """Micro-batches of 4, 3 per optimizer step: every step sees 12 samples, and the weights are the
    plain reference loop's over the same micro-batches (loss / 3 each), bit for bit."""
    source = accumulating(policy)
    with counting_steps():
        run = run_plain(source, target, loader=micro_batches(), edit=with_sgd)
    check_accumulation(source, run, target)


@pytest.mark.parametrize("name", ["fp16-true", "bf16-true"])
def test_the_plain_export_keeps_batch_norm_fp32_as_the_policy_does(name):
    """The pytorch export of a *-true policy leaves BatchNorm's weights and running statistics
    fp32, as Policy.prepare() does (fp16 statistics overflowed on large activations); both train
    the same weights bit for bit."""
    from harness import execute
    from torch import nn

    import mixprec
    from mixprec.exports import export

    def bn_net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)
        )

    torch.manual_seed(1)
    loader = [(torch.randn(4, 3, 6, 6) * 300, torch.randint(0, 2, (4,))) for _ in range(2)]

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]).float(), batch[1])

    config = mixprec.PolicyConfig(name, "cpu")
    text = with_sgd(export(config, "pytorch"))  # fp16 AdamW's eps=1e-8 rounds to 0: not this test's
    ns = execute(text, {"model": bn_net(), "loader": loader, "loss_fn": loss_fn})
    exported = ns["model"]
    policy = mixprec.get_policy(name, device="cpu")
    reference = policy.prepare(bn_net())
    assert {k: v.dtype for k, v in exported.state_dict().items()} == {
        k: v.dtype for k, v in reference.state_dict().items()
    }
    assert exported[1].running_var.dtype == torch.float32 and torch.isfinite(exported[1].running_var).all()


def test_the_plain_export_refuses_keep_fp32_that_splits_a_tied_weight_before_training():
    """A tied embedding and head with keep_fp32 on the head under bf16-true: the export names both
    paths at preparation, as Policy.prepare does (it failed at the first matmul: 'mixed dtype')."""
    from harness import execute
    from torch import nn

    import mixprec
    from mixprec.exports import export

    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, idx):
            return self.head(self.wte(idx))

    text = export(mixprec.PolicyConfig("bf16-true", "cpu", keep_fp32=("head",)), "pytorch")
    loader = [(torch.randint(0, 16, (2, 3)), torch.randint(0, 16, (2, 3)))]

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]).flatten(0, 1).float(), batch[1].flatten())

    with pytest.raises(
        ValueError, match=r"keep_fp32 splits a tied weight: 'head.weight' is the same tensor as 'wte.weight'"
    ):
        execute(text, {"model": TiedLM(), "loader": loader, "loss_fn": loss_fn})
    with pytest.raises(mixprec.errors.PolicyError, match="splits a tied weight"):
        mixprec.get_policy("bf16-true", device="cpu", keep_fp32=["head"]).prepare(TiedLM())


@pytest.mark.parametrize("name", ["bf16-true", "fp16-true"])
def test_the_true_export_says_its_stock_optimizer_keeps_half_state(name):
    """Under *-true the plain export's AdamW keeps exp_avg and exp_avg_sq in the half dtype (lint's
    MP306): the comment above the optimizer line says so; *-mixed writes none (fp32 state)."""
    from mixprec.exports import export

    config = mixprec.PolicyConfig(name, "cpu")
    lines = export(config, "pytorch", device="cpu").splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("optimizer = torch.optim.AdamW("))
    note = " ".join(line.lstrip("# ") for line in lines[at - 5 : at] if line.startswith("#"))
    short = name.split("-")[0]
    assert f"keeps its state (exp_avg, exp_avg_sq) in {short}" in note and "MP306" in note
    run = run_plain(config, "pytorch")
    state = run.optimizer.state[run.model.layers[0][0].weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == config.spec.param_dtype
    assert "MP306" not in export(mixprec.PolicyConfig(f"{short}-mixed", "cpu"), "pytorch", device="cpu")
