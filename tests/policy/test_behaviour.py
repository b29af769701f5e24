"""What each policy does to a model and a training loop on CPU."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.errors import PolicyError

CPU = mixprec.detect("cpu")
CPU_POLICIES = [n for n in mixprec.POLICY_NAMES if mixprec.check_support(n, CPU)]

OUTPUT_DTYPE = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf32": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "fp16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
    "fp16-true": torch.float16,
}
PARAM_DTYPE = {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every test here trains tiny models: one thread (see conftest.single_thread)."""


def make_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def make_batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def record_output_dtypes(model: nn.Module, names: list[str]) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}
    modules = dict(model.named_modules())
    for name in names:
        modules[name].register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, out.dtype))
    return seen


# ---------------------------------------------------------------------------------------- every policy
def test_cpu_policies_cover_the_expected_set():
    assert {"fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true"} <= set(CPU_POLICIES)
    assert "tf32" not in CPU_POLICIES


@pytest.mark.parametrize("name", CPU_POLICIES)
def test_every_cpu_policy_trains(name):
    # fp16 gradients (fp16-true) overflow at the default 65536 scale on the first step: start lower.
    options = {"init_scale": 2.0**10} if name == "fp16-true" else {}
    policy = mixprec.get_policy(name, device="cpu", **options)
    assert policy.name == name
    base = make_mlp()
    model = policy.prepare(copy.deepcopy(base))
    expected_param = PARAM_DTYPE.get(name, torch.float32)
    assert all(p.dtype == expected_param for p in model.parameters())
    assert (policy.scaler is not None) == name.startswith("fp16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with policy.precision_scope():
        for x, y in make_batches(3):
            with policy.autocast():
                out = model(x)
                assert out.dtype == OUTPUT_DTYPE[name]
                loss = F.cross_entropy(out, y)
            policy.backward(loss)
            assert policy.step(opt) is True
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    assert policy.stats.steps == 3 and policy.stats.skipped_steps == 0
    assert all(p.dtype == expected_param for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    changed = [
        not torch.equal(p.float(), q) for p, q in zip(model.parameters(), base.parameters(), strict=True)
    ]
    assert all(changed)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_fp16_true_backs_off_from_natural_overflow_then_trains():
    policy = mixprec.get_policy("fp16-true", device="cpu")
    model = policy.prepare(make_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    returned = []
    for x, y in make_batches(4):
        with policy.autocast():
            loss = F.cross_entropy(model(x), y)
        policy.backward(loss)
        returned.append(policy.step(opt))
        opt.zero_grad(set_to_none=True)
    assert returned == [False, True, True, True]
    assert policy.scaler.get_scale() == 2.0**15
    assert all(p.dtype == torch.float16 and torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", [n for n in CPU_POLICIES if n.endswith("-true")])
def test_true_policies_cast_float_inputs_and_keep_integer_inputs(name):
    policy = mixprec.get_policy(name, device="cpu")
    emb = nn.Embedding(10, 8)
    model = policy.prepare(nn.Sequential(emb, nn.Linear(8, 2)))
    seen = {}
    emb.register_forward_pre_hook(lambda m, args: seen.__setitem__("idx", args[0].dtype))
    with policy.autocast():
        out = model(torch.tensor([1, 2, 3]))
    assert seen["idx"] == torch.int64
    assert out.dtype == PARAM_DTYPE[name]


def test_autocast_of_true_policy_restores_default_dtype():
    policy = mixprec.get_policy("bf16-true", device="cpu")
    with policy.autocast():
        assert torch.get_default_dtype() == torch.bfloat16
        assert torch.zeros(1).dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32


# ---------------------------------------------------------------------------------------- keep_fp32
def test_keep_fp32_runs_module_in_fp32():
    policy = mixprec.get_policy("fp16-mixed", device="cpu", keep_fp32=["2"])
    model = policy.prepare(make_mlp())
    seen = record_output_dtypes(model, ["0", "2", "4"])
    x, y = make_batches(1)[0]
    with policy.autocast():
        out = model(x)
    assert seen == {"0": torch.float16, "2": torch.float32, "4": torch.float16}
    assert out.dtype == torch.float16
    # And it still trains through the island.
    policy.backward(F.cross_entropy(out, y))
    assert model[2].weight.grad is not None and model[2].weight.grad.dtype == torch.float32


def test_keep_fp32_island_on_true_policy_keeps_fp32_weights():
    policy = mixprec.get_policy("bf16-true", device="cpu", keep_fp32="2")
    model = policy.prepare(make_mlp())
    seen = record_output_dtypes(model, ["0", "2", "4"])
    with policy.autocast():
        out = model(make_batches(1)[0][0])
    assert model[2].weight.dtype == torch.float32
    assert model[0].weight.dtype == torch.bfloat16
    # The island computes in fp32 and hands bf16 back to its bf16 neighbours.
    assert seen == {"0": torch.bfloat16, "2": torch.bfloat16, "4": torch.bfloat16}
    assert out.dtype == torch.bfloat16
    xb = torch.randn(4, 32).bfloat16()
    with policy.autocast():
        got = model[2](xb)
    want = F.linear(xb.float(), model[2].weight, model[2].bias).bfloat16()
    assert torch.equal(got, want)


def test_keep_fp32_unmatched_pattern_raises_at_prepare():
    policy = mixprec.get_policy("fp16-mixed", device="cpu", keep_fp32=["head.*"])
    with pytest.raises(mixprec.PolicyError, match=r"'head\.\*'"):
        policy.prepare(make_mlp())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.proj(x)))


def test_keep_fp32_glob_on_nested_model():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(8, 2))
    policy = mixprec.get_policy("bf16-mixed", device="cpu", keep_fp32=["*.fc"])
    policy.prepare(model)
    names = ["0.proj", "0.fc", "1.proj", "1.fc", "2"]
    seen = record_output_dtypes(model, names)
    with policy.autocast():
        model(torch.randn(4, 8))
    assert seen == {
        "0.proj": torch.bfloat16,
        "0.fc": torch.float32,
        "1.proj": torch.bfloat16,
        "1.fc": torch.float32,
        "2": torch.bfloat16,
    }


# ---------------------------------------------------------------------------------------- channels_last
def make_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


@pytest.mark.parametrize("name", ["fp32", "bf16-mixed"])
def test_channels_last(name):
    policy = mixprec.get_policy(name, device="cpu", channels_last=True)
    model = policy.prepare(make_cnn())
    for conv in (model[0], model[2]):
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
        assert not conv.weight.is_contiguous()
    seen = {}

    def pre_hook(module, args):
        x = args[0]
        seen["channels_last"] = x.is_contiguous(memory_format=torch.channels_last)
        seen["contiguous"] = x.is_contiguous()

    model[0].register_forward_pre_hook(pre_hook)
    x = torch.randn(2, 3, 8, 8)
    assert x.is_contiguous()
    with policy.precision_scope(), policy.autocast():
        out = model(x)
    assert seen == {"channels_last": True, "contiguous": False}
    assert out.shape == (2, 4)
    assert x.is_contiguous()  # the caller's tensor is not modified


def test_no_channels_last_leaves_input_alone():
    policy = mixprec.get_policy("fp32", device="cpu")
    model = policy.prepare(make_cnn())
    seen = {}
    model[0].register_forward_pre_hook(lambda m, args: seen.__setitem__("cl", args[0].is_contiguous()))
    model(torch.randn(2, 3, 8, 8))
    assert seen == {"cl": True}
    assert model[0].weight.is_contiguous()


# ---------------------------------------------------------------------------------------- aliases
@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("fp16", "fp16-mixed"),
        ("bf16", "bf16-mixed"),
        ("32-true", "fp32"),
        ("32", "fp32"),
        ("16-mixed", "fp16-mixed"),
        ("bf16-mixed", "bf16-mixed"),
        ("16-true", "fp16-true"),
        ("bf16-true", "bf16-true"),
        (" BF16-Mixed ", "bf16-mixed"),
    ],
)
def test_aliases(alias, canonical):
    policy = mixprec.get_policy(alias, device="cpu")
    assert policy.name == canonical
    assert policy.config.name == canonical
    assert policy.state_dict()["policy"]["name"] == canonical


