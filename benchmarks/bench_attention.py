"""Times the pure-JAX attention kinds against XLA dense attention; prints a markdown table.

  python -m benchmarks.bench_attention [--lengths=1024,2048,4096] [--batch=1 | --tokens=32768]
      [--heads=4] [--head_dim=64] [--dtype=float32|bfloat16] [--kinds=...] [--out=FILE]

Kinds: dense_xla (jax.nn.dot_product_attention, XLA), dense_cudnn (GPU + half precision only),
dfss_1:2 / dfss_2:4 (pure-JAX reference path), dsa_90 (prediction path + top-k + attention,
sigma 0.25 of model width heads*head_dim), nystrom_64 (64 landmarks + conv skip of 35), and
dfss_triton_2:4 when the Triton kernel is available. Every kind sees the same random inputs
(q, k, v ~ N(0, 1), never zero) and a key padding mask with the last 1/16 of keys padded.
"fwd" times the attention output; "fwd+bwd" times the gradient of sum(out * cotangent) w.r.t.
q, k, v (and the kind's parameters). Median wall time of --reps calls after compilation and
--warmup untimed calls; ratios are against dense_xla at the same length in the same process.
"""
from __future__ import annotations

from typing import Callable

from absl import app, flags
import jax
import jax.numpy as jnp

from benchmarks import harness
from lra_sparse.attention import (AttentionDims, DSAConfig, NystromConfig, build_attention,
                                  dense_attention, dfss_attention)

ALL_KINDS = ("dense_xla", "dense_cudnn", "dfss_1:2", "dfss_2:4", "dsa_90", "nystrom_64",
             "dfss_triton_2:4")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

flags.DEFINE_list("lengths", ["1024", "2048", "4096"], "Sequence lengths.")
flags.DEFINE_integer("batch", 1, "Batch size (ignored when --tokens > 0).")
flags.DEFINE_integer("tokens", 0, "If > 0, batch = tokens // length at each length.")
flags.DEFINE_integer("heads", 4, "Attention heads.")
flags.DEFINE_integer("head_dim", 64, "Head dimension.")
flags.DEFINE_enum("dtype", "float32", list(DTYPES), "Compute dtype of q, k, v.")
flags.DEFINE_list("kinds", list(ALL_KINDS), f"Subset of {ALL_KINDS}; unavailable ones skip.")
flags.DEFINE_integer("warmup", 3, "Untimed calls after compilation.")
flags.DEFINE_integer("reps", 20, "Timed calls.")
flags.DEFINE_string("out", "", "Also write the table here.")
FLAGS = flags.FLAGS


def _core_fn(kind: str, length: int, x, mask, dims: AttentionDims):
  """(params, apply(params, q, k, v)) for the registry-built cores (DSA, Nystrom)."""
  config = {"dsa": DSAConfig(sigma=0.25, sparsity=0.9),
            "nystrom": NystromConfig(num_landmarks=64, conv_kernel=35)}[kind]
  core = build_attention(config, dims)
  shape = (x.shape[0], length, dims.num_heads, dims.head_dim)
  dummy = jnp.zeros(shape, x.dtype)
  params = jax.jit(lambda: core.init(jax.random.key(0), dummy, dummy, dummy, mask=mask,
                                     inputs=x))()["params"]

  def apply(params, q, k, v):
    # deterministic=False with dropout 0: the training path (no eval-only hit-rate top-k).
    out, _ = core.apply({"params": params}, q, k, v, mask=mask, inputs=x, deterministic=False,
                        mutable=["aux_loss", "aux_metrics"])
    return out
  return params, apply


def make_kind(kind: str, length: int, x, mask, dims: AttentionDims):
  """Returns (params, fn(params, q, k, v) -> out) or None when the kind cannot run here."""
  on_gpu = jax.default_backend() == "gpu"
  if kind == "dense_xla":
    return {}, lambda p, q, k, v: dense_attention(q, k, v, mask, implementation="xla")
  if kind == "dense_cudnn":
    if not on_gpu or dims.dtype == jnp.float32:
      return None
    return {}, lambda p, q, k, v: dense_attention(q, k, v, mask, implementation="cudnn")
  if kind.startswith("dfss_triton_"):
    if not on_gpu:
      return None
    try:
      from lra_sparse.kernels.dfss import triton as dfss_triton
    except Exception:  # pylint: disable=broad-except
      return None
    if not dfss_triton.is_available():
      return None
    n, m = (int(t) for t in kind.rsplit("_", 1)[1].split(":"))
    return {}, lambda p, q, k, v: dfss_attention(q, k, v, n=n, m=m, mask=mask,
                                                 backend="triton")
  if kind.startswith("dfss_"):
    n, m = (int(t) for t in kind.split("_", 1)[1].split(":"))
    return {}, lambda p, q, k, v: dfss_attention(q, k, v, n=n, m=m, mask=mask,
                                                 backend="reference")
  if kind == "dsa_90":
    return _core_fn("dsa", length, x, mask, dims)
  if kind == "nystrom_64":
    return _core_fn("nystrom", length, x, mask, dims)
  raise ValueError(f"unknown --kinds entry {kind!r}; choose from {ALL_KINDS}")


