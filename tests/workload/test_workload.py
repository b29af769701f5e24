"""The model zoo and the workload loader: shapes, determinism, factories and their error messages."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from mixprec.errors import UsageError
from mixprec.workload.loader import load_workload, workload_from_spec
from mixprec.workload.workload import Workload, WorkloadSpec
from mixprec.workload.zoo import ZOO_NAMES, GPTConfig, build_zoo_workload

TINY_GPT = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "seq_len": 16}
CPU = torch.device("cpu")

# Small but complete settings for each zoo model.
TINY = {
    "resnet50": {"image_size": 32},
    "vgg19": {"image_size": 32},
    "densenet121": {"image_size": 32},
    "gpt2": TINY_GPT,
    "mlp": {},
}


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# --------------------------------------------------------------------------------------------------
# Zoo


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_model_builds_and_trains_one_step(name):
    w = build_zoo_workload(name, **TINY[name])
    assert isinstance(w, Workload)
    assert w.name == name
    assert w.spec == WorkloadSpec("zoo", name, tuple(sorted(TINY[name].items())))
    assert w.description.startswith(name) and "\n" not in w.description
    assert w.default_batch_size >= 1

    x, y = w.make_batch(2, CPU)
    if name in ("resnet50", "vgg19", "densenet121"):
        assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32
        assert y.shape == (2,) and y.dtype == torch.int64 and int(y.max()) < 1000
    elif name == "gpt2":
        assert x.shape == y.shape == (2, 16) and x.dtype == y.dtype == torch.int64
        assert int(x.max()) < 1000
    else:
        assert x.shape == (2, 64) and x.dtype == torch.float32
        assert y.shape == (2,) and y.dtype == torch.int64 and int(y.max()) < 10

    loss = w.loss_fn(w.model, (x, y))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in w.model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    if name in ("gpt2", "mlp"):  # an optimizer step on the 144M-parameter vgg19 is slow on a CPU
        w.make_optimizer(w.model).step()


def test_default_batch_sizes_and_optimizers():
    gpt = build_zoo_workload("gpt2", **TINY_GPT)
    assert gpt.default_batch_size == 8
    opt = gpt.make_optimizer(gpt.model)
    assert isinstance(opt, torch.optim.AdamW)
    # nanoGPT's configure_optimizers: matrices and embeddings decay, biases and LayerNorms do not
    decay, no_decay = opt.param_groups
    assert opt.defaults["lr"] == 6e-4 and opt.defaults["betas"] == (0.9, 0.95)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(p) for p in gpt.model.parameters() if p.dim() >= 2}
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in gpt.model.parameters() if p.dim() < 2}
    assert any(p is gpt.model.transformer.wte.weight for p in decay["params"])

    mlp = build_zoo_workload("mlp")
    assert mlp.default_batch_size == 64
    sgd = mlp.make_optimizer(mlp.model)  # at 0.1: it learns within a check's 8 steps
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["lr"] == 0.1 and sgd.defaults["momentum"] == 0.9


def test_gpt2_default_config_is_gpt2_small():
    w = build_zoo_workload("gpt2")
    assert w.spec == WorkloadSpec("zoo", "gpt2", ())
    assert w.model.config == GPTConfig()
    assert 124e6 <= _n_params(w.model) <= 124.6e6  # 124,439,808 with the tied head
    assert w.model.lm_head.weight is w.model.transformer.wte.weight
    names = dict(w.model.named_modules())
    for layer in (
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0.attn.c_attn",
        "transformer.h.0.attn.c_proj",
        "transformer.h.0.mlp.c_fc",
        "transformer.h.0.mlp.c_proj",
        "transformer.h.11.ln_2",
        "transformer.ln_f",
        "lm_head",
    ):
        assert layer in names, layer
    x, y = w.make_batch(1, CPU)
    assert x.shape == (1, 128)
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-token targets


def test_gpt2_attention_is_causal():
    w = build_zoo_workload("gpt2", **TINY_GPT)
    x, _ = w.make_batch(1, CPU)
    with torch.no_grad():
        full = w.model(x)
        changed = x.clone()
        changed[0, -1] = (changed[0, -1] + 1) % 1000
        other = w.model(changed)
    assert full.shape == (1, 16, 1000)
    torch.testing.assert_close(full[:, :-1], other[:, :-1])
    assert not torch.equal(full[:, -1], other[:, -1])


def test_resnet50_has_25_6m_parameters():
    w = build_zoo_workload("resnet50")
    assert 25.5e6 <= _n_params(w.model) <= 25.6e6
    assert w.spec == WorkloadSpec("zoo", "resnet50", ())
    assert "224x224" in w.description


def test_mlp_config():
    w = build_zoo_workload("mlp", hidden=32, depth=3)
    assert [m.out_features for m in w.model if isinstance(m, nn.Linear)] == [32, 32, 32, 10]
    assert w.spec == WorkloadSpec("zoo", "mlp", (("depth", 3), ("hidden", 32)))


# --------------------------------------------------------------------------------------------------
# Determinism


@pytest.mark.parametrize("name", ["mlp", "gpt2", "densenet121"])
def test_two_builds_are_identical_and_leave_the_rng_alone(name):
    torch.manual_seed(987)
    before = torch.get_rng_state()
    a = build_zoo_workload(name, **TINY[name])
    assert torch.equal(torch.get_rng_state(), before)
    b = build_zoo_workload(name, **TINY[name])
    assert torch.equal(torch.get_rng_state(), before)
    _assert_same_state(a.model, b.model)

    first_a, first_b = a.make_batch(4, CPU), b.make_batch(4, CPU)
    for ta, tb in zip(first_a, first_b, strict=True):
        assert torch.equal(ta, tb)
    second_a = a.make_batch(4, CPU)
    assert not torch.equal(first_a[0], second_a[0])  # a sequence, not one batch repeated
    assert torch.equal(torch.get_rng_state(), before)  # batches use their own generator


def test_build_does_not_depend_on_the_callers_seed():
    torch.manual_seed(1)
    a = build_zoo_workload("mlp")
    torch.manual_seed(2)
    b = build_zoo_workload("mlp")
    _assert_same_state(a.model, b.model)


# --------------------------------------------------------------------------------------------------
# Zoo errors


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: build_zoo_workload("resnet5"), r"'resnet5'.*resnet50, vgg19.*Did you mean 'resnet50'"),
        (lambda: build_zoo_workload("gpt2", image_size=64), r"image_size=64 does not apply.*seq_len"),
        (
            lambda: build_zoo_workload("mlp", image_size=64),
            r"image_size=64 does not apply to zoo model 'mlp'",
        ),
        (lambda: build_zoo_workload("vgg19", seq_len=64), r"seq_len=64 does not apply.*image_size"),
        (lambda: build_zoo_workload("gpt2", seq_len=2048), r"seq_len=2048 exceeds block_size=1024"),
        (lambda: build_zoo_workload("gpt2", n_layers=2), r"'n_layers'.*n_layer.*Did you mean 'n_layer'"),
        (lambda: build_zoo_workload("gpt2", n_embd=65, n_head=2), r"n_embd=65 is not divisible"),
        (
            lambda: build_zoo_workload("resnet50", image_size=8),
            r"image_size for model 'resnet50' must be an integer >= 32, got 8",
        ),
        (lambda: build_zoo_workload("resnet50", width=2), r"'width'.*valid options: image_size"),
        (lambda: build_zoo_workload("mlp", hiden=8), r"'hiden'.*Did you mean 'hidden'"),
        (lambda: build_zoo_workload("mlp", depth=0), r"depth for model 'mlp' must be an integer >= 1, got 0"),
        (
            lambda: build_zoo_workload("mlp").make_batch(0, CPU),
            r"batch_size for workload 'mlp' must be an integer >= 1, got 0",
        ),
    ],
)
def test_zoo_errors(call, fragment):
    with pytest.raises(UsageError, match=fragment):
        call()


# --------------------------------------------------------------------------------------------------
# Loader

FACTORY_FILE = """
import torch
from torch import nn
import torch.nn.functional as F
from mixprec.workload import Workload
{extra}