# ---------------------------------------------------------------------------------------- precision_scope
def _knobs() -> dict[str, str]:
    b = torch.backends
    return {
        "mkldnn.matmul": b.mkldnn.matmul.fp32_precision,
        "mkldnn.conv": b.mkldnn.conv.fp32_precision,
        "cudnn.conv": b.cudnn.conv.fp32_precision,
        "cuda.matmul": b.cuda.matmul.fp32_precision,
    }


# The scope sets and restores oneDNN's knobs whether or not this CPU honours them (bf32 needs
# AVX512-BF16 or AMX, and get_policy refuses it on an AVX2-only CPU): check=False tests it on every CPU.
def test_precision_scope_bf32():
    before = _knobs()
    with mixprec.get_policy("bf32", device="cpu", check=False).precision_scope():
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
        assert torch.backends.mkldnn.conv.fp32_precision == "bf16"
    assert _knobs() == before


def test_precision_scope_fp32_is_strict():
    before = _knobs()
    # Start from a non-strict value so the scope has something to change.
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    try:
        with mixprec.get_policy("fp32", device="cpu").precision_scope():
            assert torch.backends.cudnn.conv.fp32_precision == "ieee"
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"
            assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    finally:
        torch.backends.cudnn.conv.fp32_precision = before["cudnn.conv"]
    assert _knobs() == before


