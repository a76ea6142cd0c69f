"""DSA's L_MSE (value, and value + gradients) on the Gram kernels against XLA's Gram form, in
ONE process on one GPU; optionally an older copy of the kernels (A/B) and tile variants.

Per shape BATCHxLENGTH:HEADS:RANK (head_dim 64, Q and K in bf16, XP fp32, predictor width k =
RANK / 8), each method is timed as ``--steps`` dependent calls chained in one jit (lax.scan over
3 random input sets), median of ``--rounds`` after warm-up, methods interleaved round by round:

  xla        ``kernels.dsa.reference.prediction_mse`` on the factored predictors (XLA's Gram form)
  kernels    ``kernels.dsa.gram.prediction_mse`` of this checkout
  old        the same function of an older copy (``--old=DIR`` holding its ``kernels.dsa.gram.py``
  and
             ``kernels.dsa.gram_kernels.py``, e.g. from ``git show REV:...`` into the git-ignored
             .ab/)
  tiles:...  this checkout with one kernel's tiles replaced (``--tiles``)
  small ...  this checkout with the k x k products (in XLA, fp32 HIGHEST) at another precision
             (``--small_precisions``: bf16x3 = three bf16 passes on the tensor cores, tf32)

With ``--masked`` every example has key padding (real lengths uniform in [L/4, L], as ListOps
batches), which the kernels skip and XLA's form does not.  Also checks that each method's value
and gradients agree with the first kernel method (relative error of each).

  python -m benchmarks.bench_dsa_gram [--shapes=32x2000:8:128,16x2048:4:64] [--masked]
      [--old=.ab/gram_old] [--tiles=fwd=128:8:3:128,bwd_xp=128:8:2:128]
      [--small_precisions=bf16x3,tf32] [--out=FILE]
"""
from __future__ import annotations

import sys
from typing import Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.harness import load_module
from lra_sparse.kernels.dsa import gram as dsa_gram
from lra_sparse.kernels.dsa import reference as dsa_reference

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["32x2000:8:128", "16x2048:4:64"], "BxL:heads:rank entries.")
flags.DEFINE_bool("masked", False, "Key padding: real lengths uniform in [L/4, L].")
flags.DEFINE_string("old", "", "Directory with an older dsa_gram.py and dsa_gram_kernels.py.")
flags.DEFINE_list("tiles", [], "KERNEL=BL:WARPS:STAGES:RB variants of this checkout's tiles "
                  "(kernels: fwd, fwd_xp, bwd_qk, bwd_xp); '+' joins several in one variant.")
flags.DEFINE_list("small_precisions", [], "Variants of the k x k products' precision in "
                  "XLA (today HIGHEST): bf16x3, tf32, highest.")
harness.define_chain_flags(steps=10, rounds=5)
flags.adopt_module_key_flags(harness)
flags.DEFINE_string("out", "", "Also write the table here.")


def _old_module(directory: str):
  """The older wrapper, launching its own kernels (registered as dsa_gram_kernels_old)."""
  load_module(f"{directory}/dsa_gram_kernels.py", "lra_sparse.kernels.dsa_gram_kernels_old")
  mod = load_module(f"{directory}/dsa_gram.py", "lra_sparse.kernels.dsa_gram_old")
  mod._MODULE = "dsa_gram_kernels_old"  # pylint: disable=protected-access
  return mod


def _tile_variant(spec: str):
  """(label, tiles dict) from 'fwd=128:8:3:128+bwd_xp=...'."""
  tiles = dict(dsa_gram._TILES)  # pylint: disable=protected-access
  for part in spec.split("+"):
    kernel, values = part.split("=")
    if kernel not in tiles:
      raise ValueError(f"--tiles: unknown kernel {kernel!r}; known: {sorted(tiles)}")
    tiles[kernel] = tuple(int(v) for v in values.split(":"))
  return "tiles " + spec, tiles


# --small_precisions: the algorithm of the k x k products in XLA (dsa_gram._HI)
SMALL_PRECISIONS = {"highest": jax.lax.Precision.HIGHEST,
                    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
                    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32}


def _with_module_value(fn, name, value):
  """fn with dsa_gram's module value ``name`` (the tile table, the small products' precision)
  replaced while it runs (traces)."""
  def run(*args):
    # read while tracing; restored before the next method traces
    with harness.swapped(dsa_gram, **{name: value}):
      return fn(*args)
  return run


