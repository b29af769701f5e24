"""mixprec.exports without running a framework: the settings every export locks (golden JSON), that the
Python parses and is lint-clean with every name defined, the refusal API, the helper snippets, and
what `tune` shows per target. Executed behaviour is tested in the test_run_*/test_<framework> files."""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from harness import FILL_INS, Net
from rich.console import Console
from torch import nn

import mixprec
from mixprec import state
from mixprec.errors import ExportRefused, UsageError
from mixprec.exports import (
    EXPORT_TARGETS,
    FRAMEWORKS,
    ExportResult,
    ExportStatus,
    export,
    export_all,
    export_status,
    facts,
    snippets,
    split_sections,
)
from mixprec.hardware.device import resolve_device
from mixprec.policy import Candidate, PolicyConfig, PolicySpec, ScalerOptions, get_policy
from mixprec.policy.candidate import OPTIMIZER_IMPLS
from mixprec.policy.islands import island_names

ROOT = Path(__file__).parents[2]
GOLDEN_DIR = ROOT / "tests" / "golden" / "export"
UPDATE_GOLDEN = os.environ.get("MIXPREC_UPDATE_GOLDEN") == "1"


class Case(NamedTuple):
    """What a golden case exports: a candidate or a config, for a device."""

    source: Candidate | PolicyConfig
    device: str

    @property
    def spec(self) -> PolicySpec:
        return self.source.spec

    def export(self, target: str) -> str:
        return export(self.source, target, device=self.device)

    def status(self, target: str) -> ExportStatus:
        return export_status(self.source, target, device=self.device)

    def export_all(self) -> dict[str, ExportResult]:
        return export_all(self.source, device=self.device)


def _cases() -> dict[str, Case]:
    """Every policy on both devices with default options, the options that change the text, and
    candidates with the loop axes (compile mode and scope, optimizer implementation)."""
    configs = {
        f"{name}-{device}": PolicyConfig(name, device)
        for name in mixprec.POLICY_NAMES
        for device in ("cpu", "cuda")
    }
    configs["bf16-mixed-cuda+cl+head"] = PolicyConfig("bf16-mixed", "cuda", True, ("head",))
    configs["bf16-mixed-cpu+cl+head"] = PolicyConfig("bf16-mixed", "cpu", True, ("head",))
    configs["bf16-true-cpu+cl+head"] = PolicyConfig("bf16-true", "cpu", True, ("head",))
    configs["fp16-mixed-cuda+head+scaler"] = PolicyConfig(
        "fp16-mixed",
        "cuda",
        keep_fp32=("head",),
        scaler=ScalerOptions(init_scale=1024.0, growth_interval=100),
    )
    configs["fp16-mixed-cuda+odd-scaler"] = PolicyConfig(
        "fp16-mixed", "cuda", scaler=ScalerOptions(init_scale=1000.0, growth_factor=4.0, min_scale=None)
    )
    configs["bf16-mixed-cpu+finite_check"] = PolicyConfig("bf16-mixed", "cpu", finite_check=True)
    out = {case: Case(config, config.device) for case, config in configs.items()}
    compiled_fused = Candidate("bf16-mixed", compile="default", optimizer="fused")
    out["bf16-mixed-cpu+compile+fused"] = Case(compiled_fused, "cpu")
    out["bf16-mixed-cuda+compile+fused"] = Case(compiled_fused, "cuda")
    out["fp32-cuda+max-autotune+foreach"] = Case(
        Candidate("fp32", compile="max-autotune", optimizer="foreach"), "cuda"
    )
    out["fp16-mixed-cuda+head+fused"] = Case(
        Candidate("fp16-mixed", keep_fp32=("head",), optimizer="fused"), "cuda"
    )
    out["bf16-true-cpu+cl+head+no-cudagraphs+for-loop"] = Case(
        Candidate(
            "bf16-true",
            channels_last=True,
            keep_fp32=("head",),
            compile="max-autotune-no-cudagraphs",
            optimizer="for-loop",
        ),
        "cpu",
    )
    out["bf16-mixed-cpu+compile-step"] = Case(
        Candidate("bf16-mixed", compile="default", compile_scope="step"), "cpu"
    )
    out["fp32-cuda+compile-step:max-autotune"] = Case(
        Candidate("fp32", compile="max-autotune", compile_scope="step"), "cuda"
    )
    out["fp16-mixed-cuda+compile-step"] = Case(
        Candidate("fp16-mixed", compile="default", compile_scope="step"), "cuda"
    )
    out["bf16-true-cpu+cl+head+compile-step:no-cudagraphs"] = Case(
        Candidate(
            "bf16-true",
            channels_last=True,
            keep_fp32=("head",),
            compile="max-autotune-no-cudagraphs",
            compile_scope="step",
        ),
        "cpu",
    )
    return out


