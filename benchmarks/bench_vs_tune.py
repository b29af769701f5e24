"""One truth for one configuration: `mixprec tune` (its defaults), then `mixprec.bench` of tune's
pick (the exact candidate: layout, compile scope, optimizer) right after it, settled as tune
settles its pick (``settle``: rounds pooled over sessions until the interval is 5% either side),
then plain PyTorch (benchmarks/probe_vs_tune.py's hand-written steps for strict fp32 and the pick,
in ``--probe-processes`` fresh processes, the order of the two alternating between processes; each
figure the median of the processes'), on the same machine, and the figures for the pick side by
side: they agree when the largest is within 10% of the smallest (issue 53). Each plain process times
the pick two ways (benchmarks/shared_process.py):

  alone    each variant in a loop of its own, as a training run is: strict fp32's rounds, then the
           pick's (or the other way round), ``--rounds`` each. The plain figure compared.
  probe    then both in ``--rounds`` interleaved rounds, strict fp32 first in each (the probe of
           earlier runs, and of probe_vs_tune.py). Printed beside: the pick's step runs faster after
           strict fp32's in the same process than in a loop of its own, so it reads the pick ~5-7%
           fast (method_gap.py: 2.03x one process, 1.94x two processes, mixprec 1.90x;
           shared_process.py: 2.02x interleaved, 1.89x alone; EPYC, bf16-mixed+cl).

Both mixprec figures pair the candidate with strict fp32 step by step and report the median of the
paired ratios with its 95% interval: where a repeat run lands on this machine (the run's own noise
and the spread between runs, `repeat_ci`; the run's own bootstrap interval alone is `within`). A
repeat measurement outside the other's interval is a bug in one of them (issue 36). Run it on a
quiet machine; the load average before each run is printed with it.

Both mixprec figures are settled figures, so each pools the sessions this machine measured of the
pick's configuration before (``mixprec.measure.record``): bench's pools tune's sessions of the same
run, and the next run's tune pools this run's. Their agreement with each other is then partly the
record's; the plain figures, measured outside mixprec, are the independent check. Each figure is
printed with its own sessions' figure alone and how many earlier sessions it pooled.

    python benchmarks/bench_vs_tune.py --model resnet50 [--budget 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mixprec.measure.results import session_speedup
from mixprec.tuning.config import TuneConfig
from shared_process import WORKER as SHARED_PROCESS

MODELS = {
    "gpt": ["--model", "gpt2", "--model-config", "n_layer=4,n_head=4,n_embd=256", "--seq-len", "128"],
    "resnet50": ["--model", "resnet50", "--image-size", "128"],
}
# the same models for mixprec.load_workload (bench runs tune's exact pick through the API: the CLI's
# --compile has no step scope and no optimizer choice)
SIZES = {
    "gpt": ("gpt2", {"n_layer": 4, "n_head": 4, "n_embd": 256, "seq_len": 128}),
    "resnet50": ("resnet50", {"image_size": 128}),
}
# `mixprec.bench` of one candidate in a fresh process, as a user would call it
BENCH = """
import json, sys
import mixprec
from mixprec.policy import Candidate
spec = json.loads(sys.argv[1])
workload = mixprec.load_workload(spec["model"], **spec["sizes"])
pick = Candidate.from_dict(spec["candidate"])
settings = {k: spec[k] for k in ("batch_size", "threads", "settle")}
result = mixprec.bench(workload, candidates=(pick,), **settings)
open(spec["out"], "w").write(json.dumps(result.to_dict()))
"""


# the plain probe of tune's pick in a fresh process: benchmarks/probe_vs_tune.py's hand-written steps
PROBE = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import torch
from probe_vs_tune import MODELS, probe
from mixprec.policy import Candidate
spec = json.loads(sys.argv[1])
model = MODELS[spec["model"]]
torch.manual_seed(0)
if isinstance(spec["threads"], int):  # tune's count (a GPU's tune records "auto")
    torch.set_num_threads(spec["threads"])
variants = {{"fp32 eager": Candidate("fp32"), "pick": Candidate.from_dict(spec["candidate"])}}
result = probe(model["load"](), variants, model["batch_size"], spec["rounds"])
open(spec["out"], "w").write(json.dumps(result))
"""


def _run(argv: list[str], module: bool = True) -> tuple[float, float]:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    command = [sys.executable, *(["-m", "mixprec"] if module else []), *argv]
    subprocess.run(command, check=False, stdout=subprocess.DEVNULL)  # tune exits 5 or 6 with its JSON
    return load, time.perf_counter() - start


def _row(path: Path, label: str) -> dict:
    data = json.loads(path.read_text())
    rows = data.get("bench", data).get("rows", [])
    return next(r for r in rows if r.get("label") == label and not r.get("baseline_repeat"))


def _figures(row: dict, load: float) -> dict:
    """A row's speedup, its reported interval (where a repeat lands) and its within-run one; how many
    sessions it pooled, its own and the machine's earlier ones (mixprec.measure.record), and what its
    own sessions say alone."""
    ci = row.get("repeat_ci") or row.get("speedup_ci")
    own = (
        session_speedup(row["paired_ratios"], row.get("sessions") or ())[0]
        if row.get("paired_ratios")
        else None
    )
    return {
        "speedup": row["speedup_vs_fp32"],
        "ci": ci,
        "within": row.get("speedup_ci"),
        "load": load,
        "own_sessions": len(row.get("sessions") or ()) or 1,
        "earlier_sessions": len(row.get("earlier") or ()),
        "own_speedup": own,
    }


