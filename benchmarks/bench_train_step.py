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

``--ab_tiles=FIELD=VALUE,...`` also times every variant with the Mosaic GPU kernels on other
``Tiles`` (``kernels.dfss.mosaic.DEFAULT_TILES`` swapped while the step traces), in the same
process: e.g. ``min_head_dim=64``, the kernels before they ran head dims 16 and 32 (Pathfinder's
4 and Path-X's 8 padded to 64), the A/B of the small-head-dim tiles.
"""
from __future__ import annotations

import contextlib
import os

from absl import app, flags

from benchmarks import harness
from lra_sparse.kernels.dfss import mosaic as dfss_mgpu

harness.define_train_step_flags()
flags.DEFINE_string("ab_tiles", None, "Mosaic GPU Tiles fields 'name=value,...' (e.g. "
                    "min_head_dim=64): also time every variant on those tiles.")
flags.adopt_module_key_flags(harness)
FLAGS = flags.FLAGS


def timed_runs(variants, ab_tiles, ab_text: str = ""):
  """(row label, variant, context) per timed run: each variant as it is, then, with
  ``ab_tiles`` (a ``Tiles``), the same variant with the Mosaic kernels' default tiles swapped
  for them."""
  for variant in variants:
    yield variant, variant, contextlib.nullcontext()
    if ab_tiles is not None:
      yield (f"{variant} [tiles {ab_text}]", variant,
             harness.swapped(dfss_mgpu, DEFAULT_TILES=ab_tiles))


def main(argv):
  del argv
  ab_tiles = dfss_mgpu.parse_tiles(FLAGS.ab_tiles, "--ab_tiles") if FLAGS.ab_tiles else None
  rows = []
  for label, variant, context in timed_runs(FLAGS.variants, ab_tiles, FLAGS.ab_tiles):
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