@pytest.mark.parametrize("name", ["fp32", "bf32", "bf16-mixed"])
def test_precision_scope_restores_on_error(name):
    before = _knobs()
    policy = mixprec.get_policy(name, device="cpu", check=False)  # bf32 on any CPU: see above
    with pytest.raises(ValueError, match="boom"), policy.precision_scope():
        assert _knobs() != before
        raise ValueError("boom")
    assert _knobs() == before


# ---------------------------------------------------------------------------------------- loop patterns
def test_bf16_accumulation_and_clip_value_match_manual_loop():
    """bf16-mixed, 2 micro-batches per step and clip_grad_value, against the same loop by hand."""
    clip, lr = 1e-3, 0.5
    base = make_mlp()
    batches = make_batches(6)

    manual = copy.deepcopy(base)
    opt_a = torch.optim.SGD(manual.parameters(), lr=lr)
    for i in range(0, 6, 2):
        for x, y in batches[i : i + 2]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(manual(x), y) / 2
            loss.backward()
        torch.nn.utils.clip_grad_value_(manual.parameters(), clip)
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)

    policy = mixprec.get_policy("bf16-mixed", device="cpu")
    model = policy.prepare(copy.deepcopy(base))
    opt_b = torch.optim.SGD(model.parameters(), lr=lr)
    with policy.precision_scope():
        for i in range(0, 6, 2):
            before = [p.detach().clone() for p in model.parameters()]
            for x, y in batches[i : i + 2]:
                with policy.autocast():
                    loss = F.cross_entropy(model(x), y) / 2
                policy.backward(loss)
            unclipped = max(p.grad.abs().max().item() for p in model.parameters())
            assert unclipped > clip  # so the clip has work to do
            assert policy.step(opt_b, clip_grad_value=clip) is True
            opt_b.zero_grad(set_to_none=True)
            # Plain SGD: each update is -lr * clipped grad, so no entry moves more than lr * clip.
            for p, q in zip(model.parameters(), before, strict=True):
                assert (p - q).abs().max().item() <= lr * clip + 1e-6  # + fp32 rounding of p - q
    assert policy.stats.steps == 3
    for p, q in zip(model.parameters(), manual.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["fp16-mixed", "bf16-mixed"])
