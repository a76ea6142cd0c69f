"""DFSS (dynamic N:M sparse attention) on the GPU: Triton kernels called from JAX (jax-triton).

Nothing here imports triton or jax_triton at module import time (CPU installs import this
module fine); the launching functions import them and their kernel source on first use.

Two implementations share one N:M selection (``kernels.dfss.triton_select``):

* ``impl="fused"`` (the default; kernels in ``kernels.dfss.triton_kernels``): a flash-style forward
that
  computes each QK^T tile on the tensor cores, prunes it N:M in registers and runs an online
  softmax over the kept entries only (S and A are never written; only O and a per-row
  log-sum-exp), and a flash-style backward that recomputes the tile, re-applies the same
  pruning and forms dS = P * (dP - rowsum(dO*O)) on the kept entries only.  The default
  backward is one pass per key block (dK, dV in registers, dQ added into an fp32 buffer with
  atomics: S, the pruning and the exponentials once per tile, five products);
  ``deterministic=True`` runs a dK/dV kernel and a separate dQ kernel instead (seven products,
  no atomics, bit-reproducible).
* ``impl="compressed"``: the paper's 3-kernel pipeline (App. A.1), in ``kernels.dfss.compressed``:
  compressed scores + one keep bit per key, a compressed softmax, SpMM; its backward works on
  the compressed form.

Lengths that are not a multiple of the tiles (or of M) are padded internally: rows past L are
not stored, keys past L are padded keys (-inf, never beat a real key).  A fully padded row gives
zeros, never NaN.  Layout is jax.nn.dot_product_attention's [batch, length, heads, head_dim],
read in place (no transposes); batch*heads run in one launch (grid axis 1).  Tile choices:
``kernels.dfss.tiles``.
"""

from __future__ import annotations

import functools
import math

from typing import Optional

import jax
import jax.numpy as jnp

from lra_sparse.kernels.dfss import compressed as dfss_compressed
from lra_sparse.kernels.dfss import tiles as dfss_tiles
from lra_sparse.kernels.dfss.compressed import compressed_softmax, sddmm_prune, spmm
from lra_sparse.kernels.shared.launch import is_available, launch
from lra_sparse.kernels.shared.prologue import (cdiv, kernel_head_dim, key_mask, operand_reason,
                                                padded_rows, row_delta, zero_pad_head_dim)
from lra_sparse.ops import dropout
from lra_sparse.ops.nm import check_nm

__all__ = [
    "is_available",
    "unsupported_reason",
    "dfss_attention_triton",
    "dense_attention_triton",
    "sddmm_prune",
    "compressed_softmax",
    "spmm",
]

_SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
_MAX_M = 32  # one keep bit per key in int32 metadata words: a group never straddles two words


def unsupported_reason(q, v, n: int, m: int, *, k=None) -> Optional[str]:
  """None when the kernels can run DFSS n:m on these operands; else a short reason.

  The one statement of what the kernels accept (``dfss_attention_triton`` raises
  ``ValueError(reason)``; callers with a pure-JAX fallback use it to choose): 0 < n < m
  or n == m == 1 (dense attention: every key kept), m a power of two <= 32,
  q [batch, length, heads, head_dim] with head_dim <= 128 (16, 32, 64, 128 natively; the
  fused path zero-pads the others, the compressed path refuses them), v (and k when
  given) of q's shape and dtype, dtype float32 / bfloat16 / float16.  Only shapes and dtypes
  are read, so q, v, k may be arrays or ``jax.ShapeDtypeStruct``s.
  """
  try:
    check_nm(n, m, what="dfss_triton")
  except ValueError as error:
    return str(error)
  if n == m and m != 1:
    return (f"the Triton kernel needs n < m (or 1:1, dense attention), got n={n}, m={m}")
  if m & (m - 1) or m > _MAX_M:
    return f"the Triton kernel needs m a power of two <= {_MAX_M}, got m={m}"
  return operand_reason(q, v, k, "the Triton kernel")


