"""Dense and DFSS attention with and without attention dropout, through the public functions
the model calls, against cuDNN dense, on one GPU.

One process, one table: per shape, forward and forward+backward (jax.grad of <out, cotangent>
w.r.t. q, k, v) of
  * cuDNN dense without dropout (``dense_attention(implementation="cudnn")``: JAX's cuDNN
    entry has no dropout),
  * XLA dense with dropout (``implementation="xla"``: what dense trained on before the Mosaic
    kernels),
  * Mosaic dense without and with dropout (``implementation="mosaic"``: the DFSS Mosaic GPU
    kernels with nothing pruned),
  * DFSS N:M through ``dfss_attention(backend="mosaic")`` without and with dropout,
and the ratios the kernels are held to: cuDNN time / Mosaic dense with dropout time,
cuDNN / DFSS (forward and forward+backward), DFSS with / without dropout, Mosaic dense with /
without dropout. Each timed call is one jit chaining ``--steps`` calls with lax.scan over 3
stacked random input sets (every output feeds the carry: a data dependency between calls, no
dispatch cost); median of ``--rounds`` after warm-up.

Usage, from the repository root (Hopper GPU, bf16 or fp16):

  python -m benchmarks.bench_attention_dropout [--rate=0.1] [--nm=2:4] [--dtype=bf16]
      [--shapes=32x1024,16x2048,8x4096] [--heads=4] [--dim=64] [--steps=20] [--rounds=7]
      [--ab_mosaic=OLD_COPY_OF_MOSAIC_PY] [--ab_tiles=selection=pairs] [--free_random]
      [--out=FILE]

``--ab_tiles`` adds Mosaic dense and DFSS rows without and with dropout on the same kernels
with other ``Tiles`` fields (e.g. ``selection=pairs``, ``block_kv=64``, ``min_head_dim=64``:
small head dims padded to 64 as before the kernels ran 16 and 32), called as the public path
calls them, in the same process.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Sequence

from absl import app, flags
import jax
import jax.numpy as jnp

from benchmarks import harness
from lra_sparse.attention.dense import dense_attention
from lra_sparse.attention.dfss import dfss_attention
from lra_sparse.kernels.dfss import mosaic as dfss_mgpu
from lra_sparse.ops import dropout
from lra_sparse.ops.nm import parse_nm

FLAGS = flags.FLAGS
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def methods(n: int, m: int, rate: float, ab_module=None, ab_tiles=None) -> dict:
  """name -> attention(q, k, v) through the public functions; dropout from a fixed rng. With
  ``ab_module`` (another copy of ``kernels.dfss.mosaic``) also its dense and DFSS kernels with
  dropout (called directly, the A/B rows); with ``ab_tiles`` (a ``Tiles``) dense and DFSS
  without and with dropout on those tiles."""
  rng = jax.random.PRNGKey(0)
  drop = dict(dropout_rate=rate, dropout_rng=rng)
  out = {
      "cuDNN": lambda q, k, v: dense_attention(q, k, v, implementation="cudnn"),
      "XLA+drop": lambda q, k, v: dense_attention(q, k, v, implementation="xla", **drop),
      "Mosaic dense": lambda q, k, v: dense_attention(q, k, v, implementation="mosaic"),
      "Mosaic dense+drop": lambda q, k, v: dense_attention(q, k, v, implementation="mosaic",
                                                           **drop),
      "DFSS": lambda q, k, v: dfss_attention(q, k, v, n=n, m=m, backend="mosaic"),
      "DFSS+drop": lambda q, k, v: dfss_attention(q, k, v, n=n, m=m, backend="mosaic", **drop),
  }
  if ab_module is not None:
    seed = dropout.seed_words(rng)
    out["A/B dense+drop"] = lambda q, k, v: ab_module.dense_attention_mgpu(
        q, k, v, dropout_rate=rate, dropout_seed=seed)
    out["A/B DFSS+drop"] = lambda q, k, v: ab_module.dfss_attention_mgpu(
        q, k, v, n=n, m=m, dropout_rate=rate, dropout_seed=seed)
  if ab_tiles is not None:
    seed = dropout.seed_words(rng)
    out["A/B tiles dense"] = lambda q, k, v: dfss_mgpu.dense_attention_mgpu(
        q, k, v, tiles=ab_tiles)
    out["A/B tiles dense+drop"] = lambda q, k, v: dfss_mgpu.dense_attention_mgpu(
        q, k, v, tiles=ab_tiles, dropout_rate=rate, dropout_seed=seed)
    out["A/B tiles DFSS"] = lambda q, k, v: dfss_mgpu.dfss_attention_mgpu(
        q, k, v, n=n, m=m, tiles=ab_tiles)
    out["A/B tiles DFSS+drop"] = lambda q, k, v: dfss_mgpu.dfss_attention_mgpu(
        q, k, v, n=n, m=m, tiles=ab_tiles, dropout_rate=rate, dropout_seed=seed)
  return out


# Rows timed with Philox's rounds removed (``ops.dropout.ROUNDS`` = 0 while tracing): the
# same kernels with random numbers for free, so the difference is what generating them costs.
FREE_RANDOM = ("Mosaic dense+drop", "DFSS+drop")


def define_flags() -> None:
  flags.DEFINE_float("rate", 0.1, "Attention dropout rate.")
  flags.DEFINE_string("nm", "2:4", "DFSS N:M.")
  flags.DEFINE_enum("dtype", "bf16", sorted(DTYPES), "Operand dtype.")
  harness.define_shape_flags()
  harness.define_chain_flags()
  flags.adopt_module_key_flags(harness)
  flags.DEFINE_string("out", None, "Also write the table (markdown) here.")
  flags.DEFINE_string("ab_mosaic", None, "Another copy of lra_sparse/kernels/dfss/mosaic.py "
                      "(e.g. from git show): also time its dense and DFSS kernels with dropout.")
  flags.DEFINE_string("ab_tiles", None, "Tiles fields 'name=value,...' (e.g. selection=pairs): "
                      "also time DFSS without and with dropout on those tiles.")
  flags.DEFINE_bool("free_random", False, "Also time the dropout rows without Philox's "
                    "rounds (what generating the random numbers costs).")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not dfss_mgpu.is_available():
    sys.exit("bench_attention_dropout needs a Hopper GPU (Pallas Mosaic GPU)")
  n, m = parse_nm(FLAGS.nm, what="--nm")
  dtype = DTYPES[FLAGS.dtype]
  header = (harness.run_header(f"{FLAGS.dtype}, heads {FLAGS.heads}, head_dim {FLAGS.dim}",
                               f"DFSS {n}:{m}", f"attention dropout {FLAGS.rate}",
                               f"{FLAGS.steps} calls per jit (lax.scan), median of "
                               f"{FLAGS.rounds}") + "\n" + harness.gpu_state())
  print(header, flush=True)
  ab_module = (harness.load_module(FLAGS.ab_mosaic, "ab_mosaic") if FLAGS.ab_mosaic
               else None)
  ab_tiles = dfss_mgpu.parse_tiles(FLAGS.ab_tiles, "--ab_tiles") if FLAGS.ab_tiles else None
  if ab_tiles is not None:
    header += f"\nA/B tiles: {ab_tiles}"
  fns = methods(n, m, FLAGS.rate, ab_module, ab_tiles)
  timed = [(name, fn, False) for name, fn in fns.items()]
  if FLAGS.free_random:
    timed += [(name + ", free random", fns[name], True) for name in FREE_RANDOM]
  names = [name for name, _, _ in timed]
  rows = []
  for b, l in harness.parse_shapes(FLAGS.shapes):
    xs = harness.stack_sets(harness.attention_sets(b, l, FLAGS.heads, FLAGS.dim, dtype),
                            FLAGS.steps)
    for kind in ("fwd", "fwd+bwd"):
      times = {}
      for name, attn, free in timed:
        try:
          with (harness.swapped(dropout, ROUNDS=0) if free else contextlib.nullcontext()):
            times[name] = harness.chained_ms(harness.passes(attn)[kind], xs, FLAGS.steps,
                                             FLAGS.rounds)
        except Exception as e:  # pylint: disable=broad-except  (one failure hides no other)
          print(f"{b}x{l} {kind} {name}: failed: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:120]}", flush=True)
          times[name] = float("nan")
      t = times
      row = [f"{b}x{l}", kind] + [f"{t[name]:.3f}" for name in names] + [
          f"{t['cuDNN'] / t['Mosaic dense+drop']:.2f}", f"{t['cuDNN'] / t['DFSS']:.2f}",
          f"{t['cuDNN'] / t['DFSS+drop']:.2f}", f"{t['DFSS+drop'] / t['DFSS']:.2f}",
          f"{t['Mosaic dense+drop'] / t['Mosaic dense']:.2f}",
          f"{t['XLA+drop'] / t['Mosaic dense+drop']:.2f}"]
      rows.append(row)
      print(" | ".join(row), flush=True)
  cols = (["BxL", "pass"] + [f"{name} ms" for name in names]
          + ["cuDNN / dense+drop", "cuDNN / DFSS", "cuDNN / DFSS+drop", "DFSS drop/no",
             "dense drop/no", "XLA+drop / dense+drop"])
  harness.emit_table(header, cols, rows, FLAGS.out,
                     note="ratios 'a / b' are speed-ups of b over a (time of a over time of b)")


if __name__ == "__main__":
  define_flags()
  app.run(main)
