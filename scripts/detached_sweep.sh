#!/usr/bin/env bash
# A sweep on a lent multi-GPU machine that outlives each device call. `start` launches
# `lra_sparse.sweep --parallel=gpus` detached (its own session, so the end of the call that
# started it does not stop it), with LRA_SWEEP_GPUS naming each GPU RUNS_PER_GPU times and an
# equal share of GPU memory per run; `poll` waits SECONDS (less when the sweep ends first),
# prints the sweep's non-pending runs and each run's newest metrics line, and writes the run
# records (config.json, metrics.jsonl, result.json, the sweep's files; never checkpoints) to
# $OUT/records.tgz. A machine lost between calls then loses only the runs in flight (and the
# checkpoints, which stay on it: runs whose checkpoints fit go through device_sweep.sh and
# lra_sparse.sweep.carry instead).
#   bash scripts/detached_sweep.sh start SPEC ROOT [REGEX]
#   bash scripts/detached_sweep.sh poll SECONDS SPEC ROOT
# Environment:
#   PREPARE       a command that makes the data (default: LRA-size ListOps into data/listops,
#                 when missing).
#   RUNS_PER_GPU  runs at once on each GPU (default 2: on an H200 one or two runs do about as
#                 much work per second as five, and each finishes far sooner).
#   GPUS          comma-separated GPU ids (default: every GPU nvidia-smi lists).
set -u
verb=${1:-}
case "$verb" in
  start)
    [ $# -ge 3 ] || { echo "usage: $0 start SPEC ROOT [REGEX]" >&2; exit 2; }
    spec=$2; root=$3; regex=${4:-}
    source "$(dirname "$0")/sweep_data.sh"
    prepare_data || exit 1
    gpus=${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)}
    [ -n "$gpus" ] || { echo "no GPU ids: set GPUS" >&2; exit 1; }
    per=${RUNS_PER_GPU:-2}
    slots=""
    for _ in $(seq "$per"); do slots=${slots:+$slots,}$gpus; done
    frac=$(python -c "print(round(0.9 / $per, 2))")
    mkdir -p "$root"
    if [ -f "$root/detached.pid" ] && kill -0 "$(cat "$root/detached.pid")" 2>/dev/null; then
      echo "a detached sweep already runs under $root (pid $(cat "$root/detached.pid"))" >&2
      exit 1
    fi
    LRA_SWEEP_GPUS=$slots XLA_PYTHON_CLIENT_MEM_FRACTION=$frac setsid nohup \
      python -m lra_sparse.sweep --sweep="$spec" --root="$root" --parallel=gpus --runs="$regex" \
      > "$root/detached.log" 2>&1 < /dev/null &
    echo $! > "$root/detached.pid"
    echo "started: sweep $spec under $root on GPU slots $slots (pid $!)"
    ;;
  poll)
    [ $# -eq 4 ] || { echo "usage: $0 poll SECONDS SPEC ROOT" >&2; exit 2; }
    seconds=$2; spec=$3; root=$4
    [ -f "$root/detached.pid" ] || { echo "no detached sweep was started under $root" >&2; exit 1; }
    pid=$(cat "$root/detached.pid")
    end=$((SECONDS + seconds))
    while [ $SECONDS -lt $end ] && kill -0 "$pid" 2>/dev/null; do sleep 5; done
    if kill -0 "$pid" 2>/dev/null; then echo "sweep running (pid $pid)"; else echo "sweep ended"; fi
    python -m lra_sparse.sweep --sweep="$spec" --root="$root" --status | grep -v pending
    tail -c 400 "$root/detached.log" | tr '\r' '\n' | tail -n 2
    for run in "$root"/*/; do
      [ -f "$run/metrics.jsonl" ] || continue
      echo "$(basename "$run"): $(tail -n 1 "$run/metrics.jsonl" | cut -c1-150)"
    done
    if [ -n "${OUT:-}" ]; then
      (cd "$root" && find . -maxdepth 2 \( -name config.json -o -name metrics.jsonl \
        -o -name result.json -o -name 'sweep*.json' -o -name sweep_error.txt \
        -o -name detached.log \) -print0 | tar czf "$OUT/records.tgz" --null -T -) || exit 1
    fi
    ;;
  *)
    echo "usage: $0 start SPEC ROOT [REGEX] | poll SECONDS SPEC ROOT" >&2
    exit 2
    ;;
esac
