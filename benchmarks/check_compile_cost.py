"""What compiling a candidate costs on this machine: its speed run's compile cold (a fresh Inductor
cache), then again from the cache, then what a numerics check of it adds to its eager twin's check
(issue 53's tune prices these: `mixprec.tuning.cost`). In one process, quiet machine.

    python benchmarks/check_compile_cost.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")  # cold

    import mixprec
    from mixprec.checking.check import check, make_checker
    from mixprec.checking.config import CheckConfig
    from mixprec.policy import Candidate

    workload = mixprec.load_workload("resnet50", image_size=128)
    compiled = Candidate("bf16-mixed", channels_last=True, compile="default", compile_scope="step")
    out: dict[str, Any] = {"workload": "resnet50 128 px, batch 16", "candidate": compiled.label}

    def stamp(name: str, started: float, **more: Any) -> None:
        out[name] = {"wall_s": round(time.perf_counter() - started, 1), **more}
        print(name, out[name], flush=True)

    for name in ("bench_cold", "bench_warm"):
        started = time.perf_counter()
        result = mixprec.bench(workload, candidates=(compiled,), batch_size=16, steps=3, warmup=2, settle=0)
        row = next(r for r in result.rows if r.candidate == compiled)
        stamp(name, started, compile_s=row.compile_s, status=str(row.status))
    started = time.perf_counter()
    checker = make_checker(workload, CheckConfig(steps=6, batch_size=16), events=lambda e: None, budget=None)
    stamp("checker's fp32 runs", started)
    for cand in (Candidate("bf16-mixed", channels_last=True), compiled):
        stages: list[tuple[float, str]] = []
        started = time.perf_counter()

        def on_event(event: dict[str, Any], started: float = started, stages: list = stages) -> None:
            stages.append((round(time.perf_counter() - started, 1), event.get("text") or event["event"]))

        res = check(workload, policies=(cand,), fix=False, checker=checker, events=on_event)
        stamp(f"check {cand.label}", started, verdict=str(res.candidates[0].verdict), stages=stages)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
