"""The paper's compressed DFSS pipeline (App. A.1) on the GPU: JAX side of
``kernels.dfss.compressed_kernels``.

Forward: ``sddmm_prune`` (S' compressed, fp32, + one keep bit per key), ``compressed_softmax``
(A, input dtype) and ``spmm`` (O = A V).  Backward on the compressed form: dV = A^T dO, the
compressed dS = A * (dO V^T - delta), dQ = scale * dS K and dK = scale * dS^T Q.

Nothing here imports triton at module import time.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lra_sparse.kernels.dfss import tiles as dfss_tiles
from lra_sparse.kernels.shared.launch import launch
from lra_sparse.kernels.shared.prologue import cdiv, key_mask, padded_rows, row_delta



def _geometry(length: int, tiles: dfss_tiles.Tiles):
  """(LP, KP): padded row and key counts (whole tiles)."""
  return padded_rows(length), cdiv(length, tiles.bn) * tiles.bn


def sddmm_prune(q, k, *, n, m, mask=None, poison=False):
  """SDDMM + N:M prune epilogue.  Returns (values fp32 [B*H, LP, KP*n/m],
  meta int32 [B*H, LP, KP/32]) with LP, KP the internally padded row / key counts."""
  from lra_sparse.kernels.dfss import compressed_kernels as kernels  # imports triton
  b, l, h, d = q.shape
  t = dfss_tiles.tiles("cmp", jnp.dtype(q.dtype).name, d, m)
  lp, kp = _geometry(l, t)
  km, has_mask = key_mask(mask, b)
  return launch(
      kernels.dfss_sddmm_prune, (q, k, km, 1.0 / math.sqrt(d), l, lp, kp, h),
      (jax.ShapeDtypeStruct((b * h, lp, kp // m * n), jnp.float32),
       jax.ShapeDtypeStruct((b * h, lp, kp // dfss_tiles.META_BITS), jnp.int32)),
      (lp // t.bm, kp // t.bn, b * h),
      num_warps=t.num_warps, num_stages=t.num_stages, poison=poison,
      D=d, M=m, NKEEP=n, HAS_MASK=has_mask, BM=t.bm, BN=t.bn)


def compressed_softmax(values, *, out_dtype=None, poison=False):
  """Softmax over each compressed row (values [R0, R1, CW]); -inf rows -> zeros."""
  from lra_sparse.kernels.dfss import compressed_kernels as kernels  # imports triton
  cw = values.shape[-1]
  block = 1 << max(4, (cw - 1).bit_length())
  (a,) = launch(
      kernels.dfss_csoftmax, (values, cw),
      (jax.ShapeDtypeStruct(values.shape, out_dtype or values.dtype),),
      (math.prod(values.shape[:-1]),), num_warps=4 if block <= 1024 else 8, num_stages=1,
      poison=poison, BLOCK=block)
  return a


def spmm(probs, meta, x, *, n, m, alpha=1.0, transpose=False, poison=False):
  """Compressed probs [B*H, LP, CW] + meta times x [B, L, H, D] -> [B, L, H, D].
  transpose=True computes dense(probs)^T @ x (keys as output rows)."""
  from lra_sparse.kernels.dfss import compressed_kernels as kernels  # imports triton
  b, l, h, d = x.shape
  t = dfss_tiles.tiles("cmp", jnp.dtype(x.dtype).name, d, m)
  lp, kp = _geometry(l, t)
  assert probs.shape[1:] == (lp, kp // m * n), (probs.shape, lp, kp)
  if transpose:
    kernel, grid = kernels.dfss_spmm_t, (kp // t.bn, b * h)
  else:
    kernel, grid = kernels.dfss_spmm, (lp // t.bm, b * h)
  (out,) = launch(
      kernel, (probs, meta, x, l, lp, kp, h), (jax.ShapeDtypeStruct(x.shape, x.dtype),),
      grid, num_warps=t.num_warps, num_stages=t.num_stages, poison=poison, ALPHA=float(alpha),
      D=d, M=m, NKEEP=n, BM=t.bm, BN=t.bn)
  return out


def forward(q, k, v, mask, n, m, poison=False):
  """O and the residuals (A, meta) of the compressed pipeline."""
  sc, meta = sddmm_prune(q, k, n=n, m=m, mask=mask, poison=poison)
  a = compressed_softmax(sc, out_dtype=q.dtype, poison=poison)
  o = spmm(a, meta, v, n=n, m=m, poison=poison)
  return o, a, meta


def backward(q, k, v, o, a, meta, do, n, m, poison=False):
  """(dQ, dK, dV) on the compressed form (the key mask is already encoded in A and meta)."""
  from lra_sparse.kernels.dfss import compressed_kernels as kernels  # imports triton
  b, l, h, d = q.shape
  t = dfss_tiles.tiles("cmp", jnp.dtype(q.dtype).name, d, m)
  lp, kp = _geometry(l, t)
  do = do.astype(q.dtype)
  scale = 1.0 / math.sqrt(d)
  dv = spmm(a, meta, do, n=n, m=m, transpose=True, poison=poison)
  (ds,) = launch(
      kernels.dfss_sddmm_bwd, (a, meta, do, v, row_delta(o, do), l, lp, kp, h),
      (jax.ShapeDtypeStruct(a.shape, q.dtype),), (lp // t.bm, kp // t.bn, b * h),
      num_warps=t.num_warps, num_stages=t.num_stages, poison=poison,
      D=d, M=m, NKEEP=n, BM=t.bm, BN=t.bn)
  dq = spmm(ds, meta, k, n=n, m=m, alpha=scale, poison=poison)
  dk = spmm(ds, meta, q, n=n, m=m, alpha=scale, transpose=True, poison=poison)
  return dq, dk, dv