# ----------------------------------------------------------------------------- fused path
def _fused_fwd(q, k, v, mask, n, m, poison=False, scale=None, seed=None, drop_t=0, tiles=None):
  """(O, LSE): the fused forward; LSE is fp32 [batch*heads, LP] (base 2). ``scale``: the
  softmax scale, 1/sqrt(head_dim) unless the head dim was zero-padded (``_attention``).
  drop_t > 0: attention dropout with threshold drop_t (``ops.dropout``) and key ``seed``.
  tiles: a ``kernels.dfss.tiles.Tiles`` instead of the table's (tuning)."""
  from lra_sparse.kernels.dfss import triton_kernels as kernels  # imports triton
  b, l, h, d = q.shape
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  t = dfss_tiles.tiles("fwd", jnp.dtype(q.dtype).name, d, m, tiles)
  lp = padded_rows(l)
  km, has_mask = key_mask(mask, b)
  return launch(
      kernels.dfss_fwd, (q, k, v, km, dropout.seed_operand(seed), scale, l, lp, h),
      (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b * h, lp), jnp.float32)),
      (cdiv(l, t.bm), b * h), num_warps=t.num_warps, num_stages=t.num_stages, poison=poison,
      D=d, M=m, NKEEP=n, HAS_MASK=has_mask, DROP_T=drop_t, BM=t.bm, BN=t.bn)


