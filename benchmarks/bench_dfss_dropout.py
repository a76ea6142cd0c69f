"""Cost of attention dropout inside the fused DFSS kernels, against dense attention, on one GPU.

One process, one table: per shape, forward and forward+backward (jax.grad of <out, cotangent>
w.r.t. q, k, v) of
  * cuDNN dense (bf16; the dense model people run; jax.nn.dot_product_attention has no dropout)
  * XLA dense, and XLA dense with attention dropout (what ``dense`` trains with where the
    Mosaic GPU kernels do not run: ``bench_attention_dropout`` times those)
  * DFSS Triton fused, without and with attention dropout (``ops.dropout``'s counter-based
    mask drawn inside the kernels),
  * DFSS Mosaic GPU (Hopper, bf16/fp16), without and with attention dropout (the same mask;
    also with Philox's high halves from 16-bit limbs, ``Tiles(wide_products=False)``, the A/B
    of the default 64-bit products, whose outputs and gradients must be the same bits: the last
    column says whether they were, on the first input set),
and the ratios with/without dropout.  Each timed call is one jit chaining ``--steps`` calls with
lax.scan over 3 stacked random input sets (no dispatch cost; every step's output is used);
median of ``--rounds`` after warm-up.

Usage, from the repository root:

  python -m benchmarks.bench_dfss_dropout [--rate=0.1] [--dtypes=bf16,fp32]
      [--shapes=32x1024,16x2048,8x4096] [--heads=4] [--dim=64] [--steps=20] [--rounds=7]
      [--out=FILE]
"""

from __future__ import annotations

import sys
from typing import Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from lra_sparse.attention.dense import dense_attention_reference
from lra_sparse.ops import dropout as dfss_dropout
from lra_sparse.kernels.dfss import mosaic as dfss_mgpu
from lra_sparse.kernels.dfss import triton as dfss_triton

FLAGS = flags.FLAGS
DTYPES = harness.NM_DTYPES


