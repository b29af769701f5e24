"""Every policy states every fact the rest of mixprec reads from its spec, and the facts agree."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.hardware.peaks import DTYPE_KEYS
from mixprec.numerics.limits import FORMATS
from mixprec.policy import POLICIES, Candidate, PolicySpec, Thresholds, spec_of
from mixprec.policy.registry import COMPUTE_FORMATS, DEVICE_TYPES, PEAK_KEYS
from mixprec.status import TONES, Status

FACTS = [f.name for f in dataclasses.fields(PolicySpec)]


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_states_every_fact(name):
    spec = POLICIES[name]
    assert spec.name == name
    for fact in ("description", "compute_format", "peak_key", "rounding_format", "range_format"):
        assert isinstance(getattr(spec, fact), str) and getattr(spec, fact), (name, fact)
    # Lightning has a name for every policy but the low formats (its fp8 is Transformer Engine)
    assert isinstance(spec.lightning, str) if spec.low_format is None else spec.lightning is None
    assert spec.compute_format in COMPUTE_FORMATS
    assert spec.peak_key in DTYPE_KEYS
    assert spec.rounding_format in FORMATS or spec.rounding_format == "fp32"
    assert spec.range_format in FORMATS or spec.range_format == "fp32"
    assert isinstance(spec.thresholds, Thresholds)
    assert spec.accelerate is None or spec.accelerate in ("no", "bf16", "fp16")
    assert spec.deepspeed is None or spec.deepspeed in ("bf16", "fp16", "torch_autocast")
    assert not (spec.autocast_dtype and spec.param_dtype), "mixed and true are exclusive"
    assert spec.loss_scaling == (spec.low_precision_dtype == torch.float16)
    assert spec.compute_dtype == (spec.low_precision_dtype or torch.float32)
    # fallbacks: known policies, closest first, never itself, ending where everything runs
    assert isinstance(spec.fallbacks, tuple) and set(spec.fallbacks) <= set(POLICIES) - {name}
    assert len(set(spec.fallbacks)) == len(spec.fallbacks)
    assert spec.fallbacks[-1:] == (() if name == "fp32" else ("fp32",))
    # device_only: exactly the policies whose setting reaches one device type's libraries only
    only = spec.device_only
    reduced_math_mode = spec.is_math_mode and spec.precision != POLICIES["fp32"].precision
    assert (only is not None) == (reduced_math_mode or spec.low_format is not None), name
    if only is not None:
        assert only.device_type in DEVICE_TYPES and only.reason and only.alternative
        assert only.device_type == (
            "cuda" if spec.precision.cuda_matmul != "ieee" or spec.low_format else "cpu"
        )
    # starting points: a rank where a newcomer may start, on named device types
    assert (spec.starting_rank is None) == (not spec.starting_devices), name
    assert set(spec.starting_devices) <= set(DEVICE_TYPES)
    # a newcomer starts with fp32 master weights, on a policy every stack exports (no fp8)
    assert spec.starting_rank is None or (spec.param_dtype is None and spec.fp8_recipe is None)
    if only is not None:
        assert set(spec.starting_devices) <= {only.device_type}


def test_every_device_has_one_starting_order_ending_in_fp32():
    for device in DEVICE_TYPES:
        starts = [s for s in POLICIES.values() if device in s.starting_devices]
        ranks = [s.starting_rank for s in starts]
        assert len(set(ranks)) == len(ranks), device
        assert max(starts, key=lambda s: s.starting_rank or 0).name == "fp32", device


def test_safety_ranks_order_the_vocabulary():
    ranks = [POLICIES[n].safety_rank for n in mixprec.POLICY_NAMES]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)


def test_compute_formats_match_the_dtypes():
    for spec in POLICIES.values():
        if spec.fp8_recipe is not None:
            assert spec.compute_format == "fp8" and spec.autocast_dtype is torch.bfloat16
        elif spec.block_format is not None:  # the block formats name their recipe
            assert spec.compute_format == spec.name and spec.autocast_dtype is torch.bfloat16
        elif spec.low_precision_dtype is torch.bfloat16:
            assert spec.compute_format == "bf16"
        elif spec.low_precision_dtype is torch.float16:
            assert spec.compute_format == "fp16"
        else:
            assert spec.compute_format == spec.name  # fp32, tf32, bf32 name their math mode


def test_candidate_identity_and_round_trip():
    cand = Candidate("bf16", channels_last=True, keep_fp32=["head"])
    assert cand.policy == "bf16-mixed" and cand.keep_fp32 == ("head",)  # aliases and lists normalised
    assert cand == Candidate("bf16-mixed", True, ("head",)) and hash(cand) == hash(
        Candidate("bf16-mixed", True, ("head",))
    )
    assert cand.label == "bf16-mixed+cl+fp32[head]"
    assert cand.numerics == Candidate("bf16-mixed", keep_fp32=("head",))
    assert Candidate.from_dict(cand.to_dict()) == cand
    assert Candidate("fp32", emulate="bf16").label == "bf16 (emulated)"
    assert spec_of(cand.policy) is cand.spec
    policy = mixprec.get_policy(cand.policy, device="cpu", **cand.policy_options())
    assert policy.config.channels_last and policy.config.keep_fp32 == ("head",)


@pytest.mark.parametrize(
    "kwargs",
    [{"policy": "bf16-mix"}, {"policy": "fp32", "keep_fp32": 5}, {"policy": "fp32", "emulate": "fp16"}],
)
def test_bad_candidates_fail_with_the_valid_values(kwargs):
    with pytest.raises(mixprec.PolicyError, match="valid"):
        Candidate(**kwargs)


def test_every_status_has_a_tone():
    assert set(TONES) == set(Status)


# ------------------------------------------------------------------------------------------ one registry
SRC = Path(mixprec.__file__).parent
REGISTRY = "policy/registry.py"
# A collection that also names a format which is no policy (bf16, fp16, fp8, ...) is a table of
# formats or peak keys, where "fp32" and "tf32" are formats too: not a per-policy table.
FORMAT_ONLY = {*COMPUTE_FORMATS, *PEAK_KEYS, *FORMATS} - set(mixprec.POLICY_NAMES)
# A table that is allowed elsewhere, with why: (the function or name that builds it, its policy
# names) -> the reason. None today; an entry that no longer matches fails the test.
PENDING: dict[tuple[str, tuple[str, ...]], str] = {}


def _policy_tables(tree: ast.Module) -> list[tuple[str, int, tuple[str, ...]]]:
    """(enclosing function or assigned name, line, policy names) for every dict keyed by, and every
    set/tuple/list of, two or more policy-name string literals."""
    names = set(mixprec.POLICY_NAMES)
    found: list[tuple[str, int, tuple[str, ...]]] = []

    def strings(nodes: list[ast.expr | None]) -> list[str]:
        return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]

    def visit(node: ast.AST, scope: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and scope is None:
            scope = ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
        items = None
        if isinstance(node, ast.Dict):
            items = strings(list(node.keys))
        elif isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            items = strings(list(node.elts))
        if items is not None:
            policies = tuple(s for s in items if s in names)
            if len(policies) >= 2 and not FORMAT_ONLY & set(items):
                found.append((scope or "<module>", node.lineno, policies))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, None)
    return found


def test_no_per_policy_table_outside_the_registry():
    """Every per-policy fact lives on PolicySpec: no other module keys a dict by policy names or
    groups them in a set, tuple or list (a new policy must not need edits spread around)."""
    tables, seen = [], set()
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        if module == REGISTRY:
            continue
        for scope, line, policies in _policy_tables(ast.parse(path.read_text(encoding="utf-8"))):
            if (scope, policies) in PENDING:
                seen.add((scope, policies))
                continue
            tables.append(f"{module}:{line} ({scope}): {', '.join(policies)}")
    assert not tables, (
        "per-policy tables outside policy/registry.py; make each a documented PolicySpec field:\n"
        + "\n".join(tables)
    )
    stale = set(PENDING) - seen
    assert not stale, f"PENDING entries no longer found, remove them: {sorted(stale)}"
