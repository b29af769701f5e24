"""The generated-model fuzz tier: Hypothesis builds small ``nn.Module``s from the shapes users write
(an embedding tied to the output head, a weight shared by two layers, buffers persistent, transient
and None, integer and bool buffers, BatchNorm/LayerNorm/GroupNorm, dense and sparse embeddings,
complex and float64 parameters and layers, a frozen block or parameter, a layer never called,
keyword and dict inputs, dict and tuple outputs, fp32 islands, clipping and finite_check) and runs
each under every policy that means what it says on a CPU:

- ``policy.prepare`` and 2-3 optimizer steps through ``autocast`` / ``backward`` / ``step``;
- ``mixprec.check`` of a Workload built from the model, all those policies at once, two steps;
- ``export_all`` of each candidate (text only: the texts are not run).

The property: every outcome is (a) it ran / passed, (b) a verdict other than pass with a reason, or
(c) a one-line refusal (a :class:`~mixprec.errors.MixprecError`); never a traceback of another type
(but for the torch kernel gaps in :data:`TORCH_GAPS`), never a check whose training crashed where
the same steps ran, and never a silently changed dtype: a tie stays one Parameter, complex tensors
stay complex, integer and bool buffers keep their dtype; under *-true the floating tensors are the
half dtype except in fp32 islands and BatchNorm layers (fp32 on purpose), under the other policies
they keep their own. ``hypothesis.event`` records the outcome of each input
(``--hypothesis-show-statistics``); the last test prints how many models and (model, policy) inputs
were tried.

The low-format Linear policies (fp8-rowwise, fp8-tensorwise, mxfp8, nvfp4) run fast on CUDA only,
but their numerics run here (``get_policy(check=False)``: torchao's Float8Linear, mixprec's BlockLinear
emulation) and ``mixprec.check`` predicts them here, so a second test takes them through the same
property, on models wide enough for their kernels and with a random precision map ``keep_bf16``,
and four of their own: a tie stays one Parameter; a float64, complex or float16 Linear keeps its
dtype; the map is applied as written or refused naming the entry; every Parameter after prepare is
the object it was (an optimizer built before prepare trains the converted layers).

Examples are derandomised (the same models on every run, so CI cannot flake) and sized to keep the
file near 14 s on a 2-core CPU; ``MIXPREC_FUZZ_SCALE=10`` tries ten times as many.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import re
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec.errors import MixprecError
from mixprec.exports import EXPORT_TARGETS, export_all
from mixprec.policy import POLICIES, POLICY_NAMES, Candidate
from mixprec.policy.blockscale import DIRECTIONS, BlockLinear
from mixprec.policy.islands import is_fp32_island
from mixprec.status import Status

SCALE = float(os.environ.get("MIXPREC_FUZZ_SCALE", "1"))
EXAMPLES = 40

# The policies that mean what they say on a CPU (tf32 and fp8 hold on CUDA only). A CPU without
# native bf16 refuses bf32 with an UnsupportedError: a one-line refusal, outcome (c).
CPU_POLICIES = tuple(
    n for n in POLICY_NAMES if POLICIES[n].device_only is None or POLICIES[n].device_only.device_type == "cpu"
)
VOCAB = 11
MAX_TRIES = 20  # training steps of one input, skipped ones included
BATCH = 4

# What was tried in this run (the last test prints it).
TRIED: Counter[str] = Counter()
OUTCOMES: Counter[str] = Counter()


def _settings(examples: int) -> settings:
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,  # no example database: every run tries the same inputs
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,  # single_thread: set once for all examples
        ],
    )


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


# ------------------------------------------------------------------ the generated models


@dataclass(frozen=True)
class Recipe:
    """What one generated model is made of; its repr is the minimal reproduction of a failure."""

    width: int = 8
    norm: str = "none"  # none / batch / layer / group
    embedding: str = "none"  # none / dense / sparse
    tied: bool = False  # the output head's weight is the embedding's
    shared: bool = False  # one weight in two Linear layers
    buffers: tuple[str, ...] = ()  # persistent / transient (persistent=False) / int / bool / none (None)
    complex: str = "none"  # none / param (an element-wise complex filter) / linear (a complex64 Linear)
    float64: str = "none"  # none / param / linear
    frozen: str = "none"  # none / block (a sub-module with requires_grad False) / bias (one parameter)
    unused: bool = False  # a layer forward never calls: its parameters get no gradient
    inputs: str = "positional"  # positional / keyword / dict (one dict argument)
    output: str = "tensor"  # tensor / dict / tuple (logits, hidden state, None)
    optimizer: str = "sgd"  # sgd / momentum / adagrad / adam / adamw
    step: str = "plain"  # plain / clip (clip_grad_norm) / finite_check (the policies without a scaler)
    keep_fp32: tuple[str, ...] = ()  # module-name patterns for the *-mixed and *-true policies
    # the low-format Linear policies' draws only (fp8-*, mxfp8, nvfp4):
    float16: str = "none"  # none / linear (a float16 Linear: the fp32-master policies refuse the model)
    keep_bf16: tuple[str, ...] = ()  # the precision map, as drawn (directions dropped under fp8 ...)
    fp8_directions: bool = False  # ... unless this: fp8 is given the directions, and must refuse them
    vocab: int = VOCAB  # with an embedding: the tokens and the head's outputs (32: a head they convert)


class Generated(nn.Module):
    """x (batch, width) and token ids (batch, 3) -> logits (and more, when the recipe asks)."""

    def __init__(self, r: Recipe) -> None:
        super().__init__()
        d = r.width
        self.r = r
        self.inp = nn.Linear(d, d)
        norms = {"batch": lambda: nn.BatchNorm1d(d), "layer": lambda: nn.LayerNorm(d)}
        norms["group"] = lambda: nn.GroupNorm(2, d)
        self.norm = norms.get(r.norm, nn.Identity)()
        if r.embedding != "none":
            self.embed = nn.Embedding(r.vocab, d, sparse=r.embedding == "sparse")
        self.head = nn.Linear(d, r.vocab if r.embedding != "none" else 3, bias=False)
        if r.tied and r.embedding != "none":
            self.head.weight = self.embed.weight
        if r.shared:
            self.left, self.right = nn.Linear(d, d), nn.Linear(d, d)
            self.right.weight = self.left.weight
        if r.frozen == "block":
            self.frozen = nn.Sequential(nn.Linear(d, d), nn.Tanh())
            self.frozen.requires_grad_(False)
        elif r.frozen == "bias":
            self.inp.bias.requires_grad_(False)
        if r.unused:
            self.unused = nn.Linear(d, d)
        if r.complex == "param":
            self.filter = nn.Parameter(torch.randn(d, dtype=torch.complex64) * 0.1)
        elif r.complex == "linear":
            self.spectral = nn.Linear(d, d, dtype=torch.complex64)
        if r.float64 == "param":
            self.scale64 = nn.Parameter(torch.ones(d, dtype=torch.float64))
        elif r.float64 == "linear":
            self.wide = nn.Linear(d, d, dtype=torch.float64)
        if r.float16 == "linear":
            self.narrow = nn.Linear(d, d, dtype=torch.float16)
        buffers = {
            "persistent": lambda: self.register_buffer("shift", torch.zeros(d)),
            "transient": lambda: self.register_buffer("mask", torch.ones(d), persistent=False),
            "int": lambda: self.register_buffer("calls", torch.zeros((), dtype=torch.int64)),
            "bool": lambda: self.register_buffer("keep", torch.ones(d, dtype=torch.bool)),
            "none": lambda: self.register_buffer("cache", None),
        }
        for kind in r.buffers:
            buffers[kind]()

    def forward(self, x: Any, ids: torch.Tensor | None = None) -> Any:
        r = self.r
        if isinstance(x, dict):
            x, ids = x["x"], x["ids"]
        h = self.inp(x)
        if r.embedding != "none":
            h = h + self.embed(ids).mean(1).to(h.dtype)
        h = self.norm(h)
        if r.shared:
            h = self.right(torch.relu(self.left(h)))
        if r.frozen == "block":
            h = h + self.frozen(h)
        if r.complex == "param":
            h = h + (h.to(self.filter.dtype) * self.filter).real.to(h.dtype)
        elif r.complex == "linear":
            h = h + self.spectral(h.to(self.spectral.weight.dtype)).real.to(h.dtype)
        if r.float64 == "param":
            h = (h.to(self.scale64.dtype) * self.scale64).to(h.dtype)
        elif r.float64 == "linear":
            h = h + self.wide(h.to(self.wide.weight.dtype)).to(h.dtype)
        if r.float16 == "linear":
            h = h + self.narrow(h.to(self.narrow.weight.dtype)).to(h.dtype)
        if "persistent" in r.buffers:
            h = h + self.shift.to(h.dtype)
        if "transient" in r.buffers:
            h = h * self.mask.to(h.dtype)
        if "bool" in r.buffers:
            h = h * self.keep.to(h.dtype)
        if "int" in r.buffers:
            self.calls += 1
        logits = self.head(h)
        if r.output == "dict":
            return {"logits": logits, "hidden": h}
        if r.output == "tuple":
            return logits, h, None
        return logits


def _logits(out: Any) -> torch.Tensor:
    return out["logits"] if isinstance(out, dict) else out[0] if isinstance(out, tuple) else out


def workload_of(r: Recipe) -> mixprec.Workload:
    torch.manual_seed(0)
    model = Generated(r)
    classes = r.vocab if r.embedding != "none" else 3

    def make_batch(batch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        x = torch.randn(batch_size, r.width, device=device)
        ids = torch.randint(0, r.vocab, (batch_size, 3), device=device)
        return x, ids, torch.randint(0, classes, (batch_size,), device=device)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, ids, labels = batch
        if r.inputs == "keyword":
            out = m(x, ids=ids)
        elif r.inputs == "dict":
            out = m({"x": x, "ids": ids})
        else:
            out = m(x, ids)
        return nn.functional.cross_entropy(_logits(out).float(), labels)

    def optimizer_fn(params: Any) -> torch.optim.Optimizer:
        if r.optimizer == "momentum":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        if r.optimizer == "adagrad":
            return torch.optim.Adagrad(params, lr=0.05)
        if r.optimizer == "adam":
            return torch.optim.Adam(params, lr=1e-3)
        if r.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=1e-3)
        return torch.optim.SGD(params, lr=0.05)

    return mixprec.Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=loss_fn,
        optimizer_fn=optimizer_fn,
        name="generated",
        default_batch_size=BATCH,
    )


def _modules_of(r: Recipe) -> list[str]:
    names = ["inp", "norm", "head"]
    names += ["embed"] if r.embedding != "none" else []
    names += ["left", "right"] if r.shared else []
    names += ["frozen", "frozen.0"] if r.frozen == "block" else []
    names += ["unused"] if r.unused else []
    names += ["spectral"] if r.complex == "linear" else []
    names += ["wide"] if r.float64 == "linear" else []
    names += ["narrow"] if r.float16 == "linear" else []
    return names


@st.composite
def recipes(draw: st.DrawFn, low: bool = False) -> Recipe:
    """A model; ``low``: one for the low-format Linear policies (widths whose Linear layers their
    kernels take, now and then a float16 Linear, a precision map)."""
    embedding = draw(st.sampled_from(["none", "dense", "sparse"]))
    # sparse gradients: only the optimizers that take them
    optimizers = (
        ["sgd", "momentum", "adagrad"] if embedding == "sparse" else ["sgd", "momentum", "adam", "adamw"]
    )
    r = Recipe(
        width=draw(st.sampled_from([4, 8])),
        norm=draw(st.sampled_from(["none", "batch", "layer", "group"])),
        embedding=embedding,
        tied=embedding != "none" and draw(st.booleans()),
        shared=draw(st.booleans()),
        buffers=tuple(
            draw(st.lists(st.sampled_from(["persistent", "transient", "int", "bool", "none"]), unique=True))
        ),
        complex=draw(st.sampled_from(["none", "none", "param", "linear"])),
        float64=draw(st.sampled_from(["none", "none", "param", "linear"])),
        frozen=draw(st.sampled_from(["none", "block", "bias"])),
        unused=draw(st.booleans()),
        inputs=draw(st.sampled_from(["positional", "keyword", "dict"])),
        output=draw(st.sampled_from(["tensor", "dict", "tuple"])),
        optimizer=draw(st.sampled_from(optimizers)),
        step=draw(st.sampled_from(["plain", "plain", "clip", "finite_check"])),
    )
    if low:  # fp8 and nvfp4 take multiples of 16, mxfp8 of 32; 8: no layer converted
        r = replace(r, width=draw(st.sampled_from([32, 16, 32, 16, 8])))
        r = replace(r, float16="linear" if draw(st.integers(0, 11)) == 11 else "none")
        if embedding != "none":  # a (tied) head the formats convert
            r = replace(r, vocab=draw(st.sampled_from([32, VOCAB])))
    if draw(st.integers(0, 2)) == 0:  # fp32 islands: names, and now and then a glob
        pool = [*_modules_of(r), "fro*", "*ed", "?ead"]
        keep = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2, unique=True))
        names = _modules_of(r)
        r = replace(r, keep_fp32=tuple(p for p in keep if any(fnmatch.fnmatchcase(n, p) for n in names)))
    if low and draw(st.integers(0, 2)) > 0:  # two in three: a precision map
        pool = [*_linears_of(r), "*", "?ead", "le*", "*t"]
        picks = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
        entries = [p + draw(st.sampled_from(["", "", ":forward", ":dgrad", ":wgrad"])) for p in picks]
        if draw(st.integers(0, 5)) == 0:  # one the policy must refuse, naming it
            entries.append(draw(st.sampled_from(BAD_ENTRIES)))
        r = replace(r, keep_bf16=tuple(dict.fromkeys(entries)), fp8_directions=draw(st.integers(0, 5)) == 0)
    return r


# entries a precision map must refuse: a module but no Linear, no module, no GEMM direction, no glob
BAD_ENTRIES = ("norm", "embed*", "nope", "head:backward", "inp:", ":wgrad", "inp:dgrad:wgrad")


def _linears_of(r: Recipe) -> list[str]:
    """The Linear layers of ``Generated(r)``, whatever their shapes or dtypes."""
    modules = set(_modules_of(r))
    names = ["inp", "head", "left", "right", "frozen.0", "unused", "spectral", "wide", "narrow"]
    return [n for n in names if n in modules]


# ------------------------------------------------------------------ the property


def _refusal(exc: MixprecError) -> str:
    """A refusal is one non-empty line that says something; returns the outcome's name."""
    message = str(exc)
    assert message.strip() and "\n" not in message.strip(), f"{type(exc).__name__}: {message!r}"
    assert len(message) > 20, f"{type(exc).__name__} says too little to name the problem: {message!r}"
    return f"refused ({type(exc).__name__})"