def make_workload(width=8):
    torch.manual_seed(0)
    model = nn.Linear(4, width)
    gen = torch.Generator().manual_seed(0)

    def make_batch(batch_size, device):
        return torch.randn(batch_size, 4, generator=gen).to(device)

    return Workload(model, make_batch, lambda m, x: m(x).square().mean(), name="mine")
"""


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_load_zoo_name():
    w = load_workload("mlp", hidden=16)
    assert w.name == "mlp"
    assert w.spec == WorkloadSpec("zoo", "mlp", (("hidden", 16),))


def test_load_file_factory_and_sys_path_is_restored(tmp_path):
    _write(tmp_path / "helper.py", "WIDTH = 5\n")
    # The factory imports a sibling module, so the file's directory must be importable.
    _write(tmp_path / "wl.py", FACTORY_FILE.format(extra="import helper"))
    path_before = list(sys.path)
    target = f"{tmp_path / 'wl.py'}:make_workload"
    w = load_workload(target)
    assert sys.path == path_before
    assert w.name == "mine" and isinstance(w.model, nn.Linear) and w.model.out_features == 8
    assert w.spec == WorkloadSpec("factory", target, ())
    assert w.loss_fn(w.model, w.make_batch(3, CPU)).dim() == 0

    w2 = load_workload(target, width=3)
    assert w2.model.out_features == 3
    assert w2.spec == WorkloadSpec("factory", target, (("width", 3),))
    assert sys.path == path_before


def test_file_factory_spec_round_trip(tmp_path):
    _write(tmp_path / "wl.py", FACTORY_FILE.format(extra=""))
    w = load_workload(f"{tmp_path / 'wl.py'}:make_workload", width=6)
    rebuilt = workload_from_spec(w.spec)
    _assert_same_state(w.model, rebuilt.model)
    assert rebuilt.spec == w.spec


def test_zoo_spec_round_trip():
    w = build_zoo_workload("gpt2", **TINY_GPT)
    rebuilt = workload_from_spec(w.spec)
    _assert_same_state(w.model, rebuilt.model)
    assert rebuilt.spec == w.spec
    assert torch.equal(w.make_batch(2, CPU)[0], rebuilt.make_batch(2, CPU)[0])


def test_load_module_function(tmp_path, monkeypatch):
    pkg = tmp_path / "mywl_pkg"
    pkg.mkdir()
    _write(pkg / "__init__.py", "")
    _write(pkg / "models.py", FACTORY_FILE.format(extra="NOT_CALLABLE = 3"))
    monkeypatch.syspath_prepend(str(tmp_path))
    w = load_workload("mywl_pkg.models:make_workload", width=2)
    assert w.model.out_features == 2
    assert w.spec == WorkloadSpec("factory", "mywl_pkg.models:make_workload", (("width", 2),))
    _assert_same_state(w.model, workload_from_spec(w.spec).model)

    with pytest.raises(UsageError, match=r"'NOT_CALLABLE' is a int, not callable"):
        load_workload("mywl_pkg.models:NOT_CALLABLE")
    with pytest.raises(UsageError, match=r"no function 'make_workloads'.*Did you mean 'make_workload'"):
        load_workload("mywl_pkg.models:make_workloads")


def test_factory_keeps_its_own_spec(tmp_path):
    _write(
        tmp_path / "own.py",
        """
        from mixprec.workload import WorkloadSpec
        from mixprec.workload.zoo import build_zoo_workload

        def make():
            w = build_zoo_workload("mlp")
            return w
        """,
    )
    w = load_workload(f"{tmp_path / 'own.py'}:make")
    assert w.spec == WorkloadSpec("zoo", "mlp", ())


BAD_FACTORIES = """
from mixprec.workload import Workload

