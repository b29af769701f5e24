"""Run an export as a user would and record, with forward hooks, what actually ran.

One tiny CNN (:class:`Net`: two conv blocks in ``.layers``, a ``.head`` of Flatten + Linear that is
the fp32 island when ``keep_fp32=("head",)``), one batch stream, one loss. Each ``run_*`` function
executes the exported text verbatim with the names the export says the user fills in, and returns a
:class:`Run`: the hook records, the trained parameters, the framework's loss scaler, the optimizer
it stepped and whether the module it ran is compiled. :func:`check_run` compares them with what the
candidate promises (:class:`mixprec.policy.PolicySpec`, its compile mode and scope and optimizer
implementation), so every target is judged by the same expectations. A candidate compiled at step
scope is also run eager through the same target: the compiled step must train the same losses.

A candidate with a micro-batch and gradient accumulation is run on :data:`ACC` (one pass of
``ACC_STEPS`` optimizer steps) by :func:`check_accumulation`: the loss records each micro-batch, a
global optimizer-step hook each step, so the samples per optimizer step are counted whatever
framework steps, and the trained weights are compared with :func:`reference_weights`, a plain
PyTorch loop over the same micro-batches.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec import state
from mixprec.exports import export, split_sections
from mixprec.policy import Candidate, PolicyConfig, ScalerOptions

STEPS = 4
BATCH = 8
OVERFLOW_AT = 1  # fp16 policies: this batch overflows fp16 activations, its step must be skipped
ISLAND = "head"
SCALER = ScalerOptions(init_scale=1024.0, growth_interval=1000)  # no growth within STEPS
SCALE_AFTER = 512.0  # init_scale after the one overflow
FILL_INS = (
    "model",
    "loader",
    "loss_fn",
    "YourLightningModule",
    "trainer_options",
    "train_dataset",
    "training_args",
)


# ------------------------------------------------------------------------------------------ the model
class Net(nn.Module):
    """Conv blocks (what FSDP2 shards), a head, and a tensor created in forward (needs the half
    default dtype under *-true, else ``x + zeros`` promotes to fp32 and the head's half weights fail)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(x)
        return self.head(h + torch.zeros(h.shape))


class HFNet(Net):
    """The HF Trainer's convention: forward(**batch) returns the loss, computed from ``labels``."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # type: ignore[override]
        PROBE.labels.append(None if labels is None else labels.dtype)
        if COUNTING:
            record_batch(x)
        out = super().forward(x)
        return {"loss": F.mse_loss(out.float(), labels), "logits": out}


def batches(overflow: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for i in range(STEPS):
        x = torch.randn(BATCH, 3, 4, 4, generator=generator)
        if overflow and i == OVERFLOW_AT:
            x = x * 1e6  # fp16 activations overflow: inf loss, non-finite gradients
        out.append((x, torch.randn(BATCH, 2, generator=generator)))
    return out


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    if COUNTING:  # checked here: a compiled step breaks at record_batch only while counting
        record_batch(x)
    loss = F.mse_loss(model(x).float(), y)
    record_loss(y.dtype, loss)
    return loss


@torch._dynamo.disable
def record_loss(target_dtype: torch.dtype, loss: torch.Tensor) -> None:
    """Record eagerly, also inside a compiled step: traced, the appends would make dynamo guard on the
    lists' lengths and recompile the step every step."""
    PROBE.labels.append(target_dtype)
    PROBE.losses.append(loss.item())


COUNTING = False  # while counting_steps() runs: the loss records each (micro-)batch's inputs


@torch._dynamo.disable
def record_batch(x: torch.Tensor) -> None:
    """Record the inputs of a (micro-)batch, before any cast: what the optimizer-step groups hold."""
    PROBE.events.append(x.detach().clone())


def data_loader(overflow: bool) -> torch.utils.data.DataLoader:
    pairs = batches(overflow)
    dataset = torch.utils.data.TensorDataset(
        torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
    )
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False)