# torch's own CPU kernel gaps: the user's optimizer fails the same way without mixprec once its
# weights have that dtype, so the error goes through as it is (as an optimizer's assertion does,
# see Policy.step). Each: the exception type, its message, the file torch raised it from.
TORCH_GAPS = (
    # SGD momentum adds sparse fp16 gradients to its buffer: no Half sparse add on the CPU (fp16-true)
    (NotImplementedError, re.compile(r"\"\w*sparse\w*\" not implemented for 'Half'"), "torch/optim/"),
)


def _torch_gap(exc: BaseException) -> bool:
    frames = "".join(traceback.format_tb(exc.__traceback__))
    return any(
        isinstance(exc, kind) and message.search(str(exc)) and where in frames
        for kind, message, where in TORCH_GAPS
    )


def _keep_of(r: Recipe, name: str) -> tuple[str, ...]:
    return () if POLICIES[name].is_math_mode else r.keep_fp32


def _expected_dtypes(model: nn.Module, name: str, keep: tuple[str, ...]) -> dict[str, torch.dtype]:
    """Every parameter's and buffer's dtype after ``prepare``, by the rules in the module docstring."""
    half = POLICIES[name].param_dtype
    modules = dict(model.named_modules())
    expected = {}
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for tname, t in tensors:
        owner = tname.rsplit(".", 1)[0] if "." in tname else ""
        if half is None or not t.is_floating_point():
            expected[tname] = t.dtype  # complex, integer and bool tensors too: never cast
        elif is_fp32_island(owner, keep) or isinstance(modules[owner], nn.modules.batchnorm._BatchNorm):
            expected[tname] = torch.float32
        else:
            expected[tname] = half
    return expected


