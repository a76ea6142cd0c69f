#!/usr/bin/env bash
# The DFSS kernel issue's GPU checks on one Hopper GPU (device kinds nvidia-h100-x1 and
# nvidia-h200), in parts that each fit one 10-minute device call; every step runs under its
# own time limit and writes its log to a file, and a part's logs come back as ONE tarball
# (the device returns at most 8 files a call).
#   bash scripts/dfss_gpu_checks.sh tests      # Mosaic GPU dropout tests (wide products too)
#   bash scripts/dfss_gpu_checks.sh dropout    # dropout cost, with the wide-vs-limbs bits
#   bash scripts/dfss_gpu_checks.sh forward    # attention table against XLA and cuDNN (selections A/B)
#   bash scripts/dfss_gpu_checks.sh steps      # ListOps (padded) and Pathfinder-32 steps
#   bash scripts/dfss_gpu_checks.sh small_dims # head dims 8 and 4 at 16 against padded to 64:
#                                              # attention and train steps, Path-X, Pathfinder-32
#   bash scripts/dfss_gpu_checks.sh fused      # the one-kernel backward (Tiles.fused_backward,
#                                              # the default): its GPU tests, A/Bs against the
#                                              # two-kernel backward (attention, train steps)
# Several parts in one call: bash scripts/dfss_gpu_checks.sh tests dropout
# Each part's logs and tables go to ${WORK:-/tmp/dfss_gpu_checks}/<part>/ and come back as
# ${OUT:-runs/dfss_gpu_checks}/<part>.tgz; the tables are also printed. Commit the tables under
# experiments/reports/dfss_mosaic/, named by what they show (the GPU-test log of the final code
# as gpu_tests_h100.log). PYTHON (default python3) is the interpreter; LIMIT (seconds,
# default 280) bounds each step; TESTS_K overrides the tests part's -k expression.
source "$(dirname "$0")/gpu_checks_common.sh"

part_commands() {
  case "$1" in
  tests)
    step gpu_tests $py -m pytest -m gpu tests/test_kernels.py -n 6 -q -rfE -p no:cacheprovider \
      -k "${TESTS_K:-mosaic_dropout or mosaic_wide or auto_runs_dropout}"
    ;;
  dropout)
    step bench_dfss_dropout $py -m benchmarks.bench_dfss_dropout --dtypes=bf16 --rounds=5 \
      --out="$out/bench_dfss_dropout.md"
    ;;
  forward)
    step bench_dfss_mgpu $py -m benchmarks.bench_dfss_mgpu --variants=default,pairs \
      --check=false --steps=20 --rounds=7 --out="$out/bench_dfss_mgpu.md"
    ;;
  steps)
    step listops $py -m benchmarks.bench_train_step --reps=8 --warmup=3 \
      --min_real_length=500 --variants=bf16:cudnn,bf16:kind=dfss+nm=2:4 \
      --out="$out/train_step_listops.md"
    step pathfinder $py -m benchmarks.bench_train_step --config=configs/pathfinder.py \
      --reps=8 --warmup=2 --variants=bf16:cudnn_bias,bf16:kind=dfss+nm=2:4 \
      --out="$out/train_step_pathfinder.md"
    ;;
  small_dims)
    for shape in "pathx 64x16384 2 8" "pathfinder 512x1024 4 4"; do
      set -- $shape
      step "attention_$1" $py -m benchmarks.bench_attention_dropout --shapes="$2" \
        --heads="$3" --dim="$4" --steps=5 --rounds=5 --ab_tiles=min_head_dim=64 \
        --out="$out/attention_$1.md"
    done
    for task in pathx pathfinder; do
      step "train_step_$task" $py -m benchmarks.bench_train_step --config="configs/$task.py" \
        --reps=5 --warmup=2 --attention_dropout=0.1 --ab_tiles=min_head_dim=64 \
        --variants=bf16:auto,bf16:kind=dfss+nm=2:4,bf16:kind=nystrom \
        --out="$out/train_step_$task.md"
    done
    ;;
  fused)
    step gpu_tests $py -m pytest -m gpu tests/test_kernels.py -n 6 -q -rfE -p no:cacheprovider \
      -k "fused_backward or deterministic"
    step attention $py -m benchmarks.bench_attention_dropout --ab_tiles=fused_backward=False \
      --out="$out/attention.md"
    step attention_pathx $py -m benchmarks.bench_attention_dropout --shapes=64x16384 --heads=2 \
      --dim=8 --steps=5 --rounds=5 --ab_tiles=fused_backward=False --out="$out/attention_pathx.md"
    step train_step_listops $py -m benchmarks.bench_train_step --reps=8 --warmup=3 \
      --min_real_length=500 --attention_dropout=0.1 --ab_tiles=fused_backward=False \
      --variants=bf16:auto,bf16:kind=dfss+nm=2:4 --out="$out/train_step_listops.md"
    ;;
  *) return 1 ;;
  esac
}

run_parts dfss_gpu_checks "tests|dropout|forward|steps|small_dims|fused" "$@"
