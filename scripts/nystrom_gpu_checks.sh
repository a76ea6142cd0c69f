#!/usr/bin/env bash
# The Nystromformer kernels on one GPU (F (.) and B V of lra_sparse/kernels/
# landmark_attention_pallas.py, plain and N:M; the conv skip of length_conv_pallas.py: the banded
# tensor-core kernel the model runs for half-precision V, the one-pass kernel), in parts
# that each fit one 10-minute device call; every step runs under its own time limit and writes
# its log to a file, and a part's logs come back as ONE tarball (the device returns at most 8
# files a call).
#   bash scripts/nystrom_gpu_checks.sh tests   # the kernels and the core against float64
#   bash scripts/nystrom_gpu_checks.sh bench   # core, conv and train step, one process
#   bash scripts/nystrom_gpu_checks.sh profile # the train step's kernels, dense vs Nystrom
#   bash scripts/nystrom_gpu_checks.sh tune    # the flash kernels' tiles, plain and 2:4
# Logs and tables go to ${WORK:-/tmp/nystrom_gpu_checks}/<part>/ and come back as
# ${OUT:-runs/nystrom_gpu_checks}/<part>.tgz; the tables are also printed. Commit the tables under
# experiments/reports/nystrom/, named by what they show. PYTHON (default python3) is the
# interpreter; LIMIT (seconds, default 280) bounds each step.
source "$(dirname "$0")/gpu_checks_common.sh"

part_commands() {
  case "$1" in
  tests)
    # unmarked tests: the interpreter on a CPU, the compiled kernels on a GPU
    step tests $py -m pytest tests/test_attention_kinds.py -n 4 -v -rfE -p no:cacheprovider \
      --durations=10 -k "banded_conv or conv_skip_forms or nystrom or few_keys or few_queries or landmark or pinv"
    ;;
  bench)
    # core: the flash formulations and their parts; step: dense cuDNN, then the Nystromformer
    # with "auto" (the Pallas kernels) against its A/B partners, plain and 2:4; dense and plain
    # again, then the "auto" variants with the pseudo-inverse on XLA (bench_nystrom adds them)
    step bench $py -m benchmarks.bench_nystrom --parts=core,step --reps=5 --warmup=2 \
      --step_variants=bf16:cudnn,bf16:kind=nystrom,bf16:kind=nystrom+implementation=cudnn,bf16:kind=nystrom+nm=2:4,bf16:kind=nystrom+nm=2:4+implementation=xla,bf16:cudnn,bf16:kind=nystrom \
      --out="$out/bench_nystrom.md"
    ;;
  profile)
    step profile $py -m benchmarks.profile_train_step --variants=bf16:cudnn,bf16:kind=nystrom \
      --json="$out/profile_nystrom.json"
    gzip -f "$out/profile_nystrom.json"
    ;;
  tune)
    step tune_few_keys $py -m benchmarks.tune_landmark_attention --kernels=few_keys \
      --bwd_blocks=8 --out="$out/tune_few_keys.md"
    step tune_few_queries $py -m benchmarks.tune_landmark_attention --kernels=few_queries \
      --spans=256,512 --out="$out/tune_few_queries.md"
    ;;
  *) return 1 ;;
  esac
}

run_parts nystrom_gpu_checks "tests|bench|profile|tune" "$@"
