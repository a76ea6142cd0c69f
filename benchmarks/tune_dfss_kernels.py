"""Tile-config tuning of the fused DFSS Triton kernels, one kernel family at a time.

For each shape it times (median ms after warm-up, inputs rotated, same process):
  * XLA dense attention forward and forward+backward (the baseline the targets are set on),
  * the fused forward kernel alone under every ``--fwd`` config,
  * the backward alone (given the forward's O and log-sum-exp) under every ``--bwd`` config
    (``op`` suffix = one-pass kernel with atomic dQ; otherwise dK/dV kernel + dQ kernel with the
    default dQ config) and every ``--dq`` config (default dK/dV config),
and checks each variant's outputs against the pure-JAX reference (relative L2 error; NaN fails).
Prints one markdown table.  Config syntax: ``BM,BN,num_warps,num_stages[,op]`` separated by ';'.

From the repository root (timing: ``benchmarks.harness.time_fn``):

  python -m benchmarks.tune_dfss_kernels --dtype=fp32 --nm=1:2 --shapes=32x1024,8x4096 \\
      --fwd='64,64,4,2;128,64,8,2' --bwd='32,64,4,2;32,128,8,2,op' --dq='64,64,4,2;128,64,8,2'
"""

from __future__ import annotations

import sys
from typing import Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.harness import fwd_bwd, time_fn
from lra_sparse.ops.nm import parse_nm
from lra_sparse.kernels.dfss import reference as dfss_reference
from lra_sparse.kernels.dfss import tiles as dfss_tiles
from lra_sparse.kernels.dfss import triton as dfss_triton

FLAGS = flags.FLAGS

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def parse_cfgs(text):
  cfgs = []
  for item in filter(None, (t.strip() for t in text.split(";"))):
    parts = item.split(",")
    cfgs.append(dfss_tiles.Tiles(*map(int, parts[:4]), onepass=len(parts) > 4 and parts[4] == "op"))
  return cfgs


def rel_err(x, ref):
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  if not np.all(np.isfinite(x)):
    return float("inf")
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def cfg_name(cfg):
  s = f"{cfg.bm}x{cfg.bn} w{cfg.num_warps} s{cfg.num_stages}"
  return s + (" one-pass" if cfg.onepass else "")


def define_flags() -> None:
  """Defined only when run as a program, so importing this module adds no flags."""
  flags.DEFINE_enum("dtype", "fp32", sorted(DTYPES), "Input dtype.")
  flags.DEFINE_string("nm", "1:2", "N:M pattern, 'n:m' with 0 < n < m.")
  harness.define_shape_flags(shapes="32x1024,8x4096")
  flags.adopt_module_key_flags(harness)
  flags.DEFINE_string("fwd", "", "Forward configs, 'BM,BN,num_warps,num_stages;...'.")
  flags.DEFINE_string("bwd", "", "Backward (dK/dV or one-pass) configs, "
                      "'BM,BN,num_warps,num_stages[,op];...' (op = one-pass kernel).")
  flags.DEFINE_string("dq", "", "dQ kernel configs, 'BM,BN,num_warps,num_stages;...'.")
  flags.DEFINE_string("out", None, "Also write the table (markdown) here.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not dfss_triton.is_available():
    sys.exit("tune_dfss_kernels needs a GPU with triton and jax-triton "
             "(dfss_triton.is_available() is False here)")
  dtype = DTYPES[FLAGS.dtype]
  n, m = parse_nm(FLAGS.nm, what="--nm")
  h, d = FLAGS.heads, FLAGS.dim
  rows = []

  def emit(row):
    rows.append(row)
    print(" | ".join(row), flush=True)

  for b, l in harness.parse_shapes(FLAGS.shapes):
    shape = f"{b}x{l}"
    sets = harness.attention_sets(b, l, h, d, dtype)
    xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")  # noqa: E731
    t_xf, _ = time_fn(jax.jit(xla), [s[:3] for s in sets])
    t_xb, _ = time_fn(jax.jit(fwd_bwd(xla)), sets)
    emit([FLAGS.dtype, f"{n}:{m}", shape, "XLA dense", "", f"{t_xf:.3f}", f"{t_xb:.3f}", "", "",
          ""])
    q, k, v, do = sets[0]
    ref_o, vjp = jax.vjp(
        lambda a, bb, c: dfss_reference.dfss_attention_reference(a, bb, c, n=n, m=m), q, k, v)
    ref_g = vjp(do)

    for cfg in parse_cfgs(FLAGS.fwd):
      f = jax.jit(lambda q, k, v, cfg=cfg: dfss_triton._fused_fwd(q, k, v, None, n, m, tiles=cfg))
      try:
        t, _ = time_fn(f, [s[:3] for s in sets])
        err = rel_err(f(q, k, v)[0], ref_o)
        emit([FLAGS.dtype, f"{n}:{m}", shape, "fwd", cfg_name(cfg), f"{t:.3f}", "",
              f"{t_xf / t:.2f}x", "", f"{err:.1e}"])
      except Exception as e:  # noqa: BLE001  a config that fails to compile is reported, not fatal
        emit([FLAGS.dtype, f"{n}:{m}", shape, "fwd", cfg_name(cfg), "FAIL", "", "", "",
              type(e).__name__])

    fwd0 = jax.jit(lambda q, k, v: dfss_triton._fused_fwd(q, k, v, None, n, m))
    bsets = [s + tuple(fwd0(*s[:3])) for s in sets]  # (q, k, v, do, o, lse)
    variants = ([("bwd", c) for c in parse_cfgs(FLAGS.bwd)]
                + [("dq", c) for c in parse_cfgs(FLAGS.dq)])
    for kind, cfg in variants:
      det = kind == "dq"  # the dQ kernel runs only in the deterministic (two-kernel) backward
      varied = {"dq_tiles" if det else "tiles": cfg}
      g = jax.jit(lambda q, k, v, do, o, lse, det=det, varied=varied: dfss_triton._fused_bwd(
          q, k, v, None, o, lse, do, n, m, deterministic=det, **varied))
      try:
        t, _ = time_fn(g, bsets)
        err = max(rel_err(a, r) for a, r in zip(g(*bsets[0]), ref_g))
        emit([FLAGS.dtype, f"{n}:{m}", shape, f"bwd ({kind} varied)", cfg_name(cfg), "",
              f"{t:.3f}", "", "", f"{err:.1e}"])
      except Exception as e:  # noqa: BLE001
        emit([FLAGS.dtype, f"{n}:{m}", shape, f"bwd ({kind} varied)", cfg_name(cfg), "", "FAIL",
              "", "", f"{type(e).__name__}: {str(e)[-300:]}"])

  harness.emit_table(harness.run_header(f"heads {h}, head_dim {d}"),
                     ["dtype", "N:M", "BxL", "kernel", "config", "fwd ms",
                      "bwd ms (f+b for XLA)", "fwd vs XLA", "", "max rel err"], rows, FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
