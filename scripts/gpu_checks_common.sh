# Sourced by the *_gpu_checks.sh scripts: run parts on one GPU, each step under its own time
# limit with its log in a file, and each part's logs back as ONE tarball (the device returns
# at most 8 files a call). The script defines part_commands PART (its steps, through `step`;
# non-zero for an unknown part) and ends with: run_parts NAME "PART|PART..." "$@".
# Environment: PYTHON (default python3), LIMIT (seconds per step, default 280), WORK (default
# /tmp/NAME: the logs, WORK/<part>/) and OUT (default runs/NAME: the tarballs, OUT/<part>.tgz).
set -u
py=${PYTHON:-python3}
limit=${LIMIT:-280}
export XLA_PYTHON_CLIENT_PREALLOCATE=false

step() {   # step NAME CMD...: CMD under the step limit, its output in $out/NAME.log
  local name=$1; shift
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$part/$name: exit $rc in $((SECONDS - start)) s$([ $rc = 124 ] && echo " (over the ${limit} s limit)")"
  tail -n 4 "$out/$name.log" | cut -c1-300
}

run_parts() {   # run_parts NAME USAGE PART...
  local name=$1 usage=$2; shift 2
  [ $# -gt 0 ] || { echo "usage: $name.sh $usage ..." >&2; exit 2; }
  local base=${OUT:-runs/$name} work=${WORK:-/tmp/$name}
  mkdir -p "$base"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv,noheader \
    2> /dev/null
  for part in "$@"; do
    out=$work/$part; rm -rf "$out"; mkdir -p "$out"
    part_commands "$part" || { echo "unknown part $part: $usage" >&2; exit 2; }
    cat "$out"/*.md 2> /dev/null
    tar czf "$base/$part.tgz" -C "$work" "$part"
  done
}