CASES = _cases()
# Candidates with a micro-batch (and gradient accumulation): linted, parsed and checked for fill-ins
# with the golden cases, their settings tested below rather than locked in the golden files.
ACCUMULATING = {
    "bf16-mixed-cuda@16x4": Case(Candidate("bf16-mixed", micro_batch=16, accumulation_steps=4), "cuda"),
    "fp16-mixed-cuda+head@16x4": Case(
        Candidate("fp16-mixed", keep_fp32=("head",), micro_batch=16, accumulation_steps=4), "cuda"
    ),
    "bf16-true-cpu+compile+fused@16x4": Case(
        Candidate("bf16-true", compile="default", optimizer="fused", micro_batch=16, accumulation_steps=4),
        "cpu",
    ),
    "bf16-mixed-cpu+compile-step@64": Case(
        Candidate("bf16-mixed", compile="default", compile_scope="step", micro_batch=64), "cpu"
    ),
}
TEXT_CASES = {**CASES, **ACCUMULATING}
PYTHON_SECTION = {"accelerate": "train.py", "deepspeed": "train.py"}
# Calls and assignments that carry configuration; helper bodies (the snippets) are left out.
SETTING_CALLS = {
    "Trainer",
    "MixedPrecision",
    "HalfPrecisionKeepBatch",
    "GradScaler",
    "HalfGradScaler",
    "Accelerator",
    "TrainingArguments",
    "MixedPrecisionPolicy",
    "autocast",
    "fully_shard",
    "initialize",
    "get_policy",
    "default_dtype",
    "default_dtype_in_forward",
    "keep_in_fp32",
    "fp32_islands",
    "register_forward_pre_hook",
    "to",
    "float",
    "step",
    "compile",
}
# An optimizer line that carries an implementation flag (fused=True, foreach=...) locks it.
OPTIMIZER_FLAGS = {"fused", "foreach"}
HELPERS = {*snippets._SNIPPETS, "HalfPrecisionKeepBatch"}


def python_part(text: str, target: str) -> str:
    return split_sections(text)[PYTHON_SECTION[target]] if target in PYTHON_SECTION else text


