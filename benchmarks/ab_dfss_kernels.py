"""A/B timing of two versions of the DFSS Triton kernels in ONE process on one GPU.

OLD is a copy of ``lra_sparse/kernels/dfss/triton.py`` from another revision, loaded from a file
path (e.g. the generated-source version, ``git show ce422c2:lra_sparse/kernels/dfss/triton.py``
into the git-ignored ``.ab/``); NEW is ``lra_sparse.kernels.dfss.triton`` of this checkout.  Both
run ``dfss_attention_triton`` on the same inputs: forward, and forward+backward (jax.grad of
<out, cotangent> w.r.t. q, k, v).  Each timed call is one jit that chains ``--steps`` calls
with lax.scan over stacked input sets (3 random sets, tiled), so launch overhead and host
dispatch are amortised; OLD and NEW alternate for ``--rounds`` rounds and the table gives the
median ms per attention call, NEW/OLD, and the largest |NEW - OLD| of the outputs / gradients
(0 expected, except the one-pass dQ whose atomic summation order varies).

Usage, from the repository root:

  python -m benchmarks.ab_dfss_kernels --old=.ab/dfss_triton_old.py
      [--dtypes=bf16,fp32] [--shapes=32x1024,16x2048,8x4096] [--heads=4] [--dim=64]
      [--impls=fused] [--steps=20] [--rounds=7] [--out=FILE]
"""

from __future__ import annotations

import datetime
import importlib.util
import statistics
import sys
import time
from typing import Sequence

from absl import app, flags
import jax
import jax.numpy as jnp

from benchmarks.bench_dfss_kernels import gpu_state
from lra_sparse.kernels.dfss import triton as dfss_triton

FLAGS = flags.FLAGS

DTYPES = {"bf16": (jnp.bfloat16, 2, 4), "fp32": (jnp.float32, 1, 2)}  # paper defaults
IMPLS = {"fused": dict(impl="fused"),
         "fused-deterministic": dict(impl="fused", deterministic=True),
         "compressed": dict(impl="compressed")}


def load_module(path: str, name: str):
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod
  spec.loader.exec_module(mod)
  return mod


def chained(fn, steps):
  """jit(xs -> per-step outputs' first elements): fn on xs[i] for i < steps, in one lax.scan."""
  def body(carry, x):
    outs = fn(*x)
    first = sum(o.reshape(-1)[0].astype(jnp.float32) for o in jax.tree_util.tree_leaves(outs))
    return carry + first, None

  return jax.jit(lambda xs: jax.lax.scan(body, jnp.float32(0), xs, length=steps)[0])


def chained_ms(fn, xs, steps: int, rounds: int, warmup: int = 2) -> float:
  """Median ms per call of ``fn`` over ``rounds`` timed runs of ``chained(fn, steps)`` on the
  stacked inputs ``xs`` (after ``warmup`` untimed runs, the first of which compiles)."""
  run = chained(fn, steps)
  for _ in range(warmup):
    run(xs).block_until_ready()
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    run(xs).block_until_ready()
    times.append((time.perf_counter() - t0) / steps * 1e3)
  return statistics.median(times)


def input_sets(b: int, l: int, h: int, d: int, dtype, steps: int):
  """(sets, xs): 3 random (q, k, v, cotangent) sets of [b, l, h, d], and ``steps`` of them
  stacked (tiled) for ``chained``."""
  key = jax.random.PRNGKey(b * l)
  sets = [tuple(jax.random.normal(kk, (b, l, h, d), dtype)
                for kk in jax.random.split(jax.random.fold_in(key, i), 4)) for i in range(3)]
  return sets, tuple(jnp.stack([sets[i % 3][j] for i in range(steps)]) for j in range(4))


def emit_table(header: str, cols: Sequence[str], rows: Sequence[Sequence[str]],
               out: str | None) -> None:
  """Prints the header, the GPU state at the end and the markdown table; also to ``out``."""
  table = "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                    + ["| " + " | ".join(r) + " |" for r in rows])
  text = header + "\nend of run, " + gpu_state() + "\n\n" + table + "\n"
  print("\n" + text)
  if out:
    with open(out, "w") as f:
      f.write(text)


