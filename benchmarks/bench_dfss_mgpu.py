"""DFSS on Hopper: the Mosaic GPU kernels (``kernels.dfss.mosaic``) against cuDNN, XLA dense and the
Triton DFSS kernels, in ONE process on one GPU.

First a correctness pass (``--check``): outputs and q/k/v gradients of ``kernels.dfss.mosaic``
against the
float32 reference on the same bf16 inputs, with and without a key padding mask, at lengths that
need padding, for several N:M. Then the timing table: each timed call is one jit chaining
``--steps`` attention calls with lax.scan over stacked random inputs (no dispatch cost, every
output used); median of ``--rounds`` after warm-up; ratios are speed relative to cuDNN (cuDNN ms
/ method ms, so 0.8 means 80% of cuDNN's speed).

Usage, from the repository root (GPU):

  python -m benchmarks.bench_dfss_mgpu [--shapes=32x1024,16x2048,8x4096] [--heads=4] [--dim=64]
      [--nm=2:4] [--steps=20] [--rounds=7] [--check] [--out=FILE]
"""
from __future__ import annotations

import traceback
from typing import Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.harness import fwd_bwd
from lra_sparse.attention import dense
from lra_sparse.ops.nm import parse_nm
from lra_sparse.kernels.dfss import mosaic as dfss_mgpu
from lra_sparse.kernels.dfss import reference as dfss_reference
from lra_sparse.kernels.dfss import triton as dfss_triton

FLAGS = flags.FLAGS


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


