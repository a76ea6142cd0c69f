"""Where a DSA fwd+bwd spends its time on one GPU (one process, one table).

Per shape (BATCHxLENGTH, heads, head_dim 64, predictor rank k, bf16): cuDNN and XLA dense, then
for each DSA setting the parts of the Triton path timed alone:
  operands  selection_operands (int8 Q~, K~ in XLA)
  select    the selection kernel (bits), and with --variants the kernels of a local candidate
            file (``.ab/dsa_select_variants.py``, git-ignored: STOP=n stops after pass n; DEFER=1
            accumulates per element and reduces once)
  attn      the attention kernels on precomputed bits (fwd; fwd+bwd)
  mse       L_MSE from Gram matrices, value and gradients: XLA (arrays; factored) and the
            Gram kernels (kernels/dsa_gram.py)
  total     the whole DSA fwd (operands + select + attn) and fwd+bwd (+ mse)

  PYTHONPATH=$PWD python scripts/dsa_breakdown.py [--shapes=16x2048:4:64,32x2000:8:128]
      [--variants]
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Sequence

from absl import app, flags
import jax
import jax.numpy as jnp

from benchmarks.ab_dfss_kernels import chained_ms
from benchmarks.bench_dfss_kernels import gpu_state
from lra_sparse.kernels.dsa import gram as dsa_gram
from lra_sparse.kernels.dsa import reference as dsa_reference
from lra_sparse.kernels.dsa import triton as dsa_triton

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["16x2048:4:64", "32x2000:8:128"], "BxL:heads:rank entries.")
flags.DEFINE_list("settings", ["90:1", "90:8", "95:8"], "SPARSITY%:VECTOR entries.")
flags.DEFINE_bool("variants", False, "Also time the selection variants of .ab/.")
flags.DEFINE_integer("steps", 10, "Calls chained in one jit.")
flags.DEFINE_integer("rounds", 5, "Timed rounds (median).")


def timeit(fn, xs):
  return chained_ms(fn, xs, FLAGS.steps, FLAGS.rounds, warmup=1)


def stack(sets):
  return tuple(jnp.stack([sets[i % len(sets)][j] for i in range(FLAGS.steps)])
               for j in range(len(sets[0])))


def main(argv: Sequence[str]) -> None:
  del argv
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}\n{gpu_state()}",
        flush=True)
  variants = None
  if FLAGS.variants:
    spec = importlib.util.spec_from_file_location(
        "lra_sparse.kernels.dsa_select_variants", ".ab/dsa_select_variants.py")
    variants = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = variants
    spec.loader.exec_module(variants)
  rows = []

  def row(shape, name, fwd, fwdbwd=float("nan")):
    rows.append((shape, name, fwd, fwdbwd))
    print(f"{shape} {name}: {fwd:.3f} {fwdbwd:.3f}", flush=True)

  for entry in FLAGS.shapes:
    bl, h, rank = entry.split(":")
    b, l = map(int, bl.split("x"))
    h, rank, d = int(h), int(rank), 64
    key = jax.random.PRNGKey(b * l)
    sets = []
    for i in range(3):
      ks = jax.random.split(jax.random.fold_in(key, i), 6)
      sets.append(tuple(jax.random.normal(kk, (b, l, h, d), jnp.bfloat16) for kk in ks[:4])
                  + tuple(jax.random.normal(kk, (b, l, h, rank), jnp.float32) for kk in ks[4:]))
    xs = stack(sets)       # q, k, v, ct, qp, kp
    for impl in ("cudnn", "xla"):
      att = lambda q, k, v, impl=impl: jax.nn.dot_product_attention(q, k, v, implementation=impl)
      f = lambda q, k, v, ct, qp, kp, att=att: att(q, k, v)
      g = lambda q, k, v, ct, qp, kp, att=att: jax.grad(
          lambda q, k, v: jnp.sum((att(q, k, v) * ct).astype(jnp.float32)),
          argnums=(0, 1, 2))(q, k, v)
      row(entry, f"{impl} dense", timeit(f, xs), timeit(g, xs))
    mse = lambda q, k, v, ct, qp, kp: jax.grad(
        lambda q, k, qp, kp: dsa_reference.prediction_mse(q, k, qp, kp),
        argnums=(0, 1, 2, 3))(q, k, qp, kp)
    row(entry, "mse (Gram of Q~, K~ arrays) value+grads", float("nan"), timeit(mse, xs))
    ws = jax.random.normal(jax.random.fold_in(key, 99), (2, h, rank, rank), jnp.float32)
    mse_low = lambda q, k, v, ct, qp, kp: jax.grad(
        lambda q, k, x, wq, wk: dsa_reference.prediction_mse(
            q, k, dsa_reference.LowRank(x, wq), dsa_reference.LowRank(x, wk)),
        argnums=(0, 1, 2, 3, 4))(q, k, qp[:, :, 0], ws[0], ws[1])
    row(entry, "mse (Gram, factored (XP) W~) value+grads", float("nan"), timeit(mse_low, xs))
    mse_kernels = lambda q, k, v, ct, qp, kp: jax.grad(
        lambda q, k, x, wq, wk: dsa_gram.prediction_mse(q, k, x, wq, wk),
        argnums=(0, 1, 2, 3, 4))(q, k, qp[:, :, 0], ws[0], ws[1])
    row(entry, "mse (Gram kernels, factored) value+grads", float("nan"),
        timeit(mse_kernels, xs))
    for setting in FLAGS.settings:
      sp, vec = setting.split(":")
      sparsity, vec = int(sp) / 100, int(vec)
      tag = f"DSA-{sp} V={vec} k={rank}"
      ops_fn = lambda qp, kp, vec=vec: dsa_reference.selection_operands(
          qp, kp, None, vector=vec, scale=d ** -0.5)
      row(entry, f"{tag} operands", timeit(
          lambda q, k, v, ct, qp, kp: ops_fn(qp, kp).q8, xs))
      opsets = [ops_fn(s[4], s[5]) for s in sets]
      oxs = stack([(o.q8, o.k8, o.factor) for o in opsets])
      sel = lambda q8, k8, f, sparsity=sparsity: dsa_triton.select_bits(
          dsa_reference.SelectionOperands(q8, k8, f), sparsity=sparsity)
      row(entry, f"{tag} select", timeit(sel, oxs))
      if variants is not None and vec == 1:
        for defer, tiles in ((0, (64, 64, 4)), (1, (64, 64, 4)), (1, (64, 32, 4)),
                             (1, (64, 64, 8))):
          for stop in ((1, 2, 3, 4) if defer == 0 else (4,)):
            dsa_triton._SELECT = "dsa_select_variants"
            dsa_triton.set_tiles("select", "int8", tiles + (2, False))
            import lra_sparse.kernels.shared.prologue as dl
            orig = dl.launch

            def patched(*a, stop=stop, defer=defer, orig=orig, **kw):
              return orig(*a, STOP=stop, DEFER=bool(defer), **kw)
            dsa_triton.launch = patched
            try:
              t = timeit(sel, oxs)
              if stop == 4:   # same bits as the kernel in the package
                got = jax.jit(sel)(*(x[0] for x in oxs))
                dsa_triton.launch = orig
                dsa_triton._SELECT = "dsa_select_kernels"
                dsa_triton.set_tiles("select", "int8")
                want = jax.jit(sel)(*(x[0] for x in oxs))
                same = bool(jnp.all(got == want))
              else:
                same = None
              row(entry, f"{tag} select variant defer={defer} stop={stop} tiles={tiles}"
                  f"{'' if same is None else ' same bits' if same else ' BITS DIFFER'}", t)
            except Exception as e:  # noqa: BLE001
              print(f"variant defer={defer} stop={stop} {tiles} failed: {e!s:.800}", flush=True)
            finally:
              dsa_triton.launch = orig
              dsa_triton._SELECT = "dsa_select_kernels"
              dsa_triton.set_tiles("select", "int8")
      bitsets = [jax.jit(sel)(o.q8, o.k8, o.factor) for o in opsets]
      axs = stack([s[:4] + (bb,) for s, bb in zip(sets, bitsets)])
      att = lambda q, k, v, ct, bits, vec=vec: dsa_triton.dsa_attention_triton(
          q, k, v, bits, vector=vec)
      attg = lambda q, k, v, ct, bits, att=att: jax.grad(
          lambda q, k, v: jnp.sum((att(q, k, v, ct, bits) * ct).astype(jnp.float32)),
          argnums=(0, 1, 2))(q, k, v)
      row(entry, f"{tag} attn on given bits", timeit(att, axs), timeit(attg, axs))

      def total(q, k, v, ct, qp, kp, sparsity=sparsity, vec=vec):
        ops = ops_fn(qp, kp, vec)
        bits = dsa_triton.select_bits(ops, sparsity=sparsity)
        return dsa_triton.dsa_attention_triton(q, k, v, bits, vector=vec)

      def total_g(q, k, v, ct, qp, kp):
        def loss(q, k, v, qp, kp):
          return (jnp.sum((total(q, k, v, ct, qp, kp) * ct).astype(jnp.float32))
                  + 1e-6 * dsa_reference.prediction_mse(q, k, qp, kp))
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, qp, kp)
      row(entry, f"{tag} total", timeit(total, xs), timeit(total_g, xs))
  print("\n| shape (BxL:heads:rank) | part | fwd ms | fwd+bwd ms |\n|---|---|---|---|")
  for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.3f} |")
  print(gpu_state())


if __name__ == "__main__":
  app.run(main)
