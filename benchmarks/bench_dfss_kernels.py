"""Benchmark DFSS attention kernels against dense attention on one GPU; prints ONE markdown table.

Rows: XLA dense (jax.nn.dot_product_attention implementation="xla"), cuDNN dense
(implementation="cudnn", bf16 only), DFSS pure-JAX reference, DFSS Triton fused (flash-style,
the default; one-pass backward with dQ by atomics), the same with deterministic=True (separate
dK/dV and dQ backward kernels) and DFSS Triton compressed (SDDMM+prune / softmax / SpMM).
Forward and forward+backward (jax.grad of <out, cotangent> w.r.t. q, k, v), median of many
timed runs after warm-up (each sample = a burst of back-to-back calls / burst size, inputs
rotated among 3 random sets, block_until_ready at the end of the burst).

Memory: "A bytes" is what the method holds for the attention matrix between forward and
backward (dense: L^2 probabilities in the input dtype, plus the fp32 logits XLA materialises;
compressed: L^2*N/M values + 1 bit per key of metadata; fused: one fp32 log-sum-exp per row),
reported with its ratio to dense; "temp MiB" is XLA's compiled temp-buffer size of the
fwd+bwd program (memory_analysis), which bounds the peak of the whole step.

Usage, from the repository root:

  python -m benchmarks.bench_dfss_kernels [--out=FILE] [--dtypes=bf16,fp32]
      [--shapes=32x1024,16x2048,8x4096] [--heads=4] [--dim=64] [--skip_reference] [--log=FILE]
"""

from __future__ import annotations

from typing import Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.harness import fwd_bwd, time_fn
from lra_sparse.kernels.dfss import reference as dfss_reference
from lra_sparse.kernels.dfss import triton as dfss_triton

FLAGS = flags.FLAGS

DTYPES = harness.NM_DTYPES
COLS = ["dtype", "N:M", "B", "L", "method", "fwd ms", "fwd vs XLA", "fwd vs cuDNN",
        "fwd+bwd ms", "f+b vs XLA", "f+b vs cuDNN", "A MiB (vs dense)", "temp MiB f+b"]
RATIOS = "Ratios are speed-ups (baseline time / method time); >1 means faster."


def make_methods(dtype, n, m, with_triton):
  meths = {}
  meths["XLA dense"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")
  if dtype != jnp.float32:
    meths["cuDNN dense"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="cudnn")
  meths["DFSS pure-JAX"] = lambda q, k, v: dfss_reference.dfss_attention_reference(
      q, k, v, n=n, m=m)
  if with_triton:
    meths["DFSS Triton fused"] = lambda q, k, v: dfss_triton.dfss_attention_triton(
        q, k, v, n=n, m=m)
    meths["DFSS Triton fused, deterministic bwd"] = (
        lambda q, k, v: dfss_triton.dfss_attention_triton(q, k, v, n=n, m=m, deterministic=True))
    meths["DFSS Triton compressed"] = lambda q, k, v: dfss_triton.dfss_attention_triton(
        q, k, v, n=n, m=m, impl="compressed")
  return meths


def a_bytes(name, b, h, l, dtype, n, m):
  isz = jnp.dtype(dtype).itemsize
  bh = b * h
  dense = bh * l * l * isz
  if name.endswith("dense") or name == "DFSS pure-JAX":
    return dense, dense
  if name == "DFSS Triton compressed":
    return bh * l * l * n // m * isz + bh * l * l // 8, dense
  return bh * l * 4, dense  # fused: log-sum-exp per row


def define_flags() -> None:
  """Defined only when run as a program, so importing this module adds no flags."""
  flags.DEFINE_string("out", None, "Also write the table (markdown) here.")
  flags.DEFINE_string("dtypes", "bf16,fp32", f"Comma-separated subset of {sorted(DTYPES)} "
                      "(bf16 runs 2:4, fp32 runs 1:2).")
  harness.define_shape_flags()
  flags.adopt_module_key_flags(harness)
  flags.DEFINE_bool("skip_reference", False, "Skip the DFSS pure-JAX reference rows.")
  flags.DEFINE_string("log", None, "Also append the progress lines to this file.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")

  logf = open(FLAGS.log, "a") if FLAGS.log else None

  def log(msg):
    print(msg, flush=True)
    if logf:
      logf.write(msg + "\n")
      logf.flush()

  with_triton = dfss_triton.is_available()
  try:
    import triton  # pylint: disable=import-outside-toplevel
    tver = triton.__version__
  except Exception:  # noqa: BLE001
    tver = "n/a"
  try:
    import jax_triton  # pylint: disable=import-outside-toplevel
    jtver = getattr(jax_triton, "__version__", "?")
  except Exception:  # noqa: BLE001
    jtver = "n/a"
  header = harness.run_header(f"triton {tver}", f"jax-triton {jtver}",
                              f"heads {FLAGS.heads}, head_dim {FLAGS.dim}",
                              "times = median ms after warm-up")
  log(header)
  log("start: " + harness.gpu_state())
  shapes = harness.parse_shapes(FLAGS.shapes)
  rows = []
  h, d = FLAGS.heads, FLAGS.dim
  for dname in FLAGS.dtypes.split(","):
    dtype, n, m = DTYPES[dname]
    for b, l in shapes:
      sets = harness.attention_sets(b, l, h, d, dtype, seed=l + b)
      fsets = [s[:3] for s in sets]
      res = {}
      for name, f in make_methods(dtype, n, m, with_triton).items():
        if name == "DFSS pure-JAX" and FLAGS.skip_reference:
          continue
        r = {}
        try:
          r["fwd"], _ = time_fn(jax.jit(f), fsets)
        except Exception as e:
          log(f"{dname} {b}x{l} {name} fwd failed: {type(e).__name__}: {str(e)[-800:]}")
          r["fwd"] = float("nan")
        try:
          g = jax.jit(fwd_bwd(f))
          r["fb"], _ = time_fn(g, sets)
          r["temp"] = harness.temp_mib(fwd_bwd(f), *sets[0])
        except Exception as e:
          log(f"{dname} {b}x{l} {name} fwd+bwd failed: {type(e).__name__}: {str(e)[-800:]}")
          r["fb"] = float("nan")
          r["temp"] = float("nan")
        r["abytes"], r["dense"] = a_bytes(name, b, h, l, dtype, n, m)
        res[name] = r
        log(f"{dname} {n}:{m} B={b} L={l} {name}: fwd {r['fwd']:.3f} ms, fwd+bwd {r['fb']:.3f} ms, "
            f"temp {r['temp']:.0f} MiB")
      x = res["XLA dense"]
      c = res.get("cuDNN dense")
      for name, r in res.items():
        def ratio(base, key):
          if base is None or not np.isfinite(base[key]) or not np.isfinite(r[key]):
            return "-"
          return f"{base[key] / r[key]:.2f}x"
        rows.append([dname, f"{n}:{m}", str(b), str(l), name,
                     f"{r['fwd']:.3f}", ratio(x, "fwd"), ratio(c, "fwd"),
                     f"{r['fb']:.3f}", ratio(x, "fb"), ratio(c, "fb"),
                     f"{r['abytes'] / 2**20:.1f} ({r['abytes'] / r['dense']:.3f})",
                     f"{r['temp']:.0f}"])
      # after every shape, so a cut-off run keeps its rows
      harness.save(f"{header}\n\n{RATIOS}\n\n{harness.markdown_table(COLS, rows)}\n", FLAGS.out)
  harness.emit_table(header, COLS, rows, FLAGS.out, note=RATIOS)


if __name__ == "__main__":
  define_flags()
  app.run(main)
