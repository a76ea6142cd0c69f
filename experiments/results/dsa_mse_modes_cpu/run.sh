#!/usr/bin/env bash
# The runs of this folder (README.md): from the repository root, OUT=DIR bash experiments/results/dsa_mse_modes_cpu/run.sh
set -u
T="--config=configs/listops.py:tiny"
for s in 0 1 2; do
  [ -f ${OUT:-/tmp/tm}/dense_s$s/result.json ] || python -m lra_sparse.main --workdir=${OUT:-/tmp/tm}/dense_s$s $T --config.attention.kind=dense --config.seed=$s > ${OUT:-/tmp/tm}/dense_s$s.log 2>&1
done
FT="--config.num_train_steps=300 --config.optim.learning_rate=0.00968 --config.optim.warmup_steps=30 --config.eval_every_steps=100 --config.checkpoint_every_steps=300"
DSA="--config.attention.kind=dsa --config.attention.dsa.sparsity=0.9 --config.attention.dsa.sigma=0.25 --config.attention.dsa.mse_normalization=eq6"
run() { name=$1; s=$2; shift 2; python -m lra_sparse.main --workdir=${OUT:-/tmp/tm}/${name}_s$s $T --config.seed=$s --config.init_from=${OUT:-/tmp/tm}/dense_s$s $FT "$@" > ${OUT:-/tmp/tm}/${name}_s$s.log 2>&1; }
for s in 0 1 2; do
  run dense-more $s --config.attention.kind=dense &
  run joint $s $DSA --config.attention.dsa.mse_weight=1e-6
  wait
  run joint-no-x $s $DSA --config.attention.dsa.mse_weight=1e-6 --config.attention.dsa.mse_input_gradient=False &
  run predictor $s $DSA --config.attention.dsa.mse_weight=1.0 --config.attention.dsa.mse_gradient=predictor --config.attention.dsa.mse_input_gradient=False
  wait
done