def _callee(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def settings(text: str, target: str) -> dict[str, object]:
    """The configuration an export locks: its other files parsed, and its setting calls and assignments
    in order (outermost calls, helper definitions skipped), not its comments."""
    out: dict[str, object] = {}
    sections = split_sections(text)
    if "ds_config.json" in sections:
        out["ds_config.json"] = json.loads(sections["ds_config.json"])
    if "default_config.yaml" in sections:
        out["default_config.yaml"] = _yaml(sections["default_config.yaml"])
    tree = ast.parse(python_part(text, target))
    out["helpers"] = sorted(
        n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in HELPERS
    )
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in HELPERS:
            return
        if isinstance(node, ast.Assign) and any(
            ast.unparse(t).endswith(("fp32_precision", "gradscaler")) for t in node.targets
        ):
            found.append(ast.unparse(node))
            return
        if isinstance(node, ast.Call) and (
            _callee(node) in SETTING_CALLS or {kw.arg for kw in node.keywords} & OPTIMIZER_FLAGS
        ):
            found.append(ast.unparse(node))
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    out["settings"] = found
    return out


def _yaml(text: str) -> dict[str, object]:
    """The launch config's ``key: value`` lines, a ``key:`` line holding the indented ones below it."""
    out: dict[str, object] = {}
    parent: dict[str, object] = out
    for line in text.splitlines():
        key, _, value = line.strip().partition(":")
        if not line.startswith(" "):
            parent = out
        if value.strip():
            parent[key] = value.strip()
        elif line:
            parent = out[key] = {}
    return out


# ------------------------------------------------------------------------------------------ golden files
@pytest.mark.parametrize("target", EXPORT_TARGETS)
def test_golden_settings(target):
    """One JSON per target: per config, the refusal or the settings (not every comment word)."""
    got: dict[str, object] = {}
    for case, item in CASES.items():
        faithful, reason = item.status(target)
        got[case] = settings(item.export(target), target) if faithful else {"refused": reason}
    path = GOLDEN_DIR / f"{target}.json"
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
        return
    assert path.exists(), f"missing {path}; create it with MIXPREC_UPDATE_GOLDEN=1 pytest {__file__}"
    want = json.loads(path.read_text())
    for case in CASES:
        assert got[case] == want.get(case), (
            f"{target} {case}: the exported settings differ from {path.name}; if intended, regenerate with "
            "MIXPREC_UPDATE_GOLDEN=1 and review the diff"
        )
    assert set(want) == set(got), "golden cases without a config"


def test_no_stale_golden_files():
    assert {p.name for p in GOLDEN_DIR.iterdir()} == {f"{t}.json" for t in EXPORT_TARGETS}


# ------------------------------------------------------------------------------------------ syntax
def _faithful_texts():
    for case, item in TEXT_CASES.items():
        for target, result in item.export_all().items():
            if result.text is not None:
                yield case, target, result.text


def test_every_python_part_parses_and_states_its_contract():
    for case, target, text in _faithful_texts():
        compile(python_part(text, target), f"<export {case} {target}>", "exec", flags=ast.PyCF_ONLY_AST)
        assert text.endswith("\n") and not text.endswith("\n\n")
        head = split_sections(text)[""] if target in PYTHON_SECTION else text
        item = TEXT_CASES[case]
        assert head.startswith(f"# mixprec export: policy '{item.spec.name}' on {item.device}")
        assert "# You fill in: " in head


# The venv's own ruff (a dev dependency) even when .venv/bin is not on PATH, as under `make test`.
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed")
def test_python_parts_are_lint_clean_ruff_formatted_and_define_every_name(tmp_path):
    """F821 on: every name is defined, imported or one the header lists under "You fill in"."""
    for case, target, text in _faithful_texts():
        name = re.sub(r"\W", "_", f"{case}_{target}")
        (tmp_path / f"{name}.py").write_text(python_part(text, target))
    common = ["--isolated", "--line-length", "110"]
    builtins = f"builtins = {json.dumps(list(FILL_INS))}"
    lint = [RUFF, "check", *common, "--config", builtins, "--select", "E,F,W,I,B,UP,SIM", str(tmp_path)]
    fmt = [RUFF, "format", *common, "--check", str(tmp_path)]
    for command in (lint, fmt):  # from the repository root, where ruff finds mixprec first-party
        result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
        assert result.returncode == 0, result.stdout + result.stderr


def test_helpers_named_in_the_text_are_defined_in_it():
    """A comment that points at a helper (e.g. "HalfGradScaler above") points at a definition."""
    for case, target, text in _faithful_texts():
        prose = " ".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
        for helper in HELPERS:
            if re.search(rf"\b{helper}\b", prose):
                assert re.search(rf"^(def|class) {helper}\b", text, re.M), f"{case} {target}: {helper}"


def test_fill_ins_are_listed_in_the_header():
    """Every fill-in name the code uses without defining it is named under "You fill in"."""
    for case, target, text in _faithful_texts():
        tree = ast.parse(python_part(text, target))
        stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        stored |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        header = " ".join(line[2:] for line in text.splitlines() if line.startswith("# "))
        fill_in = header.split("You fill in: ", 1)[1].split(" Run: ", 1)[0]
        for name in FILL_INS:
            if name in used - stored:
                assert re.search(rf"\b{name}\b", fill_in), f"{case} {target}: {name} is not listed: {fill_in}"


# ------------------------------------------------------------------------------------------ content
@pytest.mark.parametrize("case", CASES)
def test_precision_knobs_follow_the_policy_settings(case):
    item = CASES[case]
    libraries = ("cuda", "cudnn") if item.device == "cuda" else ("mkldnn",)
    wanted = {
        f"{backend}.{op}": value
        for (backend, op), value in item.spec.precision.per_knob().items()
        if backend in libraries
    }
    for target, result in item.export_all().items():
        if result.text is None or target == "mixprec":
            continue
        text = result.text
        set_here = dict(re.findall(r"torch\.backends\.(\w+\.\w+)\.fp32_precision = \"(\w+)\"$", text, re.M))
        assert set_here == wanted and wanted, target
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert "allow_tf32" not in code and "set_float32_matmul_precision" not in code


def test_deepspeed_config_per_policy():
    for case, item in CASES.items():
        if not item.status("deepspeed").faithful:
            continue
        ds = json.loads(split_sections(item.export("deepspeed"))["ds_config.json"])
        assert ds["train_micro_batch_size_per_gpu"] >= 1 and ds["gradient_clipping"] == 1.0
        assert ds["fp16"] == {"enabled": False} and ds["bf16"] == {"enabled": False}, case
        dtype = item.spec.autocast_dtype
        if dtype is None:
            assert "torch_autocast" not in ds, case
        else:
            want = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
            assert ds["torch_autocast"] == {"enabled": True, "dtype": want}, case


def test_odd_scaler_options_are_expressed_or_refused():
    odd = CASES["fp16-mixed-cuda+odd-scaler"].source
    assert "growth_factor=4.0," in export(odd, "pytorch") and "growth_factor=4.0," in export(odd, "deepspeed")
    assert "growth_factor=4.0," in export(odd, "accelerate") and "growth_factor=4.0," in export(
        odd, "lightning"
    )
    assert "min_scale floor" not in export(odd, "pytorch")  # min_scale=None: no floor
    faithful, reason = export_status(odd, "hf")
    assert not faithful and "init_scale=1000.0" in reason and "GradScalerKwargs" in reason


def _get_policy_call(text: str) -> ast.Call:
    calls = [
        node
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get_policy"
    ]
    assert len(calls) == 1
    return calls[0]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"channels_last": True},
        {"keep_fp32": ["head", "blocks.*.norm"], "finite_check": True},
        {"init_scale": 1024.0, "min_scale": 1.0},  # min_scale=1.0 is the default: left out
        {"init_scale": 1024.0, "finite_check": True},
        {"growth_interval": 100, "backoff_factor": 0.25, "min_scale": None, "max_skips_at_min_scale": 5},
    ],
)
def test_mixprec_call_has_exactly_the_non_default_options_and_round_trips(options):
    name = "fp16-mixed" if any(k in options for k in ("init_scale", "growth_interval")) else "bf16-mixed"
    config = get_policy(name, device="cpu", check=False, **options).config
    call = _get_policy_call(export(config, "mixprec"))
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    assert kwargs.pop("device") == "cpu"
    assert ast.literal_eval(call.args[0]) == name
    expected = {k: v for k, v in options.items() if not (k == "min_scale" and v == 1.0)}
    assert kwargs == expected
    rebuilt = get_policy(name, device="cpu", check=False, **kwargs).config
    assert rebuilt == config


# ------------------------------------------------------------------------------------------ refusals
def test_refusal_raises_with_reason_and_alternative():
    config = PolicyConfig("fp16-mixed", "cpu")
    with pytest.raises(ExportRefused) as info:
        export(config, "accelerate")
    err = info.value
    assert isinstance(err, UsageError) and err.exit_code == 2
    assert (err.target, err.policy, err.device) == ("HF Accelerate", "fp16-mixed", "cpu")
    assert "does not run fp16 autocast on a CPU" in err.reason and "bf16-mixed" in err.alternative
    assert "Nearest faithful alternative: bf16-mixed" in str(err)
    assert export_status(config, "accelerate") == (False, f"{err.reason}; instead: {err.alternative}")
    assert export_status(config, "pytorch") == (True, "")


def test_export_all_records_refusals():
    results = export_all(PolicyConfig("fp16-mixed", "cpu", channels_last=True))
    assert list(results) == list(EXPORT_TARGETS)
    assert all(
        isinstance(r, ExportResult) and (r.text is None) != (r.refused is None) for r in results.values()
    )
    refused = {t for t, r in results.items() if not r.faithful}
    assert refused == {"accelerate", "hf", "fsdp2"}
    assert "non-contiguous" in results["fsdp2"].refused


