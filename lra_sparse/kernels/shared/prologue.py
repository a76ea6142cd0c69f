"""What every kernel wrapper does before a launch (Triton, Pallas and Mosaic GPU alike):
operand checks, head-dim padding, key extents and masks, the softmax backward's row term.

Plain JAX: nothing here imports triton, jax_triton or Pallas.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 128  # the attention kernels' widest tile; smaller head dims are zero-padded


def operand_reason(q, v, k, who: str) -> Optional[str]:
  """None when q, v (and k) suit the attention kernels, else a short reason: q [batch, length,
  heads, head_dim], k / v of q's shape and dtype, float32 / bfloat16 / float16, head_dim in
  [1, 128].  ``who`` names the kernels in the messages.  Only shapes and dtypes are read."""
  if len(q.shape) != 4:
    return f"q must be [batch, length, heads, head_dim], got shape {tuple(q.shape)}"
  for name, x in (("k", k), ("v", v)):
    if x is None:
      continue
    if tuple(x.shape) != tuple(q.shape):
      return (f"{who} needs {name}.shape == q.shape, got {tuple(x.shape)} vs "
              f"{tuple(q.shape)}")
    if jnp.dtype(x.dtype) != jnp.dtype(q.dtype):
      return f"{who} needs {name}.dtype == q.dtype, got {x.dtype} vs {q.dtype}"
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    return f"dtype {q.dtype} not in (float32, bfloat16, float16)"
  if not 0 < q.shape[-1] <= MAX_HEAD_DIM:
    return f"head_dim {q.shape[-1]} not in [1, {MAX_HEAD_DIM}]"
  return None


def kernel_head_dim(head_dim: int, widths) -> Optional[int]:
  """The narrowest of a kernel's head dims ``widths`` (ascending) that holds ``head_dim`` (the
  kernel runs it zero-padded to that width), None when none does."""
  return next((w for w in widths if w >= head_dim), None)


def half_parts(x, dtype=jnp.bfloat16):
  """(hi, lo) in the half-precision ``dtype`` with hi + lo ~ x to about twice its mantissa, for
  products on the tensor cores at near-float32 accuracy; (x,) when x already is ``dtype``.
  hi is x rounded by reduce_precision, which XLA honours: a round trip through ``dtype`` is one
  that XLA's GPU compiler may remove as "excess precision", which left lo = 0 (about 3e-3
  relative error in DSA's L_MSE gradients)."""
  if x.dtype == dtype:
    return (x,)
  x = x.astype(jnp.float32)
  info = jnp.finfo(dtype)
  hi = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
  return hi.astype(dtype), (x - hi).astype(dtype)


def zero_pad_head_dim(x, width: int):
  """x [..., head_dim] with zero columns up to ``width``, for kernels that run wider heads.
  Exact: zero columns of Q and K add nothing to Q K^T, the caller keeps the softmax scale of the
  true head dim, and the padded columns of O (and of dQ, dK, dV) are zero, to be sliced off."""
  return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, width - x.shape[-1]),))


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def padded_rows(length: int) -> int:
  """LP: rows of the per-row buffers (log-sum-exp, delta, compressed scores), >= length."""
  return cdiv(length, 128) * 128


def extent(live):
  """One past the last True position of each row of ``live`` [B, L] (0 if none), int32: an
  example's key extent (``live`` the key mask), or its last row with a non-zero dO."""
  positions = jnp.arange(1, live.shape[1] + 1, dtype=jnp.int32)
  return jnp.max(jnp.where(live, positions, 0), axis=1)


def key_extent(mask, batch: int, length: int):
  """int32 [batch]: one past each example's last real key (kernels' EXT; 0 when it has none,
  ``length`` for every example without a mask)."""
  if mask is None:
    return jnp.full((batch,), length, jnp.int32)
  return extent(mask)


def key_mask(mask, batch: int):
  """(KM, HAS_MASK): the key-padding mask as int32 [batch, length], or a dummy and False."""
  if mask is None:
    return jnp.zeros((1,), jnp.int32), False
  return mask.astype(jnp.int32).reshape(batch, -1), True


def row_delta(o, do):
  """delta = rowsum(dO * O) in fp32, [batch*heads, LP] (the softmax backward's row term)."""
  b, l, h, _ = o.shape
  dl = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, L, H]
  dl = jnp.transpose(dl, (0, 2, 1)).reshape(b * h, l)
  return jnp.pad(dl, ((0, 0), (0, padded_rows(l) - l)))
