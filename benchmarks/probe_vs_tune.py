"""Is tune's pick the fastest? `mixprec tune` (its defaults), then a plain-PyTorch interleaved probe
of every precision x layout x compile scope right after it, and the ratio of the pick to the
probe's best.

The probe is written the way a user would time it by hand, with no mixprec in the timed loop: each
variant gets its own copy of the model and optimizer, is built and warmed up (compiled) first,
then all variants run in ``--rounds`` interleaved rounds (a round runs each variant for about half
a second of steps); a variant's figure is the median of its per-round medians, its speedup the
strict-fp32 eager figure over it. Variants:

  precision  fp32 (strict IEEE), bf16 autocast (fp32 weights), bf16 weights (the model cast)
  layout     NCHW, and channels_last for the CNN
  compile    eager; torch.compile(model); the whole step (forward, loss, backward and
             optimizer.step() in one torch.compile'd function)

plus tune's pick when it is not one of them (its optimizer implementation or fp32 islands), built
with mixprec's Policy in the same plain loop. The pick is read against the best variant and against
the best of those whose precision tune's numerics check passed (what tune could have picked).

Then a held-out duel: the pick, the probe's best and its best passing variant again, each in a
fresh process of its own, in ``--duel-sets`` sets of processes of ``--duel-rounds`` interleaved
rounds. The probe's best is the largest of 18 noisy medians from one process that holds every
variant, so it reads high; the duel measures it again on new samples, one process per variant as
tune's race does (``duel_pick_over_best_passing``, the median over the sets).
Models (issue 22):

  gpt       nanoGPT-style GPT-2: 4 layers x 256, 4 heads, seq 128, vocab 50257, batch 8, AdamW
  resnet50  torchvision ResNet-50, 128 px, batch 16, SGD with momentum

    python benchmarks/probe_vs_tune.py --model gpt [--budget 300] [--rounds 4] --out DIR
    python benchmarks/probe_vs_tune.py --model gpt --rounds 8 --tune-json OLD.tune.json --out DIR
    python benchmarks/probe_vs_tune.py --model resnet50 --duel-sets 5 --out DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

import mixprec
from mixprec import state
from mixprec.frameworks.torch.session import with_implementation
from mixprec.hardware.environment import collect
from mixprec.policy import Candidate

MODELS: dict[str, dict[str, Any]] = {
    "gpt": {
        "load": lambda: mixprec.load_workload("gpt2", seq_len=128, n_layer=4, n_head=4, n_embd=256),
        "batch_size": 8,
        "cli": ["--model", "gpt2", "--model-config", "n_layer=4,n_head=4,n_embd=256", "--seq-len", "128"],
        "layouts": (False,),
    },
    "resnet50": {
        "load": lambda: mixprec.load_workload("resnet50", image_size=128),
        "batch_size": 16,
        "cli": ["--model", "resnet50", "--image-size", "128"],
        "layouts": (False, True),
    },
}
PRECISIONS = {
    "fp32": Candidate("fp32"),
    "bf16 autocast": Candidate("bf16-mixed"),
    "bf16 weights": Candidate("bf16-true"),
}
SCOPES = {"eager": (None, None), "model": ("default", None), "step": ("default", "step")}
ROUND_S = 0.5
# strict IEEE fp32 wherever a variant does not ask for less (as tune's strict-fp32 baseline)
IEEE = state.PrecisionSettings(cuda_matmul="ieee", cudnn="ieee", mkldnn="ieee")


def plain_step(workload: mixprec.Workload, candidate: Candidate) -> Callable[[Any], torch.Tensor]:
    """A training step for ``candidate`` written in plain PyTorch (mixprec's Policy only where the
    candidate needs what plain code would spell out at length: fp32 islands, a loss scaler)."""
    spec = candidate.spec
    model = copy.deepcopy(workload.model).train()
    if candidate.keep_fp32 or spec.loss_scaling or (spec.is_math_mode and candidate.policy != "fp32"):
        policy = mixprec.get_policy(candidate, device="cpu", check=False)
        model = policy.prepare(model)
        optimizer = workload.make_optimizer(model)

        def step(batch: Any) -> torch.Tensor:
            with policy.autocast():
                loss = workload.loss_fn(run, batch)
            policy.backward(loss)
            policy.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            return loss

    else:
        if spec.param_dtype is not None:
            model = model.to(spec.param_dtype)
        if candidate.channels_last:
            model = model.to(memory_format=torch.channels_last)
        optimizer = workload.make_optimizer(model)
        if candidate.optimizer:
            # rebuilt with the implementation's flags, as mixprec's session does: the zoo recipes pick
            # a tensor or a float learning rate when built (Adam's foreach kernels take no tensor
            # one off CUDA), so flipping the flags afterwards crashed the probe of a +foreach pick
            optimizer = with_implementation(optimizer, candidate.optimizer)
        autocast = (
            (lambda: torch.autocast("cpu", dtype=spec.autocast_dtype)) if spec.autocast_dtype else nullcontext
        )

        def cast(batch: Any) -> Any:
            out = []
            for t in batch:
                if t.is_floating_point() and spec.param_dtype is not None:
                    t = t.to(spec.param_dtype)
                if t.dim() == 4 and candidate.channels_last:
                    t = t.contiguous(memory_format=torch.channels_last)
                out.append(t)
            return tuple(out)

        def step(batch: Any) -> torch.Tensor:
            with autocast():
                loss = workload.loss_fn(run, cast(batch))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

    run = torch.compile(model) if candidate.compile and candidate.compile_scope != "step" else model
    return torch.compile(step) if candidate.compile_scope == "step" else step


def warmed_step(
    workload: mixprec.Workload, candidate: Candidate, batches: list
) -> Callable[[Any], torch.Tensor]:
    """:func:`plain_step`, compiled (its first step, maybe a recompile) and settled."""
    step = plain_step(workload, candidate)
    for i in range(3):
        step(batches[i % 2])
    return step


def time_round(step: Callable[[Any], torch.Tensor], batches: list) -> float:
    """One round: steps for about :data:`ROUND_S`, the median of all but the first."""
    times: list[float] = []
    while sum(times) < ROUND_S or len(times) < 2:
        start = time.perf_counter()
        step(batches[len(times) % 2])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def probe(workload: mixprec.Workload, variants: dict[str, Candidate], batch_size: int, rounds: int) -> dict:
    batches = [workload.make_batch(batch_size, torch.device("cpu")) for _ in range(2)]
    steps: dict[str, Callable] = {}
    build_s: dict[str, float] = {}
    with state.precision_settings(IEEE):
        for name, cand in variants.items():
            start = time.perf_counter()
            torch._dynamo.reset()
            steps[name] = warmed_step(workload, cand, batches)
            build_s[name] = time.perf_counter() - start
            print(f"built {name} in {build_s[name]:.0f} s", file=sys.stderr, flush=True)
        per_round: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(rounds):
            for name in variants:
                per_round[name].append(time_round(steps[name], batches))
            print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    median = {name: statistics.median(v) for name, v in per_round.items()}
    base = median["fp32 eager"]
    return {
        name: {
            "candidate": variants[name].to_dict(),
            "label": variants[name].label,
            "median_step_ms": median[name] * 1e3,
            "per_round_ms": [t * 1e3 for t in per_round[name]],
            "speedup_vs_fp32_eager": base / median[name],
            "build_and_compile_s": build_s[name],
        }
        for name in variants
    }


def _duel_worker(model: str, candidate: dict, conn: Any) -> None:
    """One variant in a process of its own: build and warm up its plain step, then time a round
    whenever the parent asks, so the parent can interleave rounds between processes."""
    spec = MODELS[model]
    torch.manual_seed(0)
    workload = spec["load"]()
    batches = [workload.make_batch(spec["batch_size"], torch.device("cpu")) for _ in range(2)]
    with state.precision_settings(IEEE):
        step = warmed_step(workload, Candidate.from_dict(candidate), batches)
        conn.send("ready")
        while conn.recv() == "round":
            conn.send(time_round(step, batches))


def duel(model: str, variants: dict[str, Candidate], sets: int, rounds: int) -> dict[str, Any]:
    """The named variants again, each in a fresh process of its own, in ``sets`` sets of processes
    of ``rounds`` interleaved rounds (the order reversed every other round).

    The probe picked its best as the largest of many medians, each noisy, so that best is read
    high (the winner's curse); its figures also come from one process that holds every variant.
    This is the held-out measurement: new samples, and one process per variant as tune's race
    measures. Per set, a variant's figure is the median of its round medians."""
    import multiprocessing as mp

    context = mp.get_context("spawn")
    names = list(variants)
    per_set: list[dict[str, float]] = []
    for s in range(sets):
        workers = {}
        for name in names:  # built one after another: a compile never shares the cores
            parent, child = context.Pipe()
            process = context.Process(target=_duel_worker, args=(model, variants[name].to_dict(), child))
            process.start()
            child.close()  # so that a worker that dies ends recv() with EOFError, not a hang
            if parent.recv() != "ready":
                raise RuntimeError(f"the duel's worker for {name} did not start")
            workers[name] = (process, parent)
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names if r % 2 == 0 else reversed(names):
                workers[name][1].send("round")
                times[name].append(workers[name][1].recv())
        for process, conn in workers.values():
            conn.send("stop")
            process.join()
        per_set.append({name: statistics.median(t) for name, t in times.items()})
        shown = ", ".join(f"{n} {1e3 * t:.0f} ms" for n, t in per_set[-1].items())
        print(f"duel set {s + 1}/{sets}: {shown}", file=sys.stderr, flush=True)
    return {
        "names": names,
        "rounds": rounds,
        "per_set_median_ms": [{n: 1e3 * t for n, t in d.items()} for d in per_set],
    }


def over(duelled: dict[str, Any], name: str, other: str) -> tuple[float, list[float]]:
    """``name``'s speed over ``other``'s in each set of the duel, and their median."""
    ratios = [d[other] / d[name] for d in duelled["per_set_median_ms"]]
    return statistics.median(ratios), ratios


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--budget", type=float, default=300.0, help="tune's budget (its default: 300)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--duel-sets",
        type=int,
        default=3,
        help="sets of fresh processes in which the pick is timed again against the probe's best (0: no duel)",
    )
    parser.add_argument("--duel-rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--tune-json",
        type=Path,
        help="probe against this earlier tune's pick instead of running tune (the probe again, with "
        "more --rounds, say)",
    )
    args = parser.parse_args()
    spec = MODELS[args.model]
    args.out.mkdir(parents=True, exist_ok=True)
    tune_json = args.tune_json or args.out / f"probe_vs_tune-{args.model}.tune.json"
    command = ["mixprec", "tune", *spec["cli"], "--batch-size", str(spec["batch_size"])]
    command += ["--budget", str(args.budget), "--json", str(tune_json)]
    started = time.perf_counter()
    import subprocess

    if args.tune_json is None:
        returncode: int | None = subprocess.run([sys.executable, "-m", "mixprec", *command[1:]]).returncode
    else:
        returncode = None  # an earlier run's: its exit code was not kept
    tune_wall_s = time.perf_counter() - started if args.tune_json is None else None
    tuned = json.loads(tune_json.read_text())
    rec = tuned.get("recommendation")
    pick = Candidate.from_dict(rec["candidate"]) if rec else None

    workload = spec["load"]()
    torch.manual_seed(0)
    variants = {
        f"{p} {'cl ' if cl else ''}{s}": Candidate(c.policy, cl, compile=m, compile_scope=scope)
        for p, c in PRECISIONS.items()
        for cl in spec["layouts"]
        for s, (m, scope) in SCOPES.items()
    }
    pick_name = next((n for n, c in variants.items() if c == pick), None)
    if pick is not None and pick_name is None:
        pick_name = f"tune's pick {pick.label}"
        variants[pick_name] = pick
    measured = probe(workload, variants, spec["batch_size"], args.rounds)
    best = max(measured, key=lambda n: measured[n]["speedup_vs_fp32_eager"])
    pick_speed = measured[pick_name]["speedup_vs_fp32_eager"] if pick_name else None
    # The probe times every variant, also those tune's numerics check failed (bf16 weights on
    # ResNet-50: most updates rounded away): the best of the rest is what tune could have picked.
    failed = {c["candidate"]["policy"] for c in tuned["candidates"] if c["status"] == "fail"}
    passing = [n for n in measured if variants[n].policy not in failed]
    best_passing = max(passing, key=lambda n: measured[n]["speedup_vs_fp32_eager"]) if passing else None
    best_passing_speed = measured[best_passing]["speedup_vs_fp32_eager"] if best_passing else None
    duelled = None
    rivals = [n for n in dict.fromkeys([best_passing, best]) if n and n != pick_name]
    if pick_name and rivals and args.duel_sets:
        duelled = duel(
            args.model, {n: variants[n] for n in [pick_name, *rivals]}, args.duel_sets, args.duel_rounds
        )
        for rival in rivals:
            ratio, ratios = over(duelled, pick_name, rival)
            duelled[f"pick_over {rival}"] = {"median": ratio, "per_set": ratios}
    result = {
        "model": args.model,
        "command": "python benchmarks/probe_vs_tune.py " + " ".join(sys.argv[1:]),
        "tune_command": " ".join(command),
        "tune_exit_code": returncode,
        "tune_json": str(tune_json),
        "tune_wall_s": tune_wall_s,
        "tune_phases": tuned.get("phases"),
        "tune_pick": pick.label if pick else None,
        "tune_pick_speedup_in_tune": rec.get("speedup_vs_fp32") if rec else None,
        "tune_compiled": {
            c["label"]: {
                "compile_s": c.get("compile_s"),
                "speedup": c.get("speedup_vs_fp32"),
                "status": c["status"],
            }
            for c in tuned["candidates"]
            if c.get("candidate", {}).get("compile")
        },
        "probe": measured,
        "probe_best": best,
        "probe_best_speedup": measured[best]["speedup_vs_fp32_eager"],
        "pick_in_probe": pick_name,
        "pick_speedup_in_probe": pick_speed,
        "pick_over_best": pick_speed / measured[best]["speedup_vs_fp32_eager"] if pick_speed else None,
        "failed_tunes_check": sorted(failed),
        "probe_best_passing": best_passing,
        "pick_over_best_passing": pick_speed / best_passing_speed
        if pick_speed and best_passing_speed
        else None,
        # the held-out duel (see duel()): the pick against the probe's best, in fresh processes
        "duel": duelled,
        "duel_pick_over_best": duelled[f"pick_over {best}"]["median"]
        if duelled and f"pick_over {best}" in duelled
        else (1.0 if best == pick_name else None),
        "duel_pick_over_best_passing": duelled[f"pick_over {best_passing}"]["median"]
        if duelled and f"pick_over {best_passing}" in duelled
        else (1.0 if best_passing == pick_name else None),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "env": collect("cpu"),
    }
    out = args.out / f"probe_vs_tune-{args.model}.json"
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    took = tune_wall_s if tune_wall_s is not None else tuned.get("elapsed_s") or 0.0
    print(
        f"{args.model}: tune picked {result['tune_pick']} in {took:.0f} s; the probe's best is "
        f"{best} at {result['probe_best_speedup']:.2f}x fp32 eager, the pick {pick_speed or 0:.2f}x "
        f"({(result['pick_over_best'] or 0):.1%} of the best; {(result['pick_over_best_passing'] or 0):.1%} "
        f"of {best_passing}, the best of the variants tune's check passed); wrote {out}"
    )
    if duelled:
        for rival in rivals:
            got = duelled[f"pick_over {rival}"]
            sets = ", ".join(f"{r:.3f}" for r in got["per_set"])
            print(
                f"held-out duel, one process per variant: the pick is at {got['median']:.1%} of "
                f"{rival} (per set of processes: {sets})"
            )


if __name__ == "__main__":
    main()