class DictDataset(torch.utils.data.Dataset):
    """Samples as the HF Trainer wants them: dicts of the model's keyword inputs."""

    def __init__(self, overflow: bool, data: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        pairs = batches(overflow=False)
        self.x = torch.cat([x for x, _ in pairs]) if data is None else data[0]
        self.y = torch.cat([y for _, y in pairs]) if data is None else data[1]
        if overflow:  # exactly one batch overflows whatever the Trainer's shuffling: one sample does
            self.x[0] = self.x[0] * 1e6

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


# ------------------------------------------------------------------------------------------ recording
@dataclass
class Call:
    """One forward of a conv or linear leaf."""

    name: str
    out_dtype: torch.dtype
    weight_dtype: torch.dtype
    input_cl: bool | None  # 4-D input in channels_last, None for 2-D
    weight_cl: bool | None
    autocast: bool
    default_dtype: torch.dtype
    knobs: dict[str, str]


@dataclass
class Probe:
    """What ran: one :class:`Call` per leaf forward, the dtypes the loss saw for its targets, the
    losses :func:`loss_fn` computed, and in order the inputs of every (micro-)batch and, as None,
    every optimizer step (:func:`counting_steps`)."""

    calls: list[Call] = field(default_factory=list)
    labels: list[torch.dtype | None] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    events: list[torch.Tensor | None] = field(default_factory=list)

    def attach(self, model: nn.Module) -> None:
        self.initial = {n: p.detach().clone().float() for n, p in model.named_parameters()}
        for name, module in model.named_modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Callable:
        @torch._dynamo.disable  # under torch.compile too, record what ran, eagerly
        def record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x, w = args[0], module.weight
            four_d = x.dim() == 4
            self.calls.append(
                Call(
                    name,
                    output.dtype,
                    w.dtype,
                    x.is_contiguous(memory_format=torch.channels_last) if four_d else None,
                    w.is_contiguous(memory_format=torch.channels_last) if w.dim() == 4 else None,
                    torch.is_autocast_enabled(x.device.type),
                    torch.get_default_dtype(),
                    {op: getattr(torch.backends.mkldnn, op).fp32_precision for op in ("matmul", "conv")},
                )
            )

        return record


PROBE = Probe()


Source = Candidate | PolicyConfig  # what a case exports: a candidate, or a config with scaler options


@dataclass
class Run:
    """A finished run: the module whose parameters trained, the framework's loss scaler, the optimizer
    it stepped, and whether the module it ran is compiled (the framework's own record of it)."""

    model: nn.Module
    scaler: Any
    namespace: dict[str, Any]
    optimizer: Any = None
    compiled: bool = False


# ------------------------------------------------------------------------------------------ running
@contextlib.contextmanager
def restored_state() -> Iterator[None]:
    """Exports set the fp32 math mode for good, as a script would: put it back afterwards."""
    before = state.snapshot()
    try:
        yield
    finally:
        state.restore(before)


def fresh_model(cls: type[nn.Module] = Net) -> nn.Module:
    PROBE.__init__()  # type: ignore[misc]
    torch.manual_seed(0)
    model = cls()
    PROBE.attach(model)
    return model


def execute(text: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Run the pasted text as the module a user pastes it into: a real module while it runs (torch
    2.11's dynamo looks a compiled step's ``__module__`` up in ``sys.modules``)."""
    module = types.ModuleType("exported_snippet")
    module.__dict__.update(namespace)
    sys.modules[module.__name__] = module
    try:
        with restored_state():
            exec(compile(text, "<exported snippet>", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module.__dict__


def python_part(text: str, target: str) -> str:
    return split_sections(text).get("train.py") or text


def loss_scaling(source: Source) -> bool:
    return source.spec.loss_scaling


Edit = Callable[[str], str]  # a change to the exported text: the optimizer line is "yours"


def run_plain(source: Source, target: str, *, loader: Any = None, edit: Edit | None = None) -> Run:
    """The ``mixprec`` and ``pytorch`` exports; ``loader`` replaces the harness' batches, ``edit``
    changes the text before it runs."""
    model = fresh_model()
    text = export(source, target, device="cpu")
    ns = execute(
        edit(text) if edit else text,
        {
            "model": model,
            "loader": batches(loss_scaling(source)) if loader is None else loader,
            "loss_fn": loss_fn,
        },
    )
    scaler = ns["policy"].scaler if target == "mixprec" else ns.get("scaler")
    trained = getattr(ns["model"], "_orig_mod", ns["model"])  # torch.compile's wrapper: the module inside
    return Run(trained, scaler, ns, ns["optimizer"], is_compiled(ns["model"]))


def run_accelerate(source: Source, *, loader: Any = None, edit: Edit | None = None) -> Run:
    from accelerate.state import AcceleratorState

    model = fresh_model()
    text = python_part(export(source, "accelerate", device="cpu"), "accelerate")
    loader = data_loader(loss_scaling(source)) if loader is None else loader
    try:
        ns = execute(edit(text) if edit else text, {"model": model, "loader": loader, "loss_fn": loss_fn})
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return Run(model, ns["accelerator"].scaler, ns, ns["optimizer"].optimizer, is_compiled(ns["model"]))


def run_deepspeed(
    source: Source,
    workdir: Path,
    *,
    loader: Any = None,
    edit: Edit | None = None,
    config: dict[str, Any] | None = None,
) -> Run:
    """``config``: entries the user adds to the exported ds_config.json."""
    model = fresh_model()
    sections = split_sections(export(source, "deepspeed", device="cpu"))
    ds_config = {**json.loads(sections["ds_config.json"]), **(config or {})}
    (workdir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
    text = sections["train.py"]
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        ns = execute(
            edit(text) if edit else text,
            {
                "model": model,
                "loader": batches(loss_scaling(source)) if loader is None else loader,
                "loss_fn": loss_fn,
            },
        )
    finally:
        os.chdir(cwd)
    engine = ns["model_engine"]
    return Run(model, engine.torch_autocast_z0_gradscaler, ns, engine.optimizer, engine.is_compiled)


def run_fsdp2(source: Source, *, loader: Any = None, edit: Edit | None = None) -> Run:
    model = fresh_model()
    text = export(source, "fsdp2", device="cpu")
    ns = execute(
        edit(text) if edit else text,
        {
            "model": model,
            "loader": batches(loss_scaling(source)) if loader is None else loader,
            "loss_fn": loss_fn,
        },
    )
    return Run(model, ns.get("scaler"), ns, ns["optimizer"], is_compiled(ns["model"]))


def run_hf(source: Source, workdir: Path, *, dataset: Any = None, args: dict[str, Any] | None = None) -> Run:
    """``dataset`` replaces the harness' samples; ``args`` updates the TrainingArguments the user
    passes (a None value removes one)."""
    from accelerate.state import AcceleratorState

    model = fresh_model(HFNet)
    changes = args or {}
    args = {
        "output_dir": str(workdir / "hf-out"),
        "max_steps": STEPS,
        "per_device_train_batch_size": BATCH,
        "learning_rate": 1e-3,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    args = {k: v for k, v in {**args, **changes}.items() if v is not None}
    dataset = DictDataset(loss_scaling(source)) if dataset is None else dataset
    try:
        ns = execute(
            export(source, "hf", device="cpu"),
            {"model": model, "train_dataset": dataset, "training_args": args},
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    trainer = ns["trainer"]
    stepped = trainer.optimizer.optimizer  # inside Accelerate's wrapper
    if "optimizer" in ns:  # the export's own optimizer (Trainer(optimizers=...)), not the Trainer's default
        assert stepped is ns["optimizer"], "the Trainer stepped an optimizer of its own"
    return Run(model, trainer.accelerator.scaler, ns, stepped, is_compiled(trainer.model_wrapped))


def lightning_module_class(optimizer: Callable[[Any], torch.optim.Optimizer] | None = None) -> type:
    """YourLightningModule for the Lightning export: Net's modules and forward, AdamW (or
    ``optimizer(parameters)``), the loss."""
    import lightning as L

    class LitNet(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            net = Net()
            self.layers, self.head = net.layers, net.head
            PROBE.attach(self)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Net.forward(self, x)  # type: ignore[arg-type]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return loss_fn(self, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if optimizer is not None:
                return optimizer(self.parameters())
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return LitNet


def run_lightning(
    source: Source,
    workdir: Path,
    *,
    loader: Any = None,
    module: type | None = None,
    options: dict[str, Any] | None = None,
) -> Run:
    """``loader``, ``module`` (YourLightningModule) and ``options`` (updating trainer_options)
    replace the harness' own."""
    PROBE.__init__()  # type: ignore[misc]
    changes = options or {}
    options = {
        "max_steps": STEPS,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(workdir),
        **changes,
    }
    ns = execute(
        export(source, "lightning", device="cpu"),
        {
            "YourLightningModule": module or lightning_module_class(),
            "loader": data_loader(loss_scaling(source)) if loader is None else loader,
            "trainer_options": options,
        },
    )
    trainer = ns["trainer"]
    module = trainer.lightning_module
    compiled = (module._compiler_ctx or {}).get("compiler") == "dynamo"  # what trainer.fit made of it
    return Run(module, getattr(trainer.precision_plugin, "scaler", None), ns, trainer.optimizers[0], compiled)


def is_compiled(module: nn.Module) -> bool:
    """torch.compile's wrapper (an OptimizedModule) or a module compiled in place (Module.compile)."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule) or (
        getattr(module, "_compiled_call_impl", None) is not None
    )


# ------------------------------------------------------------------------------------------ checking
def island(name: str) -> bool:
    return name == ISLAND or name.startswith(ISLAND + ".")


def check_run(source: Source, run: Run, *, target: str, scale: float | None = None) -> None:
    """Assert that what ran is what ``source`` promises; ``scale``: the loss scale mixprec's own Policy
    ends with on the same batches (fp16 policies)."""
    spec = source.spec
    keep = bool(source.keep_fp32)
    calls = PROBE.calls
    assert calls, "no conv/linear forward was recorded"
    assert {c.name for c in calls} == {"layers.0.0", "layers.1.0", "head.1"}
    wanted_knobs = {
        op: v for (b, op), v in spec.precision.per_knob().items() if b == "mkldnn" and op != "rnn"
    }
    for c in calls:
        where = f"{target}: {c.name}"
        assert c.knobs == wanted_knobs, f"{where}: fp32 math knobs {c.knobs}, want {wanted_knobs}"
        if keep and island(c.name):
            assert c.out_dtype == torch.float32, f"{where}: fp32 island computed in {c.out_dtype}"
            assert c.weight_dtype == torch.float32, f"{where}: fp32 island weights are {c.weight_dtype}"
            assert not c.autocast, f"{where}: fp32 island ran under autocast"
            continue
        assert c.out_dtype == spec.compute_dtype, (
            f"{where}: computed in {c.out_dtype}, want {spec.compute_dtype}"
        )
        weight = spec.param_dtype or torch.float32
        if target == "fsdp2" and spec.low_precision_dtype is not None:
            weight = spec.low_precision_dtype  # FSDP2 all-gathers in param_dtype
        assert c.weight_dtype == weight, f"{where}: weights used in {c.weight_dtype}, want {weight}"
        assert c.autocast == (spec.autocast_dtype is not None), f"{where}: autocast={c.autocast}"
        assert c.default_dtype == (spec.param_dtype or torch.float32), (
            f"{where}: default dtype {c.default_dtype}"
        )
        if c.input_cl is not None:
            assert c.input_cl == source.channels_last, f"{where}: channels_last input is {c.input_cl}"
        if c.weight_cl is not None:
            assert c.weight_cl == source.channels_last, f"{where}: channels_last weight is {c.weight_cl}"
    # The loss (or the model's own loss) saw fp32 targets: no export rounds them to the half dtype.
    assert PROBE.labels and all(d == torch.float32 for d in PROBE.labels), f"{target}: targets {PROBE.labels}"

    # Trained parameters: dtypes as the policy stores them, every tensor changed.
    params = dict(run.model.named_parameters())
    assert set(params) == set(PROBE.initial), sorted(params)
    for name, p in params.items():
        stored = torch.float32 if keep and island(name) else (spec.param_dtype or torch.float32)
        assert p.dtype == stored, f"{target}: parameter {name} stored as {p.dtype}, want {stored}"
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        assert not torch.equal(value.detach().float(), PROBE.initial[name]), f"{target}: {name} did not train"

    # Loss scaling: present with the policy's options exactly where the policy scales the loss.
    if spec.loss_scaling:
        assert isinstance(run.scaler, torch.amp.GradScaler), f"{target}: no GradScaler ({run.scaler!r})"
        assert run.scaler.is_enabled()
        assert run.scaler.get_scale() == scale, f"{target}: scale {run.scaler.get_scale()}, mixprec's {scale}"
        planted = isinstance(source, PolicyConfig) and source.scaler == SCALER
        if spec.autocast_dtype is not None and planted:  # fp16-mixed: exactly the planted overflow skipped
            assert scale == SCALE_AFTER
    else:
        assert run.scaler is None or not run.scaler.is_enabled(), (
            f"{target}: unexpected scaler {run.scaler!r}"
        )
    check_loop_axes(source, run, target)


def check_loop_axes(source: Source, run: Run, target: str) -> None:
    """A compiled candidate ran compiled (the framework's module is, and dynamo compiled frames since
    :func:`run_case` reset its counters); at step scope the step function is compiled instead and
    the optimizer's step ran inside it (:func:`check_step_compiled`). The optimizer the framework
    stepped has the measured implementation. A config (or an eager candidate) ran eager."""
    from torch._dynamo.utils import counters

    mode = source.compile if isinstance(source, Candidate) else None
    step_scope = is_step(source)
    module = bool(mode) and not step_scope  # at step scope the model is compiled inside the step
    assert run.compiled == module, f"{target}: module compiled={run.compiled}, candidate {source!r}"
    if mode:
        assert counters["frames"]["ok"] > 0, (
            f"{target}: dynamo compiled no frame ({dict(counters['frames'])})"
        )
    if step_scope:
        check_step_compiled(run, target)
    impl = source.optimizer if isinstance(source, Candidate) else None
    if impl is None:
        return  # the optimizer as written (the HF Trainer's default is fused AdamW on torch >= 2.8)
    group = run.optimizer.param_groups[0]
    flags = {"fused": bool(group.get("fused")), "foreach": bool(group.get("foreach"))}
    want = {"fused": impl == "fused", "foreach": impl == "foreach"}
    assert flags == want, f"{target}: the stepped {type(run.optimizer).__name__} has {flags}, want {impl}"


def check_step_compiled(run: Run, target: str) -> None:
    """The export's ``train_step`` is a ``torch.compile``'d function, dynamo made at least two graphs
    of it (forward + loss, the optimizer step: it breaks at ``.backward()``), and among the frames it
    compiled is the stepped optimizer's own ``step`` function, with the update's ops in its graph.

    Inside a compiled step the optimizer's step is a frame of its own: ``torch.optim``'s
    ``_use_grad`` wrapper breaks the graph on purpose, and an LR scheduler's wrapper (in
    ``lr_scheduler.py``, which dynamo skips) or ``GradScaler.step`` (``torch.amp``, skipped) calls it
    from eager code; dynamo compiles it all the same, and an eager step would leave no such frame.
    """
    from torch._dynamo.utils import counters, get_compilation_metrics

    step = run.namespace.get("train_step")
    assert step is not None and hasattr(step, "_torchdynamo_orig_callable"), (
        f"{target}: train_step is not a torch.compile'd function ({step!r})"
    )
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2, f"{target}: dynamo made {graphs} graph(s) of the step, want forward + optimizer"
    code = inspect.unwrap(type(run.optimizer).step).__code__
    compiled = [
        m
        for m in get_compilation_metrics()
        if (m.co_filename, m.co_firstlineno) == (code.co_filename, code.co_firstlineno) and m.graph_op_count
    ]
    assert compiled, f"{target}: {type(run.optimizer).__name__}.step was not compiled by dynamo"


# torch.testing.assert_close's default (rtol, atol) per dtype, from its documentation.
TOLERANCES = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}


def check_same_losses(source: Candidate, compiled: list[float], eager: list[float], target: str) -> None:
    """The compiled step trains the losses of the same step run eagerly (same target, same batches).

    Tolerance: torch.testing's default for the dtype matmuls and convolutions compute in (fp32: rtol
    1.3e-6, bf16: 1.6e-2, fp16: 1e-3; atol 1e-5), i.e. about one rounding of that dtype. Both runs
    do the same arithmetic in the same formats; inductor only reorders fp32 reductions and fuses
    elementwise ops, keeping their intermediates in fp32 where eager rounds each op's output to the
    compute dtype. Over STEPS AdamW steps (each moves a weight by about lr, whatever its gradient)
    that does not grow past one rounding. The planted fp16 overflow is non-finite in both runs.
    """
    assert len(compiled) == len(eager) == STEPS, f"{target}: losses {compiled} vs eager {eager}"
    rtol, atol = TOLERANCES[source.spec.compute_dtype]
    torch.testing.assert_close(
        torch.tensor(compiled),
        torch.tensor(eager),
        rtol=rtol,
        atol=atol,
        equal_nan=True,
        msg=lambda m: f"{target}: compiled step losses {compiled} vs eager {eager}: {m}",
    )


def cases() -> dict[str, PolicyConfig]:
    """Target-independent CPU configs: {fp32, bf16-mixed, fp16-mixed, bf16-true} x channels_last x keep_fp32,
    plus bf32 and fp16-true (base) and tf32 (refused on a CPU everywhere)."""
    out: dict[str, PolicyConfig] = {}
    for name in ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true"):
        for cl in (False, True):
            for keep in (False, True):
                if keep and name == "fp32":
                    continue
                label = name + ("+cl" if cl else "") + ("+keep" if keep else "")
                scaler = SCALER if name == "fp16-mixed" else None
                out[label] = PolicyConfig(name, "cpu", cl, (ISLAND,) if keep else (), scaler=scaler)
    out["bf32"] = PolicyConfig("bf32", "cpu")
    out["fp16-true"] = PolicyConfig("fp16-true", "cpu", scaler=SCALER)
    out["tf32"] = PolicyConfig("tf32", "cpu")
    return out


# Candidates with the loop axes, exported for the CPU: compiled with the fused optimizer (one
# inductor compile per target each), fp16-mixed with the fused optimizer under its GradScaler, and
# the whole step compiled (the optimizer as written: the step scope compiles its update itself), fp16
# with its planted overflow skipped by the GradScaler inside the compiled step.
LOOP_CASES: dict[str, Candidate] = {
    "bf16-mixed+compile+fused": Candidate("bf16-mixed", compile="default", optimizer="fused"),
    "fp32+compile+fused": Candidate("fp32", compile="default", optimizer="fused"),
    "fp16-mixed+fused": Candidate("fp16-mixed", optimizer="fused"),
    "bf16-mixed+compile-step": Candidate("bf16-mixed", compile="default", compile_scope="step"),
    "fp32+compile-step": Candidate("fp32", compile="default", compile_scope="step"),
    "fp16-mixed+compile-step": Candidate("fp16-mixed", compile="default", compile_scope="step"),
}
STEP_CASES = [case for case, c in LOOP_CASES.items() if c.compile_scope == "step"]


CASES: dict[str, Source] = {**cases(), **LOOP_CASES}


def require(package: str) -> None:
    """Skip the calling test module when ``package`` (from the ``frameworks`` extra) is missing, or
    fail when MIXPREC_REQUIRE_FRAMEWORKS=1 (``make test`` sets it: there the extra is installed)."""
    import importlib

    import pytest

    if os.environ.get("MIXPREC_REQUIRE_FRAMEWORKS") == "1":
        importlib.import_module(package)
        return
    pytest.importorskip(
        package, reason=f"{package} is not installed: pip install -e '.[frameworks]' (make test does)"
    )


def installed_version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def run_case(target: str, case: str, refused: set[str], runner: Callable[[Source], Run]) -> None:
    """The tier's one test body: a refused case raises ExportRefused (and only the expected ones are
    refused); a faithful one trains and :func:`check_run` confirms the promise with the hooks."""
    import pytest

    from mixprec.errors import ExportRefused
    from mixprec.exports import export_status

    source = CASES[case]
    faithful, reason = export_status(source, target, device="cpu")
    if case in refused:
        assert not faithful, f"{target} {case}: expected a refusal"
        with pytest.raises(ExportRefused, match="Nearest faithful alternative") as info:
            export(source, target, device="cpu")
        assert info.value.reason in reason and info.value.alternative in reason
        return
    assert faithful, f"{target} {case}: unexpected refusal: {reason}"
    skip_where_unsupported(source)
    scale = None
    if source.spec.loss_scaling:  # mixprec's own policy on the same batches: the reference scale
        eager_source = replace(source, compile=None, compile_scope=None) if is_step(source) else source
        scale = run_plain(eager_source, "mixprec").namespace["policy"].stats.scale
    torch._dynamo.reset()  # a fresh compile per run, and counters that count this run only
    torch._dynamo.utils.counters.clear()
    torch._dynamo.utils.clear_compilation_metrics()
    run = runner(source)
    check_run(source, run, target=target, scale=scale)
    if is_step(source):
        assert isinstance(source, Candidate)
        compiled = list(PROBE.losses)
        runner(replace(source, compile=None, compile_scope=None))
        check_same_losses(source, compiled, PROBE.losses, target)


def skip_where_unsupported(source: Source) -> None:
    """Skip, with the reason, a case whose policy this CPU cannot run (bf32 needs AVX512-BF16 or AMX):
    mixprec's policy refuses it there, and the plain text's math mode would change nothing."""
    import pytest

    from mixprec.hardware import detect
    from mixprec.policy import check_support

    support = check_support(source.spec.name, detect(torch.device("cpu")))
    if not support:
        pytest.skip(f"{source.spec.name} does not run on this CPU: {support.reason}")


def is_step(source: Source) -> bool:
    """A candidate compiled at step scope."""
    return isinstance(source, Candidate) and source.compile_scope == "step"


# ------------------------------------------------------------------------------------------ accumulation
MICRO, ACCUMULATE, ACC_STEPS = 4, 3, 2  # micro-batches of 4, 3 per optimizer step, 2 steps: one pass
SGD_LR = 0.05
# The stacks clip and reduce gradients with their own code (DeepSpeed's clip_grad_norm_, FSDP2's
# reduce-scatter, Accelerate's, Lightning's and the Trainer's clipping): torch.testing's fp32
# tolerance for them. On the verified releases they match the reference bit for bit; a wrong
# accumulation (the loss divided twice or not at all, clipping a micro-batch's gradient) misses by
# about 1e-3.
FRAMEWORK_TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}
ADAMW = "torch.optim.AdamW(model.parameters(), lr=1e-3)"


def accumulating(policy: str) -> Candidate:
    """``policy`` at micro-batches of :data:`MICRO`, :data:`ACCUMULATE` per optimizer step."""
    return Candidate(policy, micro_batch=MICRO, accumulation_steps=ACCUMULATE)


def _accumulation_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Two optimizer steps of samples: the first step's gradient norm stays under the clipping
    threshold, so the weights show the accumulated gradient's scale (a loss divided twice, or not at
    all); the second step's targets are tripled to exceed it, so the weights show that clipping saw
    the whole step's gradient, not a micro-batch's. (Tripled, fp16's scaled gradients still fit.)"""
    generator = torch.Generator().manual_seed(2)
    n = MICRO * ACCUMULATE * ACC_STEPS
    x, y = torch.randn(n, 3, 4, 4, generator=generator), torch.randn(n, 2, generator=generator)
    y[MICRO * ACCUMULATE :] *= 3
    return x, y


