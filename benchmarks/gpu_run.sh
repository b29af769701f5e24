#!/usr/bin/env bash
# Everything mixprec measures on a CUDA GPU, in two stages that each fit one ~6-minute command of a
# 15-minute device lease (so that a failed first one can be rerun once).
#
#   bash benchmarks/gpu_run.sh OUT_DIR STAGE...
#
# Stages:
#   first   nvidia-smi, `mixprec env` (also with NVIDIA_TF32_OVERRIDE=0), the TF32 probe, the
#           gpu-marked tests (tests/test_gpu.py, tests/test_gpu_paths.py: compile at both scopes,
#           the race, fused optimizers, fp8 and the emulated block formats, the monitor, `mixprec
#           train`, --batch auto, the exports executed, models by name, Lightning on the GPU; the
#           CUDA parity, FSDP2 and HF Trainer tests), the Policy's overhead ratio, the monitor's
#           cost, then as much of the whole suite as the stage's time allows (interrupted cleanly,
#           the summary kept)
#   second  benchmarks/fp8_gpt.py (fp8-rowwise/tensorwise vs bf16-mixed on the zoo GPT, eager and
#           compiled, verdicts beside), `mixprec tune --budget 80` on ResNet-50 (128 px) and on GPT-2, and
#           `mixprec run --monitor -- python <script>` (the script source) on a nanoGPT-style script,
#           and `mixprec run --rescue -- torchrun ... ddp_train.py` (NCCL, one rank) with a bad batch
#   seed    benchmarks/seed_table.py: ResNet-50 / VGG-19 / DenseNet-121 at 224 px
# A 15-minute lease holds a machine start (1-2 min) and both stages: first ~5 min, second ~7 min.
# Each step has its own time limit and none stops the next. After every step the results so far are
# packed into OUT_DIR/<stage>.tgz, so a command cut short still returns what it measured.
# Runs from the repository root with src/ on PYTHONPATH: no install beyond the GPU image's torch,
# rich, matplotlib, jinja2, pytest (+ pytest-xdist, pytest-timeout) and torchao for fp8.
#
# Rehearse on a CPU first: MIXPREC_GPU_RUN_DEVICE=cpu bash benchmarks/gpu_run.sh /tmp/rehearsal first second
set -uo pipefail
out=$(realpath -m "$1"); shift
work="$out/work"
mkdir -p "$work"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MIXPREC_CACHE_DIR="$work/.cache"
py=${PYTHON:-python3}
dev=${MIXPREC_GPU_RUN_DEVICE:-cuda}
log() { echo "=== $* ($(date -u +%T))"; }
# GPU_RUN_PACK_DIR: where the packed results go (the device tool's $OUT), else OUT_DIR
pack() { tar -C "$work" --exclude=.cache -czf "${GPU_RUN_PACK_DIR:-$out}/$1.tgz" . ; }

