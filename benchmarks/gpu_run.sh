#!/usr/bin/env bash
# Everything mixprec measures on a CUDA GPU, in stages that each fit a 10-minute lease.
#
#   bash benchmarks/gpu_run.sh OUT_DIR STAGE...
#
# Stages:
#   check   nvidia-smi, `mixprec env` (also with NVIDIA_TF32_OVERRIDE=0), the TF32 probe,
#           the gpu-marked tests, the GPU overhead ratio and the planted-overflow check
#   tests   the whole pytest suite on the GPU machine (no CUDA test may skip)
#   seed    benchmarks/seed_table.py: ResNet-50 / VGG-19 / DenseNet-121 at 224 px
#   tune    `mixprec tune` and an exhaustive `mixprec bench` of the same candidates, resnet50
#   tune-gpt2  the same for the gpt2 zoo model
# Runs from the repository root with the src/ tree on PYTHONPATH, so it needs no install
# beyond what the GPU image has (torch, torchvision, rich, matplotlib, pytest).
set -uo pipefail
out=$(realpath -m "$1"); shift
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MIXPREC_CACHE_DIR="$out/cache"
py=${PYTHON:-python3}
log() { echo "=== $* ($(date -u +%T))"; }

for stage in "$@"; do
  case "$stage" in
    check)
      log check
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
        --format=csv >"$out/nvidia-smi.csv"
      cat "$out/nvidia-smi.csv"
      $py -m mixprec env --json "$out/env.json"
      NVIDIA_TF32_OVERRIDE=0 $py -m mixprec env --json "$out/env-tf32-override-0.json" | tail -n 12
      $py benchmarks/tf32_probe.py --json "$out/tf32_probe.json"
      $py -m pytest -q -p no:cacheprovider --timeout 180 -m gpu tests 2>&1 | tee "$out/pytest-gpu.log" | tail -n 30
      $py benchmarks/overhead.py --device cuda --rounds 15 --steps 50 --json "$out/overhead-cuda.json"
      $py -m mixprec check --workload examples/planted_overflow.py:workload --fix --device cuda \
        --json "$out/check-planted-overflow-cuda.json" | tail -n 20
      echo "check exit code (4 = a candidate failed, as planted): $?"
      ;;
    tests)
      log tests
      timeout 420 $py -m pytest -q -p no:cacheprovider --timeout 180 -rs tests 2>&1 | tee "$out/pytest-all.log" | tail -n 40
      ;;
    seed)
      log seed
      $py benchmarks/seed_table.py --out "$out/seed" --batch-size 256 --steps 15 --warmup 5
      ;;
    tune)
      log tune resnet50
      $py -m mixprec tune --model resnet50 --report "$out/tune-resnet50" --json "$out/tune-resnet50.json"
      log bench resnet50
      $py -m mixprec bench --model resnet50 --policies all --channels-last both \
        --json "$out/bench-resnet50.json" --markdown "$out/bench-resnet50.md"
      ;;
    tune-gpt2)
      log tune gpt2
      $py -m mixprec tune --model gpt2 --seq-len 512 --batch-size 16 --report "$out/tune-gpt2" \
        --json "$out/tune-gpt2.json"
      log bench gpt2
      $py -m mixprec bench --model gpt2 --seq-len 512 --batch-size 16 --policies all \
        --json "$out/bench-gpt2.json" --markdown "$out/bench-gpt2.md"
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
log done