def _rel(x, y):
  x, y = (np.asarray(a, np.float64) for a in (x, y))
  return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def main(argv: Sequence[str]) -> None:
  del argv
  print(f"{harness.run_header()}\n{harness.gpu_state()}", flush=True)
  # (label, function, (dsa_gram module value to replace while tracing, its value) or None)
  impls = [("kernels", dsa_gram.prediction_mse, None)]
  if FLAGS.old:
    impls.append(("old", _old_module(FLAGS.old).prediction_mse, None))
  impls += [(label, dsa_gram.prediction_mse, ("_TILES", tiles))
            for label, tiles in map(_tile_variant, FLAGS.tiles)]
  for name in FLAGS.small_precisions:
    if name not in SMALL_PRECISIONS:
      raise ValueError(f"--small_precisions: unknown {name!r}; known: {sorted(SMALL_PRECISIONS)}")
    impls.append((f"kernels, small products {name}", dsa_gram.prediction_mse,
                  ("_HI", SMALL_PRECISIONS[name])))
  xla = lambda q, k, x, wq, wk, mask: dsa_reference.prediction_mse(  # noqa: E731
      q, k, dsa_reference.LowRank(x, wq), dsa_reference.LowRank(x, wk), mask)
  impls.append(("xla", xla, None))
  rows = []
  for entry in FLAGS.shapes:
    bl, h, rank = entry.split(":")
    b, l = harness.parse_shape(bl)
    h, rank, d, width = int(h), int(rank), 64, max(int(rank) // 8, 1)
    key = jax.random.PRNGKey(b * l + h)
    sets = []
    for i in range(3):
      ks = jax.random.split(jax.random.fold_in(key, i), 6)
      q, k = (jax.random.normal(kk, (b, l, h, d), jnp.bfloat16) for kk in ks[:2])
      xp = jax.random.normal(ks[2], (b, l, rank), jnp.float32)
      wq, wk = (jax.random.normal(kk, (h, rank, width), jnp.float32) / np.sqrt(rank)
                for kk in ks[3:5])
      mask = (harness.random_padding_mask(ks[5], b, l) if FLAGS.masked
              else jnp.ones((b, l), bool))
      sets.append((q, k, xp, wq, wk, mask))
    xs = harness.stack_sets(sets, FLAGS.steps)
    methods, checks = [], {}
    for label, fn, replaced in impls:
      value = lambda q, k, x, wq, wk, m, fn=fn: fn(q, k, x, wq, wk, m)  # noqa: E731
      grads = lambda q, k, x, wq, wk, m, fn=fn: jax.value_and_grad(  # noqa: E731
          lambda *a: fn(*a, m), argnums=range(5))(q, k, x, wq, wk)
      if replaced is not None:   # the backward is traced after fn returns: wrap it all
        value, grads = (_with_module_value(f, *replaced) for f in (value, grads))
      methods += [(f"{label} value", value), (f"{label} value+grads", grads)]
      try:
        checks[label] = jax.jit(grads)(*sets[0])
      except Exception:  # noqa: BLE001  reported by interleaved_chained_ms
        checks[label] = None
    ms = harness.interleaved_chained_ms(methods, xs, FLAGS.steps, FLAGS.rounds)
    ref_value, ref_grads = checks["kernels"]
    base = ms["xla value+grads"]
    for label, _, _ in impls:
      err = float("nan")
      if checks[label] is not None:
        value, grads = checks[label]
        err = max([_rel(value, ref_value)] + [_rel(g, r) for g, r in zip(grads, ref_grads)])
      rows.append([entry + (" masked" if FLAGS.masked else ""), label,
                   f"{ms[label + ' value']:.3f}", f"{ms[label + ' value+grads']:.3f}",
                   f"{base / ms[label + ' value+grads']:.2f}", f"{err:.1e}"])
      print(" | ".join(rows[-1]), flush=True)
  command = " ".join(["python -m benchmarks.bench_dsa_gram"] + sys.argv[1:])
  header = (f"# DSA L_MSE: Gram kernels vs XLA ({harness.device_kind()})\n\n"
            + harness.run_header(f"`{command}`", f"{FLAGS.steps} chained calls per jit, median "
                                 f"of {FLAGS.rounds}", "head_dim 64, bf16 Q/K, predictor width "
                                 "rank/8."))
  harness.emit_table(header, ["shape", "method", "value ms", "value+grads ms",
                              "speed vs XLA (value+grads)", "max rel. diff vs kernels"], rows,
                     FLAGS.out)


if __name__ == "__main__":
  app.run(main)