def _fused_bwd(q, k, v, mask, o, lse, do, n, m, deterministic=False, poison=False,
               scale=None, seed=None, drop_t=0, tiles=None, dq_tiles=None):
  """(dQ, dK, dV) of the fused path: one pass (dQ by atomics) unless deterministic. tiles /
  dq_tiles: ``kernels.dfss.tiles.Tiles`` of the key-block ("bwd") and dQ kernels instead of
  the table's (tuning)."""
  from lra_sparse.kernels.dfss import triton_kernels as kernels  # imports triton
  b, l, h, d = q.shape
  dtype_name = jnp.dtype(q.dtype).name
  t = dfss_tiles.tiles("bwd", dtype_name, d, m, tiles)
  km, has_mask = key_mask(mask, b)
  do = do.astype(q.dtype)
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  args = (q, k, v, km, dropout.seed_operand(seed), do, lse, row_delta(o, do), scale, l,
          padded_rows(l), h)
  meta = dict(D=d, M=m, NKEEP=n, HAS_MASK=has_mask, DROP_T=drop_t)
  grid = (cdiv(l, t.bn), b * h)
  if t.onepass and not deterministic:
    dk, dv, dq = launch(
        kernels.dfss_bwd_onepass, args,
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct(q.shape, jnp.float32)),
        grid, num_warps=t.num_warps, num_stages=t.num_stages, zeroed=(2,), poison=poison,
        BM=t.bm, BN=t.bn, **meta)
    return (dq * scale).astype(q.dtype), dk, dv
  dk, dv = launch(
      kernels.dfss_bwd_dkdv, args,
      (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      grid, num_warps=t.num_warps, num_stages=t.num_stages, poison=poison,
      BM=t.bm, BN=t.bn, **meta)
  tq = dfss_tiles.tiles("dq", dtype_name, d, m, dq_tiles)
  (dq,) = launch(
      kernels.dfss_bwd_dq, args, (jax.ShapeDtypeStruct(q.shape, q.dtype),),
      (cdiv(l, tq.bm), b * h), num_warps=tq.num_warps, num_stages=tq.num_stages,
      poison=poison, BM=tq.bm, BN=tq.bn, **meta)
  return dq, dk, dv


# ----------------------------------------------------------------------------- custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11))
def _attn(q, k, v, mask, seed, n, m, impl, deterministic, poison, scale, drop_t):
  if impl == "fused":
    return _fused_fwd(q, k, v, mask, n, m, poison, scale, seed, drop_t)[0]
  return dfss_compressed.forward(q, k, v, mask, n, m, poison)[0]


def _attn_fwd(q, k, v, mask, seed, n, m, impl, deterministic, poison, scale, drop_t):
  del deterministic  # backward only
  if impl == "fused":
    o, lse = _fused_fwd(q, k, v, mask, n, m, poison, scale, seed, drop_t)
    return o, (q, k, v, mask, seed, o, lse)
  o, a, meta = dfss_compressed.forward(q, k, v, mask, n, m, poison)
  return o, (q, k, v, mask, seed, o, (a, meta))


def _attn_bwd(n, m, impl, deterministic, poison, scale, drop_t, res, do):
  q, k, v, mask, seed, o, extra = res
  if impl == "fused":
    dq, dk, dv = _fused_bwd(q, k, v, mask, o, extra, do, n, m, deterministic, poison, scale,
                            seed, drop_t)
  else:
    a, meta = extra  # the key mask is already encoded in A and meta
    dq, dk, dv = dfss_compressed.backward(q, k, v, o, a, meta, do, n, m, poison)
  return dq, dk, dv, None, None


_attn.defvjp(_attn_fwd, _attn_bwd)


def dfss_attention_triton(q, k, v, *, n: int, m: int, mask=None, impl: str = "fused",
                          deterministic: bool = False, dropout_rate: float = 0.0,
                          dropout_seed=None):
  """DFSS attention on the GPU.  q, k, v: [batch, length, heads, head_dim] (fp32 / bf16 /
  fp16, head_dim <= 128: 16, 32, 64 and 128 run as they are, other head dims zero-padded to
  the next of those on the fused path, exactly; 0 < n < m, m a power of two <= 32, or 1:1:
  dense, ``dense_attention_triton``), mask: bool
  [batch, length] key padding (True = real token).  Same semantics as
  ``kernels.dfss.reference.dfss_attention_reference``.
  impl: "fused" (flash-style, default) or "compressed" (SDDMM+prune / softmax / SpMM).
  deterministic: the fused backward accumulates dQ with fp32 atomics by default (one pass,
  fastest; the summation order, hence the last bits of dQ, can vary run to run); True uses
  the separate dK/dV and dQ kernels, bit-reproducible and slower.
  dropout_rate > 0 with dropout_seed (int32 [2], ``dropout.seed_words``): attention
  dropout on the kept probabilities, drawn inside the fused kernels (``ops.dropout`` states
  the rule; its ``dropout_multiplier`` gives the same mask in JAX).
  Raises ValueError(``unsupported_reason(q, v, n, m, k=k)``) for operands the kernels do not
  handle."""
  return _attention(q, k, v, n=n, m=m, mask=mask, impl=impl, deterministic=deterministic,
                    dropout_rate=dropout_rate, dropout_seed=dropout_seed)


def dense_attention_triton(q, k, v, *, mask=None, deterministic: bool = False,
                           dropout_rate: float = 0.0, dropout_seed=None):
  """Dense flash attention with attention dropout on the fused kernels: DFSS at 1:1 (every key
  kept, so the N:M selection is the identity and each key block is one tile; the dropout draws
  are ``ops.dropout``'s, one Philox call per eight keys).  Any key mask (holes allowed); fp32
  runs its products as TF32 on the tensor cores, as XLA's default fp32 matmul does.  Arguments
  as ``dfss_attention_triton``; a fully padded sequence gives zeros."""
  return _attention(q, k, v, n=1, m=1, mask=mask, deterministic=deterministic,
                    dropout_rate=dropout_rate, dropout_seed=dropout_seed)


def _attention(q, k, v, *, n, m, mask=None, impl="fused", deterministic=False, poison=False,
               dropout_rate=0.0, dropout_seed=None):
  """dfss_attention_triton; poison=True (tests) pre-fills every kernel output with NaN so that
  an element a kernel does not write shows up (``kernels.shared.launch.launch``)."""
  reason = unsupported_reason(q, v, n, m, k=k)
  if reason is not None:
    raise ValueError(reason)
  if impl not in ("fused", "compressed"):
    raise ValueError(f"impl must be 'fused' or 'compressed', got {impl!r}")
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.shape != q.shape[:2]:
      raise ValueError(f"mask must be [batch, length] = {q.shape[:2]}, got {mask.shape}")
    mask = mask.astype(bool)
  if n == m and impl != "fused":
    raise ValueError("1:1 (dense attention) runs on impl='fused' only")
  if dropout.threshold(dropout_rate) and impl != "fused":
    raise ValueError("attention dropout runs on impl='fused' only")
  drop_t, seed = dropout.checked_seed(dropout_rate, dropout_seed)
  head_dim = q.shape[-1]
  kernel_dim = kernel_head_dim(head_dim, _SUPPORTED_HEAD_DIMS)
  if kernel_dim == head_dim:
    return _attn(q, k, v, mask, seed, n, m, impl, bool(deterministic), bool(poison), None,
                 drop_t)
  if impl != "fused":
    raise ValueError(f"impl='compressed' needs head_dim in {_SUPPORTED_HEAD_DIMS}, got "
                     f"{head_dim} (impl='fused' zero-pads it)")
  q, k, v = (zero_pad_head_dim(x, kernel_dim) for x in (q, k, v))
  out = _attn(q, k, v, mask, seed, n, m, impl, bool(deterministic), bool(poison),
              1.0 / math.sqrt(head_dim), drop_t)
  return out[..., :head_dim]