ACC = _accumulation_data()  # one pass: ACC_STEPS optimizer steps of MICRO * ACCUMULATE samples


def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:data:`ACC` in micro-batches of :data:`MICRO`, in order: the loader the export asks for."""
    x, y = ACC
    return [(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, len(x), MICRO)]


def micro_loader() -> torch.utils.data.DataLoader:
    """:data:`ACC` as ``DataLoader(..., batch_size=MICRO)``, for the stacks that prepare a DataLoader."""
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*ACC), batch_size=MICRO, shuffle=False)


def with_sgd(text: str) -> str:
    """The export with SGD in the optimizer line the user fills in. Its update is proportional to the
    gradient, so a loss divided by the accumulation steps twice, or not at all, shows in the weights;
    AdamW's update barely depends on the gradient's scale."""
    assert text.count(ADAMW) == 1, "the export's optimizer line moved"
    return text.replace(ADAMW, f"torch.optim.SGD(model.parameters(), lr={SGD_LR})")


def sgd(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=SGD_LR)


@contextlib.contextmanager
def counting_steps() -> Iterator[None]:
    """Record every (micro-)batch's inputs and every optimizer step, of any optimizer whoever calls
    it, as None in ``PROBE.events`` (torch.optim's global step post-hook: a step GradScaler skips
    records nothing)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    global COUNTING
    handle = register_optimizer_step_post_hook(lambda *_: PROBE.events.append(None))
    COUNTING = True
    try:
        yield
    finally:
        COUNTING = False
        handle.remove()


