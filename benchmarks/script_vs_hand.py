"""Your script, unchanged: for each script style of tests/frameworks/scripts, the default
`mixprec tune -- python SCRIPT` (its time, its pick, the speedup it claims over the script as
written), then a plain probe: the script as written, `mixprec run --policy <pick> -- SCRIPT`, and the
script edited by hand to the pick, each timed as whole processes at two lengths (the difference
cancels start-up), interleaved over rounds; the per-step times' medians compared.

    python benchmarks/script_vs_hand.py --out benchmarks/results/cpu-amd-epyc [--styles plain,hf,...]
        [--rounds 3] [--budget 300]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "frameworks" / "scripts"
PY = sys.executable


def styles(scratch: Path) -> dict[str, dict]:
    """Each style: the command as written (steps as a format slot), and its hand edit per policy."""
    hf_out = str(scratch / "hf")
    return {
        "plain": {
            "cmd": [PY, str(SCRIPTS / "plain_loop.py"), "--steps", "{n}"],
            "hand": {"bf16-mixed": ["--amp", "bf16"], "fp16-mixed": ["--amp", "fp16"]},
        },
        "own-amp": {  # the script's own fp16 autocast + GradScaler: the as-written row is fp16
            "cmd": [PY, str(SCRIPTS / "plain_loop.py"), "--steps", "{n}", "--amp", "fp16"],
            "hand": {"bf16-mixed": ["--amp", "bf16"], "fp32": ["--amp", "none"]},
            "hand_replaces": ["--amp", "fp16"],
        },
        "hf": {
            "cmd": [
                PY,
                str(SCRIPTS / "hf_trainer.py"),
                "--output_dir",
                hf_out,
                "--max_steps",
                "{n}",
                "--per_device_train_batch_size",
                "8",
                "--report_to",
                "none",
                "--save_strategy",
                "no",
                "--disable_tqdm",
                "true",
            ],
            "hand": {"bf16-mixed": ["--bf16", "--use_cpu"], "fp16-mixed": ["--fp16"]},
        },
        "lightning": {
            "cmd": [PY, str(SCRIPTS / "lightning_module.py"), "--max-steps", "{n}"],
            "hand": {
                "bf16-mixed": ["--precision", "bf16-mixed"],
                "bf16-true": ["--precision", "bf16-true"],
                "fp16-mixed": ["--precision", "16-mixed"],
            },
        },
    }


def command(style: dict, n: int, extra: list[str] | None = None) -> list[str]:
    cmd = [a.format(n=n) for a in style["cmd"]]
    if extra is not None:
        drop = style.get("hand_replaces")
        if drop:
            i = cmd.index(drop[0])
            del cmd[i : i + len(drop)]
        cmd += extra
    return cmd


class Build:
    """The command of one configuration at ``n`` steps: as written, under ``mixprec run``, or edited."""

    def __init__(self, style: dict, *, run: list[str] | None = None, hand: list[str] | None = None) -> None:
        self.style, self.run, self.hand = style, run or [], hand

    def __call__(self, n: int) -> list[str]:
        return [*self.run, *command(self.style, n, self.hand)]


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - start


def per_step(build, short: int, long: int) -> float:
    """Seconds per step: the whole process at ``long`` steps less at ``short``, over the difference."""
    return (wall(build(long)) - wall(build(short))) / (long - short)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--styles", default="plain,own-amp,hf,lightning")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=300)
    parser.add_argument("--short", type=int, default=20)
    parser.add_argument("--long", type=int, default=120)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="script-vs-hand-"))
    results = {}
    for name in args.styles.split(","):
        style = styles(scratch)[name]
        tune_json = scratch / f"tune-{name}.json"
        started = time.perf_counter()
        tune = subprocess.run(
            [
                PY,
                "-m",
                "mixprec",
                "tune",
                "--budget",
                str(args.budget),
                "--json",
                str(tune_json),
                "--",
                *command(style, 100_000),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        tune_s = time.perf_counter() - started
        data = json.loads(tune_json.read_text()) if tune_json.exists() else {}
        rec = data.get("recommendation") or {}
        pick = (rec.get("candidate") or {}).get("policy")
        rows = {r["label"]: r for r in (data.get("bench") or {}).get("rows") or []}
        own = next((r for label, r in rows.items() if label.endswith("(as written)")), None)
        claimed = None
        if rec.get("speedup_vs_fp32") and own and own.get("speedup_vs_fp32"):
            claimed = rec["speedup_vs_fp32"] / own["speedup_vs_fp32"]
        entry = {
            "tune_s": round(tune_s, 1),
            "tune_exit": tune.returncode,
            "pick": rec.get("label"),
            "as_written": own["label"] if own else None,
            "claimed_vs_as_written": claimed,
            "tune_notes": data.get("notes"),
        }
        if pick and not (rec.get("candidate") or {}).get("as_written"):
            hand = style["hand"].get(pick)
            probe: dict[str, list[float]] = {"as_written": [], "mixprec_run": [], "by_hand": []}
            # tune's own answer, up to the command: `mixprec run --policy P [--channels-last] ...`
            run_flags = shlex.split(data["exports"]["run"].split(" -- ")[0])
            run_dir = scratch / f"run-{name}"
            builds = {
                "as_written": Build(style),
                "mixprec_run": Build(style, run=[PY, "-m", *run_flags, "--out", str(run_dir), "--"]),
                **({"by_hand": Build(style, hand=hand)} if hand is not None else {}),
            }
            for _ in range(args.rounds):  # interleaved: the machine's drift hits all three alike
                for key, build in builds.items():
                    probe[key].append(per_step(build, args.short, args.long))
            medians = {k: statistics.median(v) for k, v in probe.items() if v}
            entry["probe_s_per_step"] = {k: [round(x, 5) for x in v] for k, v in probe.items()}
            entry["run_vs_as_written"] = medians["as_written"] / medians["mixprec_run"]
            if "by_hand" in medians:
                entry["run_vs_by_hand"] = medians["by_hand"] / medians["mixprec_run"]
        results[name] = entry
        print(name, json.dumps(entry, default=str), flush=True)
    (out / "script_vs_hand.json").write_text(
        json.dumps(
            {"command": "python benchmarks/script_vs_hand.py " + " ".join(sys.argv[1:]), "results": results},
            indent=1,
            default=str,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