def _ties(model: nn.Module) -> list[list[str]]:
    paths: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(p), []).append(n)
    return [names for names in paths.values() if len(names) > 1]


def _assert_dtypes(
    model: nn.Module, expected: dict[str, torch.dtype], ties: list[list[str]], when: str
) -> None:
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    found = {n: t.dtype for n, t in tensors.items()}
    assert found == expected, f"{when}: dtypes changed: " + ", ".join(
        f"{n} {expected.get(n)} -> {found.get(n)}"
        for n in sorted(expected.keys() | found.keys())
        if expected.get(n) != found.get(n)
    )
    for names in ties:
        first = model.get_parameter(names[0])
        assert all(model.get_parameter(n) is first for n in names), f"{when}: tie {names} was split"


def _train(r, name, policy, model, optimizer, workload, steps):
    """Up to ``steps`` optimizer steps (at most MAX_TRIES tries): ``(stepped, tries)``, or the
    one-line outcome of a refusal or of a kernel torch lacks; anything else fails the test."""
    stepped = tries = 0
    try:
        with policy.precision_scope():
            while stepped < steps and tries < MAX_TRIES:
                batch = workload.make_batch(BATCH, torch.device("cpu"))
                with policy.autocast():
                    loss = workload.loss_fn(model, batch)
                policy.backward(loss)
                stepped += policy.step(optimizer, clip_grad_norm=1.0 if r.step == "clip" else None)
                optimizer.zero_grad(set_to_none=True)
                tries += 1
    except MixprecError as exc:
        return _refusal(exc)
    except Exception as exc:
        if _torch_gap(exc):
            return "torch kernel gap"
        raise AssertionError(f"{r} under {name}, step {tries}: {type(exc).__name__}: {exc}") from exc
    return stepped, tries