def test_a_fused_optimizer_under_a_loss_scaler_is_refused_where_the_scheduler_would_miss_skips():
    """Accelerate and the HF Trainer tell a skipped step by whether optimizer.step() ran (see
    test_accelerate); the other stacks take fp16-mixed with a fused optimizer."""
    fused = Candidate("fp16-mixed", optimizer="fused")
    for target in EXPORT_TARGETS:
        faithful, reason = export_status(fused, target, device="cuda")
        if target in ("accelerate", "hf"):
            assert not faithful and "always runs a fused optimizer's step" in reason, target
            assert "instead: optimizer='foreach'" in reason, target
        else:
            assert faithful, (target, reason)
    for impl in ("foreach", "for-loop"):
        assert export_status(Candidate("fp16-mixed", optimizer=impl), "accelerate", device="cuda").faithful
    assert export_status(Candidate("bf16-mixed", optimizer="fused"), "hf", device="cuda").faithful


@pytest.mark.parametrize("target", ["accelerate", "hf"])
def test_compiled_exports_set_the_fp32_knobs_after_the_stack_touches_tf32(target):
    """On a GPU, Accelerator(dynamo_backend, mixed_precision="no") sets the legacy allow_tf32 flag and
    TrainingArguments(torch_compile=True) TF32 as the global fp32 precision: the knobs come after."""
    text = python_part(export(Candidate("fp32", compile="default"), target, device="cuda"), target)
    code = [line for line in text.splitlines() if not line.startswith("#")]
    made = next(i for i, line in enumerate(code) if line.startswith(("accelerator = ", "trainer = ")))
    knobs = [i for i, line in enumerate(code) if ".fp32_precision = " in line]
    assert knobs and min(knobs) > made
    eager = python_part(export(Candidate("fp32"), target, device="cuda"), target)
    assert eager.index(".fp32_precision = ") < eager.index(
        "Accelerator(" if target == "accelerate" else "Trainer("
    )


def test_every_optimizer_implementation_has_its_flag():
    assert set(facts.OPTIMIZER_FLAGS) == set(OPTIMIZER_IMPLS)
    for impl, flag in facts.OPTIMIZER_FLAGS.items():  # each flag builds that implementation
        group = eval(f"torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], {flag})").param_groups[0]
        assert (bool(group["fused"]), bool(group["foreach"])) == (impl == "fused", impl == "foreach")


def test_loop_axes_are_written_the_way_each_stack_runs_them():
    candidate = Candidate("bf16-mixed", compile="max-autotune", optimizer="fused")
    texts = {t: r.text for t, r in export_all(candidate, device="cuda").items()}
    assert all(texts.values()), [t for t, text in texts.items() if text is None]
    for target in ("mixprec", "pytorch", "fsdp2"):
        assert 'model = torch.compile(model, mode="max-autotune")' in texts[target], target
        assert "lr=1e-3, fused=True)" in texts[target], target
    fsdp2 = texts["fsdp2"]
    sharded = fsdp2.index("fully_shard(model, mesh=mesh, mp_policy=mp_policy)")
    assert sharded < fsdp2.index("model = torch.compile(model")
    lightning = texts["lightning"].splitlines()
    compiled = lightning.index(next(line for line in lightning if line.startswith("model = torch.compile(")))
    assert lightning[compiled + 1].startswith("trainer.fit(model, ")  # a compiled LightningModule goes in
    assert "torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)" in texts["lightning"]
    assert "def configure_gradient_clipping(" in texts["lightning"]  # MixedPrecision refuses fused clipping
    assert 'TorchDynamoPlugin(backend="inductor", mode="max-autotune")' in texts["accelerate"]
    assert "dynamo_mode: max-autotune" in split_sections(texts["accelerate"])["default_config.yaml"]
    assert 'torch_compile=True,\n    torch_compile_mode="max-autotune",' in texts["hf"]
    assert "optimizers=(optimizer, None)" in texts["hf"]
    assert 'model_engine.compile(compile_kwargs={"mode": "max-autotune"})' in texts["deepspeed"]
    for target, text in texts.items():
        assert text.startswith(
            '# mixprec export: policy \'bf16-mixed\' on cuda (compile="max-autotune", optimizer="fused")'
        ), target
    eager = export_all(Candidate("bf16-mixed"), device="cuda")
    assert not any("torch.compile" in r.text or "fused=True" in r.text for r in eager.values() if r.text)
    assert "def configure_gradient_clipping(" not in export(
        Candidate("fp32", optimizer="fused"), "lightning", device="cuda"
    )  # the 32-true plugin clips a fused optimizer's gradients itself


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_step_scope_is_one_compiled_train_step(device):
    """The targets that write the loop compile its body whole, as mixprec's TrainingSession does: no
    model-level compile, the mode on torch.compile, the scheduler outside, the optimizer as written."""
    candidate = Candidate("bf16-mixed", compile="max-autotune", compile_scope="step")
    texts = {t: r.text for t, r in export_all(candidate, device=device).items() if r.text}
    assert set(texts) == {"mixprec", "pytorch", "accelerate", "fsdp2"}
    for target, text in texts.items():
        assert text.startswith(
            "# mixprec export: policy 'bf16-mixed' on "
            f'{device} (compile="max-autotune", compile_scope="step")'
        ), target
        code = python_part(text, target)
        assert code.count("\ndef train_step(batch):\n") == 1, target
        assert 'train_step = torch.compile(train_step, mode="max-autotune")\n' in code, target
        assert "model = torch.compile(" not in code and "TorchDynamoPlugin" not in code, target
        assert "AdamW(model.parameters(), lr=1e-3)  # yours" in code, target
        body = code.split("def train_step(batch):", 1)[1].split("\n\n", 1)[0]
        assert "scheduler" not in body and "zero_grad(set_to_none=True)" in body, target
        assert "loss_fn(model, batch)" in body and "step(" in body, target
    assert "dynamo_config" not in split_sections(texts["accelerate"])["default_config.yaml"]
    assert "    stepped = policy.step(optimizer, clip_grad_norm=1.0)" in texts["mixprec"]
    assert "        if stepped:\n            scheduler.step()" in texts["mixprec"]
    assert texts["fsdp2"].index("fully_shard(model,") < texts["fsdp2"].index("def train_step(")
    fp16 = export(Candidate("fp16-mixed", compile="default", compile_scope="step"), "pytorch", device=device)
    step = fp16.split("def train_step(batch):", 1)[1]
    assert step.index("scaler.scale(loss).backward()") < step.index("return loss, skipped")
    assert "    loss, skipped = train_step(batch)\n    if not skipped:\n        scheduler.step()" in fp16
    assert "GradScaler's methods (scale, unscale_, step, update) run eagerly" in " ".join(
        line[2:].strip() for line in fp16.splitlines() if line.startswith("#")
    )