for stage in "$@"; do
  case "$stage" in
    first)
      log first
      if [ "$dev" = cuda ]; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
          --format=csv | tee "$work/nvidia-smi.csv"
        gpu_tests=(-m gpu)
      else
        export MIXPREC_GPU_TEST_DEVICE=cpu
        gpu_tests=(-m gpu tests/test_gpu_paths.py)
      fi
      # everything below needs mixprec to import and see the device: stop at once if it cannot
      timeout 90 $py -m mixprec env --device "$dev" --json "$work/env.json" || { log "mixprec env failed"; pack first; exit 3; }
      NVIDIA_TF32_OVERRIDE=0 timeout 60 $py -m mixprec env --device "$dev" --json "$work/env-tf32-override-0.json" >/dev/null
      pack first
      [ "$dev" = cuda ] && timeout 60 $py benchmarks/tf32_probe.py --json "$work/tf32_probe.json"
      log gpu tests
      timeout -k 15 -s INT "${GPU_TESTS_S:-180}" $py -m pytest -q -p no:cacheprovider --timeout 170 -n 8 -rfEs --durations=20 \
        "${gpu_tests[@]}" tests >"$work/pytest-gpu.log" 2>&1
      tail -n 45 "$work/pytest-gpu.log"
      pack first
      log overhead
      timeout 60 $py benchmarks/overhead.py --device "$dev" --rounds 15 --steps 50 --json "$work/overhead-$dev.json" | tail -n 6
      pack first
      log monitor overhead
      timeout 75 $py benchmarks/monitor_overhead.py --device "$dev" --rounds 9 --steps 200 --profile --out "$work"
      pack first
      log suite
      # the rest of the suite, cut by SIGINT at the limit: pytest prints the summary of what ran
      timeout -k 15 -s INT "${SUITE_S:-60}" $py -m pytest -q -p no:cacheprovider --timeout 100 -n 12 -rfE \
        -m "not gpu" tests >"$work/pytest-suite.log" 2>&1
      tail -n 40 "$work/pytest-suite.log"
      pack first
      ;;
    second)
      log second
      if [ -n "${MONITOR_OVERHEAD_IN_SECOND:-}" ]; then  # the H200 run of 2026-11-27: it broke in first
        log monitor overhead
        timeout 60 $py benchmarks/monitor_overhead.py --device "$dev" --rounds 5 --steps 200 --profile --out "$work"
        pack second
      fi
      log fp8 gpt
      if [ "$dev" = cuda ]; then
        timeout -k 10 "${FP8_S:-150}" $py benchmarks/fp8_gpt.py --out "$work/fp8" --device cuda
      else  # a small GPT: the CPU refuses to time fp8 and predicts its verdict
        timeout 210 $py benchmarks/fp8_gpt.py --out "$work/fp8" --device cpu --n-embd 128 --n-layer 1 \
          --n-head 4 --seq-len 32 --batch-size 4 --steps 3 --check-steps 4
      fi
      pack second
      log tune resnet50
      # 128 px, batch 64: at the default CUDA size (224 px, batch 256) cuDNN's autotuning of strict
      # fp32 alone took 17 s of the H200's last 120 s budget, and nothing below fp32 was measured
      timeout -k 10 "${TUNE_S:-105}" $py -m mixprec tune --device "$dev" --model resnet50 --image-size 128 --batch-size 64 \
        --budget "${TUNE_BUDGET:-80}" \
        --report "$work/tune-resnet50" --json "$work/tune-resnet50.json" | tail -n 25
      echo "tune exit code: ${PIPESTATUS[0]}"
      pack second
      log tune gpt2
      timeout -k 10 "${TUNE_S:-105}" $py -m mixprec tune --device "$dev" --model gpt2 --seq-len 512 --batch-size 16 \
        --budget "${TUNE_BUDGET:-80}" --report "$work/tune-gpt2" --json "$work/tune-gpt2.json" | tail -n 25
      echo "tune exit code: ${PIPESTATUS[0]}"
      pack second
      if $py -m mixprec run --help >/dev/null 2>&1; then
        log run script
        timeout -k 10 60 $py -m mixprec run --policy bf16-mixed --monitor --out "$work/run-script" -- \
          $py tests/frameworks/scripts/plain_loop.py --steps 60 --device "$dev" | tail -n 15
        echo "run exit code: ${PIPESTATUS[0]}"
        pack second
        log run torchrun
        # the script source's torchrun launch on CUDA (NCCL, one rank per GPU: one here), a bad batch
        # at step 80 that the monitor withholds
        timeout -k 10 60 $py -m mixprec run --policy bf16-mixed --rescue --out "$work/run-torchrun" -- \
          $py -m torch.distributed.run --standalone --nproc_per_node 1 tests/frameworks/scripts/ddp_train.py \
          --steps 120 --bad-rank 0 --bad-at 80 --device "$dev" | tail -n 15
        echo "run exit code: ${PIPESTATUS[0]}"
        pack second
      else
        log "run script: skipped, this checkout has no \`mixprec run\` (the script source)"
      fi
      ;;
    seed)
      log seed
      $py benchmarks/seed_table.py --out "$work/seed" --batch-size 256 --steps 15 --warmup 5
      pack seed
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
log done