def train(r: Recipe, name: str, steps: int) -> str:
    """prepare + training under ``name`` of a fresh copy until ``steps`` optimizer steps were taken
    (a loss-scaled policy skips its first steps while the scale backs off from 2**16, at most
    :data:`MAX_TRIES` in all); the outcome's name."""
    workload = workload_of(r)
    model = copy.deepcopy(workload.model)
    keep = _keep_of(r, name)
    expected, ties = _expected_dtypes(model, name, keep), _ties(model)
    try:
        finite_check = r.step == "finite_check" and not POLICIES[name].loss_scaling
        policy = mixprec.get_policy(name, device="cpu", keep_fp32=list(keep), finite_check=finite_check)
        model = policy.prepare(model)
    except MixprecError as exc:
        return _refusal(exc)
    _assert_dtypes(model, expected, ties, f"after {name} prepare")
    optimizer = workload.make_optimizer(model)
    outcome = _train(r, name, policy, model, optimizer, workload, steps)
    if isinstance(outcome, str):
        return outcome
    stepped, tries = outcome
    _assert_dtypes(model, expected, ties, f"after {tries} {name} steps")
    return "ran" if stepped == steps else "ran (steps skipped)"


def check(r: Recipe, trained: dict[str, str]) -> dict[str, str]:
    """``mixprec.check`` of every CPU policy at once; each verdict's outcome name (or one refusal's
    for all of them). A candidate whose training crashed in the check must have failed the loop too."""
    cands = [Candidate(n, keep_fp32=_keep_of(r, n)) for n in CPU_POLICIES]
    try:
        result = mixprec.check(workload_of(r), policies=cands, steps=2, batch_size=BATCH, device="cpu")
    except MixprecError as exc:
        return dict.fromkeys(CPU_POLICIES, "check " + _refusal(exc))
    outcomes = {}
    for c in result.candidates:
        name = c.candidate.policy
        if c.verdict == Status.PASS:
            outcomes[name] = "check pass"
            continue
        assert c.reason.strip(), f"{r} under {name}: {c.verdict} without a reason"
        crashed = c.reason.startswith("training crashed")
        assert not crashed or trained[name] != "ran", (
            f"{r} under {name}: the check's training crashed ({c.reason}) where the same steps ran"
        )
        outcomes[name] = f"check {c.verdict}" + (" (training crashed)" if crashed else "")
    assert sorted(outcomes) == sorted(CPU_POLICIES)
    return outcomes


def export(r: Recipe, name: str, cand: Candidate | None = None) -> str:
    try:
        results = export_all(cand or Candidate(name, keep_fp32=_keep_of(r, name)), device="cpu")
    except MixprecError as exc:
        return "export " + _refusal(exc)
    assert list(results) == list(EXPORT_TARGETS)
    for target, res in results.items():
        assert (res.text is None) != (res.refused is None), (name, target, res)
        assert (res.text or res.refused or "").strip(), f"{name} to {target}: empty export and no reason"
    return f"export {sum(res.faithful for res in results.values())}/{len(results)} faithful"