def test_the_model_scope_is_todays_text():
    """compile_scope='model' is the default scope, spelled None: the text of a compiled model."""
    model = Candidate("bf16-mixed", compile="default", compile_scope="model")
    assert model.compile_scope is None
    assert export_all(model, device="cuda") == export_all(
        Candidate("bf16-mixed", compile="default"), device="cuda"
    )


# The stacks that own the optimizer step, and what the refusal names as the reason.
STEP_OWNERS = {
    "lightning": "Lightning's automatic optimization owns the optimizer step",
    "hf": "the HF Trainer owns its loop",
    "deepspeed": "DeepSpeed's engine.step() is its own",
}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_step_scope_is_refused_where_the_stack_owns_the_step(device):
    step = Candidate(
        "fp32", compile="reduce-overhead" if device == "cuda" else "default", compile_scope="step"
    )
    model_scope = replace(step, compile_scope=None)
    for target, why in STEP_OWNERS.items():
        faithful, reason = export_status(step, target, device=device)
        assert not faithful and reason.startswith(why), (target, reason)
        assert f"instead: the same candidate at model scope (compile={step.compile!r} without" in reason
        assert "or the 'pytorch' or 'mixprec' export, which compile the whole step" in reason
        assert export_status(model_scope, target, device=device).faithful, target  # the alternative
        with pytest.raises(ExportRefused, match=re.escape(why)):
            export(step, target, device=device)
    for target in ("mixprec", "pytorch", "accelerate", "fsdp2"):
        assert export_status(step, target, device=device).faithful, target


def test_accelerate_refuses_the_step_scope_with_its_fp16_scaler():
    """Accelerate's fp16 exists only off the CPU, where mixprec has not run it compiled."""
    step = Candidate("fp16-mixed", compile="default", compile_scope="step")
    faithful, reason = export_status(step, "accelerate", device="cuda")
    assert not faithful and "mixprec has not run that inside a compiled step" in reason
    assert "with Accelerate, which compiles the model (TorchDynamoPlugin)" in reason
    assert export_status(replace(step, compile_scope=None), "accelerate", device="cuda").faithful
    assert export_status(step, "pytorch", device="cuda").faithful
    assert export_status(
        Candidate("bf16-mixed", compile="default", compile_scope="step"), "accelerate"
    ).faithful


@pytest.mark.parametrize(
    ("candidate", "fragment"),
    [
        (
            Candidate("bf16-mixed", compile="default", compile_scope="step", optimizer="fused"),
            "the step scope compiles the optimizer's update itself; drop optimizer='fused'",
        ),
        (Candidate("bf16-mixed", compile="default", compile_scope="graph"), "valid: model, step"),
        (Candidate("bf16-mixed", compile="fast"), "Unknown PyTorch compile mode 'fast'; valid: default"),
    ],
)
def test_loop_axes_mixprec_does_not_run_are_usage_errors(candidate, fragment):
    """What mixprec's torch backend refuses to measure is not exported either."""
    for call in (export, export_status):
        with pytest.raises(UsageError, match=re.escape(fragment)):
            call(candidate, "pytorch", device="cpu")


@pytest.mark.parametrize(("name", "device"), [("tf32", "cpu"), ("bf32", "cuda")])
def test_a_math_mode_of_the_other_device_is_refused_everywhere(name, device):
    for target in EXPORT_TARGETS:
        faithful, reason = export_status(PolicyConfig(name, device), target)
        assert not faithful and "plain fp32" in reason, target


def test_frameworks_extra_matches_the_verified_releases():
    """pyproject's frameworks extra pins each package to the minor release its target was checked against."""
    text = (ROOT / "pyproject.toml").read_text()
    for package, verified in FRAMEWORKS.items():
        major, minor = verified.split(".")
        assert f'"{package}>={verified},<{major}.{int(minor) + 1}"' in text, package


