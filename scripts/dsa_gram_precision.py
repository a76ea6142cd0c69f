"""L_MSE's Gram matmuls on a GPU: each dot algorithm's error against float64 and its time.

Errors on batch 2, length 300, 2 heads, d 64, k 96, for random Q~, K~ and for S~ ~ S (where
the three Gram terms cancel): the value relative to sum_ij a_ij^2 and to the MSE itself, and
the gradients w.r.t. Q and Q~.  Time: value + gradients of the factored form (Q~ = (XP) W~)
at the ListOps shape (batch 32, length 2000, 8 heads of 64, rank 128), 10 calls in one jit.

  PYTHONPATH=$PWD python scripts/dsa_gram_precision.py
"""
from __future__ import annotations

from typing import Sequence

from absl import app
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.ab_dfss_kernels import chained_ms
from lra_sparse.kernels.dsa import reference as ref

PRESET = jax.lax.DotAlgorithmPreset
ALGORITHMS = {"BF16 x3": PRESET.BF16_BF16_F32_X3, "BF16 x6": PRESET.BF16_BF16_F32_X6,
              "TF32 x3": PRESET.TF32_TF32_F32_X3, "fp32": jax.lax.Precision.HIGHEST}


def make_case(rng, near: bool, b=2, l=300, h=2, d=64, r=96):
  q, k = (rng.normal(size=(b, l, h, d)).astype(np.float32) for _ in range(2))
  if near:   # Q~ K~^T = Q K^T + a small perturbation
    rot = np.linalg.qr(rng.normal(size=(d, d)))[0]
    qp = np.concatenate([q @ rot, 0.05 * rng.normal(size=(b, l, h, r - d))], -1)
    kp = np.concatenate([k @ rot, rng.normal(size=(b, l, h, r - d))], -1)
  else:
    qp, kp = (rng.normal(size=(b, l, h, r)) for _ in range(2))
  qp, kp = qp.astype(np.float32), kp.astype(np.float32)
  f64 = lambda x: x.astype(np.float64)  # noqa: E731
  diff = (np.einsum("bqhd,bkhd->bhqk", f64(q), f64(k))
          - np.einsum("bqhd,bkhd->bhqk", f64(qp), f64(kp)))
  scale = np.sum(np.einsum("bqhd,bkhd->bhqk", f64(q), f64(k)) ** 2) / b
  want = {"value": np.sum(diff ** 2) / b,
          "dq": 2 * np.einsum("bhqk,bkhd->bqhd", diff, f64(k)) / b,
          "dqp": -2 * np.einsum("bhqk,bkhd->bqhd", diff, f64(kp)) / b}
  return (q, k, qp, kp), want, scale


def rel(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def main(argv: Sequence[str]) -> None:
  del argv
  rng = np.random.default_rng(0)
  cases = {near: make_case(rng, near) for near in (False, True)}
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  steps, (b, l, h, d, r) = 10, (32, 2000, 8, 64, 128)
  big = (jax.random.normal(ks[0], (steps, b, l, h, d), jnp.bfloat16),
         jax.random.normal(ks[1], (steps, b, l, h, d), jnp.bfloat16),
         jax.random.normal(ks[2], (steps, b, l, r), jnp.float32),
         jax.random.normal(ks[3], (steps, h, r, r), jnp.float32),
         jax.random.normal(ks[4], (steps, h, r, r), jnp.float32))

  def factored(q, k, x, wq, wk):
    return jax.grad(lambda *a: ref.prediction_mse(
        a[0], a[1], ref.LowRank(a[2], a[3]), ref.LowRank(a[2], a[4])), argnums=range(5))(
            q, k, x, wq, wk)

  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
  print("| algorithm | case | value err / sum a^2 | value err / MSE | dQ rel | dQ~ rel | ms |")
  print("|---|---|---|---|---|---|---|")
  for name, algorithm in ALGORITHMS.items():
    ref._gram_precision = lambda algorithm=algorithm: algorithm  # pylint: disable=protected-access
    ms = chained_ms(factored, big, steps, rounds=5, warmup=1)
    for near, (args, want, scale) in cases.items():
      args = [jnp.asarray(x) for x in args]
      got = float(jax.jit(ref.prediction_mse)(*args))
      dq, dqp = jax.jit(jax.grad(ref.prediction_mse, argnums=(0, 2)))(*args)
      err = abs(got - want["value"])
      print(f"| {name} | {'S~ ~ S' if near else 'random'} | {err / scale:.2e} | "
            f"{err / want['value']:.2e} | {rel(dq, want['dq']):.2e} | "
            f"{rel(dqp, want['dqp']):.2e} | {ms:.3f} |", flush=True)


if __name__ == "__main__":
  app.run(main)
