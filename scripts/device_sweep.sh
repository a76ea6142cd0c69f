#!/usr/bin/env bash
# Runs part of a sweep on a single-GPU machine that is lent for a few minutes at a time:
# several runs at once on the one GPU (each its own lra_sparse.sweep process, selected by
# --runs REGEX, with an equal share of GPU memory, under its own root ROOT.pI, since a sweep
# locks its root), a Ctrl-C to its sweeps and their trainers DEADLINE_S seconds after this
# script started, data preparation and unpacking included (each trainer saves its checkpoint
# and stops, and its sweep starts no further run; the sweep resumes it next time; leave about
# a minute after DEADLINE_S for those saves and the packing below), then the runs' logs
# (config.json, metrics.jsonl, result.json, TensorBoard events; no checkpoints) as one tarball
# in $OUT. Merge the roots' run directories into one directory to build the table.
# Checkpoints travel through lra_sparse.sweep.carry (records and each run's newest checkpoint,
# in size-limited parts).
#   bash scripts/device_sweep.sh SPEC ROOT DEADLINE_S REGEX [REGEX ...]
# Environment:
#   PREPARE    a command that makes the data (default: LRA-size ListOps into data/listops,
#              when missing), e.g. the Pathfinder-32 generator for experiments/specs/lra_pixels.py.
#   CARRY_IN   a directory holding the pI/ folders of an earlier call's $OUT (carry parts):
#              each carried run is unpacked first into the root ROOT.pI of the I-th REGEX, the
#              one that selects it (whichever part it came in; in every root whose REGEX
#              selects it), so runs resume from their checkpoints on a fresh machine (runs
#              longer than one call: copy $OUT's pI/ folders into experiments/carry/NAME/ and
#              commit them, since a new session starts from a fresh clone;
#              experiments/carry/README.md). A run already at or past the carried
#              checkpoint (a later call on the same machine) keeps its own copy.
#   RETURN_CHECKPOINTS  0: no carry parts (runs that finish on one machine, or checkpoints
#              too large to come back); default 1.
#   GPUS       comma-separated GPU ids of a multi-GPU machine: the sweep of the I-th REGEX
#              runs on GPU I modulo their number (its trainer sees only that GPU), each GPU's
#              memory shared equally by its sweeps. An entry "1+0" gives its sweep two slots,
#              GPUs 1 and 0, one run on each at a time (runs that depend on each other in one
#              root, spread over both GPUs). Unset: every sweep on the visible GPU.
# With $OUT set, each root also comes back as carry parts in $OUT/pI/ (at most 7 files in all
# beside runs.tgz; a larger pack is one error naming its largest runs).
set -u
spec=$1; root=$2; deadline=$3; shift 3
source "$(dirname "$0")/sweep_data.sh"
prepare_data || exit 1
if [ -n "${CARRY_IN:-}" ]; then
  # Each carried run goes to the root of the REGEX that selects it, whatever part holds it;
  # one that no REGEX selects is named and left out.
  placed=(); left=(); i=0
  for re in "$@"; do
    for parts in "$CARRY_IN"/p*; do
      [ -d "$parts" ] || continue
      lines=$(python -m lra_sparse.sweep.carry --unpack --root="$root.p$i" \
        --parts_dir="$parts" --runs="$re") || exit 1
      while IFS= read -r line; do
        [ -n "$line" ] || continue
        case "$line" in
          *": left out "*) left+=("${line%%: left out *}") ;;
          *) echo "carry -> $root.p$i: $line"; placed+=("${line%%: *}") ;;
        esac
      done <<< "$lines"
    done
    i=$((i + 1))
  done
  for run in $(printf '%s\n' "${left[@]}" | sort -u); do
    printf '%s\n' "${placed[@]}" | grep -qxF -- "$run" ||
      echo "carry: $run is carried in $CARRY_IN but no REGEX selects it; left out" >&2
  done
fi
gpus=()
[ -z "${GPUS:-}" ] || IFS=, read -ra gpus <<< "$GPUS"
for g in "${gpus[@]}"; do
  [[ "$g" =~ ^[0-9]+(\+[0-9]+)*$ ]] || {
    echo "GPUS=$GPUS: give comma-separated GPU ids, e.g. 0,1,2,3 (or 1+0: one sweep on GPUs 1 and 0)" >&2
    exit 2
  }
done
per_gpu=$#
[ ${#gpus[@]} -eq 0 ] || per_gpu=$(( ($# + ${#gpus[@]} - 1) / ${#gpus[@]} ))
frac=$(python -c "print(round(0.9 / $per_gpu, 2))")
left=$((deadline - SECONDS))   # the deadline counts from this script's start
if [ "$left" -le 0 ]; then
  echo "the deadline ($deadline s) passed while preparing the data and unpacking CARRY_IN ($SECONDS s)" >&2
  exit 1
fi
pids=(); roots=(); i=0
for re in "$@"; do
  r="$root.p$i"; roots+=("$r"); mkdir -p "$r"
  # The sweep's GPU slots: "ID;" (one slot: its runs get CUDA_VISIBLE_DEVICES=ID), or for
  # "1+0" the id list "1,0" (a slot per GPU).
  placement=()
  if [ ${#gpus[@]} -gt 0 ]; then
    g=${gpus[$((i % ${#gpus[@]}))]}
    if [[ "$g" == *+* ]]; then slots=${g//+/,}; else slots="$g;"; fi
    placement=(env "LRA_SWEEP_GPUS=$slots")
  fi
  i=$((i + 1))
  "${placement[@]}" env XLA_PYTHON_CLIENT_MEM_FRACTION="$frac" python -m lra_sparse.sweep \
    --sweep="$spec" --root="$r" --runs="$re" ${placement[0]:+--parallel=gpus} \
    > "$r/sweep.log" 2>&1 &
  pids+=($!)
done
# The watchdog holds no pipe of ours open, so a finished batch returns at once. At the
# deadline it sends Ctrl-C to these sweeps and to their trainers (children of the sweeps) and
# to nothing else on the machine; when the batch ends first, its sleep is killed and the "&&"
# sends nothing (a "pkill -f" by name after a ";" once reached other runs' trainers: the test
# suite's, through this script's own test).
(sleep "$left" && for p in "${pids[@]}"; do pkill -INT -P "$p"; kill -INT "$p"; done) \
  > /dev/null 2>&1 < /dev/null &
watchdog=$!
wait "${pids[@]}"
pkill -P "$watchdog" 2>/dev/null; kill "$watchdog" 2>/dev/null
for r in "${roots[@]}"; do
  python -m lra_sparse.sweep --sweep="$spec" --root="$r" --status | grep -v pending
  tail -n 2 "$r/sweep.log"
done
[ -n "${OUT:-}" ] || exit 0
tar czf "$OUT/runs.tgz" --exclude='checkpoints' --exclude='*.lock' "${roots[@]}"
[ "${RETURN_CHECKPOINTS:-1}" = 1 ] || exit 0
i=0
for r in "${roots[@]}"; do
  python -m lra_sparse.sweep.carry --pack --root="$r" --parts_dir="$OUT/p$i" \
    --max_parts=$((7 / ${#roots[@]})) || exit 1
  i=$((i + 1))
done
