"""Issue 55's measure: is tune's pick over a script the fastest this machine offers, and does
`mixprec run` reproduce it?

1. `mixprec tune --json T -- python tests/frameworks/scripts/plain_loop.py --steps 100000` with its
   defaults (the nanoGPT-style plain loop: AdamW with two parameter groups, a cosine schedule set
   by hand, clip_grad_norm_);
2. in the same run, a plain probe of the same model (the script's own GPT and token data, its AdamW
   and clipping) in one process, as probe_vs_tune.py times a workload: eager / model-compiled /
   step-compiled x fp32 / bf16 autocast / bf16 weights, interleaved rounds; the pick's variant over
   the best variant (and the best whose precision tune's check did not fail);
3. `mixprec run` with the pick's line against the script as written, each timed as whole processes
   at two lengths (the difference cancels start-up), interleaved over rounds: the script's own
   per-step time, the ratio against tune's figure.

    python benchmarks/script_search.py --out benchmarks/results/cpu-amd-epyc-avx2 [--rounds 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import mixprec
from mixprec.hardware.environment import collect
from mixprec.policy import Candidate

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "frameworks" / "scripts" / "plain_loop.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
from probe_vs_tune import PRECISIONS, SCOPES, probe  # noqa: E402

PY = sys.executable


def script_workload() -> mixprec.Workload:
    """The script's own model, data, optimizer and loss as a Workload the probe can time."""
    spec = importlib.util.spec_from_file_location("plain_loop", SCRIPT)
    assert spec is not None and spec.loader is not None
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)
    tokens = loop.Tokens(512)

    def make_batch(batch_size: int, device: torch.device, generator: torch.Generator | None = None):
        i = torch.randint(0, len(tokens), (batch_size,), generator=generator)
        return tokens.seqs[i, :-1].to(device), tokens.seqs[i, 1:].to(device)

    def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
        loss = model(*batch)[1]
        return loss

    def optimizer_fn(model: torch.nn.Module) -> torch.optim.Optimizer:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))

    torch.manual_seed(0)
    return mixprec.Workload(
        loop.GPT(256, 4), make_batch, loss_fn, optimizer_fn, name="plain_loop", default_batch_size=16
    )


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - start


def per_step(cmd: list[str], short: int, long: int) -> float:
    """Seconds per step: the whole process at ``long`` steps less at ``short``, over the difference."""
    return (wall([*cmd, "--steps", str(long)]) - wall([*cmd, "--steps", str(short)])) / (long - short)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--budget", type=float, default=None, help="tune's --budget (default: its own)")
    parser.add_argument("--short", type=int, default=20)
    parser.add_argument("--long", type=int, default=80)
    parser.add_argument("--tune-json", type=Path, help="an earlier tune's JSON instead of running tune")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tune_json = args.tune_json or args.out / "script_search.tune.json"
    tune_cmd = [PY, "-m", "mixprec", "tune", "--json", str(tune_json)]
    tune_cmd += ["--budget", str(args.budget)] if args.budget else []
    tune_cmd += ["--", PY, str(SCRIPT), "--steps", "100000"]
    started = time.perf_counter()
    code = subprocess.run(tune_cmd, cwd=ROOT).returncode if args.tune_json is None else None
    tune_s = time.perf_counter() - started
    tuned = json.loads(tune_json.read_text())
    rec = tuned.get("recommendation")
    pick = Candidate.from_dict(rec["candidate"]) if rec else None

    variants = {
        f"{p} {s}": Candidate(c.policy, compile=m, compile_scope=scope)
        for p, c in PRECISIONS.items()
        for s, (m, scope) in SCOPES.items()
    }
    pick_name = None
    if pick is not None:
        key = (pick.policy, pick.compile, pick.compile_scope)
        plain = not (pick.keep_fp32 or pick.channels_last or pick.optimizer or pick.micro_batch)
        found = (n for n, c in variants.items() if (c.policy, c.compile, c.compile_scope) == key)
        pick_name = next(found, None) if plain else None
        if pick_name is None:
            pick_name = f"tune's pick {pick.label}"
            variants[pick_name] = dataclasses.replace(pick, framework="torch", as_written=False)
    measured = probe(script_workload(), variants, 16, args.rounds)
    speed = {n: m["speedup_vs_fp32_eager"] for n, m in measured.items()}
    best = max(speed, key=speed.__getitem__)
    failed = {c["candidate"]["policy"] for c in tuned["candidates"] if c["status"] == "fail"}
    passing = [n for n in speed if variants[n].policy not in failed]
    best_passing = max(passing, key=speed.__getitem__) if passing else None

    # mixprec run with the pick's line against the script as written, interleaved
    run_line = pick_run = None
    per_round: dict[str, list[float]] = {"as written": [], "mixprec run": []}
    if pick is not None:
        from mixprec.frameworks.script.framework import run_line as line_of

        run_line = line_of(pick, ["python", str(SCRIPT)])
        parts = shlex.split(run_line)
        pick_run = [PY, "-m", "mixprec", *parts[1 : parts.index("--") + 1], PY, str(SCRIPT)]
        for _ in range(args.rounds):
            per_round["as written"].append(per_step([PY, str(SCRIPT)], args.short, args.long))
            per_round["mixprec run"].append(per_step(pick_run, args.short, args.long))
    run_speedup = (
        statistics.median(per_round["as written"]) / statistics.median(per_round["mixprec run"])
        if pick
        else None
    )
    in_tune = rec.get("speedup_vs_fp32") if rec else None
    result = {
        "command": "python benchmarks/script_search.py " + " ".join(sys.argv[1:]),
        "tune_command": shlex.join(tune_cmd),
        "tune_exit_code": code,
        "tune_wall_s": tune_s if args.tune_json is None else None,
        "tune_phases": tuned.get("phases"),
        "tune_pick": pick.label if pick else None,
        "tune_pick_speedup_in_tune": in_tune,
        "probe": measured,
        "probe_pick": pick_name,
        "probe_best": best,
        "probe_best_passing": best_passing,
        "pick_over_probe_best": speed[pick_name] / speed[best] if pick_name else None,
        "pick_over_probe_best_passing": speed[pick_name] / speed[best_passing]
        if pick_name and best_passing
        else None,
        "run_line": run_line,
        "run_per_step_ms": {k: [t * 1e3 for t in v] for k, v in per_round.items()},
        "run_speedup_vs_as_written": run_speedup,
        "run_over_tune": run_speedup / in_tune if run_speedup and in_tune else None,
        "env": collect(),
    }
    out = args.out / "script_search.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k not in ("probe", "env")}, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