def median_ms(fn: Callable, *args) -> float:
  """Median ms of ``fn(*args)`` over --reps calls after compilation and --warmup calls."""
  return 1e3 * harness.median_seconds(lambda: fn(*args), warmup=FLAGS.warmup, reps=FLAGS.reps)


def bench_length(length: int, kinds) -> list[dict]:
  batch = FLAGS.tokens // length if FLAGS.tokens > 0 else FLAGS.batch
  if batch < 1:
    raise ValueError(f"--tokens={FLAGS.tokens} is smaller than length {length}")
  dtype = DTYPES[FLAGS.dtype]
  heads, head_dim = FLAGS.heads, FLAGS.head_dim
  dims = AttentionDims(num_heads=heads, head_dim=head_dim, model_dim=heads * head_dim,
                       length=length, dropout_rate=0.0, dtype=dtype)
  keys = jax.random.split(jax.random.key(length), 5)
  shape = (batch, length, heads, head_dim)
  q, k, v, cotangent = (jax.random.normal(key, shape, jnp.float32).astype(dtype)
                        for key in keys[:4])
  x = jax.random.normal(keys[4], (batch, length, heads * head_dim), jnp.float32).astype(dtype)
  mask = harness.prefix_mask(jnp.full((batch,), length - length // 16), length)
  rows = []
  for kind in kinds:
    made = make_kind(kind, length, x, mask, dims)
    if made is None:
      print(f"  {kind}: not available here, skipped", flush=True)
      continue
    params, fn = made
    forward = jax.jit(fn)

    def loss(params, q, k, v, fn=fn):
      return jnp.sum(fn(params, q, k, v).astype(jnp.float32) * cotangent.astype(jnp.float32))
    backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    try:
      fwd = median_ms(forward, params, q, k, v)
      bwd = median_ms(backward, params, q, k, v)
    except Exception as error:  # pylint: disable=broad-except  (e.g. out of memory)
      print(f"  {kind}: failed ({type(error).__name__}: {str(error)[:200]})", flush=True)
      continue
    print(f"  {kind:16s} L={length:5d} B={batch:3d} fwd {fwd:9.3f} ms  fwd+bwd {bwd:9.3f} ms",
          flush=True)
    rows.append({"kind": kind, "length": length, "batch": batch, "fwd": fwd, "bwd": bwd})
  return rows


def to_markdown(rows: list[dict]) -> str:
  header = harness.run_header(f"dtype {FLAGS.dtype}",
                              f"heads {FLAGS.heads}, head_dim {FLAGS.head_dim}",
                              f"median of {FLAGS.reps} after {FLAGS.warmup} warm-up calls",
                              "ratio = kind / dense_xla (same length).")
  dense = {(r["length"]): r for r in rows if r["kind"] == "dense_xla"}
  cells = []
  for r in rows:
    base = dense.get(r["length"])
    ratio = lambda key, r=r, base=base: f"{r[key] / base[key]:.2f}x" if base else "-"
    cells.append((r["kind"], r["length"], r["batch"], f"{r['fwd']:.3f}", ratio("fwd"),
                  f"{r['bwd']:.3f}", ratio("bwd")))
  return (header + "\n\n" + harness.markdown_table(
      ["kind", "L", "batch", "fwd ms", "fwd ratio", "fwd+bwd ms", "fwd+bwd ratio"], cells,
      align="lrrrrrr") + "\n")


def main(argv):
  del argv
  kinds = [k.strip() for k in FLAGS.kinds if k.strip()]
  for kind in kinds:
    if kind not in ALL_KINDS:
      raise ValueError(f"unknown --kinds entry {kind!r}; choose from {ALL_KINDS}")
  if "dense_xla" not in kinds:
    kinds.insert(0, "dense_xla")
  rows = []
  for length in (int(t) for t in FLAGS.lengths):
    if length % 16:
      raise ValueError(f"--lengths entry {length} must be a multiple of 16 (N:M groups, "
                       f"DSA vectors)")
    rows.extend(bench_length(length, kinds))
  harness.emit(to_markdown(rows), FLAGS.out)


if __name__ == "__main__":
  app.run(main)
