"""The training frameworks a script may train through, and the precision switch of each that the
agent sets: the HF Trainer's ``TrainingArguments(bf16=, fp16=)``, Lightning's
``Trainer(precision=)`` and ``Accelerator(mixed_precision=)``, as mixprec's export for that framework
writes them, so that what is measured is what the user will run; a compiled candidate through each
one's own compile switch (``TrainingArguments(torch_compile=True)``, ``trainer.fit(torch.compile(
module))``, Accelerate's ``TorchDynamoPlugin``), which compiles the model. Gradient accumulation (the
plan's ``accumulate``) goes through the HF Trainer's ``gradient_accumulation_steps`` and Lightning's
``accumulate_grad_batches``, multiplied by it. The optimizer's implementation is
set where torch builds the optimizer (:mod:`.optimizers`), and named in ``TrainingArguments(optim=)``
where the Trainer builds torch's AdamW.

Each is patched where the framework reads it (``TrainingArguments.__post_init__``,
``Trainer.__init__``, ``Accelerator.__init__``), once its module is imported by the script (an
import hook: the agent is installed before the script imports anything), through the agent's
:class:`~mixprec.frameworks.script.patches.Patches`, so removing the agent puts each back. In the
modes that measure (``measure``, ``trace``) the framework's outputs go to the run's scratch folder.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

# What trains the script: the frameworks whose precision switch the agent sets, or its own loop
# (MIXPREC: a loop that runs mixprec's own Policy, built under the candidate).
HF, LIGHTNING, ACCELERATE, MIXPREC, PLAIN = "hf", "lightning", "accelerate", "mixprec", "plain"
# Training frameworks whose switches the agent does not know: their loop is measured as a plain one.
UNKNOWN_FRAMEWORKS = ("ignite", "fastai", "composer", "mmengine", "deepspeed", "colossalai", "keras")

Agent = Any  # mixprec.frameworks.script.agent.Agent (which imports this module)
# TrainingArguments(optim=) for torch's AdamW in each implementation (a script's other optim, SGD
# or Adafactor, keeps its own: the implementation is set where the Trainer builds it)
HF_ADAMW = {"fused": "adamw_torch_fused", "foreach": "adamw_torch", "for-loop": "adamw_torch"}
# a framework module -> the patch of its precision switch
Patch = Callable[[Any, Agent], None]


def _hf_arguments(module: Any, agent: Agent) -> None:
    cls = module.TrainingArguments
    original = cls.__post_init__

    def __post_init__(self: Any) -> None:
        agent.framework = HF
        agent.own.as_written["framework"] = {"bf16": bool(self.bf16), "fp16": bool(self.fp16)}
        if agent.inject:
            spec = agent.candidate.spec
            if spec.param_dtype is not None or spec.accelerate is None:
                agent.fail(
                    "UnsupportedError",
                    f"{agent.candidate.label} is not a precision the HF Trainer's flags express "
                    "(TrainingArguments has bf16= and fp16=): not measured through the Trainer",
                )
            self.bf16, self.fp16 = spec.accelerate == "bf16", spec.accelerate == "fp16"
            self.tf32 = None  # mixprec sets the fp32 math mode (the HF export's knobs)
            if (self.bf16 or self.fp16) and not torch.cuda.is_available():
                self.use_cpu = True  # as the HF export writes it: bf16 on a CPU needs it said
            agent.framework_flags = {"bf16": self.bf16, "fp16": self.fp16}
            if agent.candidate.compile:
                self.torch_compile, self.torch_compile_mode = True, agent.candidate.compile
                agent.framework_flags |= {
                    "torch_compile": True,
                    "torch_compile_mode": agent.candidate.compile,
                }
            optim = HF_ADAMW.get(agent.candidate.optimizer or "")
            if optim is not None and str(getattr(self.optim, "value", self.optim)) in HF_ADAMW.values():
                # its own name for the implementation; the AdamW it builds gets foreach= at construction
                self.optim = agent.framework_flags["optim"] = optim
        if agent.plan.accumulate > 1:  # the Trainer's own accumulation (it divides the loss itself)
            self.gradient_accumulation_steps *= agent.plan.accumulate
            agent.framework_flags["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        if agent.mode.sandboxed and agent.plan.scratch:
            # a measured run saves nothing and reports nowhere; loading the best checkpoint at the
            # end needs saved ones (the Trainer refuses the pair), so it goes too
            self.output_dir = agent.plan.scratch
            self.save_strategy = "no"
            self.load_best_model_at_end = False
            self.push_to_hub = False
            self.report_to = []
        original(self)

    agent.patches.replace(cls, "__post_init__", __post_init__)


def _lightning_trainer(module: Any, agent: Agent) -> None:
    cls = module.Trainer
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kw: Any) -> None:
        agent.framework = LIGHTNING
        agent.own.as_written["framework"] = {"precision": kw.get("precision")}
        if agent.inject:
            wanted = agent.candidate.spec.lightning
            if wanted is None:
                agent.fail(
                    "UnsupportedError",
                    f"{agent.candidate.label} is not a Lightning precision (Trainer(precision=...)): not "
                    "measured through the Trainer",
                )
            if _is_precision_plugin(kw.get("plugins")):  # the script's own precision plugin: replaced
                kw.pop("plugins")
            if wanted == "16-mixed":
                # Trainer(accelerator="cpu", precision="16-mixed") silently runs bf16: the plugin, as
                # mixprec's lightning export writes it, runs fp16 autocast with the loss scaler anywhere
                kw.pop("precision", None)
                kw["plugins"] = [*_as_list(kw.get("plugins")), _fp16_plugin(kw)]
            else:
                kw["precision"] = wanted
            agent.framework_flags = {"precision": wanted}
        if agent.plan.accumulate > 1:  # the Trainer's own accumulation
            kw["accumulate_grad_batches"] = kw.get("accumulate_grad_batches", 1) * agent.plan.accumulate
            agent.framework_flags["accumulate_grad_batches"] = kw["accumulate_grad_batches"]
        if agent.mode.sandboxed and agent.plan.scratch:
            # its logs and checkpoints in the run's scratch folder; the script's own callbacks and
            # loggers stay (a ModelCheckpoint refuses enable_checkpointing=False, a
            # LearningRateMonitor refuses logger=False), and what they write lands there too (.sandbox)
            kw["default_root_dir"] = agent.plan.scratch
        original(self, *args, **kw)

    agent.patches.replace(cls, "__init__", __init__)
    fit = cls.fit

    def compiled_fit(self: Any, model: Any, *args: Any, **kw: Any) -> Any:
        """A compiled candidate as Lightning's users compile (the lightning export's line):
        ``trainer.fit(torch.compile(module))``, which Lightning unwraps to compile the module's
        forward and training_step."""
        mode = agent.candidate.compile if agent.inject else None
        if mode and not isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = torch.compile(model, mode=mode)
            agent.framework_flags["compile"] = mode
        return fit(self, model, *args, **kw)

    agent.patches.replace(cls, "fit", compiled_fit)


def _as_list(plugins: Any) -> list[Any]:
    return list(plugins) if isinstance(plugins, (list, tuple)) else ([] if plugins is None else [plugins])


def _fp16_plugin(kw: dict[str, Any]) -> Any:
    """``MixedPrecision("16-mixed", device, scaler=GradScaler(device, <mixprec's options>))``."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from mixprec.policy.scaler import ScalerOptions

    accelerator = str(kw.get("accelerator", "auto"))
    device = (
        "cuda"
        if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    options = ScalerOptions()
    scaler = torch.amp.GradScaler(
        device,
        init_scale=options.init_scale,
        growth_factor=options.growth_factor,
        backoff_factor=options.backoff_factor,
        growth_interval=options.growth_interval,
    )
    return MixedPrecision("16-mixed", device, scaler=scaler)


def _is_precision_plugin(plugins: Any) -> bool:
    items = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    return any(type(p).__name__.endswith("Precision") for p in items if p is not None)


def _accelerator(module: Any, agent: Agent) -> None:
    cls = module.Accelerator
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kw: Any) -> None:
        if agent.framework == HF:  # the Trainer's own Accelerator: its flags were set on TrainingArguments
            original(self, *args, **kw)
            return
        agent.framework = ACCELERATE
        # (what the script runs with: its argument, else what `accelerate launch --mixed_precision`
        # or the launcher's config file left for the Accelerator in the environment)
        asked = kw.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION")
        agent.own.as_written["framework"] = {"mixed_precision": asked}
        if agent.plan.accumulate > 1:
            agent.fail(
                "UnsupportedError",
                "gradient accumulation through Accelerate is not measured yet (its accumulate() context "
                "decides when the optimizer steps): search the micro-batch of a plain loop, the HF "
                "Trainer or Lightning",
            )
        if agent.inject:
            wanted = agent.candidate.spec.accelerate
            if wanted is None or agent.candidate.spec.param_dtype is not None:
                agent.fail(
                    "UnsupportedError",
                    f"{agent.candidate.label} is not an Accelerate precision "
                    "(Accelerator(mixed_precision=...)): not measured through the Accelerator",
                )
            kw["mixed_precision"] = wanted
            agent.framework_flags = {"mixed_precision": wanted}
            if agent.candidate.compile:  # its own switch: prepare() compiles the model (the export's)
                from accelerate.utils import TorchDynamoPlugin

                kw.pop("dynamo_backend", None)
                kw["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor", mode=agent.candidate.compile)
                agent.framework_flags["dynamo_plugin"] = f"inductor, mode={agent.candidate.compile}"
        original(self, *args, **kw)

    agent.patches.replace(cls, "__init__", __init__)


PATCHES: dict[str, Patch] = {
    "transformers.training_args": _hf_arguments,
    "lightning.pytorch.trainer.trainer": _lightning_trainer,
    "pytorch_lightning.trainer.trainer": _lightning_trainer,
    "accelerate.accelerator": _accelerator,
}


class _PatchingLoader(importlib.abc.Loader):
    """Runs the module as its own loader would, then the patch."""

    def __init__(self, loader: Any, patch: Patch, agent: Agent) -> None:
        self.loader, self.patch, self.agent = loader, patch, agent

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.patch(module, self.agent)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch, self.agent)
        return spec


def install_import_hooks(agent: Agent) -> Callable[[], None]:
    """Patch each framework module the script imports, as it is imported (or now, if it was);
    returns what stops patching the ones imported later."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name], agent)
    finder = _Finder(agent)
    sys.meta_path.insert(0, finder)
    return lambda: sys.meta_path.remove(finder)