def attention_fns(mod, n, m, kw):
  def fwd(q, k, v, ct):
    del ct
    return mod.dfss_attention_triton(q, k, v, n=n, m=m, **kw)

  def fwd_bwd(q, k, v, ct):
    return jax.grad(
        lambda q, k, v: jnp.sum((mod.dfss_attention_triton(q, k, v, n=n, m=m, **kw) * ct)
                                .astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

  return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def max_diff(a, b):
  return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
             for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def define_flags() -> None:
  flags.DEFINE_string("old", ".ab/dfss_triton_old.py", "Path of the OLD dfss_triton.py.")
  flags.DEFINE_string("dtypes", "bf16,fp32",
                      f"Subset of {sorted(DTYPES)} (bf16 runs 2:4, fp32 runs 1:2).")
  flags.DEFINE_string("shapes", "32x1024,16x2048,8x4096", "Comma-separated BATCHxLENGTH list.")
  flags.DEFINE_integer("heads", 4, "Attention heads.")
  flags.DEFINE_integer("dim", 64, "Head dimension.")
  flags.DEFINE_list("impls", ["fused"], f"Subset of {sorted(IMPLS)}.")
  flags.DEFINE_integer("steps", 20, "Attention calls chained in one jit (lax.scan).")
  flags.DEFINE_integer("rounds", 7, "Timed OLD/NEW alternations.")
  flags.DEFINE_string("out", None, "Also write the table (markdown) here.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not dfss_triton.is_available():
    sys.exit("ab_dfss_kernels needs a GPU with triton and jax-triton")
  old = load_module(FLAGS.old, "dfss_triton_old")
  dev = jax.devices()[0]
  now = datetime.datetime.now(datetime.timezone.utc)
  header = (f"device: {getattr(dev, 'device_kind', dev.platform)}; jax {jax.__version__}; "
            f"OLD {FLAGS.old}, NEW lra_sparse/kernels/dfss/triton.py; heads {FLAGS.heads}, "
            f"head_dim {FLAGS.dim}; {FLAGS.steps} calls per jit (lax.scan), median of "
            f"{FLAGS.rounds} alternating rounds; {now:%Y-%m-%d %H:%M} UTC\n{gpu_state()}")
  print(header, flush=True)
  rows = []
  h, d = FLAGS.heads, FLAGS.dim
  for dname in FLAGS.dtypes.split(","):
    dtype, n, m = DTYPES[dname]
    for shape in FLAGS.shapes.split(","):
      b, l = map(int, shape.split("x"))
      sets, xs = input_sets(b, l, h, d, dtype, FLAGS.steps)
      for impl in FLAGS.impls:
        fns = {"OLD": attention_fns(old, n, m, IMPLS[impl]),
               "NEW": attention_fns(dfss_triton, n, m, IMPLS[impl])}
        for kind in ("fwd", "fwd+bwd"):
          diff = max_diff(jax.jit(fns["OLD"][kind])(*sets[0]),
                          jax.jit(fns["NEW"][kind])(*sets[0]))
          runs = {tag: chained(f[kind], FLAGS.steps) for tag, f in fns.items()}
          for r in runs.values():  # compile and warm up
            r(xs).block_until_ready()
            r(xs).block_until_ready()
          times = {tag: [] for tag in runs}
          for _ in range(FLAGS.rounds):
            for tag, r in runs.items():
              t0 = time.perf_counter()
              r(xs).block_until_ready()
              times[tag].append((time.perf_counter() - t0) / FLAGS.steps * 1e3)
          t_old, t_new = (statistics.median(times[t]) for t in ("OLD", "NEW"))
          row = [dname, f"{n}:{m}", shape, impl, kind, f"{t_old:.3f}", f"{t_new:.3f}",
                 f"{t_new / t_old:.3f}", f"{diff:.2e}"]
          rows.append(row)
          print(" | ".join(row), flush=True)
  emit_table(header, ["dtype", "N:M", "BxL", "impl", "pass", "OLD ms", "NEW ms", "NEW/OLD",
                      "max |NEW-OLD|"], rows, FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
