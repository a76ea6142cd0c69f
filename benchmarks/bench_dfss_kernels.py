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

Usage, from the repository root (benchmarks/ is a package: tune_dfss_kernels imports the timing
helpers from here):

  python -m benchmarks.bench_dfss_kernels [--out=FILE] [--dtypes=bf16,fp32]
      [--shapes=32x1024,16x2048,8x4096] [--heads=4] [--dim=64] [--skip_reference] [--log=FILE]
"""

from __future__ import annotations

import datetime
import statistics
import subprocess
import time
from typing import Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from lra_sparse.kernels.dfss import reference as dfss_reference
from lra_sparse.kernels.dfss import triton as dfss_triton

FLAGS = flags.FLAGS

DTYPES = {"bf16": (jnp.bfloat16, 2, 4), "fp32": (jnp.float32, 1, 2)}  # paper defaults


def _block(x):
  jax.tree_util.tree_map(lambda a: a.block_until_ready(), x)


def time_fn(fn, input_sets, target_s=0.4, min_samples=7, max_samples=41):
  """Median ms per call; bursts of back-to-back calls, inputs rotated."""
  for args in input_sets:  # warm-up (compile) on every input set
    _block(fn(*args))
  t0 = time.perf_counter()
  _block(fn(*input_sets[0]))
  est = max(time.perf_counter() - t0, 1e-5)
  burst = int(min(max(1, 0.02 / est), 50))
  n_samples = int(min(max(min_samples, target_s / (est * burst)), max_samples))
  samples = []
  for s in range(n_samples):
    t0 = time.perf_counter()
    out = None
    for j in range(burst):
      out = fn(*input_sets[(s * burst + j) % len(input_sets)])
    _block(out)
    samples.append((time.perf_counter() - t0) / burst * 1e3)
  return statistics.median(samples), samples


def gpu_state():
  """SM clock / max clock / power limit / temperature from nvidia-smi: compute-bound kernels
  (the fused DFSS ones) move with the SM clock, which differs between lent machines."""
  try:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    return f"nvidia-smi sm clock, max sm clock, power, power limit, temp: {out}"
  except Exception as e:  # noqa: BLE001  no nvidia-smi (or no GPU): say so, do not fail
    return f"nvidia-smi unavailable ({type(e).__name__})"


def temp_mib(fn, *args):
  try:
    ma = jax.jit(fn).lower(*args).compile().memory_analysis()
    return ma.temp_size_in_bytes / 2**20
  except Exception:  # pragma: no cover
    return float("nan")


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


def fwd_bwd(f):
  def g(q, k, v, ct):
    return jax.grad(lambda q, k, v: jnp.sum((f(q, k, v) * ct).astype(jnp.float32)),
                    argnums=(0, 1, 2))(q, k, v)
  return g


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
  """Defined only when run as a program, so importing this module (tune_dfss_kernels does)
  adds no flags."""
  flags.DEFINE_string("out", None, "Also write the table (markdown) here.")
  flags.DEFINE_string("dtypes", "bf16,fp32", f"Comma-separated subset of {sorted(DTYPES)} "
                      "(bf16 runs 2:4, fp32 runs 1:2).")
  flags.DEFINE_string("shapes", "32x1024,16x2048,8x4096", "Comma-separated BATCHxLENGTH list.")
  flags.DEFINE_integer("heads", 4, "Attention heads.")
  flags.DEFINE_integer("dim", 64, "Head dimension.")
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

  dev = jax.devices()[0]
  with_triton = dfss_triton.is_available()
  try:
    import triton
    tver = triton.__version__
  except Exception:
    tver = "n/a"
  try:
    import jax_triton
    jtver = getattr(jax_triton, "__version__", "?")
  except Exception:
    jtver = "n/a"
  now = datetime.datetime.now(datetime.timezone.utc)
  header = (f"device: {getattr(dev, 'device_kind', dev.platform)} ({dev.platform}); "
            f"jax {jax.__version__}; triton {tver}; jax-triton {jtver}; "
            f"date {now:%Y-%m-%d %H:%M} UTC; "
            f"heads {FLAGS.heads}, head_dim {FLAGS.dim}; times = median ms after warm-up")
  log(header)
  log("start: " + gpu_state())
  shapes = [tuple(int(x) for x in s.split("x")) for s in FLAGS.shapes.split(",")]
  rows = []
  h, d = FLAGS.heads, FLAGS.dim
  for dname in FLAGS.dtypes.split(","):
    dtype, n, m = DTYPES[dname]
    for b, l in shapes:
      key = jax.random.PRNGKey(l + b)
      sets = []
      for i in range(3):
        ks = jax.random.split(jax.random.fold_in(key, i), 4)
        sets.append(tuple(jax.random.normal(kk, (b, l, h, d), dtype) for kk in ks))
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
          r["temp"] = temp_mib(fwd_bwd(f), *sets[0])
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
      write_table(rows, header, FLAGS.out)  # after every shape, so a cut-off run keeps its rows
  header += "\n" + gpu_state().replace("nvidia-smi", "end of run, nvidia-smi")
  table = write_table(rows, header, FLAGS.out)
  print()
  print(table, flush=True)


def write_table(rows, header, out):
  cols = ["dtype", "N:M", "B", "L", "method", "fwd ms", "fwd vs XLA", "fwd vs cuDNN",
          "fwd+bwd ms", "f+b vs XLA", "f+b vs cuDNN", "A MiB (vs dense)", "temp MiB f+b"]
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  table = "\n".join(lines)
  if out:
    with open(out, "w") as f:
      f.write(header + "\n\n"
              + "Ratios are speed-ups (baseline time / method time); >1 means faster.\n\n"
              + table + "\n")
  return table


if __name__ == "__main__":
  define_flags()
  app.run(main)
