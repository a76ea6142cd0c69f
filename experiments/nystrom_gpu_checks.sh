#!/usr/bin/env bash
# The Nystromformer kernel candidates on one GPU (the fused pseudo-inverse of
# lra_sparse/kernels/pinv_pallas.py, the banded conv skip of length_conv_pallas.py), in parts
# that each fit one 10-minute device call; every step runs under its own time limit and writes
# its log to a file, and a part's logs come back as ONE tarball (the device returns at most 8
# files a call).
#   bash experiments/nystrom_gpu_checks.sh tests   # the candidates against float64 references
#   bash experiments/nystrom_gpu_checks.sh bench   # core, conv and train step, one process
# Logs and tables go to ${WORK:-/tmp/nystrom_gpu_checks}/<part>/ and come back as
# ${OUT:-runs/nystrom_gpu_checks}/<part>.tgz; the tables are also printed. PYTHON (default
# python3) is the interpreter; LIMIT (seconds, default 280) bounds each step.
source "$(dirname "$0")/gpu_checks_common.sh"

part_commands() {
  case "$1" in
  tests)
    # unmarked tests: the interpreter on a CPU, the compiled kernels on a GPU
    step tests $py -m pytest tests/test_attention_kinds.py -n 4 -q -rfE -p no:cacheprovider \
      -k "fused_pinv or banded_conv or conv_skip_forms or nystrom"
    ;;
  bench)
    step bench $py -m benchmarks.bench_nystrom --parts=core,conv,step --conv_dtypes=bf16 \
      --convs="banded block matmul,Pallas kernel,Pallas banded kernel" --step_convs= \
      --step_variants=bf16:cudnn,bf16:kind=nystrom,bf16:kind=nystrom+nm=2:4 \
      --step_candidates="fused pinv,banded conv,fused pinv + banded conv" --reps=5 \
      --warmup=2 --out="$out/bench_nystrom.md"
    ;;
  *) return 1 ;;
  esac
}

run_parts nystrom_gpu_checks "tests|bench" "$@"
