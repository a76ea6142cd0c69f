#!/usr/bin/env bash
# The DSA kernels' GPU checks on one GPU (device kinds nvidia-h100-x1 and nvidia-h200), in
# parts that each fit one 10-minute device call; every step runs under its own time limit and
# writes its log to a file, and a part's logs come back as ONE tarball (the device returns at
# most 8 files a call). What experiments/reports/dsa/block_rule_h200.md ran, as one command:
#   bash scripts/dsa_gpu_checks.sh tests    # every DSA GPU test (kernels, block rule, Gram)
#   bash scripts/dsa_gpu_checks.sh block    # block DSA (tile lists, bit-test skip, selection
#                                           # alone) against cuDNN and fine-grained DSA-95
#   bash scripts/dsa_gpu_checks.sh steps    # the padded ListOps step: block DSA vs cuDNN
# Several parts in one call: bash scripts/dsa_gpu_checks.sh tests block steps
# Logs and tables go to ${WORK:-/tmp/dsa_gpu_checks}/<part>/ and come back as
# ${OUT:-runs/dsa_gpu_checks}/<part>.tgz; the tables are also printed. PYTHON (default python3)
# is the interpreter; LIMIT (seconds, default 280) bounds each step; WORKERS (default 8) the
# tests part's pytest workers.
source "$(dirname "$0")/gpu_checks_common.sh"

part_commands() {
  case "$1" in
  tests)
    step gpu_tests $py -m pytest -m gpu tests/test_dsa_kernels.py tests/test_dsa_gram.py \
      -n "${WORKERS:-8}" -q -rfE -p no:cacheprovider --junitxml="$out/gpu_tests.xml"
    ;;
  block)
    step bench_dsa $py -m benchmarks.bench_dsa --shapes=32x1024,16x2048,8x4096 \
      --settings=90:b64:0.25,95:b64:0.25,99:b64:0.25,95:8:0.1 --forwards=gather \
      --skip_reference --block_skip_rows --select_only --out="$out/bench_dsa_block.md"
    ;;
  steps)
    local block="granularity=block+block_size=64"
    step listops $py -m benchmarks.bench_train_step --reps=8 --warmup=3 --min_real_length=500 \
      --variants="bf16:cudnn,bf16:kind=dsa+sparsity=0.95+$block,bf16:kind=dsa+sparsity=0.9+$block,bf16:kind=dsa+sparsity=0.95+$block/drop=0.1,bf16:kind=dsa+sparsity=0.95+vector=8,bf16:cudnn" \
      --out="$out/train_step_block_dsa.md"
    ;;
  *) return 1 ;;
  esac
}

run_parts dsa_gpu_checks "tests|block|steps" "$@"