def check(tiles_list) -> list[str]:
  """Lines 'ok'/'FAIL' per case: relative max error of O and dQ/dK/dV vs the reference."""
  lines = []
  cases = [(2, 256, 2, 64, 2, 4, False), (2, 300, 2, 64, 2, 4, True), (1, 384, 2, 128, 1, 2, True),
           (2, 200, 1, 64, 2, 8, True), (1, 256, 2, 64, 3, 4, False)]
  for b, l, h, d, n, m, masked in cases:
    key = jax.random.PRNGKey(l + n + m)
    q, k, v, ct = (jax.random.normal(kk, (b, l, h, d), jnp.bfloat16)
                   for kk in jax.random.split(key, 4))
    mask = None
    if masked:
      mask = harness.prefix_mask(jnp.array([l, l // 3] + [l - 7] * (b - 2))[:b], l)
    ref = lambda q, k, v: dfss_reference.dfss_attention_reference(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), n=n, m=m,
        mask=mask, precision=jax.lax.Precision.HIGHEST)
    o_ref = ref(q, k, v)
    g_ref = fwd_bwd(ref)(q, k, v, ct)
    for tiles in tiles_list:
      name = f"B={b} L={l} H={h} d={d} {n}:{m} mask={masked} tiles={tiles}"
      try:
        f = jax.jit(lambda q, k, v: dfss_mgpu.dfss_attention_mgpu(q, k, v, n=n, m=m, mask=mask,
                                                                   tiles=tiles))
        o = f(q, k, v)
        err_o = _rel(o, o_ref)
        g = jax.jit(fwd_bwd(f))(q, k, v, ct)
        errs = [_rel(x, y) for x, y in zip(g, g_ref)]
        finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (o, *g))
        ok = finite and err_o < 2e-2 and max(errs) < 3e-2
        lines.append(f"{'ok  ' if ok else 'FAIL'} {name}: rel err O {err_o:.2e}, dQ/dK/dV "
                     + " ".join(f"{e:.2e}" for e in errs) + ("" if finite else " NON-FINITE"))
      except Exception:  # pylint: disable=broad-except  # report and go on to the next case
        lines.append(f"ERROR {name}:\n" + traceback.format_exc()[-3000:])
      print(lines[-1], flush=True)
  return lines


def methods(n, m, tiles, length, mask=None):
  """name -> f(q, k, v). With ``mask`` (bool [batch, length], real keys a prefix of each row,
  as the loaders produce), every method takes it: cuDNN as sequence lengths, the others as a
  key mask."""
  meths = {
      "XLA dense": lambda q, k, v: dense.dense_attention(q, k, v, mask, implementation="xla"),
      "cuDNN dense": lambda q, k, v: dense.dense_attention(q, k, v, mask,
                                                           implementation="cudnn"),
      "DFSS Triton": lambda q, k, v: dfss_triton.dfss_attention_triton(q, k, v, n=n, m=m,
                                                                       mask=mask),
  }
  for label, t in tiles.items():
    meths[f"DFSS Mosaic {label}"] = (
        lambda q, k, v, t=t: dfss_mgpu.dfss_attention_mgpu(q, k, v, n=n, m=m, mask=mask,
                                                           tiles=t))
  first = next(iter(tiles.values()))
  if mask is None and dfss_mgpu._padded_length(length, first) == length:
    # The forward kernel alone, on inputs taken as already permuted (and needing no padding):
    # what the key permutation (two XLA transposes per call) costs is the difference to the
    # row above.
    meths[KERNEL_ONLY] = lambda q, k, v: dfss_mgpu._forward(  # pylint: disable=protected-access
        q, k, v, None, None, None, n=n, m=m, scale=q.shape[-1] ** -0.5, tiles=first)[0]
  return meths


KERNEL_ONLY = "DFSS Mosaic fwd kernel alone"


def define_flags() -> None:
  harness.define_shape_flags()
  harness.define_chain_flags()
  flags.adopt_module_key_flags(harness)
  flags.DEFINE_string("nm", "2:4", "N:M.")
  flags.DEFINE_bool("check", True, "Run the correctness pass first.")
  flags.DEFINE_list("variants", ["default"], "Tile variants to time (default, nosched, "
                    "stages3, bkv64, pairs); the check runs the first two.")
  flags.DEFINE_bool("masked", False, "Give every method a key padding mask (real lengths "
                    "uniform in [L/4, L], one row full) and a cotangent that is 0 on padded "
                    "rows, as a padded LRA batch and a masked model give.")
  flags.DEFINE_string("out", "", "Also write the table here.")


VARIANTS = {
    "default": dfss_mgpu.DEFAULT_TILES,
    "nosched": dfss_mgpu.Tiles(schedule_barrier=False),
    "stages3": dfss_mgpu.Tiles(stages=3, bwd_stages=3),
    "bkv64": dfss_mgpu.Tiles(block_kv=64),
    "pairs": dfss_mgpu.Tiles(selection="pairs"),
}


def main(argv: Sequence[str]) -> None:
  del argv
  n, m = parse_nm(FLAGS.nm)
  tiles = {name: VARIANTS[name] for name in FLAGS.variants}
  header = (f"DFSS Mosaic GPU vs cuDNN / XLA / Triton; {harness.run_header()}; bf16, "
            f"{FLAGS.heads} heads, d={FLAGS.dim}, DFSS {n}:{m}"
            f"{', key padding mask' if FLAGS.masked else ''}; median of {FLAGS.rounds} rounds "
            f"of {FLAGS.steps} chained calls; 'x cuDNN' = cuDNN ms / method ms (speed relative "
            "to cuDNN)")
  check_lines = check(list(tiles.values())[:2]) if FLAGS.check else []
  rows = []
  for b, l in harness.parse_shapes(FLAGS.shapes):
    shape = f"{b}x{l}"
    xs = harness.stack_sets(harness.attention_sets(b, l, FLAGS.heads, FLAGS.dim, jnp.bfloat16),
                            FLAGS.steps)
    mask = None
    if FLAGS.masked:
      mask = harness.random_padding_mask(jax.random.PRNGKey(l), b, l, full_first=True)
      # as in a masked model, padded rows reach no loss: their cotangent is 0
      xs = xs[:3] + (jnp.where(mask[None, :, :, None, None], xs[3], 0),)
    times = {}
    meths = methods(n, m, tiles, l, mask)
    for name, f in meths.items():
      for mode, fn in harness.passes(f).items():
        if name == KERNEL_ONLY and mode != "fwd":
          continue
        try:
          times[(name, mode)] = harness.chained_ms(fn, xs, FLAGS.steps, FLAGS.rounds)
        except Exception as error:  # pylint: disable=broad-except
          print(f"{name} {mode} {shape}: {type(error).__name__}: {str(error)[-1500:]}",
                flush=True)
          times[(name, mode)] = float("nan")
        print(f"{shape} {mode:8s} {name:28s} {times[(name, mode)]:.3f} ms", flush=True)
    for name in meths:
      for mode in ("fwd", "fwd+bwd"):
        if name == KERNEL_ONLY and mode != "fwd":
          continue                      # a forward-only row: nothing to time backward
        t = times[(name, mode)]
        rows.append([shape, mode, name, f"{t:.3f}",
                     f"{times[('cuDNN dense', mode)] / t:.2f}",
                     f"{times[('XLA dense', mode)] / t:.2f}"])
  harness.emit_table(
      header + ("\n\ncorrectness:\n" + "\n".join(check_lines) if check_lines else ""),
      ["BxL", "pass", "method", "ms", "x cuDNN", "x XLA"], rows, FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