# ------------------------------------------------------------------------------------------ snippets
def test_snippets_are_what_policy_uses_and_emitted_with_their_dependencies():
    from mixprec.policy import policy as policy_module

    for name in ("cast_inputs", "channels_last_inputs", "keep_in_fp32", "default_dtype"):
        assert getattr(policy_module, name) is getattr(snippets, name)
    assert snippets.needed(["keep_in_fp32"]) == ["cast_floating", "Fp32Island", "keep_in_fp32"]
    assert snippets.needed(["channels_last_inputs", "cast_inputs"]) == [
        "cast_floating",
        "to_channels_last",
        "CastInputs",
        "cast_inputs",
        "channels_last_inputs",
    ]
    blocks = snippets.source(["default_dtype", "fp32_islands"])
    assert snippets.stdlib_imports(blocks) == [
        "import contextlib",
        "import fnmatch",
        "from collections.abc import Iterator",
    ]
    with pytest.raises(KeyError):
        snippets.source_in_file(snippets.__file__, "no_such_helper")


def test_fp32_islands_matches_mixprec_keep_fp32():
    model = Net()
    for patterns in (["head"], ["layers.*"], ["head", "layers.0.0"]):
        assert list(snippets.fp32_islands(model, patterns)) == island_names(model, patterns)
    with pytest.raises(ValueError, match="matches no module"):
        snippets.fp32_islands(model, ["nope"])


def test_input_hooks_convert_keyword_inputs_and_keep_labels():
    x, labels = torch.randn(2, 3, 4, 4), torch.randn(2, 2)
    args, kwargs = snippets.cast_inputs(torch.bfloat16, keep=("labels",))(
        None, (x,), {"x": x, "labels": labels}
    )
    assert args[0].dtype == kwargs["x"].dtype == torch.bfloat16 and kwargs["labels"].dtype == torch.float32
    args, kwargs = snippets.channels_last_inputs(None, (x,), {"x": x, "labels": labels})
    assert args[0].is_contiguous(memory_format=torch.channels_last)
    assert kwargs["x"].is_contiguous(memory_format=torch.channels_last) and kwargs["labels"] is labels


def test_policy_converts_keyword_inputs_to_channels_last():
    seen = []

    class Kw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, *, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.is_contiguous(memory_format=torch.channels_last))
            return self.conv(x)

    model = get_policy("fp32", device="cpu", channels_last=True).prepare(Kw())
    model(x=torch.randn(1, 3, 4, 4))
    assert seen == [True]


def test_default_dtype_in_forward_restores_on_errors():
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert torch.get_default_dtype() == torch.bfloat16
            raise RuntimeError("boom")

    model = snippets.default_dtype_in_forward(Boom(), torch.bfloat16)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.ones(1))
    assert torch.get_default_dtype() == torch.float32


# ------------------------------------------------------------------------------------------ API
def test_unknown_target_lists_the_valid_ones():
    with pytest.raises(UsageError) as info:
        export(CASES["fp32-cpu"].source, "lightnin")
    message = str(info.value)
    assert "'lightnin'" in message and all(t in message for t in EXPORT_TARGETS)
    assert "Did you mean 'lightning'?" in message
    assert info.value.exit_code == 2


def test_aliases_and_policy_objects_are_accepted():
    config = CASES["bf16-mixed-cuda+cl+head"].source
    assert export(config, "transformers") == export(config, "hf")
    assert export(config, "DS") == export(config, "deepspeed")
    bf16 = CASES["bf16-mixed-cuda"].source
    assert export(bf16, "FSDP") == export(bf16, "fsdp2")
    policy = get_policy("bf16", device="cpu", check=False)
    assert export(policy, "mixprec") == export(policy.config, "mixprec")
    aliased = PolicyConfig("16-mixed", "cuda")
    assert export(aliased, "mixprec") == export(PolicyConfig("fp16-mixed", "cuda"), "mixprec")


def test_a_candidate_exports_as_its_policy_config_does():
    """A Candidate becomes its config through get_policy; without loop axes the texts are the config's."""
    candidate = Candidate("bf16", channels_last=True, keep_fp32=["head"])
    config = PolicyConfig("bf16-mixed", "cuda", True, ("head",))
    assert export_all(candidate, device="cuda") == export_all(config)
    assert export_status(candidate, "fsdp2", device="cuda") == export_status(config, "fsdp2")
    here = str(resolve_device(None))
    assert export(candidate, "pytorch") == export(
        replace(config, device=here), "pytorch"
    )  # mixprec's default
    fp16 = export(Candidate("fp16-mixed"), "pytorch", device="cuda")
    assert "init_scale=65536.0," in fp16 and export(PolicyConfig("fp16-mixed", "cuda"), "pytorch") == fp16


def test_a_config_exports_eager_for_its_device_unless_one_is_given():
    policy = get_policy("bf16-mixed", device="cpu", check=False)
    assert 'device="cpu"' in export(policy, "mixprec")
    assert 'device="cuda"' in export(policy, "mixprec", device="cuda")
    assert export(policy, "mixprec", device="cuda") == export(PolicyConfig("bf16-mixed", "cuda"), "mixprec")
    for side in ({"compile": "default"}, {"optimizer": "fused"}):  # the candidate's axes, not side arguments
        with pytest.raises(TypeError):
            export(policy, "pytorch", **side)
        with pytest.raises(TypeError):
            export_all(policy, **side)