def _plain(per_process: list[float], load: float) -> dict:
    return {"speedup": statistics.median(per_process), "ci": None, "load": load, "per_process": per_process}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet50")
    parser.add_argument("--budget", type=float, default=None, help="tune's budget (default: its own)")
    parser.add_argument("--json", help="write both figures here")
    parser.add_argument(
        "--rounds",
        type=int,
        default=8,
        help="each plain process's rounds per variant alone, then interleaved",
    )
    parser.add_argument(
        "--probe-processes",
        type=int,
        default=5,
        help="fresh plain processes, each figure their median: a few processes run 10-50%% slow "
        "(benchmarks/allocator_pace.py), and the median of five outvotes one (runs 1-13 used three)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # beside --json where given (the rows and notes behind each figure), else thrown away
        keep = Path(args.json).with_suffix("") if args.json else Path(tmp) / "run"
        tune_json, bench_json = (keep.with_name(f"{keep.name}.{what}.json") for what in ("tune", "bench"))
        budget = ["--budget", str(args.budget)] if args.budget else []
        tune_load, tune_s = _run(["tune", *MODELS[args.model], *budget, "--json", str(tune_json)])
        tuned_json = json.loads(tune_json.read_text())
        rec = tuned_json["recommendation"]
        label = rec["label"]
        model, sizes = SIZES[args.model]
        threads = tuned_json["bench"]["settings"]["threads"]  # tune's, for all three
        spec = {
            "model": model,
            "sizes": sizes,
            "candidate": rec["candidate"],
            "batch_size": tuned_json["bench"]["batch_size"],
            "out": str(bench_json),
            "threads": threads,
            "settle": TuneConfig().settle,  # bench to the precision tune settles its pick to
        }
        bench_load, bench_s = _run(["-c", BENCH, json.dumps(spec)], module=False)
        if not bench_json.exists():
            raise SystemExit(f"mixprec.bench of {label} wrote no result (its error is above)")
        tuned, benched = _row(tune_json, label), _row(bench_json, label)
        # plain PyTorch in fresh processes, each figure their median: one process carries that
        # process's speed (the AMX Xeon's plain probe read 2.01x, 2.30x and 2.48x in three runs of one)
        plain, probe_load, probe_s = [], os.getloadavg()[0], 0.0
        for i in range(args.probe_processes):
            plain_json = Path(tmp) / f"plain-{i}.json"
            plain_spec = {
                "model": args.model,
                "candidate": rec["candidate"],
                "rounds": args.rounds,
                "threads": threads,
                "first": "fp32" if i % 2 == 0 else "pick",
                "out": str(plain_json),
            }
            probe_s += _run(["-c", SHARED_PROCESS, json.dumps(plain_spec)], module=False)[1]
            if not plain_json.exists():
                raise SystemExit(f"the plain timing of {label} wrote no result (its error is above)")
            plain.append(json.loads(plain_json.read_text()))
        alone = [p["alone_ms"]["fp32"] / p["alone_ms"]["pick"] for p in plain]
        beside = [p["beside_ms"]["fp32"] / p["beside_ms"]["pick"] for p in plain]
    out = {
        "model": args.model,
        "pick": label,
        "threads": threads,
        "tune": _figures(tuned, tune_load),
        "bench": _figures(benched, bench_load),
        "alone": _plain(alone, probe_load),
        "probe": _plain(beside, probe_load),
        "plain_processes": plain,
        "seconds": {"tune": round(tune_s), "bench": round(bench_s), "probe": round(probe_s)},
    }
    for name in ("tune", "bench", "alone", "probe"):
        r = out[name]
        ci = f" [{r['ci'][0]:.2f}-{r['ci'][1]:.2f}]" if r["ci"] else ""
        each = (
            f" (processes: {', '.join(f'{x:.2f}x' for x in r['per_process'])})" if "per_process" in r else ""
        )
        pooled = (
            f" ({r['own_sessions']} sessions of its own, {r['own_speedup']:.2f}x alone, "
            f"and {r['earlier_sessions']} earlier)"
            if r.get("earlier_sessions")
            else ""
        )
        print(
            f"{name:>5}: {label} {r['speedup']:.2f}x{ci}{each}{pooled} (load average {r['load']:.1f} before)"
        )
    figures = [out[name]["speedup"] for name in ("tune", "bench", "alone")]
    spread = max(figures) / min(figures)
    verdict = "<=" if spread <= 1.1 else ">"
    print(f"tune, bench and alone within {100 * (spread - 1):.1f}% of each other ({verdict} 10%)")
    with_probe = max(*figures, out["probe"]["speedup"]) / min(*figures, out["probe"]["speedup"])
    print(f"with the interleaved probe: within {100 * (with_probe - 1):.1f}%")
    a, b = out["tune"], out["bench"]
    tune_in_bench = bool(b["ci"] and b["ci"][0] <= a["speedup"] <= b["ci"][1])
    bench_in_tune = bool(a["ci"] and a["ci"][0] <= b["speedup"] <= a["ci"][1])
    inside = tune_in_bench or bench_in_tune
    print(
        "agree: each within the other's interval"
        if tune_in_bench and bench_in_tune
        else "agree: one within the other's interval"
        if inside
        else "DISAGREE: neither within the other's interval"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    **out,
                    "agree": inside,
                    "each_within_the_other": tune_in_bench and bench_in_tune,
                    "three_within_10_percent": spread <= 1.1,
                    "with_probe_within_10_percent": with_probe <= 1.1,
                    "argv": sys.argv,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
