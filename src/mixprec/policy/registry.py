"""The closed vocabulary of precision policies, and every fact the rest of mixprec needs about each.

One :class:`PolicySpec` per policy carries what it computes in, which peak FLOP/s applies,
how it ranks for ties, what the numerics gate allows, and what the other training stacks
call it. Nothing else in mixprec keeps a per-policy table: a new policy is one entry here
(``tests/test_policy_registry.py`` checks that every spec states every fact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.errors import PolicyError, did_you_mean
from mixprec.state import PrecisionSettings

_STRICT = PrecisionSettings(cuda_matmul="ieee", cudnn="ieee", mkldnn="ieee")

# Formats the numerics facts name (mixprec.numerics.limits.FORMATS has their limits).
COMPUTE_FORMATS = ("fp32", "tf32", "bf32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4")
# torchao.float8 recipes the fp8 policies use (Float8LinearConfig.from_recipe_name).
FP8_RECIPES = ("tensorwise", "rowwise")
PEAK_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4")
# Device types mixprec policies run on (torch.device(...).type).
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class Thresholds:
    """Limits a candidate must meet against the strict-fp32 reference (see docs/check.md).

    Attributes:
        max_rel_loss_diff: largest relative loss difference from fp32 at any checked step,
            before the chaos-floor allowance (``chaos_factor`` times the fp32-vs-fp32 drift).
        min_output_sqnr_db: SQNR of the model output at the first step, in dB.
        min_grad_sqnr_db: SQNR of all parameter gradients together (one vector) at the first step.
        max_skip_fraction: optimizer steps skipped on non-finite gradients / steps, after the
            loss scale has settled (the start-up back-off is reported, not counted).
        chaos_factor: how many times the drift of two fp32 runs 2^-20 apart a candidate may drift.
        max_stalled_update_fraction: *-true policies: the share of weights with a gradient whose
            update rounded away in half-precision storage.

    The chaos floor is an fp32 run whose initial weights differ by one part in 2^20: how far
    two fp32 runs drift apart on this model in the same steps. Deep nets at initialisation
    amplify any rounding difference, so a fixed loss tolerance would fail every format on
    them while passing anything on a shallow model.
    """

    max_rel_loss_diff: float
    min_output_sqnr_db: float
    min_grad_sqnr_db: float
    max_skip_fraction: float = 0.0
    chaos_factor: float = 3.0
    max_stalled_update_fraction: float = 0.05


@dataclass(frozen=True)
class DeviceOnly:
    """A policy whose name holds on one device type only: elsewhere its setting reaches no library
    (tf32 on a CPU, bf32 on a GPU: plain fp32 under another name) or only reference kernels (fp8
    on a CPU). The exports refuse it elsewhere with these words.

    Attributes:
        device_type: the device type (one of :data:`DEVICE_TYPES`) the policy means what it says on.
        reason: what it would do on the other device type, one clause a user can act on.
        alternative: the nearest faithful alternative there.
    """

    device_type: str
    reason: str
    alternative: str


@dataclass(frozen=True)
class PolicySpec:
    """What a policy name means. ``autocast_dtype`` and ``param_dtype`` are mutually exclusive.

    Attributes:
        name: the canonical name (``fp32``, ``bf16-mixed``, ...).
        description: one line for tables and docs.
        precision: the fp32 math mode per library while the policy is active.
        compute_format: what matmuls and convolutions compute in: fp32, tf32, bf32, bf16 or fp16.
        peak_key: whose peak FLOP/s is the MFU denominator (bf32 runs oneDNN's bf16 kernels).
        rounding_format: the format whose rounding bounds the result's precision.
        range_format: the format whose exponent range limits values (tf32 and bf32 have bf16's).
        safety_rank: tie-break order, lower is simpler/safer: fp32 master weights beat
            half-precision storage, no loss scaling beats loss scaling.
        thresholds: the numerics gate's default limits, calibrated in docs/check.md.
        lightning: ``Trainer(precision=...)`` for this policy; None where Lightning has no such mode.
        accelerate: ``Accelerator(mixed_precision=...)``; None where Accelerate has no such mode.
        deepspeed: the DeepSpeed config section that expresses it ("torch_autocast" for *-mixed: fp32
            parameters, autocast), None where every precision section stays off (fp32 math modes, and
            *-true: the model is cast by hand, as DeepSpeed's "bf16"/"fp16" sections add fp32 master
            weights).
        autocast_dtype: *-mixed: fp32 weights, autocast to this dtype.
        param_dtype: *-true: weights stored in this dtype, no fp32 master copy.
        loss_scaling: a dynamic loss scaler is part of the policy (fp16).
        keras: the Keras 3 dtype policy that expresses it (``keras.mixed_precision.set_global_policy``),
            None where Keras has none (bf32 and newer formats: TensorFlow refuses the candidate).
        fp8_recipe: fp8 policies: the torchao.float8 recipe (:data:`FP8_RECIPES`) their Linear
            layers are converted with; everything else runs under bf16 autocast.
        block_format: block-scaled policies: the :data:`mixprec.policy.blockscale.BLOCK_FORMATS`
            recipe their Linear GEMMs run in (torchao's kernels on Blackwell, mixprec's emulation
            elsewhere); everything else runs under bf16 autocast.

    The facts from ``fallbacks`` on are documented under each field.
    """

    name: str
    description: str
    precision: PrecisionSettings
    compute_format: str
    peak_key: str
    rounding_format: str
    range_format: str
    safety_rank: int
    thresholds: Thresholds
    lightning: str | None
    accelerate: str | None
    deepspeed: str | None
    fallbacks: tuple[str, ...]
    """What to suggest where the policy is unsupported or only emulated: the first of these policies
    that runs natively on the device (:func:`mixprec.policy.support.check_support`'s suggestion).
    Closest numerics first; fp32 runs everywhere, so every chain but fp32's own ends with it."""
    autocast_dtype: torch.dtype | None = None
    param_dtype: torch.dtype | None = None
    loss_scaling: bool = False
    keras: str | None = None
    fp8_recipe: str | None = None
    block_format: str | None = None
    device_only: DeviceOnly | None = None
    """The one device type the policy means what it says on, with why not elsewhere and what to use
    there instead; None where it holds on every device type mixprec supports."""
    starting_rank: int | None = None
    """Where a newcomer starts before measuring anything
    (:func:`mixprec.policy.support.starting_policy`): on a device type of ``starting_devices``, the
    natively supported policy of lowest rank. Autocast before a math mode (tf32 and bf32 only change
    matmul internals), bf16 before fp16 (no loss scaler), fp32 last as it always runs. None: never a
    starting point."""
    starting_devices: tuple[str, ...] = ()
    """The device types (of :data:`DEVICE_TYPES`) on which ``starting_rank`` applies. fp16-mixed is a
    GPU default only: on a CPU without native fp16 it is far slower than fp32."""

    @property
    def low_precision_dtype(self) -> torch.dtype | None:
        """The half dtype the policy computes in, None for the fp32-storage math modes."""
        return self.autocast_dtype or self.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmul/conv outputs have (fp32 for fp32, tf32 and bf32)."""
        return self.low_precision_dtype or torch.float32

    @property
    def low_format(self) -> str | None:
        """The format a low-format Linear policy runs its Linear GEMMs in ("fp8", "mxfp8", "nvfp4"),
        None for every other policy: the policies a precision map (``keep_bf16``) applies to."""
        return "fp8" if self.fp8_recipe is not None else self.block_format

    @property
    def is_mixed(self) -> bool:
        return self.autocast_dtype is not None

    @property
    def is_math_mode(self) -> bool:
        """fp32 storage and compute whose internals a library flag changes (fp32, tf32, bf32)."""
        return self.low_precision_dtype is None


_FP8_ON_CPU = DeviceOnly(
    "cuda",
    "fp8 training needs fp8 tensor cores (an NVIDIA GPU with compute capability >= 8.9); on a CPU it runs "
    "torch._scaled_mm's slow reference kernels: mixprec only predicts its numerics there",
    "export for device='cuda' on an fp8 GPU, or 'bf16-mixed' on this CPU",
)

_BLOCK_ON_BLACKWELL = DeviceOnly(
    "cuda",
    "block-scaled formats (MXFP8, NVFP4) need Blackwell data-center tensor cores (compute capability 10.x); "
    "elsewhere mixprec emulates their numerics in fp32 to predict them, slowly",
    "export for device='cuda' on a Blackwell GPU, or 'bf16-mixed' here",
)

POLICIES: dict[str, PolicySpec] = {
    spec.name: spec
    for spec in (
        PolicySpec(
            "fp32",
            "fp32 storage and strict IEEE fp32 math (TF32 off for matmul and cuDNN conv)",
            _STRICT,
            compute_format="fp32",
            peak_key="fp32",
            rounding_format="fp32",
            range_format="fp32",
            safety_rank=0,
            thresholds=Thresholds(1e-6, 100.0, 100.0),
            lightning="32-true",
            accelerate="no",
            deepspeed=None,
            fallbacks=(),
            starting_rank=4,
            starting_devices=("cpu", "cuda"),
            keras="float32",
        ),
        PolicySpec(
            "tf32",
            "fp32 storage, TF32 tensor cores for matmul and convolution",
            PrecisionSettings(cuda_matmul="tf32", cudnn="tf32", mkldnn="ieee"),
            compute_format="tf32",
            peak_key="tf32",
            rounding_format="tf32",
            range_format="bf16",
            safety_rank=1,
            thresholds=Thresholds(1e-2, 15.0, 10.0),
            lightning="32-true",
            accelerate="no",
            deepspeed=None,
            fallbacks=("bf32", "bf16-mixed", "fp16-mixed", "fp32"),
            device_only=DeviceOnly(
                "cuda",
                "TF32 is a cuBLAS/cuDNN math mode; on a CPU its knobs change nothing, it would train in plain"
                " fp32",
                "'fp32', or 'bf32' (oneDNN's reduced-precision fp32 math) on a CPU with native bf16",
            ),
            starting_rank=2,
            starting_devices=("cuda",),
            keras="float32",
        ),
        PolicySpec(
            "bf32",
            "fp32 storage, oneDNN matmul/conv with bf16 internals (CPU)",
            PrecisionSettings(cuda_matmul="ieee", cudnn="ieee", mkldnn="bf16"),
            compute_format="bf32",
            peak_key="bf16",
            rounding_format="bf16",
            range_format="bf16",
            safety_rank=2,
            thresholds=Thresholds(2e-2, 5.0, 3.0),
            lightning="32-true",
            accelerate="no",
            deepspeed=None,
            fallbacks=("tf32", "bf16-mixed", "fp32"),
            device_only=DeviceOnly(
                "cpu",
                "bf32 is a oneDNN (CPU) math mode; on a GPU its knob changes nothing, it would train in plain"
                " fp32",
                "'fp32', or 'tf32' on a GPU with compute capability >= 8.0",
            ),
            starting_rank=3,
            starting_devices=("cpu",),
        ),
        PolicySpec(
            "bf16-mixed",
            "fp32 weights, autocast to bf16, optional finite-gradient guard",
            _STRICT,
            compute_format="bf16",
            peak_key="bf16",
            rounding_format="bf16",
            range_format="bf16",
            safety_rank=3,
            thresholds=Thresholds(2e-2, 5.0, 3.0),
            lightning="bf16-mixed",
            accelerate="bf16",
            deepspeed="torch_autocast",
            fallbacks=("fp16-mixed", "tf32", "bf32", "fp32"),
            starting_rank=0,
            starting_devices=("cpu", "cuda"),
            keras="mixed_bfloat16",
            autocast_dtype=torch.bfloat16,
        ),
        PolicySpec(
            "fp16-mixed",
            "fp32 weights, autocast to fp16, dynamic loss scaling",
            _STRICT,
            compute_format="fp16",
            peak_key="fp16",
            rounding_format="fp16",
            range_format="fp16",
            safety_rank=4,
            thresholds=Thresholds(1e-2, 10.0, 6.0, max_skip_fraction=0.25),
            lightning="16-mixed",
            accelerate="fp16",
            deepspeed="torch_autocast",
            fallbacks=("bf16-mixed", "tf32", "bf32", "fp32"),
            starting_rank=1,
            starting_devices=("cuda",),
            keras="mixed_float16",
            autocast_dtype=torch.float16,
            loss_scaling=True,
        ),
        PolicySpec(
            "bf16-true",
            "bf16 weights and math, no fp32 master weights",
            _STRICT,
            compute_format="bf16",
            peak_key="bf16",
            rounding_format="bf16",
            range_format="bf16",
            safety_rank=5,
            thresholds=Thresholds(5e-2, 5.0, 0.0),
            lightning="bf16-true",
            accelerate=None,
            deepspeed=None,
            fallbacks=("fp16-mixed", "bf16-mixed", "fp32"),
            keras="bfloat16",
            param_dtype=torch.bfloat16,
        ),
        PolicySpec(
            "fp16-true",
            "fp16 weights and math, no fp32 master weights, dynamic loss scaling",
            _STRICT,
            compute_format="fp16",
            peak_key="fp16",
            rounding_format="fp16",
            range_format="fp16",
            safety_rank=6,
            thresholds=Thresholds(2e-2, 10.0, 3.0, max_skip_fraction=0.25),
            lightning="16-true",
            accelerate=None,
            deepspeed=None,
            fallbacks=("bf16-mixed", "bf16-true", "fp32"),
            keras="float16",
            param_dtype=torch.float16,
            loss_scaling=True,
        ),
        # fp8 training as torchao does it: Linear matmuls in fp8 (e4m3 operands forward, e5m2
        # gradients, fp32 accumulation, dynamic scales), the rest under bf16 autocast, fp32 master
        # weights. Lightning's fp8 mode is Transformer Engine and Accelerate's needs its own recipe
        # objects: neither is what mixprec measures, so those exports refuse.
        *(
            PolicySpec(
                f"fp8-{recipe}",
                f"fp32 weights, bf16 autocast, Linear layers in fp8 via torchao.float8 ({recipe} scales)",
                _STRICT,
                compute_format="fp8",
                peak_key="fp8",
                rounding_format="fp8_e4m3",
                range_format="bf16",
                safety_rank=7 + i,
                thresholds=Thresholds(1e-1, 3.0, 0.0),
                lightning=None,
                accelerate=None,
                deepspeed=None,
                fallbacks=(f"fp8-{other}", "bf16-mixed", "fp16-mixed", "tf32", "bf32", "fp32"),
                autocast_dtype=torch.bfloat16,
                fp8_recipe=recipe,
                device_only=_FP8_ON_CPU,
            )
            for i, (recipe, other) in enumerate((("rowwise", "tensorwise"), ("tensorwise", "rowwise")))
        ),
        # Block-scaled formats, Blackwell's: every Linear GEMM (forward and both backward) takes
        # block-scaled operands (MXFP8: 32-element blocks of e4m3 with power-of-two scales; NVFP4:
        # 16-element blocks of e2m1 with e4m3 scales and a tensor scale, stochastically rounded
        # gradients), fp32 accumulation, the rest under bf16 autocast, fp32 master weights.
        *(
            PolicySpec(
                name,
                f"fp32 weights, bf16 autocast, Linear GEMMs in {what}",
                _STRICT,
                compute_format=name,
                peak_key=peak,
                rounding_format=element,
                range_format="bf16",
                safety_rank=9 + i,
                thresholds=Thresholds(1e-1, 3.0, 0.0),
                lightning=None,
                accelerate=None,
                deepspeed=None,
                fallbacks=(*extra, "fp8-rowwise", "bf16-mixed", "fp16-mixed", "tf32", "bf32", "fp32"),
                autocast_dtype=torch.bfloat16,
                block_format=name,
                device_only=_BLOCK_ON_BLACKWELL,
            )
            for i, (name, what, peak, element, extra) in enumerate(
                (
                    ("mxfp8", "MXFP8 (e4m3, 32-element blocks, power-of-two scales)", "fp8", "fp8_e4m3", ()),
                    ("nvfp4", "NVFP4 (e2m1, 16-element blocks, e4m3 scales)", "fp4", "fp4_e2m1", ("mxfp8",)),
                )
            )
        ),
    )
}


def mixed_twin(name: str) -> str | None:
    """The *-mixed policy that computes what the *-true policy ``name`` computes, with fp32 master
    weights (bf16-true -> bf16-mixed): where a run whose half weights stall continues; None for a
    policy without half weights."""
    return _plain_mixed(POLICIES[name].param_dtype)


def carrier(name: str) -> str | None:
    """The *-mixed policy a low-format policy computes everything but its eligible GEMMs in
    (fp8-rowwise -> bf16-mixed); None for a policy without a low format."""
    spec = POLICIES.get(name)
    return _plain_mixed(spec.autocast_dtype) if spec is not None and spec.low_format else None


def _plain_mixed(half: torch.dtype | None) -> str | None:
    """The *-mixed policy autocasting to ``half`` with no low format (bf16 -> bf16-mixed)."""
    if half is None:
        return None
    return next((n for n, s in POLICIES.items() if s.autocast_dtype == half and s.low_format is None), None)


POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
# What `check` judges when no policy is named: the two autocast policies most users choose between.
CHECK_DEFAULT: tuple[str, ...] = ("bf16-mixed", "fp16-mixed")

# Short names and Lightning's precision strings, so configs can be pasted between tools.
ALIASES: dict[str, str] = {
    "fp16": "fp16-mixed",
    "bf16": "bf16-mixed",
    "32-true": "fp32",
    "32": "fp32",
    "16-mixed": "fp16-mixed",
    "16-true": "fp16-true",
}


def canonical_name(name: str) -> str:
    """The canonical policy name for ``name`` or an alias; raises :class:`PolicyError` otherwise."""
    if not isinstance(name, str):
        raise PolicyError(
            f"Policy name must be a string, got {type(name).__name__} {name!r}; "
            f"valid: {', '.join(POLICY_NAMES)}."
        )
    key = name.strip().lower()
    if key in POLICIES:
        return key
    if key in ALIASES:
        return ALIASES[key]
    raise PolicyError(
        f"Unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)} "
        f"(aliases: {', '.join(ALIASES)}).{did_you_mean(key, [*POLICY_NAMES, *ALIASES])}"
    )


def spec_of(name: str) -> PolicySpec:
    """The :class:`PolicySpec` of ``name`` (aliases accepted); raises :class:`PolicyError` otherwise."""
    return POLICIES[canonical_name(name)]