@pytest.mark.parametrize(
    ("source", "device", "fragment"),
    [
        ("bf16-mixed", None, "takes a mixprec Candidate, PolicyConfig or Policy, got str 'bf16-mixed'"),
        (PolicyConfig("bf16-mix", "cpu"), None, "Did you mean 'bf16-mixed'"),
        (PolicyConfig("fp32", "not-a-device"), None, "invalid device 'not-a-device'"),
        (PolicyConfig("fp32", "meta"), None, "mixprec policies run on cuda, cpu"),
        (Candidate("fp32"), "meta", "Cannot export for device 'meta'; mixprec policies run on cuda, cpu"),
        (Candidate("fp32"), "not-a-device", "valid: cuda, cpu"),
        (Candidate("bf16-mixed", framework="tensorflow"), None, "a 'tensorflow' candidate"),
        (Candidate("fp32", emulate="bf16"), None, "emulates bf16 rounding for `check`"),
    ],
)
def test_bad_input_raises_usage_errors_naming_it(source, device, fragment):
    with pytest.raises(UsageError, match=re.escape(fragment)):
        export(source, "pytorch", device=device)
    with pytest.raises(UsageError, match=re.escape(fragment)):
        export_status(source, "pytorch", device=device)
    with pytest.raises(UsageError, match=re.escape(fragment)):
        export_all(source, device=device)


def test_split_sections():
    assert split_sections("a = 1\n") == {"": "a = 1\n"}
    sections = split_sections("# head\n# --- x.yaml ---\nk: v\n# --- y.py ---\nimport os\n")
    assert sections == {"": "# head\n", "x.yaml": "k: v\n", "y.py": "import os\n"}


def test_exporting_touches_no_global_state_and_imports_no_framework():
    before = state.snapshot()
    modules = set(sys.modules)
    for item in CASES.values():
        item.export_all()
    assert state.snapshot() == before
    assert not {m.split(".")[0] for m in set(sys.modules) - modules} & {
        "lightning",
        "accelerate",
        "deepspeed",
    }


# ------------------------------------------------------------------------------------------ tune
def test_tune_summary_lists_each_target_as_faithful_or_refused():
    from mixprec.report.tune import export_lines
    from mixprec.report.view import exports_section

    results = export_all(PolicyConfig("fp16-mixed", "cpu"))
    section = exports_section(
        {t: r.text for t, r in results.items() if r.faithful},
        {t: r.refused for t, r in results.items() if not r.faithful},
    )
    console = Console(file=io.StringIO(), width=400)
    for line in export_lines(section.body):
        console.print(line)
    out = console.file.getvalue()
    assert "  pytorch: faithful" in out and "  lightning: faithful" in out
    assert "  accelerate: refused: Accelerate does not run fp16 autocast on a CPU" in out
    assert out.index("mixprec:") < out.index("accelerate:") < out.index("hf:")


def test_tune_result_round_trips_export_refusals(tiny_tune_result):
    from mixprec.tuning.result import TuneResult

    data = json.loads(json.dumps(tiny_tune_result.to_dict()))
    data["export_refusals"] = {"accelerate": "why"}
    assert TuneResult.from_dict(data).to_dict()["export_refusals"] == {"accelerate": "why"}


# ------------------------------------------------------------------------------------------ docs
DOC = ROOT / "docs" / "exports.md"
MATRIX_START, MATRIX_END = "<!-- matrix: generated by tests/exports/test_text.py -->", "<!-- matrix end -->"
OPTION_CASES = {
    "channels_last=True": {"channels_last": True},
    "keep_fp32": {"keep_fp32": ("head",)},
    "finite_check=True": {"finite_check": True},
    "non-default GradScaler options": {"scaler": ScalerOptions(init_scale=1024.0)},
    # The candidate's loop axes (a Candidate's fields, exported with device=...).
    "compile='max-autotune'": {"compile": "max-autotune"},
    "compile='default', compile_scope='step'": {"compile": "default", "compile_scope": "step"},
    "optimizer='fused'": {"optimizer": "fused"},
    "optimizer='foreach'": {"optimizer": "foreach"},
}
LOOP_OPTIONS = {"compile", "compile_scope", "optimizer"}


def matrix_markdown() -> str:
    """target x policy x device -> faithful / refused (n), then the reasons, then the options that
    turn a faithful combination into a refusal."""
    reasons: dict[str, int] = {}
    lines = [
        "| policy | device | " + " | ".join(EXPORT_TARGETS) + " |",
        "|---|---|" + "---|" * len(EXPORT_TARGETS),
    ]
    for device in ("cpu", "cuda"):
        for name in mixprec.POLICY_NAMES:
            cells = []
            for target in EXPORT_TARGETS:
                faithful, reason = export_status(PolicyConfig(name, device), target)
                cells.append(
                    "faithful" if faithful else f"refused ({reasons.setdefault(reason, len(reasons) + 1)})"
                )
            lines.append(f"| {name} | {device} | " + " | ".join(cells) + " |")
    lines += ["", "Refusals (each names the nearest faithful alternative after `instead:`):", ""]
    lines += [f"{n}. {reason}" for reason, n in reasons.items()]
    lines += ["", "Options that make a faithful combination refused:", ""]
    for label, options in OPTION_CASES.items():
        hit: dict[str, tuple[list[str], str]] = {}
        for target in EXPORT_TARGETS:
            for device in ("cpu", "cuda"):
                for name in mixprec.POLICY_NAMES:
                    config = PolicyConfig(name, device)
                    if not export_status(config, target).faithful:
                        continue
                    if "scaler" in options and not config.spec.loss_scaling:
                        continue
                    if "keep_fp32" in options and config.spec.low_precision_dtype is None:
                        continue
                    if LOOP_OPTIONS & set(options):
                        faithful, reason = export_status(Candidate(name, **options), target, device=device)
                    else:
                        faithful, reason = export_status(PolicyConfig(name, device, **options), target)
                    if not faithful:
                        hit.setdefault(target, ([], reason))[0].append(f"{name} on {device}")
        if not hit:
            lines.append(f"- {label}: none.")
        for target, (where, reason) in hit.items():
            lines.append(f"- {label}, {target} ({', '.join(dict.fromkeys(where))}): {reason}")
    return "\n".join(lines)


