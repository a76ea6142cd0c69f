"""Times one LRA-default training step per attention setting; prints a table.

  python -m benchmarks.bench_train_step [--variants=fp32:xla,bf16:xla,bf16:cudnn] \
      [--batch=32 --length=2000] [--out=FILE]
  python -m benchmarks.bench_train_step --variants=bf16:kind=dfss+nm=2:4,bf16:kind=dsa+sparsity=0.9
  python -m benchmarks.bench_train_step --config=configs/pathfinder.py \
      --variants=bf16:cudnn,bf16:kind=dfss   # Pathfinder-32: batch 512, 1024 pixels, head dim 4

Random tokens (no data needed; --min_real_length pads them as a loader does), the full trainer
step (forward, backward, AdamW update), median wall time of --reps steps after --warmup steps,
all variants in one process. Attention dropout is 0 unless --attention_dropout says otherwise
(or a variant ends in /drop=RATE, e.g. bf16:auto/drop=0.1 beside bf16:cudnn/drop=0)
(the task configs' default is LRA's 0.1, which no cuDNN variant can train with).
The flags and the step builders are ``benchmarks.harness``'s (bench_nystrom,
bench_data_parallel and profile_train_step build the same steps).

``--mosaic_head_dims=64,128`` also times every variant with the Mosaic GPU kernels limited to
those head dims (``kernels.dfss.mosaic.SUPPORTED_HEAD_DIMS`` swapped while the step traces):
64,128 is the kernels before they ran 16 and 32, so Pathfinder's head dim 4 and Path-X's 8 run
padded to 64 there, the A/B of the small-head-dim tiles in one process.
"""
from __future__ import annotations

import contextlib
import os

from absl import app, flags

from benchmarks import harness
from lra_sparse.kernels.dfss import mosaic as dfss_mgpu

harness.define_train_step_flags()
flags.DEFINE_list("mosaic_head_dims", [], "Also time every variant with the Mosaic GPU "
                  "kernels running only these head dims (e.g. 64,128: small ones padded to 64).")
flags.adopt_module_key_flags(harness)
FLAGS = flags.FLAGS


def ab_head_dims(values) -> tuple[int, ...]:
  """The head dims of --mosaic_head_dims (ascending, a subset of the kernels' own, ending at
  their widest); one ValueError otherwise."""
  try:
    dims = tuple(int(v) for v in values)
  except ValueError:
    dims = ()
  widest = dfss_mgpu.SUPPORTED_HEAD_DIMS[-1]
  if (not dims or list(dims) != sorted(set(dims)) or dims[-1] != widest
      or not set(dims) <= set(dfss_mgpu.SUPPORTED_HEAD_DIMS)):
    raise ValueError(f"--mosaic_head_dims must be ascending head dims among "
                     f"{dfss_mgpu.SUPPORTED_HEAD_DIMS} ending at {widest}, got {list(values)}")
  return dims


def timed_runs(variants, head_dims):
  """(row label, context) per timed run: each variant as it is, then, with ``head_dims``, the
  same variant with the Mosaic kernels limited to them."""
  for variant in variants:
    yield variant, contextlib.nullcontext()
    if head_dims:
      yield (f"{variant} [mosaic head dims {','.join(map(str, head_dims))}]",
             harness.swapped(dfss_mgpu, SUPPORTED_HEAD_DIMS=head_dims))


def main(argv):
  del argv
  head_dims = ab_head_dims(FLAGS.mosaic_head_dims) if FLAGS.mosaic_head_dims else ()
  rows = []
  for label, context in timed_runs(FLAGS.variants, head_dims):
    variant = label.split(" [")[0]
    try:
      with context:
        seconds, loss = harness.time_variant(
            variant, config_path=FLAGS.config, batch=FLAGS.batch, length=FLAGS.length,
            warmup=FLAGS.warmup, reps=FLAGS.reps, overrides=harness.step_overrides(),
            min_real_length=FLAGS.min_real_length)
      rows.append((label, f"{seconds * 1e3:.1f}", f"{1 / seconds:.2f}", f"{loss:.3f}"))
    except Exception as e:  # one failing variant must not hide the others
      rows.append((label, "failed", type(e).__name__, str(e).splitlines()[0][:80]))
    print(rows[-1], flush=True)
  config = harness.make_config("bf16:xla", config_path=FLAGS.config, batch=FLAGS.batch,
                               length=FLAGS.length, overrides=harness.step_overrides())
  model = config.model
  header = (f"{config.task} train step ({os.path.relpath(FLAGS.config)}): batch "
            f"{config.batch_size}, length {config.data.max_length}, {model.num_layers} layers, "
            f"{model.emb_dim} wide, {model.num_heads} heads of "
            f"{model.qkv_dim // model.num_heads}; {harness.run_header()}; attention dropout "
            f"{model.attention_dropout_rate:g}; a variant's /drop=RATE sets its own; median of {FLAGS.reps} after {FLAGS.warmup} "
            "warm-up"
            + (f"; real lengths uniform in [{FLAGS.min_real_length}, "
               f"{config.data.max_length}], then padding" if FLAGS.min_real_length else ""))
  harness.emit_table(header, ["variant", "ms/step", "steps/s", "loss"], rows, FLAGS.out)


if __name__ == "__main__":
  app.run(main)
