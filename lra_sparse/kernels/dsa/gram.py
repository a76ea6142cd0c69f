"""DSA's L_MSE on the GPU: the Gram form of ``kernels.dsa.reference.prediction_mse`` for factored
predictors, with its forward and backward as Triton kernels (``kernels.dsa.gram_kernels``).

Per example and head, with Q~ = (XP) W~q, K~ = (XP) W~k (XP [L, r] shared by the heads; only the
real rows: padded ones are zero) and the Grams

    G_Q = Q^T Q,  G_K = K^T K  (d x d),   C_Q = Q^T XP,  C_K = K^T XP  (d x r),   GX = XP^T XP
    cq = C_Q W~q = Q^T Q~,  ck = C_K W~k = K^T K~  (d x k),
    pq = W~q^T GX W~q = Q~^T Q~,  pk = W~k^T GX W~k = K~^T K~  (k x k),

the squared error over all pairs of real tokens is

    total = <G_Q, G_K> - 2 <cq, ck> + <pq, pk>

and with s = dL/dtotal (the normalisation, and 0 where the clamp at 0 is active):

    dQ    = 2s (Q G_K - XP W~q ck^T)          dK    = 2s (K G_Q - XP W~k cq^T)
    dW~q  = 2s sum_b (GX W~q pk - C_Q^T ck)   dW~k  = 2s sum_b (GX W~k pq - C_K^T cq)
    dXP   = XP N + sum_h (Q_h P_h + K_h R_h),  N = 2s sum_h (W~q pk W~q^T + W~k pq W~k^T),
            P_h = -2s ck W~q^T,  R_h = -2s cq W~k^T.

Only the products over the length (the Grams forward; dQ, dK and dXP backward) touch
[L, *] arrays: they are the kernels, each reading Q, K and XP once and stopping at the
example's last real token (XLA's autodiff of the reference works on every row).  Everything
else is k x k work in XLA at full fp32 precision.  H100, ListOps shape (32 x 2000, 8 heads of
64, rank 128), value and gradients per layer: 1.20 ms without padding against 1.95 ms for the
XLA form (the first kernels, which split fp32 tiles in registers and loaded bf16 rows without
alignment, took 2.24 ms in the same process; ``experiments/reports/dsa/gram_kernels.md``).

Nothing here imports triton at module import time (its launching functions do, on first use).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lra_sparse.kernels.dsa import reference as dsa_reference
from lra_sparse.kernels.shared.launch import launch
from lra_sparse.kernels.shared.prologue import cdiv, half_parts, key_extent, key_mask
from lra_sparse.ops import sharding

__all__ = ["MAX_RANK", "prediction_mse"]

MAX_RANK = 256      # widest XP (predictor rank) the kernels take
_HI = jax.lax.Precision.HIGHEST
# (rows per step, warps, stages, column block) of the four kernels (forward Grams of Q / K and
# of XP, the backward's dQ / dK and dXP tiles); at head dims above 64 or ranks above 128 the
# column blocks and the dXP tiles shrink to bound the registers and the shared memory.
# Chosen on an H100 (``benchmarks/bench_dsa_gram.py``, ``experiments/reports/dsa/gram_kernels.md``)
# among
# tiles that ptxas compiles for sm_90a without spills and whose buffers fit the 227 KiB of
# shared memory: wider head dims or ranks, and fp32 / fp16 Q and K (two bf16 parts each, so
# twice the buffers of the dXP loop), take smaller ones.
_TILES = {"fwd": (128, 8, 2, 128), "fwd_xp": (64, 8, 3, 64), "bwd_qk": (128, 8, 1, 128),
          "bwd_xp": (64, 4, 2, 128)}
_WIDE_TILES = {"fwd": (64, 8, 2, 64), "bwd_qk": (64, 8, 1, 128), "bwd_xp": (32, 8, 2, 64)}
_SPLIT_X_TILES = {"fwd": (64, 8, 2, 128), "bwd_xp": (64, 8, 2, 64)}


def _tiles(kernel: str, dw: int, rw: int, exact: bool = True):
  """(BL, warps, stages, RB) of a kernel at padded head dim dw and rank rw (RB <= rw); exact:
  Q and K are bf16 (one part each)."""
  if dw > 64 or rw > 128:
    tiles = _WIDE_TILES.get(kernel, _TILES[kernel])
  elif not exact:
    tiles = _SPLIT_X_TILES.get(kernel, _TILES[kernel])
  else:
    tiles = _TILES[kernel]
  bl, warps, stages, rb = tiles
  return bl, warps, stages, min(rb, rw)


def _width(n: int) -> int:
  """A kernel tile width: n rounded up to a power of two >= 16 (zero-padded columns)."""
  return max(16, 1 << (n - 1).bit_length())


def _split(x):
  """(hi, lo) bf16 arrays with hi + lo ~ x to about 16 mantissa bits (``half_parts``); a bf16
  x is exact (lo = hi, which the kernels do not read: pass ``exact``)."""
  parts = half_parts(x)
  return parts * 2 if len(parts) == 1 else parts


def _dot(spec, *operands):
  return jnp.einsum(spec, *operands, precision=_HI, preferred_element_type=jnp.float32)


def _grams(x, xp, km, ext, has_mask, exact):
  """(G [b, h, 2, d, d], C [b, h, 2, d, r], GX [b, r, r]) over the real rows (kernels); x the
  (hi, lo) parts of Q and K, xp of XP."""
  from lra_sparse.kernels.dsa import gram_kernels as kernels  # imports triton
  (qh, ql), (kh, kl) = x
  b, l, h, d = qh.shape
  r = xp[0].shape[-1]
  dw, rw = _width(d), _width(r)
  bl, warps, stages, rb = _tiles("fwd", dw, rw, exact)
  g, c = launch(kernels.gram_fwd, (qh, ql, kh, kl, *xp, km, ext, l),
                (jax.ShapeDtypeStruct((b * h, 2, dw, dw), jnp.float32),
                 jax.ShapeDtypeStruct((b * h, 2, dw, rw), jnp.float32)),
                (2, b * h, rw // rb), num_warps=warps, num_stages=stages, H=h, D0=d, R0=r, D=dw,
                RP=rw, RB=rb, BL=bl, HAS_MASK=has_mask, X_EXACT=exact)
  bl, warps, stages, rb = _tiles("fwd_xp", dw, rw)
  (gx,) = launch(kernels.gram_fwd_xp, (*xp, km, ext, l),
                 (jax.ShapeDtypeStruct((b, rw, rw), jnp.float32),),
                 (b, rw // rb, rw // rb), num_warps=warps, num_stages=stages, R0=r, RP=rw,
                 RB=rb, BL=bl, HAS_MASK=has_mask)
  return (g.reshape(b, h, 2, dw, dw)[..., :d, :d], c.reshape(b, h, 2, dw, rw)[..., :d, :r],
          gx[:, :r, :r])


def _small_terms(g, c, gx, w_q, w_k):
  """cq, ck [b, h, d, k] and pq, pk [b, h, k, k] from the Grams and W~."""
  cq = _dot("bhdr,hrk->bhdk", c[:, :, 0], w_q)
  ck = _dot("bhdr,hrk->bhdk", c[:, :, 1], w_k)
  pq = _dot("hrk,brs,hsj->bhkj", w_q, gx, w_q)
  pk = _dot("hrk,brs,hsj->bhkj", w_k, gx, w_k)
  return cq, ck, pq, pk


def _total(g, cq, ck, pq, pk):
  return (jnp.sum(g[:, :, 0] * g[:, :, 1]) - 2.0 * jnp.sum(cq * ck) + jnp.sum(pq * pk))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _mse(q, k, xp, w_q, w_k, km, ext, has_mask):
  return _mse_fwd(q, k, xp, w_q, w_k, km, ext, has_mask)[0]


def _mse_fwd(q, k, xp, w_q, w_k, km, ext, has_mask):
  # Q, K and XP go to the kernels as bf16 parts (made once here, kept for the backward); the
  # zero-size array carries q's dtype (that of dQ, dK) to the backward.
  x, xps = (_split(q), _split(k)), _split(xp)
  g, c, gx = _grams(x, xps, km, ext, has_mask, q.dtype == jnp.bfloat16)
  small = _small_terms(g, c, gx, w_q, w_k)
  return _total(g, *small), (x, xps, w_q, w_k, km, ext, g, c, gx, small,
                             jnp.zeros((0,), q.dtype))


def _mse_bwd(has_mask, res, ct):
  from lra_sparse.kernels.dsa import gram_kernels as kernels  # imports triton
  x, xps, w_q, w_k, km, ext, g, c, gx, (cq, ck, pq, pk), like_q = res
  (qh, ql), (kh, kl) = x
  b, l, h, d = qh.shape
  r = xps[0].shape[-1]
  dw, rw = _width(d), _width(r)
  exact = like_q.dtype == jnp.bfloat16
  s2 = 2.0 * ct
  pad = lambda x, *widths: jnp.pad(x, [(0, 0)] * (x.ndim - len(widths)) + [  # noqa: E731
      (0, w - n) for w, n in zip(widths, x.shape[x.ndim - len(widths):])])
  # dX = X A + XP M per (example, head) and side (Q, K)
  a = s2 * jnp.stack([g[:, :, 1], g[:, :, 0]], axis=2)                       # [b, h, 2, d, d]
  m = -s2 * jnp.stack([_dot("hrk,bhdk->bhrd", w_q, ck), _dot("hrk,bhdk->bhrd", w_k, cq)],
                      axis=2)                                                # [b, h, 2, r, d]
  bl, warps, stages, rb = _tiles("bwd_qk", dw, rw, exact)
  dq, dk = launch(kernels.gram_bwd_qk,
                  (qh, ql, kh, kl, *xps, km, ext,
                   *_split(pad(a, dw, dw).reshape(b * h, 2, dw, dw)),
                   *_split(pad(m, rw, dw).reshape(b * h, 2, rw, dw)), l),
                  (jax.ShapeDtypeStruct(qh.shape, like_q.dtype),) * 2,
                  (2, cdiv(l, bl), b * h), num_warps=warps, num_stages=stages, H=h, D0=d, R0=r,
                  D=dw, RP=rw, RB=rb, BL=bl, HAS_MASK=has_mask, X_EXACT=exact)
  # dXP = XP N + sum_h (Q_h P_h + K_h R_h)
  n = s2 * jnp.sum(_dot("hrk,bhkj,hsj->bhrs", w_q, pk, w_q)
                   + _dot("hrk,bhkj,hsj->bhrs", w_k, pq, w_k), axis=1)        # [b, r, r]
  p = -s2 * _dot("bhdk,hrk->bhdr", ck, w_q)                                  # [b, h, d, r]
  rr = -s2 * _dot("bhdk,hrk->bhdr", cq, w_k)
  bl, warps, stages, rb = _tiles("bwd_xp", dw, rw, exact)
  (dxp,) = launch(kernels.gram_bwd_xp,
                  (qh, ql, kh, kl, *xps, km, ext, *_split(pad(n, rw, rw)),
                   *_split(pad(p, dw, rw).reshape(b * h, dw, rw)),
                   *_split(pad(rr, dw, rw).reshape(b * h, dw, rw)), l),
                  (jax.ShapeDtypeStruct((b, l, r), jnp.float32),),
                  (cdiv(l, bl), b, rw // rb), num_warps=warps, num_stages=stages, H=h, D0=d,
                  R0=r, D=dw, RP=rw, RB=rb, BL=bl, HAS_MASK=has_mask, X_EXACT=exact)
  # dW~ (k x k work only)
  dw_q = s2 * jnp.sum(_dot("brs,hsk,bhkj->bhrj", gx, w_q, pk)
                      - _dot("bhdr,bhdj->bhrj", c[:, :, 0], ck), axis=0)
  dw_k = s2 * jnp.sum(_dot("brs,hsk,bhkj->bhrj", gx, w_k, pq)
                      - _dot("bhdr,bhdj->bhrj", c[:, :, 1], cq), axis=0)
  return dq, dk, dxp, dw_q, dw_k, None, None


_mse.defvjp(_mse_fwd, _mse_bwd)


def prediction_mse(q, k, xp, w_q, w_k, mask=None, *, normalization: str = "eq6"):
  """``lra_sparse.kernels.dsa.reference.prediction_mse(q, k, LowRank(xp, w_q),
  LowRank(xp, w_k), mask, normalization=...)`` on the GPU kernels: q, k [batch, length,
  heads, head_dim] (float32 / bfloat16 / float16, head_dim <= 128), xp [batch, length, r]
  (float32; r <= 256), w_q, w_k [heads, r, k]; mask bool [batch, length] (None: every token
  real).  Gradients flow to q, k, xp, w_q and w_k."""
  dsa_reference.check_normalization(normalization)
  if q.ndim != 4 or k.shape != q.shape or k.dtype != q.dtype:
    raise ValueError(f"q and k must be [batch, length, heads, head_dim] of one dtype, got "
                     f"{q.shape} {q.dtype} and {k.shape} {k.dtype}")
  b, l, h, d = q.shape
  if not 0 < d <= 128:
    raise ValueError(f"head_dim {d} not in [1, 128]")
  if xp.ndim != 3 or xp.shape[:2] != (b, l) or not 0 < xp.shape[-1] <= MAX_RANK:
    raise ValueError(f"xp must be [batch, length, r] = ({b}, {l}, r <= {MAX_RANK}), got "
                     f"{xp.shape}")
  r = xp.shape[-1]
  for name, w in (("w_q", w_q), ("w_k", w_k)):
    if w.ndim != 3 or w.shape[:2] != (h, r) or w.shape != w_q.shape:
      raise ValueError(f"{name} must be [heads, r, k] = ({h}, {r}, k) like w_q, got "
                       f"{w.shape}")
  if mask is not None and tuple(mask.shape) != (b, l):
    raise ValueError(f"mask must be bool [batch, length] = {(b, l)}, got {mask.shape}")

  def shard_total(q, k, xp, mask, w_q, w_k):   # [1]: the squared error summed over the shard
    km, has_mask = key_mask(mask, q.shape[0])
    return _mse(q, k, xp, w_q, w_k, km, key_extent(mask, q.shape[0], l), has_mask)[None]

  # Sums split over a data-parallel batch: once per device on its shard, then added.
  total = jnp.sum(sharding.per_data_shard(shard_total, q, k, xp.astype(jnp.float32), mask,
                                        w_q.astype(jnp.float32), w_k.astype(jnp.float32),
                                        replicated=(4, 5)))
  return dsa_reference.normalize_mse(jnp.maximum(total, 0.0), mask, q.shape, normalization)