def step_groups(events: list[torch.Tensor | None], target: str) -> list[list[torch.Tensor]]:
    """The micro-batch inputs of each optimizer step, in order; none may follow the last step."""
    groups: list[list[torch.Tensor]] = [[]]
    for event in events:
        if event is None:
            groups.append([])
        else:
            groups[-1].append(event)
    assert not groups[-1], f"{target}: {len(groups[-1])} micro-batch(es) after the last optimizer step"
    return groups[:-1]


def sample_indices(x: torch.Tensor) -> list[int]:
    """The rows of :data:`ACC` that the micro-batch ``x`` holds, in its order."""
    rows = ACC[0].flatten(1)
    out = []
    for sample in x.flatten(1):
        hits = (rows == sample).all(dim=1).nonzero().flatten().tolist()
        assert len(hits) == 1, f"a sample that is not one of the data's ({len(hits)} matches)"
        out += hits
    return out


def reference_weights(
    source: Candidate, order: list[list[list[int]]], *, scheduler: bool
) -> dict[str, torch.Tensor]:
    """Plain PyTorch: per optimizer step the micro-batches ``order`` lists (indices into :data:`ACC`),
    each loss divided by :data:`ACCUMULATE` under the policy's autocast (and its GradScaler, with
    mixprec's default options), backward on each, then clip at 1.0, SGD step, the exports'
    CosineAnnealingLR where ``scheduler``, zero_grad. Asserts that clipping bites on the second step
    only (see :func:`_accumulation_data`) and that no step overflows."""
    from mixprec.policy import get_policy

    spec = source.spec
    assert spec.autocast_dtype is not None, "the accumulation cases are *-mixed policies"
    torch.manual_seed(0)
    model = Net()
    optimizer = sgd(model.parameters())
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000) if scheduler else None
    opts = ScalerOptions()
    scaler = None
    if spec.loss_scaling:
        scaler = torch.amp.GradScaler(
            "cpu",
            init_scale=opts.init_scale,
            growth_factor=opts.growth_factor,
            backoff_factor=opts.backoff_factor,
            growth_interval=opts.growth_interval,
        )
    x, y = ACC
    with get_policy(source.policy, device="cpu").precision_scope():
        for number, step in enumerate(order):
            for indices in step:
                with torch.autocast("cpu", dtype=spec.autocast_dtype):
                    loss = F.mse_loss(model(x[indices]).float(), y[indices]) / ACCUMULATE
                (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            assert (norm > 1.0) == (number == 1), f"step {number}: gradient norm {norm}"
            if scaler:
                scaler.step(optimizer)
                scaler.update()
                assert scaler.get_scale() == opts.init_scale, "a reference step overflowed"
            else:
                optimizer.step()
            if cosine:
                cosine.step()
            optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def check_accumulation(
    source: Candidate,
    run: Run,
    target: str,
    *,
    scheduler: bool = True,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> None:
    """Each optimizer step saw exactly :data:`ACCUMULATE` micro-batches of :data:`MICRO` samples,
    :data:`ACC_STEPS` steps in all, every sample once and in order, and the trained weights are
    :func:`reference_weights` on the same micro-batches (``scheduler``: the export's scheduler line
    ran) within ``rtol``/``atol`` (default: bit for bit)."""
    groups = step_groups(PROBE.events, target)
    sizes = [[len(x) for x in group] for group in groups]
    assert sizes == [[MICRO] * ACCUMULATE] * ACC_STEPS, (
        f"{target}: micro-batch sizes per optimizer step {sizes}"
    )
    order = [[sample_indices(x) for x in group] for group in groups]
    seen = [i for step in order for indices in step for i in indices]
    assert seen == list(range(len(ACC[0]))), f"{target}: samples {seen}"
    want = reference_weights(source, order, scheduler=scheduler)
    got = {
        name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in run.model.named_parameters()
    }
    assert set(got) == set(want), sorted(got)
    for name, value in got.items():
        assert not torch.equal(value.detach().float(), PROBE.initial[name]), f"{target}: {name} did not train"
        torch.testing.assert_close(
            value.detach(), want[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{target}: {n}: {m}"
        )