def methods(dtype, n, m, rate, dense=True):
  """name -> attention(q, k, v); the dropout ones draw from a fixed seed (same work)."""
  rng = jax.random.PRNGKey(0)
  seed = dfss_dropout.seed_words(rng)
  out = {}
  if dense:
    if dtype != jnp.float32:
      out["cuDNN dense"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                        implementation="cudnn")
    out["XLA dense"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")
    out[f"XLA dense, dropout {rate}"] = lambda q, k, v: dense_attention_reference(
        q, k, v, dropout_rate=rate, dropout_rng=rng)
  out["DFSS Triton"] = lambda q, k, v: dfss_triton.dfss_attention_triton(q, k, v, n=n, m=m)
  out[f"DFSS Triton, dropout {rate}"] = lambda q, k, v: dfss_triton.dfss_attention_triton(
      q, k, v, n=n, m=m, dropout_rate=rate, dropout_seed=seed)
  if dtype != jnp.float32 and dfss_mgpu.is_available():
    out["DFSS Mosaic"] = lambda q, k, v: dfss_mgpu.dfss_attention_mgpu(q, k, v, n=n, m=m)
    out[f"DFSS Mosaic, dropout {rate}"] = lambda q, k, v: dfss_mgpu.dfss_attention_mgpu(
        q, k, v, n=n, m=m, dropout_rate=rate, dropout_seed=seed)
    # A/B: Philox's high halves from 16-bit limbs instead of one 64-bit product each
    limbs = dfss_mgpu.Tiles(wide_products=False)
    out[f"DFSS Mosaic, dropout {rate}, limbs"] = lambda q, k, v: dfss_mgpu.dfss_attention_mgpu(
        q, k, v, n=n, m=m, dropout_rate=rate, dropout_seed=seed, tiles=limbs)
  return out


def define_flags() -> None:
  flags.DEFINE_float("rate", 0.1, "Attention dropout rate.")
  flags.DEFINE_string("dtypes", "bf16", f"Subset of {sorted(DTYPES)} (bf16 2:4, fp32 1:2).")
  harness.define_shape_flags()
  harness.define_chain_flags()
  flags.adopt_module_key_flags(harness)
  flags.DEFINE_bool("dense", True, "Also time the dense rows (cuDNN, XLA with/without dropout).")
  flags.DEFINE_string("out", None, "Also write the table (markdown) here.")


def same_bits(fn_a, fn_b, inputs) -> str:
  """'yes' when fn_a and fn_b give bit-identical outputs on ``inputs``, 'NO' when not, '-'
  when either failed (its time is then nan too)."""
  try:
    a, b = (jax.tree.leaves(jax.jit(fn)(*inputs)) for fn in (fn_a, fn_b))
  except Exception:  # pylint: disable=broad-except
    return "-"
  return "yes" if all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b)) \
      else "NO"


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not dfss_triton.is_available():
    sys.exit("bench_dfss_dropout needs a GPU with triton and jax-triton")
  header = (harness.run_header(f"heads {FLAGS.heads}, head_dim {FLAGS.dim}",
                               f"attention dropout {FLAGS.rate}",
                               f"{FLAGS.steps} calls per jit (lax.scan), median of "
                               f"{FLAGS.rounds}") + "\n" + harness.gpu_state())
  print(header, flush=True)
  rows = []
  h, d = FLAGS.heads, FLAGS.dim
  for dname in FLAGS.dtypes.split(","):
    dtype, n, m = DTYPES[dname]
    for b, l in harness.parse_shapes(FLAGS.shapes):
      shape = f"{b}x{l}"
      sets = harness.attention_sets(b, l, h, d, dtype)
      xs = harness.stack_sets(sets, FLAGS.steps)
      for kind in ("fwd", "fwd+bwd"):
        times = {}
        fns = methods(dtype, n, m, FLAGS.rate, FLAGS.dense)
        wide_name = f"DFSS Mosaic, dropout {FLAGS.rate}"
        wide_same = (same_bits(harness.passes(fns[wide_name])[kind],
                               harness.passes(fns[wide_name + ", limbs"])[kind], sets[0])
                     if wide_name in fns else "-")
        for name, attn in fns.items():
          try:
            times[name] = harness.chained_ms(harness.passes(attn)[kind], xs, FLAGS.steps,
                                             FLAGS.rounds)
          except Exception as e:  # pylint: disable=broad-except  (e.g. out of memory)
            print(f"{dname} {shape} {kind} {name}: failed: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:100]}", flush=True)
            times[name] = float("nan")
        nan = float("nan")
        dfss, drop = times["DFSS Triton"], times[f"DFSS Triton, dropout {FLAGS.rate}"]
        xla = times.get("XLA dense", nan)
        xla_drop = times.get(f"XLA dense, dropout {FLAGS.rate}", nan)
        mosaic = times.get("DFSS Mosaic", nan)
        mosaic_drop = times.get(f"DFSS Mosaic, dropout {FLAGS.rate}", nan)
        limbs = times.get(f"DFSS Mosaic, dropout {FLAGS.rate}, limbs", nan)
        cudnn = times.get("cuDNN dense", nan)
        row = [dname, f"{n}:{m}", shape, kind, f"{cudnn:.3f}",
               f"{xla:.3f}", f"{xla_drop:.3f}", f"{dfss:.3f}", f"{drop:.3f}",
               f"{drop / dfss:.3f}", f"{xla_drop / xla:.3f}", f"{mosaic:.3f}",
               f"{mosaic_drop:.3f}", f"{mosaic_drop / mosaic:.3f}",
               f"{cudnn / mosaic_drop:.3f}", f"{limbs:.3f}", f"{limbs / mosaic:.3f}",
               wide_same]
        rows.append(row)
        print(" | ".join(row), flush=True)
  harness.emit_table(header, ["dtype", "N:M", "BxL", "pass", "cuDNN ms", "XLA ms",
                              "XLA+drop ms", "DFSS ms", "DFSS+drop ms", "DFSS drop/no",
                              "XLA drop/no", "Mosaic ms", "Mosaic+drop ms", "Mosaic drop/no",
                              "Mosaic+drop x cuDNN", "Mosaic+drop limbs ms",
                              "Mosaic limbs drop/no", "wide = limbs bits"], rows, FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