def raises():
    raise ValueError("no data here")

def returns_dict():
    return {"model": None}

def no_args():
    from mixprec.workload.zoo import build_zoo_workload
    return build_zoo_workload("mlp")

def helper_one():
    pass
"""


@pytest.mark.parametrize(
    ("target", "sizes", "fragment"),
    [
        ("bad.py:raises", {}, r"workload factory '.*bad.py:raises' raised ValueError: no data here"),
        ("bad.py:returns_dict", {}, r"returned dict, expected a mixprec.Workload"),
        ("bad.py:no_arg", {}, r"no function 'no_arg'.*helper_one.*Did you mean 'no_args'"),
        ("bad.py:no_args", {"image_size": 64}, r"does not accept image_size=64.*none"),
        ("missing.py:f", {}, r"missing.py.*does not exist"),
    ],
)
def test_file_factory_errors(tmp_path, target, sizes, fragment):
    _write(tmp_path / "bad.py", BAD_FACTORIES)
    path_before = list(sys.path)
    with pytest.raises(UsageError, match=fragment):
        load_workload(f"{tmp_path}/{target}", **sizes)
    assert sys.path == path_before


def test_file_that_fails_to_execute(tmp_path):
    _write(tmp_path / "broken.py", "import no_such_module_mixprec_test\n")
    path_before = list(sys.path)
    with pytest.raises(
        UsageError, match=r"broken.py.*raised ModuleNotFoundError.*no_such_module_mixprec_test"
    ):
        load_workload(f"{tmp_path / 'broken.py'}:f")
    assert sys.path == path_before


@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        ("resnet", r"'resnet' is neither a zoo model.*resnet50, vgg19.*Did you mean 'resnet50'"),
        ("train.py", r"'train.py' is neither.*'train.py:make_workload'"),
        ("no_such_pkg_mixprec.mod:f", r"cannot import module 'no_such_pkg_mixprec.mod'.*No module named"),
        ("mixprec.workload.zoo:", r"malformed"),
        ("", r"empty"),
    ],
)
def test_target_errors(target, fragment):
    with pytest.raises(UsageError, match=fragment):
        load_workload(target)


def test_usage_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_workload("nope")
