"""mixprec.export: every snippet parses, matches its golden file, and the runnable ones train on CPU."""

from __future__ import annotations

import ast
import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import state
from mixprec.errors import UsageError
from mixprec.exports import EXPORT_TARGETS, export, export_all, split_sections
from mixprec.policy import PolicyConfig, ScalerOptions

GOLDEN_DIR = Path(__file__).parent / "golden" / "export"
UPDATE_GOLDEN = os.environ.get("MIXPREC_UPDATE_GOLDEN") == "1"

# CUDA configs are built directly: exporting needs no GPU.
MATRIX: dict[str, PolicyConfig] = {
    "fp32": PolicyConfig("fp32", "cpu"),
    "tf32": PolicyConfig("tf32", "cuda"),
    "bf32": PolicyConfig("bf32", "cpu"),
    "bf16-mixed": PolicyConfig("bf16-mixed", "cuda", channels_last=True, keep_fp32=("head",)),
    "fp16-mixed": PolicyConfig("fp16-mixed", "cuda", scaler=ScalerOptions(init_scale=1024.0, min_scale=1.0)),
    "bf16-true": PolicyConfig("bf16-true", "cuda"),
    "fp16-true": PolicyConfig("fp16-true", "cuda", scaler=ScalerOptions()),
}
CASES = [(policy, target) for policy in MATRIX for target in EXPORT_TARGETS]
PYTHON_SECTION = {"accelerate": "train.py", "deepspeed": "train.py"}


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every test here trains tiny models: one thread (see conftest.single_thread)."""


def python_part(text: str, target: str) -> str:
    return split_sections(text)[PYTHON_SECTION[target]] if target in PYTHON_SECTION else text


# ------------------------------------------------------------------------------------------ golden files
@pytest.mark.parametrize(("policy", "target"), CASES, ids=[f"{p}-{t}" for p, t in CASES])
def test_golden(policy, target):
    text = export(MATRIX[policy], target)
    path = GOLDEN_DIR / f"{policy}-{target}.txt"
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"missing {path}; create it with MIXPREC_UPDATE_GOLDEN=1 pytest {__file__}"
    assert text == path.read_text(), (
        f"export({policy!r}, {target!r}) differs from {path}; if the change is intended, regenerate with "
        "MIXPREC_UPDATE_GOLDEN=1 and review the diff"
    )


def test_no_stale_golden_files():
    expected = {f"{p}-{t}.txt" for p, t in CASES}
    present = {p.name for p in GOLDEN_DIR.glob("*.txt")}
    assert present - expected == set(), "golden files without a matrix entry"


# ------------------------------------------------------------------------------------------ syntax
@pytest.mark.parametrize("policy", MATRIX)
def test_every_python_part_parses(policy):
    texts = export_all(MATRIX[policy])
    assert list(texts) == list(EXPORT_TARGETS)
    for target, text in texts.items():
        source = python_part(text, target)
        compile(source, f"<export {policy} {target}>", "exec", flags=ast.PyCF_ONLY_AST)
        assert text.endswith("\n") and not text.endswith("\n\n")


# The venv's own ruff (a dev dependency) even when .venv/bin is not on PATH, as under `make test`.
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed")
def test_python_parts_are_lint_clean_and_ruff_formatted(tmp_path):
    for policy, config in MATRIX.items():
        for target, text in export_all(config).items():
            (tmp_path / f"{policy.replace('-', '_')}_{target}.py").write_text(python_part(text, target))
    common = ["--isolated", "--line-length", "110"]
    lint = [RUFF, "check", *common, "--select", "E,F,W,I,B,UP,SIM", "--ignore", "F821", str(tmp_path)]
    fmt = [RUFF, "format", *common, "--check", str(tmp_path)]
    for command in (lint, fmt):  # F821: model, loader, loss_fn are the user's
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("policy", MATRIX)
def test_deepspeed_block_is_json(policy):
    sections = split_sections(export(MATRIX[policy], "deepspeed"))
    assert list(sections) == ["", "ds_config.json", "train.py"]
    assert all(line.startswith("#") for line in sections[""].splitlines())  # comments stay outside the JSON
    config = json.loads(sections["ds_config.json"])
    assert config["gradient_clipping"] == 1.0
    spec = MATRIX[policy].spec
    if spec.low_precision_dtype == torch.bfloat16:
        assert config["bf16"] == {"enabled": True} and "fp16" not in config
    elif spec.low_precision_dtype is None:
        assert config["fp16"] == {"enabled": False} and config["bf16"] == {"enabled": False}
    else:
        options = MATRIX[policy].scaler or ScalerOptions()
        assert config["fp16"] == {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": round(math.log2(options.init_scale)),
            "loss_scale_window": options.growth_interval,
            "hysteresis": 1,
            "min_loss_scale": options.min_scale,
        }
        assert "hysteresis" in sections[""] and "default 2" in sections[""]


def test_deepspeed_fp16_values_for_the_fp16_mixed_recommendation():
    config = json.loads(split_sections(export(MATRIX["fp16-mixed"], "deepspeed"))["ds_config.json"])
    assert config["fp16"]["initial_scale_power"] == 10  # init_scale=1024
    assert config["fp16"]["min_loss_scale"] == 1 and isinstance(config["fp16"]["min_loss_scale"], int)


def test_deepspeed_notes_what_it_cannot_express():
    odd = PolicyConfig(
        "fp16-mixed", "cuda", scaler=ScalerOptions(init_scale=1000.0, growth_factor=4.0, min_scale=None)
    )
    sections = split_sections(export(odd, "deepspeed"))
    config = json.loads(sections["ds_config.json"])
    assert config["fp16"]["initial_scale_power"] == 10 and "min_loss_scale" not in config["fp16"]
    assert "rounded to 2**10" in sections[""]
    assert "growth_factor=4.0" in sections[""] and "min_scale=None" in sections[""]


YAML_LINE = re.compile(r"^[a-z_]+: ('no'|[a-z0-9]+|true|false)$")


@pytest.mark.parametrize("policy", MATRIX)
def test_accelerate_yaml_is_trivial_yaml(policy):
    config = MATRIX[policy]
    yaml = split_sections(export(config, "accelerate"))["default_config.yaml"]
    lines = yaml.splitlines()
    assert lines and all(YAML_LINE.match(line) for line in lines), yaml
    values = dict(line.split(": ") for line in lines)
    expected = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(config.spec.autocast_dtype, "'no'")
    assert values["mixed_precision"] == expected
    assert ("use_cpu" in values) == (config.device == "cpu")
    train = split_sections(export(config, "accelerate"))["train.py"]
    mode = expected.strip("'")
    assert f'mixed_precision="{mode}"' in train
    if config.spec.autocast_dtype == torch.float16:
        assert "GradScalerKwargs(" in train and "init_scale=1024.0," in train


# ------------------------------------------------------------------------------------------ content
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
    config = mixprec.get_policy(name, device="cpu", check=False, **options).config
    call = _get_policy_call(export(config, "mixprec"))
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    assert kwargs.pop("device") == "cpu"
    assert ast.literal_eval(call.args[0]) == name
    expected = {k: v for k, v in options.items() if not (k == "min_scale" and v == 1.0)}
    assert kwargs == expected
    rebuilt = mixprec.get_policy(name, device="cpu", check=False, **kwargs).config
    assert rebuilt == config


@pytest.mark.parametrize("policy", MATRIX)
def test_precision_knobs_follow_the_policy_settings(policy):
    config = MATRIX[policy]
    text = export(config, "pytorch")
    set_here = dict(re.findall(r"^torch\.backends\.(\w+\.\w+)\.fp32_precision = \"(\w+)\"$", text, re.M))
    libraries = ("cuda", "cudnn") if config.device == "cuda" else ("mkldnn",)
    wanted = {
        f"{backend}.{op}": value
        for (backend, op), value in config.spec.precision.per_knob().items()
        if backend in libraries
    }
    assert set_here == wanted and wanted
    assert "allow_tf32 =" not in text and "set_float32_matmul_precision(" not in text.replace(
        "torch.set_float32_matmul_precision()", ""
    )


def test_plain_pytorch_details():
    fp16 = export(MATRIX["fp16-mixed"], "pytorch")
    assert fp16.index("scaler.unscale_(optimizer)") < fp16.index("clip_grad_norm_")
    assert "torch.amp.GradScaler(" in fp16 and "init_scale=1024.0," in fp16
    assert "scaler.update(1.0)  # min_scale floor" in fp16
    cl = export(MATRIX["bf16-mixed"], "pytorch")
    assert "model = model.to(memory_format=torch.channels_last)" in cl
    assert "torch.autocast(device_type, enabled=False)" in cl and 'KEEP_FP32 = ["head"]' in cl
    true = export(MATRIX["bf16-true"], "pytorch")
    assert "model = model.to(torch.bfloat16)" in true and "torch.autocast" not in true
    assert "HalfGradScaler(" in export(MATRIX["fp16-true"], "pytorch")


def test_lightning_details():
    texts = {p: export(c, "lightning") for p, c in MATRIX.items()}
    precisions = {p: re.search(r'precision="([\w-]+)"', t) for p, t in texts.items()}
    assert precisions["fp32"][1] == precisions["tf32"][1] == precisions["bf32"][1] == "32-true"
    assert precisions["bf16-mixed"][1] == "bf16-mixed"
    assert precisions["bf16-true"][1] == "bf16-true" and precisions["fp16-true"][1] == "16-true"
    # A custom scaler goes through the plugin: Lightning refuses precision= together with it.
    assert precisions["fp16-mixed"] is None
    assert 'MixedPrecision("16-mixed", "cuda", scaler=scaler)' in texts["fp16-mixed"]
    assert "has no floor" in texts["fp16-mixed"]
    assert "set_float32_matmul_precision" in texts["tf32"] and "def setup(self, stage):" in texts["tf32"]
    assert (
        "def configure_model(self):" in texts["bf16-mixed"] and "keep_in_fp32(module" in texts["bf16-mixed"]
    )
    assert "WARNING: fp16-true" in texts["fp16-true"]
    default_scaler = PolicyConfig("fp16-mixed", "cuda", scaler=ScalerOptions())
    assert 'precision="16-mixed"' in export(default_scaler, "lightning")


def test_fsdp2_matches_mixprec_distributed():
    from mixprec.distributed import fsdp_mp_policy

    names = {torch.float32: "torch.float32", torch.bfloat16: "torch.bfloat16", torch.float16: "torch.float16"}
    for policy, config in MATRIX.items():
        text = export(config, "fsdp2")
        mp = fsdp_mp_policy(policy)
        assert f"mp_policy = MixedPrecisionPolicy(param_dtype={names[mp.param_dtype]}, " in text
        assert f"reduce_dtype={names[mp.reduce_dtype]})" in text
        assert "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard" in text
        if config.spec.loss_scaling:
            prose = " ".join(line.lstrip("# ") for line in text.splitlines())
            assert "ShardedGradScaler (made for FSDP1) is not needed" in prose
    islands = export(MATRIX["bf16-mixed"], "fsdp2")
    assert "fully_shard(islands[name], mp_policy=fp32_policy)" in islands
    assert islands.index("mp_policy=fp32_policy") < islands.index("for block in model.layers")


def test_hf_details():
    texts = {p: export(c, "hf") for p, c in MATRIX.items()}
    assert "bf16=True" in texts["bf16-mixed"] and "fp16=True" in texts["fp16-mixed"]
    assert "tf32=" not in re.sub(r"#.*", "", texts["tf32"])  # left unset on purpose, explained
    assert "use_cpu=True" in texts["fp32"] and "use_cpu=True" not in texts["tf32"]
    assert "init_scale=1024.0: no TrainingArguments flag" in texts["fp16-mixed"]
    assert "min_scale=1.0" in texts["fp16-mixed"]
    assert 'keep_fp32=["head"]' in texts["bf16-mixed"] and "bf32" in texts["bf32"]
    assert "model = model.to(torch.bfloat16)" in texts["bf16-true"] and "bf16=True" not in texts["bf16-true"]
    assert "WARNING: fp16-true" in texts["fp16-true"]


# ------------------------------------------------------------------------------------------ API
def test_unknown_target_lists_the_valid_ones():
    with pytest.raises(UsageError) as info:
        export(MATRIX["fp32"], "lightnin")
    message = str(info.value)
    assert "'lightnin'" in message and all(t in message for t in EXPORT_TARGETS)
    assert "Did you mean 'lightning'?" in message
    assert info.value.exit_code == 2


def test_aliases_and_policy_objects_are_accepted():
    config = MATRIX["bf16-mixed"]
    assert export(config, "FSDP") == export(config, "fsdp2")
    assert export(config, "transformers") == export(config, "hf")
    policy = mixprec.get_policy("bf16", device="cpu", check=False)
    assert export(policy, "mixprec") == export(policy.config, "mixprec")
    aliased = PolicyConfig("16-mixed", "cuda")
    assert export(aliased, "mixprec") == export(PolicyConfig("fp16-mixed", "cuda"), "mixprec")


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ("bf16-mixed", "PolicyConfig or Policy"),
        (PolicyConfig("bf16-mix", "cpu"), "Did you mean 'bf16-mixed'"),
        (PolicyConfig("fp32", "not-a-device"), "invalid device"),
        (PolicyConfig("fp32", "meta"), "mixprec policies run on cuda, cpu"),
    ],
)
def test_bad_configs_raise_usage_errors(config, fragment):
    with pytest.raises(UsageError, match=re.escape(fragment)):
        export(config, "pytorch")


def test_split_sections():
    assert split_sections("a = 1\n") == {"": "a = 1\n"}
    sections = split_sections("# head\n# --- x.yaml ---\nk: v\n# --- y.py ---\nimport os\n")
    assert sections == {"": "# head\n", "x.yaml": "k: v\n", "y.py": "import os\n"}


def test_exporting_touches_no_global_state():
    before = state.snapshot()
    for config in MATRIX.values():
        export_all(config)
    assert state.snapshot() == before


# ------------------------------------------------------------------------------------------ running them
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def make_loader(steps: int = 5, overflow_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for i in range(steps):
        x = torch.randn(8, 3, 4, 4, generator=generator)
        if i == overflow_at:
            x = x * 1e6  # overflows fp16 activations: the step must be skipped
        batches.append((x, torch.randn(8, 2, generator=generator)))
    return batches


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def run_snippet(text: str, model: nn.Module, loader: list) -> dict:
    namespace = {"model": model, "loader": loader, "loss_fn": loss_fn, "__name__": "exported_snippet"}
    exec(compile(text, "<exported snippet>", "exec"), namespace)
    return namespace


def run_plain(config: PolicyConfig, model: nn.Module, loader: list) -> dict:
    """The plain snippet sets the fp32 math mode at the top of a script, for good: restore it here."""
    before = state.snapshot()
    try:
        namespace = run_snippet(export(config, "pytorch"), model, loader)
        knobs = {
            f"mkldnn.{op}": getattr(torch.backends.mkldnn, op).fp32_precision
            for op in ("matmul", "conv", "rnn")
        }
    finally:
        state.restore(before)
    wanted = {f"{b}.{op}": v for (b, op), v in config.spec.precision.per_knob().items() if b == "mkldnn"}
    assert knobs == wanted  # the snippet really set the policy's oneDNN math mode
    return namespace


def run_mixprec(config: PolicyConfig, model: nn.Module, loader: list) -> dict:
    before = state.snapshot()
    namespace = run_snippet(export(config, "mixprec"), model, loader)
    assert state.snapshot() == before  # precision_scope() restored everything by itself
    return namespace


EXEC_CONFIGS = {
    "bf16-mixed": PolicyConfig("bf16-mixed", "cpu"),
    "bf16-mixed+cl+head": PolicyConfig("bf16-mixed", "cpu", channels_last=True, keep_fp32=("head",)),
    "fp16-mixed": PolicyConfig(
        "fp16-mixed", "cpu", scaler=ScalerOptions(init_scale=1024.0, growth_interval=2, min_scale=1.0)
    ),
    "bf16-true+head": PolicyConfig("bf16-true", "cpu", keep_fp32=("head",)),
}


@pytest.mark.parametrize("name", EXEC_CONFIGS)
def test_plain_and_mixprec_snippets_train_identically_on_cpu(name):
    config = EXEC_CONFIGS[name]
    fp16 = config.spec.loss_scaling
    loader = make_loader(overflow_at=2 if fp16 else None)
    torch.manual_seed(0)
    model = Net()
    initial = copy.deepcopy(model.state_dict())

    plain = run_plain(config, copy.deepcopy(model), loader)
    via_mixprec = run_mixprec(config, copy.deepcopy(model), loader)

    for namespace in (plain, via_mixprec):
        assert torch.isfinite(namespace["loss"]).item()  # the last step's loss
        trained = namespace["model"].state_dict()
        assert any(not torch.equal(trained[k].float(), initial[k].float()) for k in initial)
    # Same weights bit for bit, and the same scheduler steps (a skipped step skips it in both).
    plain_weights, mixprec_weights = plain["model"].state_dict(), via_mixprec["model"].state_dict()
    for key in initial:
        assert plain_weights[key].dtype == mixprec_weights[key].dtype
        assert torch.equal(plain_weights[key], mixprec_weights[key]), key
    assert plain["scheduler"].last_epoch == via_mixprec["scheduler"].last_epoch
    stats = via_mixprec["policy"].stats
    assert plain["scheduler"].last_epoch == stats.steps - stats.skipped_steps
    if fp16:
        assert (
            stats.skipped_steps == 1 and plain["skipped"] is False
        )  # the overflow was skipped, then trained
        assert plain["scaler"].get_scale() == stats.scale
    if config.keep_fp32:
        check_island(plain["model"], config)
        check_island(via_mixprec["model"], config)
    if config.channels_last:
        assert plain["model"].features[0].weight.is_contiguous(memory_format=torch.channels_last)


def check_island(model: nn.Module, config: PolicyConfig) -> None:
    """The head computes in fp32 from fp32-cast inputs inside the policy's autocast (outputs cast back for
    *-true), so its output equals fp32 math exactly."""
    head = model.head
    assert head.weight.dtype == torch.float32
    low = config.spec.low_precision_dtype
    x = torch.randn(2, 4 * 4 * 4).to(low)
    mixed = config.spec.autocast_dtype is not None
    with torch.no_grad(), torch.autocast("cpu", dtype=low, enabled=mixed):
        out = head(x)
    expected = F.linear(x.float(), head.weight, head.bias)
    assert out.dtype == (config.spec.param_dtype or torch.float32)
    assert torch.equal(out, expected.to(out.dtype))
