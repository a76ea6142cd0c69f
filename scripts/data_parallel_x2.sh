#!/usr/bin/env bash
# Data-parallel training on the two GPUs of one host (device kinds nvidia-h100-x2 and
# nvidia-h200-x2): what the multi-GPU issue asks to show, in parts that each fit one 10-minute
# device call (every step has its own time limit, so a slow step leaves the others' output).
#   bash scripts/data_parallel_x2.sh bench       # one process: speed and loss curves, 1 vs 2
#   bash scripts/data_parallel_x2.sh rounding    # the same curves' float32 (rounding scale)
#   bash scripts/data_parallel_x2.sh processes   # two processes (jax.distributed) vs one
#   bash scripts/data_parallel_x2.sh sweep       # --parallel=gpus: two runs at once
# Outputs under ${OUT:-runs/data_parallel}; commit the tables under
# experiments/reports/data_parallel/ (sweep.md as experiments/results/data_parallel_sweep.md)
# and, from the tarballs, each run's config.json, result.json and metrics.jsonl under
# experiments/results/data_parallel_processes/ and experiments/results/data_parallel_sweep/.
# CONFIG (default configs/listops.py) and EXTRA (more trainer flags) shrink the "processes"
# runs for a CPU smoke check (JAX_PLATFORMS=cpu, two forced host devices). PYTHON (default
# python3) is the interpreter; LIMIT (seconds, default 270) bounds each step; ONLY=dense or
# ONLY=dfss runs one variant of bench and rounding.
set -u
part=${1:?usage: data_parallel_x2.sh bench|rounding|processes|sweep}
py=${PYTHON:-python3}
limit=${LIMIT:-270}
out=${OUT:-runs/data_parallel}; mkdir -p "$out"
root=${ROOT:-/tmp/runs/data_parallel}; mkdir -p "$root"
nvidia-smi --query-gpu=index,name,clocks.sm,memory.used --format=csv,noheader 2> /dev/null
data=data/listops_dp
if [ "$part" = processes ] || [ "$part" = sweep ] && [ ! -f "$data/basic_train.tsv" ]; then
  $py -m lra_sparse.generators.listops --output_dir=$data --num_train=8000 --num_val=500 \
    --num_test=500 --seed=0 > /dev/null || exit 1
fi
limited() {   # limited NAME CMD...: CMD under the step limit, its output in $out/NAME.log
  local name=$1; shift
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc$([ $rc = 124 ] && echo " (over the ${limit} s limit)")"
  return $rc
}
# dense on cuDNN and DFSS 2:4 on its Triton kernels (the issue's pair), LRA ListOps, bf16
variants=("dense bf16:cudnn" "dfss bf16:kind=dfss+nm=2:4+backend=triton")
case "$part" in
  bench)
    for entry in "${variants[@]}"; do
      set -- $entry
      [ -n "${ONLY:-}" ] && [ "$ONLY" != "$1" ] && continue
      limited "bench_$1" $py -m benchmarks.bench_data_parallel --variants="$2" --devices=1,2 \
        --per_device_batch=32 --curve_batch=64 --curve_steps=200 --fp32_curve=false \
        --reps=20 --warmup=5 --out="$out/bench_$1.md"
      cat "$out/bench_$1.md" 2> /dev/null
    done
    ;;
  rounding)
    # The one-device curve again, beside the same run in float32 (XLA attention for cuDNN's):
    # how far bfloat16 rounding alone moves a curve, to read the 1 vs 2 GPU difference against.
    # Dense float32 on XLA asks about 80 GiB at batch 64, so its curve runs on both GPUs, 45
    # GiB each; the platform allocator hands the bf16 curves' memory back first (JAX's default
    # pool keeps it, and the float32 run then ran out of memory on GPU 0 while GPU 1 waited).
    for entry in "${variants[@]}"; do
      set -- $entry
      [ -n "${ONLY:-}" ] && [ "$ONLY" != "$1" ] && continue
      fp32_devices=$([ "$1" = dense ] && echo 2 || echo 1)
      XLA_PYTHON_CLIENT_ALLOCATOR=platform limited "rounding_$1" \
        $py -m benchmarks.bench_data_parallel \
        --variants="$2" --devices=1 --speed=false --curve_batch=64 --curve_steps=200 \
        --fp32_devices=$fp32_devices --out="$out/rounding_$1.md"
      cat "$out/rounding_$1.md" 2> /dev/null
    done
    ;;
  processes)
    # The same 200 steps (LRA ListOps model, bf16, global batch 64) three ways: one process
    # on one GPU, one process on both GPUs, two processes with one GPU each. No attention
    # dropout, so dense attention runs on cuDNN (with it, XLA's explicit attention needs
    # about 47 GiB at batch 64 on one GPU); the model's other dropout stays on.
    common=(--config=${CONFIG:-configs/listops.py} --config.model.dtype=bfloat16
            --config.model.attention_dropout_rate=0.0 --config.batch_size=64
            --config.num_train_steps=200 --config.log_every_steps=10
            --config.eval_every_steps=200 --config.checkpoint_every_steps=100
            --config.num_eval_batches=4 --config.data.data_dir=$data ${EXTRA:-})
    rm -rf "$root/one_gpu" "$root/one_process" "$root/two_processes"
    CUDA_VISIBLE_DEVICES=0 limited one_gpu $py -m lra_sparse.main "${common[@]}" \
      --workdir="$root/one_gpu"
    limited one_process $py -m lra_sparse.main "${common[@]}" --workdir="$root/one_process"
    port=$($py -c "import socket; s = socket.socket(); s.bind(('localhost', 0))
print(s.getsockname()[1])")
    for i in 0 1; do
      CUDA_VISIBLE_DEVICES=$i limited two_processes.p$i $py -m lra_sparse.main "${common[@]}" \
        --workdir="$root/two_processes" --coordinator_address=localhost:$port \
        --num_processes=2 --process_id=$i &
    done
    wait
    runs=()
    for run in one_gpu one_process two_processes; do
      [ -f "$root/$run/metrics.jsonl" ] && runs+=("$root/$run")
    done
    $py -m scripts.compare_runs "${runs[@]}" | tee "$out/processes.md"
    tar czf "$out/processes_runs.tgz" --exclude=checkpoints -C "$root" one_gpu one_process \
      two_processes 2> /dev/null
    ;;
  sweep)
    rm -rf "$root/sweep"
    limited sweep $py -m lra_sparse.sweep --sweep=experiments/specs/data_parallel_sweep.py \
      --root="$root/sweep" --parallel=gpus
    $py -m scripts.compare_runs --manifest="$root/sweep/sweep.json" | tee "$out/sweep.md"
    $py -m lra_sparse.tables --root="$root/sweep" --spec=experiments/specs/data_parallel_sweep.py \
      --format=markdown | tee -a "$out/sweep.md"
    tar czf "$out/sweep_runs.tgz" --exclude=checkpoints -C "$root" sweep
    ;;
  *) echo "unknown part $part: bench | rounding | processes | sweep" >&2; exit 2 ;;
esac