@pytest.mark.timeout(600)
@_settings(EXAMPLES)
@given(r=recipes(), steps=st.integers(2, 3))
def test_generated_models_train_check_and_export_or_refuse_in_one_line(r, steps):
    TRIED["models"] += 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own UserWarnings are not mixprec's output
        trained = {}
        for name in CPU_POLICIES:
            TRIED["inputs"] += 1
            trained[name] = train(r, name, steps)
            event(f"{name}: train {trained[name]}")
            OUTCOMES[f"train {trained[name]}"] += 1
            outcome = export(r, name)
            event(f"{name}: {outcome}")
            OUTCOMES[outcome.split(" (")[0]] += 1
        for name, outcome in check(r, trained).items():
            event(f"{name}: {outcome}")
            OUTCOMES[outcome] += 1
        TRIED["checked models"] += 1


# ------------------------------------------------------------------ the low-format Linear policies

# fp8 (torchao's Float8Linear) and the block formats (mixprec's BlockLinear emulation): they run fast
# on CUDA only, but get_policy(check=False) + prepare run them here and mixprec.check predicts their
# numerics here, so they go through the same property, and four of their own:
# (1) a tie stays one Parameter; (2) a float64, complex or float16 Linear keeps its dtype (left as it
# is, or its outputs in its own dtype); (3) the precision map keep_bf16 is applied as written (the
# layers it names whole stay nn.Linear, the directions it names are not in BlockLinear.low) or
# refused by a PolicyError naming an entry it cannot apply; (4) every Parameter after prepare is the
# object it was (an optimizer built before prepare trains the converted layers), the state dict's
# keys are the same.
LOW_POLICIES = tuple(n for n in POLICY_NAMES if POLICIES[n].low_format is not None)
LOW_EXAMPLES = 16
BLOCK = {"fp8": 16, "mxfp8": 32, "nvfp4": 16}  # both Linear dimensions: multiples of this, or no conversion
LOW_TRIED: Counter[str] = Counter()


def _map_of(r: Recipe, name: str) -> tuple[str, ...]:
    """The precision map ``name`` is given: fp8 converts a Linear whole, so its entries lose their
    GEMM direction, unless the recipe is there to see fp8 refuse them."""
    if POLICIES[name].block_format is not None or r.fp8_directions:
        return r.keep_bf16
    stripped = []
    for entry in r.keep_bf16:
        pattern, _, direction = entry.rpartition(":")
        stripped.append(pattern if pattern and direction in DIRECTIONS else entry)
    return tuple(dict.fromkeys(stripped))


def _parse(entry: str) -> tuple[str, str | None] | None:
    """(glob, direction or None) of a well-formed entry; None for one that is not."""
    pattern, sep, direction = entry.rpartition(":")
    if not sep:
        return entry, None
    return (pattern, direction) if pattern and direction in DIRECTIONS else None


def _bad_entries(entries: tuple[str, ...], name: str, linears: list[str]) -> list[str]:
    """The entries ``name`` cannot apply: malformed, a direction where the policy converts a Linear
    whole (fp8), or a glob naming no Linear of the model (a typo it would silently ignore)."""

    def applies(entry: str) -> bool:
        parsed = _parse(entry)
        if parsed is None or (parsed[1] and POLICIES[name].block_format is None):
            return False
        return any(fnmatch.fnmatchcase(n, parsed[0]) for n in linears)

    return [e for e in entries if not applies(e)]


def _expected_plan(model: nn.Module, name: str, r: Recipe) -> dict[str, frozenset[str]]:
    """Linear name -> the GEMM directions ``name`` runs in its format: every fp32 nn.Linear outside
    the fp32 islands whose dimensions its kernels take, less what the map keeps in bf16."""
    block = BLOCK[str(POLICIES[name].low_format)]
    entries = [_parse(e) for e in _map_of(r, name)]
    plan = {}
    for lname, m in model.named_modules():
        if type(m) is not nn.Linear or is_fp32_island(lname, r.keep_fp32) or m.weight.dtype != torch.float32:
            continue
        if m.in_features % block or m.out_features % block:
            continue
        low = set(DIRECTIONS)
        for pattern, direction in (e for e in entries if e is not None):
            if fnmatch.fnmatchcase(lname, pattern):
                low -= set(DIRECTIONS) if direction is None else {direction}
        if low:
            plan[lname] = frozenset(low)
    return plan


def _assert_plan(model: nn.Module, original: nn.Module, name: str, r: Recipe) -> None:
    """The Linear layers after ``prepare``: converted as :func:`_expected_plan` says, the others left
    the nn.Linear they were (property 2 and 3)."""
    expected = _expected_plan(original, name, r)
    block = POLICIES[name].block_format is not None
    for lname, m in original.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        now = model.get_submodule(lname)
        if lname not in expected:
            assert type(now) is nn.Linear, f"{r} under {name}: {lname} became a {type(now).__name__}"
        elif block:
            assert isinstance(now, BlockLinear), f"{r} under {name}: {lname} is a {type(now).__name__}"
            assert now.low == expected[lname], f"{r} under {name}: {lname} runs {sorted(now.low)}"
        else:  # torchao's Float8Linear (or an MXFP8Linear one day): converted, whole
            assert type(now) is not nn.Linear, f"{r} under {name}: {lname} was not converted"


