"""Tiles of the Nystromformer F (.) kernel (kernels/landmark_attention_pallas.py) against cuDNN.

  python -m benchmarks.tune_landmark_attention [--shape=32x2000x8x64 --landmarks=64] [--out=FILE]

Times forward and forward+backward (grads of <out, cotangent> w.r.t. q, k, v) of cuDNN's flash
attention and of the kernel under every combination of ROWS x NUM_WARPS x BWD_BLOCKS, in one
process, bf16; median after warm-up (benchmarks.bench_dfss_kernels.time_fn). One table.
"""
from __future__ import annotations

import itertools

from absl import app, flags
import jax
import jax.numpy as jnp

from benchmarks.ab_dfss_kernels import emit_table
from benchmarks.bench_dfss_kernels import time_fn
from benchmarks.bench_nystrom import grad_of, random_sets
from lra_sparse.attention import dense
from lra_sparse.kernels import landmark_attention_pallas as kernel

flags.DEFINE_list("rows", ["64", "128"], "ROWS values.")
flags.DEFINE_list("warps", ["4", "8"], "NUM_WARPS values.")
flags.DEFINE_list("bwd_blocks", ["2", "4", "8"], "BWD_BLOCKS values.")
FLAGS = flags.FLAGS   # --shape, --landmarks: bench_nystrom's; --out: bench_train_step's


def main(argv):
  del argv
  b, l, h, d = map(int, FLAGS.shape.split("x"))
  m = FLAGS.landmarks
  sets = random_sets([((b, l, h, d), jnp.bfloat16), ((b, m, h, d), jnp.bfloat16),
                      ((b, m, h, d), jnp.bfloat16), ((b, l, h, d), jnp.float32)])
  rows = []

  def run(name, fn):
    try:
      fwd, _ = time_fn(jax.jit(fn), [s[:3] for s in sets])
      both, _ = time_fn(grad_of(fn), sets)
      rows.append((name, f"{fwd:.3f}", f"{both:.3f}"))
    except Exception as e:  # noqa: BLE001  one failing row must not hide the others
      rows.append((name, "failed", str(e).splitlines()[0][:80]))
    print(rows[-1], flush=True)

  run("cuDNN", lambda q, k, v: dense.cudnn_attention(q, k, v))
  saved = kernel.ROWS, kernel.NUM_WARPS, kernel.BWD_BLOCKS
  for r, w, g in itertools.product(*(map(int, x) for x in (FLAGS.rows, FLAGS.warps,
                                                           FLAGS.bwd_blocks))):
    kernel.ROWS, kernel.NUM_WARPS, kernel.BWD_BLOCKS = r, w, g   # read at trace time
    run(f"Pallas ROWS={r} warps={w} bwd_blocks={g}" + (" (default)" if (r, w, g) == saved
                                                        else ""),
        lambda q, k, v: kernel.few_keys_attention(q, k, v))
  kernel.ROWS, kernel.NUM_WARPS, kernel.BWD_BLOCKS = saved
  emit_table(f"F (.) at {FLAGS.shape}, {m} keys, bf16; device {jax.devices()[0].device_kind}; "
             f"jax {jax.__version__}", ["what", "fwd ms", "fwd+bwd ms"], rows, FLAGS.out)


if __name__ == "__main__":
  app.run(main)
