#!/usr/bin/env bash
# Runs part of a sweep on a single-GPU machine that is lent for a few minutes at a time:
# several runs at once on the one GPU (each its own lra_sparse.sweep process, selected by
# --runs REGEX, with an equal share of GPU memory, under its own root ROOT.pI, since a sweep
# locks its root), a Ctrl-C to every trainer DEADLINE_S seconds in (each saves its checkpoint
# and stops; the sweep resumes it next time), then the runs' logs (config.json, metrics.jsonl,
# result.json, TensorBoard events; no checkpoints) as one tarball in $OUT. Generates LRA-size
# ListOps into data/listops first when it is missing. Merge the roots' run directories into
# one directory to build the table.
#   bash experiments/device_sweep.sh SPEC ROOT DEADLINE_S REGEX [REGEX ...]
set -u
spec=$1; root=$2; deadline=$3; shift 3
if [ ! -f data/listops/basic_train.tsv ]; then
  python -m lra_sparse.generators.listops --output_dir=data/listops --num_train=96000 \
    --num_val=2000 --num_test=2000 --seed=0 > /dev/null || exit 1
fi
md5sum data/listops/*.tsv
frac=$(python -c "print(round(0.9 / $#, 2))")
pids=(); roots=(); i=0
for re in "$@"; do
  r="$root.p$i"; i=$((i + 1)); roots+=("$r"); mkdir -p "$r"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$frac python -m lra_sparse.sweep --sweep="$spec" \
    --root="$r" --runs="$re" > "$r/sweep.log" 2>&1 &
  pids+=($!)
done
# the watchdog holds no pipe of ours open, so a finished batch returns at once
(sleep "$deadline"; pkill -INT -f "lra_sparse\.(sweep|main)") > /dev/null 2>&1 < /dev/null &
watchdog=$!
wait "${pids[@]}"
pkill -P "$watchdog" 2>/dev/null; kill "$watchdog" 2>/dev/null
for r in "${roots[@]}"; do
  python -m lra_sparse.sweep --sweep="$spec" --root="$r" --status | grep -v pending
  tail -n 2 "$r/sweep.log"
done
[ -n "${OUT:-}" ] && tar czf "$OUT/runs.tgz" --exclude='checkpoints' --exclude='*.lock' "${roots[@]}"