def test_docs_matrix_is_current():
    text = DOC.read_text()
    head, rest = text.split(MATRIX_START)
    _, tail = rest.split(MATRIX_END)
    fresh = f"{head}{MATRIX_START}\n{matrix_markdown()}\n{MATRIX_END}{tail}"
    if UPDATE_GOLDEN:
        DOC.write_text(fresh)
        return
    assert text == fresh, f"{DOC} is stale: regenerate with MIXPREC_UPDATE_GOLDEN=1 pytest {__file__}"


# ------------------------------------------------------------------------------------------ micro-batches
def test_accumulation_is_written_the_way_each_stack_runs_it():
    """Micro-batches of 16, 4 per optimizer step: each stack's own setting where it has one, the loss
    divided by 4 only where the stack's backward does not divide it, and the header says 16 x 4 = 64."""
    texts = {t: r.text for t, r in ACCUMULATING["bf16-mixed-cuda@16x4"].export_all().items()}
    assert all(texts.values()), [t for t, text in texts.items() if text is None]
    for target, text in texts.items():
        head = " ".join(line[2:].strip() for line in text.splitlines() if line.startswith("#"))
        assert head.startswith(
            "mixprec export: policy 'bf16-mixed' on cuda (micro_batch=16, accumulation_steps=4)"
        )
        assert "an effective batch of 64 samples per optimizer step" in head, target
        divides = "loss_fn(model, batch) / accumulation_steps" in text
        assert divides == (target in ("mixprec", "pytorch", "fsdp2")), target
    for target in ("mixprec", "pytorch", "fsdp2"):
        assert "accumulation_steps = 4  # micro-batches of 16 per optimizer step: 64 samples" in texts[target]
        assert "for i, batch in enumerate(loader, start=1):  # micro-batches of 16" in texts[target]
        assert "    if i % accumulation_steps:\n" in texts[target], target
    pytorch = texts["pytorch"]  # clipping and the step after the last micro-batch's backward only
    assert (
        pytorch.index("    loss.backward()") < pytorch.index("continue") < pytorch.index("clip_grad_norm_(")
    )
    assert "    model.set_requires_gradient_sync(i % accumulation_steps == 0)\n" in texts["fsdp2"]
    assert "accumulate_grad_batches=4" in texts["lightning"]
    accelerate = texts["accelerate"]
    assert (
        "gradient_accumulation_steps=4" in accelerate and "with accelerator.accumulate(model):" in accelerate
    )
    assert "        if accelerator.sync_gradients:" in accelerate  # clips the whole step's gradients only
    config = json.loads(split_sections(texts["deepspeed"])["ds_config.json"])
    assert config["train_micro_batch_size_per_gpu"] == 16 and config["gradient_accumulation_steps"] == 4
    assert "train_batch_size" not in config  # DeepSpeed derives it with the world size
    assert "boundary = model_engine.is_gradient_accumulation_boundary()" in texts["deepspeed"]
    assert "per_device_train_batch_size=16,\n    gradient_accumulation_steps=4," in texts["hf"]
    fp16 = ACCUMULATING["fp16-mixed-cuda+head@16x4"].export("pytorch")  # the scaler once per step
    assert fp16.count("scaler.step(optimizer)") == fp16.count("scaler.update()") == 1
    assert fp16.index("continue") < fp16.index("scaler.unscale_(optimizer)") < fp16.index("clip_grad_norm_(")


def test_a_micro_batch_without_accumulation_is_the_batch_size_and_none_is_todays_text():
    one = Candidate("bf16-mixed", micro_batch=16)
    texts = {t: r.text for t, r in export_all(one, device="cuda").items()}
    assert (
        "per_device_train_batch_size=16," in texts["hf"] and "gradient_accumulation_steps" not in texts["hf"]
    )
    config = json.loads(split_sections(texts["deepspeed"])["ds_config.json"])
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (16, 1)
    assert "for batch in loader:  # batches of 16: DataLoader(..., batch_size=16)" in texts["pytorch"]
    # DeepSpeed's loop checks the accumulation boundary in every export (a user may add accumulation
    # to ds_config.json: issue 39); nothing else says accumulation without it
    boundary = "model_engine.is_gradient_accumulation_boundary()"
    assert boundary in texts["deepspeed"]
    assert not any(
        "accumulat" in python_part(text, target).replace(boundary, "") for target, text in texts.items()
    )
    assert export_all(one.unbatched, device="cuda") == export_all(Candidate("bf16-mixed"), device="cuda")


def test_the_step_scope_with_accumulation_is_refused_everywhere():
    """A compiled step over accumulated micro-batches loops around backward(): dynamo skips such a
    function; the model scope accumulates, and the step scope without accumulation is written."""
    step = Candidate(
        "bf16-mixed", compile="default", compile_scope="step", micro_batch=16, accumulation_steps=4
    )
    for target in EXPORT_TARGETS:
        faithful, reason = export_status(step, target, device="cuda")
        assert not faithful and "dynamo does not resume a graph break inside a loop" in reason, target
        assert (
            "the same candidate at model scope" in reason and "micro_batch=64 without accumulation" in reason
        )
    assert all(r.text for r in export_all(replace(step, compile_scope=None), device="cuda").values())
    assert export_status(
        replace(step, micro_batch=64, accumulation_steps=1), "pytorch", device="cuda"
    ).faithful