def _output_dtypes(model: nn.Module, seen: dict[str, tuple[torch.dtype, torch.dtype]]) -> list[Any]:
    """Hooks recording (weight dtype, output dtype) of every Linear's first forward."""

    def hook(lname: str) -> Any:
        def record(m: nn.Module, args: Any, out: torch.Tensor) -> None:
            seen.setdefault(lname, (m.weight.dtype, out.dtype))

        return record

    return [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def train_low(r: Recipe, name: str, steps: int) -> str:
    """prepare (``check=False``: the CPU runs the formats' numerics, slowly) + ``steps`` optimizer
    steps of a fresh copy, with an optimizer built *before* prepare; the outcome's name."""
    workload = workload_of(r)
    model = copy.deepcopy(workload.model)
    original = copy.deepcopy(model)  # the Linear layers as written (prepare swaps them in place)
    keep, keep_bf16 = r.keep_fp32, _map_of(r, name)
    expected, ties = _expected_dtypes(model, name, keep), _ties(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    keys = list(model.state_dict())
    bad = _bad_entries(keep_bf16, name, _linears_of(r))
    optimizer = workload.make_optimizer(model)  # before prepare, as a user's script may
    try:
        finite_check = r.step == "finite_check"
        policy = mixprec.get_policy(
            name, device="cpu", check=False, keep_fp32=list(keep), keep_bf16=list(keep_bf16),
            finite_check=finite_check,
        )  # fmt: skip
        model = policy.prepare(model)
    except MixprecError as exc:
        outcome = _refusal(exc)
        if bad:  # (3): the refusal names an entry it cannot apply (or the float16 weights, first)
            named = any(e in str(exc) for e in bad)
            assert named or (r.float16 != "none" and "keep_bf16" not in str(exc)), (
                f"{r} under {name}: the refusal names none of {bad}: {exc}"
            )
            return outcome + (" (map)" if named else "")
        # a float16 Linear: fp32 master weights refuse the model; nothing else may be refused
        assert r.float16 != "none", f"{r} under {name}: refused {type(exc).__name__}: {exc}"
        return outcome
    assert not bad, f"{r} under {name}: keep_bf16 {list(keep_bf16)} applied although {bad} cannot be"
    assert r.float16 == "none", f"{r} under {name}: prepared a model with float16 weights for fp32 masters"
    when = f"{r} after {name} prepare"
    _assert_dtypes(model, expected, ties, when)  # (1) and the dtypes: nothing cast
    moved = [n for n, p in params.items() if model.get_parameter(n) is not p]
    assert not moved, f"{when}: new Parameter objects for {moved}"  # (4)
    assert list(model.state_dict()) == keys, f"{when}: state dict keys changed"
    _assert_plan(model, original, name, r)  # (2) and (3)
    converted = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and type(m) is not nn.Linear]
    trained = {n: model.get_parameter(f"{n}.weight").detach().clone() for n in converted}
    seen: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    hooks = _output_dtypes(model, seen)
    try:
        outcome = _train(r, name, policy, model, optimizer, workload, steps)
    finally:
        for h in hooks:
            h.remove()
    if isinstance(outcome, str):
        return outcome
    stepped, tries = outcome
    when = f"{r} after {tries} {name} steps"
    _assert_dtypes(model, expected, ties, when)
    narrowed = {n: d for n, d in seen.items() if d[0] != torch.float32 and d[1] != d[0]}
    assert not narrowed, f"{when}: Linear outputs cast from their weights' dtype: {narrowed}"  # (2)
    # (4): the optimizer built before prepare moved the converted layers' weights
    weights = {n: model.get_parameter(f"{n}.weight") for n in converted if n != "unused"}  # unused: no grad
    idle = [n for n, w in weights.items() if w.requires_grad and torch.equal(trained[n], w)]
    assert not stepped or not idle, f"{when}: {stepped} steps left {idle} as they were"
    return ("ran" if stepped == steps else "ran (steps skipped)") + (
        " (converted none)" if not converted else ""
    )


def check_low(r: Recipe, trained: dict[str, str]) -> dict[str, str]:
    """``mixprec.check`` of the four low formats at once, each with its map: predicted verdicts (none
    unsupported: their numerics run here), a reason for each that is not a pass; a map the
    Candidate cannot take refuses that candidate, naming the entry, and one the model cannot take
    refuses the check (naming it too)."""
    outcomes, cands = {}, []
    model = workload_of(r).model
    for name in LOW_POLICIES:
        try:
            cands.append(Candidate(name, keep_fp32=r.keep_fp32, keep_bf16=_map_of(r, name)))
        except MixprecError as exc:
            bad = _bad_entries(_map_of(r, name), name, _linears_of(r))
            assert any(e in str(exc) for e in bad), (
                f"{r}: {name}'s candidate refused naming none of {bad}: {exc}"
            )
            outcomes[name] = "check " + _refusal(exc) + " (map)"
    bad = {c.policy: _bad_entries(c.keep_bf16, c.policy, _linears_of(r)) for c in cands}
    try:
        result = mixprec.check(workload_of(r), policies=cands, steps=2, batch_size=BATCH, device="cpu")
    except MixprecError as exc:
        named = any(e in str(exc) for entries in bad.values() for e in entries)
        assert named or r.float16 != "none", f"{r}: check refused {type(exc).__name__}: {exc}"
        return {**outcomes, **dict.fromkeys(bad, "check " + _refusal(exc) + (" (map)" if named else ""))}
    for c in result.candidates:
        name = c.candidate.policy
        assert c.verdict != Status.UNSUPPORTED and c.predicted, f"{r} under {name}: not predicted: {c.reason}"
        assert not bad[name], (
            f"{r} under {name}: checked ({c.verdict}: {c.reason}) with {bad[name]} in its map"
        )
        if c.verdict == Status.PASS:  # a pass needs a GEMM that ran in the format
            assert _expected_plan(model, name, r), f"{r} under {name}: passed with no GEMM in the format"
        if c.verdict == Status.PASS:
            outcomes[name] = "check pass"
            continue
        assert c.reason.strip(), f"{r} under {name}: {c.verdict} without a reason"
        crashed = c.reason.startswith("training crashed")
        assert not crashed or not trained[name].startswith("ran"), (
            f"{r} under {name}: the check's training crashed ({c.reason}) where the same steps ran"
        )
        outcomes[name] = f"check {c.verdict}" + (" (training crashed)" if crashed else "")
    assert sorted(outcomes) == sorted(LOW_POLICIES)
    return outcomes


def export_low(r: Recipe, name: str) -> str:
    try:
        cand = Candidate(name, keep_fp32=r.keep_fp32, keep_bf16=_map_of(r, name))
    except MixprecError as exc:
        return "export " + _refusal(exc)
    return export(r, name, cand)


@pytest.mark.timeout(600)
@_settings(LOW_EXAMPLES)
@given(r=recipes(low=True), steps=st.integers(2, 3))
def test_generated_models_under_the_low_formats_keep_ties_dtypes_parameters_and_maps(r, steps):
    LOW_TRIED["models"] += 1
    drawn = {
        f"width {r.width}": True,
        "a precision map": bool(r.keep_bf16),
        "GEMM directions": any(_parse(e) and _parse(e)[1] for e in r.keep_bf16),  # type: ignore[index]
        "an entry to refuse": any(e in BAD_ENTRIES for e in r.keep_bf16),
        "fp8 given directions": r.fp8_directions and any(":" in e for e in r.keep_bf16),
        "fp32 islands": bool(r.keep_fp32),
        "a tie or shared weight": r.tied or r.shared,
        "a float16 Linear": r.float16 != "none",
        "a float64 or complex Linear": "linear" in (r.float64, r.complex),
    }
    for feature in (f for f, yes in drawn.items() if yes):
        event(f"low-format model: {feature}")
        LOW_TRIED[f"with {feature}"] += 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trained = {}
        for name in LOW_POLICIES:
            LOW_TRIED["inputs"] += 1
            trained[name] = train_low(r, name, steps)
            event(f"{name}: train {trained[name]}")
            OUTCOMES[f"{name} train {trained[name]}"] += 1
            outcome = export_low(r, name)
            event(f"{name}: {outcome}")
            OUTCOMES[f"{name} {outcome.split(' (')[0]}"] += 1
        for name, outcome in check_low(r, trained).items():
            event(f"{name}: {outcome}")
            OUTCOMES[f"{name} {outcome}"] += 1
        LOW_TRIED["checked models"] += 1


def test_check_refuses_a_map_entry_naming_no_linear_up_front():
    """Found by this tier: a keep_bf16 entry that names no Linear of the model (a typo: "nope"; a
    module that is no Linear: "norm") is refused by get_policy().prepare with a PolicyError naming
    it, but mixprec.check runs the candidate, and its verdict is 'fail: training crashed: PolicyError:
    keep_bf16 entry 'nope' matches no Linear ...': a numerics verdict for a map that was never
    applied. A keep_fp32 pattern that matches no module is refused up front (check_islands); a map
    entry should be too."""
    r = Recipe(width=16, keep_bf16=("inp", "nope"))
    cand = Candidate("mxfp8", keep_bf16=r.keep_bf16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(MixprecError, match="'nope'"):
            mixprec.get_policy("mxfp8", device="cpu", check=False, keep_bf16=list(r.keep_bf16)).prepare(
                Generated(r)
            )
        try:
            result = mixprec.check(workload_of(r), policies=[cand], steps=2, batch_size=BATCH, device="cpu")
        except MixprecError as exc:
            assert "'nope'" in str(exc) and "\n" not in str(exc).strip()
            return
    c = result.candidates[0]
    raise AssertionError(f"check ran a map naming no Linear: {c.verdict}: {c.reason}")


@pytest.mark.parametrize("keep_bf16", [(), ("*",)], ids=["no-Linear-eligible", "map-keeps-all"])
def test_a_low_format_that_converted_no_linear_is_no_pass(keep_bf16):
    """Found by this tier: a low-format candidate none of whose Linear GEMMs runs in the format (no
    Linear has dimensions its kernels take: width 8 under fp8, whose kernels need multiples of 16;
    or the map keeps them all in bf16) is checked as the bf16 autocast run it is and passes
    ('matches fp32'): a pass with no test of the format behind it. check's own default
    candidates skip such a policy ('would convert none of this model's Linear layers ... nothing to
    predict'), and a format that never ran is an error ('nothing was tested'), not a pass."""
    r = Recipe(width=8 if not keep_bf16 else 16, keep_bf16=keep_bf16)
    cand = Candidate("fp8-rowwise", keep_bf16=keep_bf16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mixprec.check(workload_of(r), policies=[cand], steps=2, batch_size=BATCH, device="cpu")
    c = result.candidates[0]
    assert c.verdict == Status.ERROR and c.reason.startswith("nothing was tested"), (c.verdict, c.reason)


# ------------------------------------------------------------------ what this tier found


class ComplexFilter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.filter = nn.Parameter(torch.tensor([1 + 1j, 2 - 1j, -1 + 0.5j, 0.5j], dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x).to(torch.complex64) * self.filter).real


@pytest.mark.parametrize("name", ["fp16-mixed", "fp16-true"])
def test_loss_scaled_policies_unscale_complex_gradients(name):
    """Found by this tier: GradScaler's fused unscale kernel has no complex dtypes, so the first
    ``policy.step`` of an fp16 policy on a model with a complex parameter raised NotImplementedError
    ('_amp_foreach_non_finite_check_and_unscale_cpu not implemented for ComplexFloat'). Now the
    complex gradient is unscaled through its real view: the update is the unscaled one, and inf in
    either part skips the step."""
    policy = mixprec.get_policy(name, device="cpu", init_scale=8.0)
    model = policy.prepare(ComplexFilter())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with policy.autocast():
        loss = model(torch.ones(2, 4)).float().sum()
    policy.backward(loss)
    scaled, before = model.filter.grad.clone(), model.filter.detach().clone()
    assert policy.step(optimizer, clip_grad_norm=1e6 if name == "fp16-true" else None)  # both unscale paths
    torch.testing.assert_close(model.filter.detach(), before - 0.5 * scaled / 8.0)
    assert model.filter.dtype == torch.complex64

    optimizer.zero_grad()
    with policy.autocast():
        loss = model(torch.ones(2, 4)).float().sum()
    policy.backward(loss)
    model.filter.grad[1] = complex(0.0, float("inf"))  # finite real part, infinite imaginary part
    before = model.filter.detach().clone()
    assert not policy.step(optimizer)
    assert torch.equal(model.filter.detach(), before) and policy.stats.last_nonfinite_params == ["filter"]


class Float64Island(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.wide = nn.Linear(4, 4, dtype=torch.float64)  # a float64 layer, as numerically careful code has

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h + self.wide(h.double()).to(h.dtype)


def test_an_fp32_island_widens_half_inputs_and_never_narrows_float64_ones():
    """Found by this tier: keep_fp32 on a float64 layer under a *-mixed policy cast the layer's float64
    input down to fp32 ('mat1 and mat2 must have the same dtype, but got Float and Double'); an island
    widens half-precision inputs to fp32 and leaves wider ones as they are."""
    policy = mixprec.get_policy("bf16-mixed", device="cpu", keep_fp32=["wide", "proj"])
    model = policy.prepare(Float64Island())
    computed = {}
    model.wide.register_forward_hook(lambda m, args, out: computed.update(wide=out.dtype))
    model.proj.register_forward_hook(lambda m, args, out: computed.update(proj=out.dtype))
    with policy.autocast():
        out = model(torch.randn(2, 4, dtype=torch.bfloat16))
    # proj's bf16 input was widened to fp32, wide computed in float64 as written
    assert computed == {"proj": torch.float32, "wide": torch.float64} and out.dtype == torch.float32
    out.sum().backward()
    assert model.wide.weight.grad.dtype == torch.float64


@pytest.mark.parametrize("layer", ["complex", "float64"])
def test_a_complex_or_float64_first_layer_is_no_proof_that_the_format_never_ran(layer):
    """Found by this tier: with ``inp`` in fp32, the
    first other Linear is a complex64 (or float64) one, autocast leaves it alone, and check calls the
    candidate 'error: nothing was tested ... never ran' although ``head`` ran in bf16."""
    r = Recipe(**{layer: "linear"}, keep_fp32=("inp",))
    cand = Candidate("bf16-mixed", keep_fp32=("inp",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mixprec.check(workload_of(r), policies=[cand], steps=2, batch_size=BATCH, device="cpu")
    assert result.candidates[0].verdict != Status.ERROR, result.candidates[0].reason


def test_zz_what_was_tried(request):
    """The counts of this run, for the record (shown with -rA, or -s)."""
    if not TRIED["models"] and not LOW_TRIED["models"]:
        pytest.skip("the fuzz tests did not run (deselected)")
    line = (
        f"generated-model fuzz: {TRIED['models']} models, {TRIED['inputs']} (model, policy) inputs over "
        f"{len(CPU_POLICIES)} policies ({', '.join(CPU_POLICIES)}), "
        f"{TRIED['checked models']} models checked; low formats: {LOW_TRIED['models']} models, "
        f"{LOW_TRIED['inputs']} (model, policy) inputs over {len(LOW_POLICIES)} policies "
        f"({', '.join(LOW_POLICIES)}), {LOW_TRIED['checked models']} models checked ("
        + ", ".join(f"{k[5:]} x{v}" for k, v in sorted(LOW_TRIED.items()) if k.startswith("with "))
        + "); "
        "outcomes: " + ", ".join(f"{k} x{v}" for k, v in sorted(OUTCOMES.items()))
    )
    print(line)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(line)
    assert TRIED["inputs"] == TRIED["models"] * len(CPU_POLICIES)
    assert LOW_TRIED["inputs"] == LOW_TRIED["models"] * len(LOW_POLICIES)
