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
set -u
[ $# -gt 0 ] || { echo "usage: nystrom_gpu_checks.sh tests|bench ..." >&2; exit 2; }
py=${PYTHON:-python3}
limit=${LIMIT:-280}
base=${OUT:-runs/nystrom_gpu_checks}; mkdir -p "$base"
work=${WORK:-/tmp/nystrom_gpu_checks}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv,noheader \
  2> /dev/null
for part in "$@"; do
  out=$work/$part; rm -rf "$out"; mkdir -p "$out"
  step() {   # step NAME CMD...: CMD under the step limit, its output in $out/NAME.log
    local name=$1; shift
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "$part/$name: exit $rc in $((SECONDS - start)) s$([ $rc = 124 ] && echo " (over the ${limit} s limit)")"
    tail -n 4 "$out/$name.log" | cut -c1-300
  }
  case "$part" in
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
    *) echo "unknown part $part: tests | bench" >&2; exit 2 ;;
  esac
  cat "$out"/*.md 2> /dev/null
  tar czf "$base/$part.tgz" -C "$work" "$part"
done
