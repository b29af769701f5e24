"""The fuzz tier's generated scripts (tests/frameworks/script_shapes.py: 24 shapes covering every pair
of LR scheduler, clip path, backward path, accumulation, eval mode, part calls, two optimizers and
the script's own AMP) through the real command line of a checkout: for each, `mixprec run --policy
P -- python train.py` beside the same script edited by hand to P (the PyTorch AMP recipe), each in a
process of its own; whether the final weights are the same bit for bit, or how the run failed.

    python benchmarks/script_fuzz_cli.py --src src --policy bf16-mixed --json OUT.json
    python benchmarks/script_fuzz_cli.py --src /path/to/older/checkout/src --policy fp16-mixed ...

(``--src``: the mixprec sources to run, put first on PYTHONPATH: this checkout's or another's.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from frameworks.script_shapes import render, shapes  # noqa: E402

FORMAT = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}


def one(shape, src: str, policy: str) -> str:
    folder = Path(tempfile.mkdtemp(prefix="script-fuzz-"))
    (folder / "train.py").write_text(render(shape))
    (folder / "hand.py").write_text(render(shape, hand=True))
    py = sys.executable
    subprocess.run([py, "hand.py", "--amp", FORMAT[policy], "--out", "hand.pt"], cwd=folder, check=True)
    env = {**os.environ, "PYTHONPATH": src}
    command = [
        py,
        "-m",
        "mixprec",
        "run",
        "--policy",
        policy,
        "--out",
        "out",
        "--",
        py,
        "train.py",
        "--out",
        "run.pt",
    ]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not (folder / "run.pt").exists():
        last = (done.stderr.strip().splitlines() or ["?"])[-1][:160]
        return f"exit {done.returncode}: {last}"
    a, b = torch.load(folder / "run.pt"), torch.load(folder / "hand.pt")
    return "same" if all(torch.equal(a[k], b[k]) for k in a) else "differs from the hand edit"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", default=str(ROOT / "src"))
    parser.add_argument("--policy", choices=sorted(FORMAT), default="bf16-mixed")
    parser.add_argument("--shapes", type=int, default=24)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    results = {
        str(shape): one(shape, str(Path(args.src).resolve()), args.policy) for shape in shapes(args.shapes)
    }
    same = sum(v == "same" for v in results.values())
    data = {"src": args.src, "policy": args.policy, "same": same, "of": len(results), "results": results}
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    print(f"{args.policy}: {same} of {len(results)} the same as the hand edit, bit for bit")


if __name__ == "__main__":
    main()
