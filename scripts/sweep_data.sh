# Sourced by device_sweep.sh and detached_sweep.sh: the data a sweep on a fresh lent machine
# reads. prepare_data runs $PREPARE when set (e.g. the Pathfinder-32 generator), else makes
# LRA-size ListOps in data/listops when it is missing (and prints its files' checksums).
prepare_data() {
  if [ -n "${PREPARE:-}" ]; then
    bash -c "$PREPARE" > /dev/null || return 1
  elif [ ! -f data/listops/basic_train.tsv ]; then
    python -m lra_sparse.generators.listops --output_dir=data/listops --num_train=96000 \
      --num_val=2000 --num_test=2000 --seed=0 > /dev/null || return 1
    md5sum data/listops/*.tsv
  fi
}