def test_scheduler_not_stepped_on_skipped_step(name):
    options = {"finite_check": True} if name == "bf16-mixed" else {}
    policy = mixprec.get_policy(name, device="cpu", **options)
    model = policy.prepare(make_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    fault_step = 2
    with policy.precision_scope():
        for step, (x, y) in enumerate(make_batches(5)):
            with policy.autocast():
                loss = F.cross_entropy(model(x), y)
            if step == fault_step:
                loss = loss * float("nan")
            policy.backward(loss)
            if policy.step(opt):
                sched.step()
            opt.zero_grad(set_to_none=True)
            expected = step + 1 if step < fault_step else step
            assert sched.last_epoch == expected
    assert sched.last_epoch == 4
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
    assert policy.stats.skipped_steps == 1
    assert policy.stats.last_skipped_step == fault_step


def test_a_step_without_its_backward_later_in_a_run_names_the_missing_backward():
    """Issue 26: past the first step torch's own AssertionError ('No inf checks were recorded for
    this optimizer') came through raw."""
    policy = mixprec.get_policy("fp16-mixed", device="cpu")
    model = policy.prepare(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        with policy.autocast():
            loss = model(torch.randn(3, 4)).float().sum()
        optimizer.zero_grad()
        policy.backward(loss)
        policy.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    missing = r"found no gradient in optimizer 0 .*call policy\.backward\(loss\)"
    with pytest.raises(PolicyError, match=missing):
        policy.step(optimizer)


def test_a_stalling_true_policy_switches_to_fp32_master_weights_exactly():
    """Policy.switch from bf16-true: weights, optimizer state and buffers widened in place (every
    bf16 value is an fp32 value), the same parameter objects, the input cast gone, islands fp32."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    policy = mixprec.get_policy("bf16-true", device="cpu", keep_fp32=["2"])
    model = policy.prepare(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with policy.autocast():
        loss = model(torch.randn(5, 4)).float().sum()
    loss.backward()
    optimizer.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    with pytest.raises(PolicyError, match=r"pass the model and its optimizers"):
        policy.switch("bf16-mixed")
    with pytest.raises(PolicyError, match=r"narrowing weights and optimizer state mid-run is not exact"):
        policy.switch("fp16-true", model, optimizer)
    policy.switch("bf16-mixed", model, optimizer)
    assert policy.name == "bf16-mixed" and list(model.parameters()) == params  # the same objects
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n].float())
        assert optimizer.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(optimizer.state[p]["exp_avg"], state[n].float())
    assert model[1].running_mean.dtype == torch.float32
    with policy.autocast():
        out = model(torch.randn(5, 4))  # fp32 input, no cast hook: autocast computes the Linears
    assert out.dtype == torch.float32  # the island's output, no longer cast back to bf16
    optimizer.step()  # the widened state steps


def test_a_prepared_model_is_not_prepared_again():
    """Issue 26: fp16-true after bf16-true on the same model was accepted, its inputs going through
    the stale bf16 cast hook, then fp16."""
    model = mixprec.get_policy("bf16-true", device="cpu").prepare(nn.Linear(4, 2))
    for again in (model, copy.deepcopy(model)):
        with pytest.raises(PolicyError, match=r"prepared under 'bf16-true' already"):
            mixprec.get_policy("fp16-true", device="cpu").prepare(again)


@pytest.mark.parametrize("name", ["bf16-mixed", "bf16-true"])
def test_a_copy_of_a_prepared_model_computes_with_its_own_weights_and_pickles(name):
    """A script's EMA, best-so-far snapshot or teacher is copy.deepcopy(model). An fp32 island's
    forward was a closure over the original module's bound forward: the copy's island computed with
    the original's weights (silently), and torch.save(model) could pickle neither the island nor
    the *-true input cast (a local function)."""
    policy = mixprec.get_policy(name, device="cpu", keep_fp32=["2"])
    model = policy.prepare(make_mlp())
    twin = copy.deepcopy(model)
    x = make_batches(1)[0][0]
    with torch.no_grad(), policy.autocast():
        before, original = twin(x), model(x)
        twin[2].weight.zero_()  # the copy's island only
        after = twin(x)
        assert not torch.equal(before, after), "the copy's island computed with the original's weights"
        assert torch.equal(model(x), original)
        seen = record_output_dtypes(twin, ["0", "2"])
        twin(x)
    assert seen == {"0": OUTPUT_DTYPE[name], "2": PARAM_DTYPE.get(name, torch.float32)}
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad(), policy.autocast():
        assert torch.equal(loaded(x), original)
        loaded[2].weight.zero_()
        assert not torch.equal(loaded(x), original)  # (the loaded island is the loaded module's)


def test_a_hook_mixprec_owns_fires_on_its_module_and_its_data_parallel_replicas_only():
    """OwnHook: inert on a deep copy (an EMA's forwards are not the model's), live on the replicas
    nn.DataParallel runs the module's forward on (they share its hooks dict), inert once pickled."""
    from mixprec.policy.hooks import OwnHook

    seen = []
    model = make_mlp()
    model.register_forward_pre_hook(OwnHook(lambda m, args: seen.append(m), model))
    x = make_batches(1)[0][0]
    replica = model._replicate_for_data_parallel()  # (what DataParallel makes on each GPU)
    for module in (model, copy.deepcopy(model), replica):
        module(x)
    assert seen == [model, replica]
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=False)(x)
    assert len(seen) == 2


class TiedLM(nn.Module):
    """nanoGPT's tie: the LM head's weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(torch.relu(self.mid(self.wte(idx))))


def test_keep_fp32_on_one_side_of_a_tie_names_both_paths():
    """Issue 26: the tie survived with the shared weight fp32, and the first step raised
    'mixed dtype (CPU): expect parameter to have scalar type of Float'."""
    with pytest.raises(PolicyError, match=r"'lm_head.weight' is the same tensor as 'wte.weight'.*add 'wte'"):
        mixprec.get_policy("bf16-true", device="cpu", keep_fp32=["lm_head"]).prepare(TiedLM())
    model = mixprec.get_policy("bf16-true", device="cpu", keep_fp32=["lm_head", "wte"]).prepare(TiedLM())
    assert model.lm_head.weight is model.wte.weight and model.wte.weight.dtype == torch.float32
    model(torch.randint(0, 16, (2, 5))).float().sum().backward()  # trains, the tie kept
    plain = mixprec.get_policy("bf16-true", device="cpu").prepare(TiedLM())
    assert plain.lm_head.weight is plain.wte.weight and plain.wte.weight.dtype == torch.bfloat16


class ComplexFilter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.filter = nn.Parameter(torch.randn(8, dtype=torch.complex64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        spectrum = torch.fft.fft(self.proj(x).float()) * self.filter
        return torch.fft.ifft(spectrum).real


@pytest.mark.parametrize("name", ["bf16-true", "fp16-true"])
def test_true_policies_leave_complex_and_integer_tensors_alone(name):
    """Issue 26: a complex parameter was cast to a real half dtype ('Casting complex values to real
    discards the imaginary part')."""
    model = mixprec.get_policy(name, device="cpu").prepare(ComplexFilter())
    assert model.filter.dtype == torch.complex64 and model.steps.dtype == torch.int64
    assert model.proj.weight.dtype == mixprec.get_policy(name, device="cpu").spec.param_dtype
    model(torch.randn(3, 8)).sum().backward()
    assert model.filter.grad is not None and model.filter.grad.dtype == torch.complex64


@pytest.mark.parametrize("name", ["fp16-true", "bf16-true"])
def test_true_policies_keep_batch_norm_statistics_fp32_so_large_activations_do_not_break_eval(name):
    """fp16's running variance overflows on large activations (inf, then nan in eval); the layer's
    weights and statistics stay fp32 while its input and output keep the policy's half dtype."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 2)
    )
    policy = mixprec.get_policy(name, device="cpu")
    policy.prepare(model)
    half = policy.spec.param_dtype
    assert model[0].weight.dtype == half and model[4].weight.dtype == half
    assert {t.dtype for t in (*model[1].parameters(), model[1].running_var, model[1].running_mean)} == {
        torch.float32
    }
    assert model[1].num_batches_tracked.dtype == torch.int64
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8) * 3000  # activations whose square passes fp16's 65504
        with policy.autocast():
            loss = model(x).float().square().mean()
        policy.backward(loss)
        policy.step(optimizer)
        optimizer.zero_grad()
    assert torch.isfinite(model[1].running_var).all()
    model.eval()
    with torch.no_grad(), policy.autocast():
        out = model(torch.randn(2, 3, 8, 8) * 3000)
    assert out.dtype == half and torch.isfinite(out).all()


def train_until_error(policy, model, optimizer, batches):
    for x, y in batches:
        with policy.autocast():
            loss = F.cross_entropy(model(x), y)
        policy.backward(loss)
        policy.step(optimizer)
        optimizer.zero_grad(set_to_none=True)


def test_fp16_true_adam_whose_eps_rounds_to_0_blames_the_weights_and_eps_not_the_gradients():
    """Issue 26: Adam's default eps=1e-8 is 0 in fp16, the first step divides 0 by 0 into the
    weights, and the loss scaler then skipped every step until a ScaleCollapseError blamed the
    gradients ('non-finite gradients in: 0.weight, ...; keep those modules in fp32')."""
    from mixprec import errors

    policy = mixprec.get_policy("fp16-true", device="cpu")
    model = policy.prepare(make_mlp())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    with pytest.raises(FloatingPointError) as info:
        train_until_error(policy, model, optimizer, make_batches(40))
    message = str(info.value)
    assert isinstance(info.value, errors.NonFiniteWeightsError), message
    assert "weights became non-finite after an optimizer step" in message and "'0.weight'" in message
    assert "Adam eps=1e-08 rounds to 0 in float16" in message and "eps>=1e-4" in message
    assert "fp16-mixed" in message and "\n" not in message
    assert "non-finite gradients in" not in message
    assert info.value.parameters[0] == "0.weight"
    assert info.value.exit_code == 4


def test_a_finite_check_policy_whose_weights_turned_nan_blames_the_weights():
    """Without a loss scaler (finite_check=True) the same: 20 skipped steps on gradients that a NaN
    weight makes NaN are the weights' doing; nothing names an eps that bf16 represents."""
    from mixprec import errors

    policy = mixprec.get_policy("bf16-true", device="cpu", finite_check=True)
    model = policy.prepare(make_mlp())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = make_batches(30)
    train_until_error(policy, model, optimizer, batches[:1])
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError) as info:
        train_until_error(policy, model, optimizer, batches[1:])
    message = str(info.value)
    assert isinstance(info.value, errors.NonFiniteWeightsError), message
    assert "'2.weight'" in message and "eps=" not in message and "\n" not in message


class SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(32, 4)

    def forward(self, idx):
        return self.head(self.emb(idx).flatten(1))


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_fp16_true_sgd_momentum_on_sparse_gradients_is_refused_in_one_line(momentum):
    """Issue 26: torch has no Half kernel for adding sparse tensors on the CPU ('"cadd_sparse" not
    implemented for 'Half''), which SGD's momentum buffer of a sparse gradient needs from its second
    step on; that raw NotImplementedError passed through. Without momentum SGD still trains."""
    policy = mixprec.get_policy("fp16-true", device="cpu", init_scale=2.0**8)
    model = policy.prepare(SparseBag())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 50, (8, 4), generator=g), torch.randint(0, 4, (8,), generator=g))] * 3
    if not momentum:
        train_until_error(policy, model, optimizer, batches)
        assert policy.stats.steps == 3 and model.emb.weight.dtype == torch.float16
        return
    with pytest.raises(mixprec.UnsupportedError) as info:
        train_until_error(policy, model, optimizer, batches)
    message = str(info.value)
    assert "'emb.weight'" in message and "'fp16-true'" in message and "sparse" in message
    assert "fp16-mixed" in message and "momentum" in message and "sparse=False" in message
    assert "\n" not in message and isinstance(info.value.__cause__, NotImplementedError)
