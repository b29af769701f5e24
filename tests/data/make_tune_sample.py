"""Regenerate ``tune_sample.json``: a real bench + check of the mlp workload, the rest filled by hand.

The bench and check figures are measured on this machine (CPU, a few steps: about 20 s); the
candidates, recommendation, lint findings and exports are plausible values written here, in
the shape ``mixprec tune --json`` writes. Run from the repository root:

    .venv/bin/python tests/data/make_tune_sample.py
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import mixprec
from mixprec.hardware import environment
from mixprec.numerics.check import check
from mixprec.report.jsonio import dumps

OUT = Path(__file__).with_name("tune_sample.json")

EXPORTS = {
    "mixprec": (
        "import mixprec\n\n"
        'policy = mixprec.get_policy("bf16-mixed", channels_last=False, keep_fp32=["4"])\n'
        "model = policy.prepare(model)\n"
        "with policy.precision_scope():\n"
        "    for batch in loader:\n"
        "        with policy.autocast():\n"
        "            loss = loss_fn(model, batch)\n"
        "        policy.backward(loss)\n"
        "        policy.step(optimizer, clip_grad_norm=1.0)\n"
        "        optimizer.zero_grad(set_to_none=True)\n"
    ),
    "pytorch": (
        "import torch\n\n"
        'torch.backends.fp32_precision = "ieee"\n'
        'with torch.autocast(device_type="cpu", dtype=torch.bfloat16):\n'
        "    loss = loss_fn(model, batch)   # model[4] runs in fp32: wrap it in autocast(enabled=False)\n"
        "loss.backward()\n"
        "optimizer.step()\n"
    ),
    "lightning": 'trainer = lightning.Trainer(precision="bf16-mixed", accelerator="cpu")\n',
    "accelerate": (
        "# accelerate config (default_config.yaml)\n"
        "mixed_precision: bf16\n"
        "downcast_bf16: 'no'\n\n"
        'accelerator = Accelerator(mixed_precision="bf16")\n'
    ),
    "deepspeed": '{\n  "bf16": {"enabled": true},\n  "fp16": {"enabled": false}\n}\n',
    "fsdp2": (
        "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard\n\n"
        "mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)\n"
        "fully_shard(model, mp_policy=mp)\n"
    ),
    "hf": (
        "TrainingArguments(output_dir=..., bf16=True, fp16=False, tf32=False)\n"
        "# keep model[4] in fp32: model.model[4].float() and _keep_in_fp32_modules = ['4']\n"
    ),
}


def main() -> None:
    workload = mixprec.load_workload("mlp")
    # A shared CPU is noisy: measure again (at most 3 times) until the order is the
    # usual one on this CPU class (bf16-mixed fastest; fp16 emulated without AVX512-FP16), so the
    # hand-written recommendation below agrees with the figures.
    for _ in range(3):
        bench = mixprec.bench(
            workload,
            policies="fp32,bf16-mixed,fp16-mixed",
            channels_last="off",
            steps=8,
            warmup=2,
            isolate=False,
            device="cpu",
        )
        thr = {r.policy: r.throughput or 0.0 for r in bench.rows if not r.baseline_repeat}
        if thr["bf16-mixed"] > max(thr["fp16-mixed"], thr["fp32"]):
            break
    checked = check(
        mixprec.load_workload("mlp"), policies=["bf16-mixed", "fp16-mixed"], steps=3, device="cpu"
    )
    # In-process runs on a CPU measure no isolated peak memory: fill plausible figures by hand.
    sample_memory = {"fp32": 3_420_000, "bf16-mixed": 2_610_000, "fp16-mixed": 2_790_000}
    for row in bench.rows:
        if row.peak_memory_bytes is None and row.step_time_ms is not None:
            row.peak_memory_bytes = sample_memory.get(row.policy)
            row.memory_method = "sample value, filled by hand"
    rows = {r.policy: r for r in bench.rows if not r.baseline_repeat}
    verdicts = {c.policy: c for c in checked.candidates}

    def cand(policy: str, status: str, reason: str, keep: list[str] | None = None) -> dict:
        row = rows.get(policy)
        c = verdicts.get(policy)
        return {
            "label": policy,
            "policy": policy,
            "channels_last": False,
            "keep_fp32": keep or [],
            "status": status,
            "throughput": row.throughput if row else None,
            "speedup_vs_fp32": row.speedup_vs_fp32 if row else None,
            "step_time_ms": row.step_time_ms.to_dict() if row and row.step_time_ms else None,
            "peak_memory_bytes": row.peak_memory_bytes if row else None,
            "mfu": row.mfu if row else None,
            "verdict": c.verdict if c else None,
            "reason": reason,
        }

    finding = {
        "rule": "MP104",
        "severity": "warning",
        "module": "4",
        "message": "Linear 4 has out_features=10, not a multiple of 8: tensor cores pad it <with a copy>.",
        "fix": "Pad the head to 16 outputs and slice the logits: nn.Linear(256, 16) then logits[:, :10].",
        "gain": {
            "layer_ms_before": 0.21,
            "layer_ms_after": 0.12,
            "step_ms_before": 8.4,
            "step_ms_after": 8.3,
            "gain_pct": 1.2,
        },
    }
    candidates = [
        cand("bf16-mixed", "recommended", "fastest candidate whose numerics pass against fp32"),
        cand(
            "fp16-mixed",
            "rejected",
            "slower than fp32 on this CPU (no AVX512-FP16) & loss scaling adds a pass",
        ),
        cand("fp32", "passed", "strict fp32 baseline (TF32 off for matmul and cuDNN conv)"),
        {
            "label": "tf32",
            "policy": "tf32",
            "channels_last": False,
            "keep_fp32": [],
            "status": "unsupported",
            "throughput": None,
            "speedup_vs_fp32": None,
            "step_time_ms": None,
            "peak_memory_bytes": None,
            "mfu": None,
            "verdict": None,
            "reason": "needs an NVIDIA GPU with compute capability >= 8.0",
        },
        {
            "label": "bf16-true",
            "policy": "bf16-true",
            "channels_last": False,
            "keep_fp32": [],
            "status": "pruned",
            "throughput": rows["fp32"].throughput * 0.18,
            "speedup_vs_fp32": 0.18,
            "step_time_ms": {
                "median": bench.batch_size / (rows["fp32"].throughput * 0.18) * 1e3,
                "iqr": 0.4,
                "n": 2,
            },
            "peak_memory_bytes": 2_400_000,
            "mfu": None,
            "verdict": None,
            "reason": "stopped after 2 of 8 steps: more than 5x slower than the best so far",
        },
    ]
    rec_row = rows["bf16-mixed"]
    base = rows["fp32"]
    bf = verdicts["bf16-mixed"]
    data = {
        "schema_version": environment.SCHEMA_VERSION,
        "kind": "tune",
        "command": "mixprec tune --model mlp --budget 180 --json out/tune.json --html out/report",
        "env": bench.env,
        "workload": bench.workload,
        "description": bench.description,
        "device": bench.device,
        "created": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "budget_s": 180,
        "elapsed_s": 151.2,
        "bench": bench.to_dict(),
        "check": checked.to_dict(),
        "lint": {
            "findings": [
                finding,
                {
                    "rule": "MP301",
                    "severity": "info",
                    "module": "2",
                    "message": "Activation in a separate kernel after Linear 2.",
                    "fix": "None needed on CPU; torch.compile fuses it.",
                    "gain": None,
                },
            ]
        },
        "candidates": candidates,
        "recommendation": {
            "label": "bf16-mixed",
            "policy": "bf16-mixed",
            "channels_last": False,
            "keep_fp32": [],
            "speedup_vs_fp32": rec_row.speedup_vs_fp32,
            "speedup_vs_tf32": None,
            "memory_saved_bytes": (base.peak_memory_bytes or 0) - (rec_row.peak_memory_bytes or 0),
            "margin": {
                "output_sqnr_db": bf.output_sqnr_db,
                "min_grad_sqnr_db": bf.min_grad_sqnr_db,
                "max_rel_loss_diff": bf.max_rel_loss_diff,
            },
            "reason": (
                "bf16-mixed is the fastest candidate whose loss, output and gradients stay within the "
                "bf16 thresholds of strict fp32 over 3 steps. fp16-mixed also passes but runs slower "
                "here: this CPU has AVX512-BF16 but no AVX512-FP16, so fp16 matmuls are emulated."
            ),
            "tie_break": None,
            "lint_worth_fixing": [finding],
        },
        "exports": EXPORTS,
    }
    OUT.write_text(dumps(data) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size / 1024:.1f} KiB)")


if __name__ == "__main__":
    main()
